"""``kernels.route``: bitsandbytes' ``gemm_4bit`` op sent to vramguard's 4-bit kernels inside a
``TorchDispatchMode``: :func:`vramguard.run.kernels.nf4.matmul_4bit` (the fused GEMV) up to
:data:`vramguard.run.kernels.nf4.MAX_ROWS` rows, :func:`vramguard.run.kernels.nf4_gemm.gemm_4bit` above, and
every other call left to bitsandbytes, counting both.
"""

from __future__ import annotations

from vramguard.run.kernels import nf4, nf4_gemm  # modules, not names: the tests reload them interpreted
from vramguard.run.kernels.nf4 import MAX_ROWS, SECOND_LEVEL_BLOCK


def _route_reason(a, shape, blocksize: int, quant_type: str, absmax, absmax_8bit,
                  max_rows: int = MAX_ROWS) -> str | None:
    """Why a ``gemm_4bit`` call stays with bitsandbytes (None: the GEMV takes it, or beyond :data:`MAX_ROWS` rows
    :func:`vramguard.run.kernels.nf4_gemm.gemm_4bit`)."""
    k = int(shape[1])
    rows = a.numel() // max(k, 1)
    if rows > max_rows:
        return f"{rows} rows (more than {max_rows})"
    if rows > MAX_ROWS and blocksize % 32:
        return f"blocksize {blocksize} (the GEMM takes multiples of 32)"
    if quant_type not in ("nf4", "fp4"):
        return f"quant_type {quant_type!r}"
    if k % blocksize or blocksize % 2:
        return f"K {k} not a multiple of blocksize {blocksize}"
    if absmax_8bit is not None and absmax.numel() * SECOND_LEVEL_BLOCK < absmax_8bit.numel():
        return "second-level absmax shorter than 256 blocks each"
    return None


def _route_gemm_4bit(args, kwargs, counts: dict, max_rows: int = MAX_ROWS, choice: dict | None = None):
    """Run one ``bitsandbytes::gemm_4bit`` call's arguments through the GEMV (at most :data:`MAX_ROWS` rows) or
    :func:`vramguard.run.kernels.nf4_gemm.gemm_4bit` (up to ``max_rows``), or return None. ``choice``:
    ``(N, K, "gemv" | "gemm")`` -> "bnb" (return None) or a GEMM path: "gather" or "lut" (how the GEMM reads
    the 4-bit values); a kind not in it is routed ("gather")."""
    names = ("A", "B", "shapeB", "absmax", "blocksize", "quant_type", "bias", "absmax_8bit", "absmax_code",
             "absmax_offset")
    v = dict(zip(names, args))
    v.update(kwargs)
    a, absmax, a8 = v["A"], v["absmax"], v.get("absmax_8bit")
    why = _route_reason(a, v["shapeB"], v["blocksize"], v["quant_type"], absmax, a8, max_rows)
    gemm = a.numel() // int(v["shapeB"][1]) > MAX_ROWS
    how = (choice or {}).get((int(v["shapeB"][0]), int(v["shapeB"][1]), "gemm" if gemm else "gemv"), "gather")
    if why is None and how == "bnb":
        why = "slower than bitsandbytes for this shape"
    if why is not None:
        counts["declined"] = counts.get("declined", 0) + 1
        counts.setdefault("declined_why", why)
        return None
    code = nf4.code_table(v["quant_type"], a.device)
    scales = (a8, absmax, v["absmax_code"], v["absmax_offset"]) if a8 is not None else (absmax,)
    if gemm:
        out = nf4_gemm.gemm_4bit(a, v["B"], v["shapeB"], v["blocksize"], code, *scales, bias=v.get("bias"),
                                 lut=how == "lut")
    else:
        out = nf4.matmul_4bit(a, v["B"], v["shapeB"], v["blocksize"], code, *scales, bias=v.get("bias"))
    counts["routed"] = counts.get("routed", 0) + 1
    return out


def gemm_4bit_route(max_rows: int = MAX_ROWS, choice: dict | None = None):
    """A ``TorchDispatchMode`` (a context manager) that sends bitsandbytes' ``gemm_4bit`` calls of at most
    :data:`MAX_ROWS` rows to :func:`~vramguard.run.kernels.nf4.matmul_4bit`, and of more rows up to ``max_rows``
    (at most :data:`vramguard.run.kernels.nf4_gemm.MAX_ROWS`) to :func:`vramguard.run.kernels.nf4_gemm.gemm_4bit`;
    every other op, larger calls and the ``(N, K, "gemv" | "gemm")`` kinds ``choice`` maps to "bnb" run unchanged
    (the other paths: :func:`_route_gemm_4bit`). Its ``counts`` dict says how many calls were routed
    and declined (with the first reason). bitsandbytes' ``Linear4bit`` reaches ``gemm_4bit`` from
    ``bitsandbytes.matmul_4bit`` in inference (bitsandbytes >= 0.50).

    Raises:
        RuntimeError: bitsandbytes has no ``gemm_4bit`` op (an older version), so nothing could be routed.
        ValueError: ``max_rows`` beyond what the GEMM takes.
    """
    import torch

    if not 0 < max_rows <= nf4_gemm.MAX_ROWS:
        raise ValueError(f"max_rows: {max_rows}; the 4-bit GEMM takes 1 to {nf4_gemm.MAX_ROWS} rows")
    from torch.utils._python_dispatch import TorchDispatchMode
    try:
        import bitsandbytes  # noqa: F401 -- registers the bitsandbytes ops
        target = torch.ops.bitsandbytes.gemm_4bit.default
    except (ImportError, AttributeError, RuntimeError) as e:
        raise RuntimeError(f"bitsandbytes has no gemm_4bit op to route ({type(e).__name__}: {e})") from e

    class Gemm4bitRoute(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.counts: dict = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is target:
                out = _route_gemm_4bit(args, kwargs, self.counts, max_rows, choice)
                if out is not None:
                    return out
            return func(*args, **kwargs)

    return Gemm4bitRoute()
