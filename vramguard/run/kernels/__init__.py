"""``kernels``: Triton kernels for batch-1 and small-batch decoding, each beside a pure-torch reference of its math.

* :mod:`vramguard.run.kernels.nf4`: bitsandbytes 4-bit weights (NF4 / FP4, double quant included) times a few rows of
  activations, read from the packed bytes as bitsandbytes stores them.
* :mod:`vramguard.run.kernels.nf4_gemm`: the same weights times 9 to 64 rows (a continuous-batching decode step) on
  the tensor cores, each packed byte read once; :mod:`vramguard.run.kernels.route` sends bitsandbytes' ``gemm_4bit``
  calls to the GEMV or the GEMM.
* :mod:`vramguard.run.kernels.decode_attention`: one query token against a static KV cache, GQA without copying the
  cache, over the filled length only (read on the device, so one CUDA graph serves every length).

Triton is optional: :func:`triton_status` says whether the kernels can run and why not.
"""

from __future__ import annotations

import importlib.util


def triton_status(device) -> tuple[bool, str]:
    """(True, reason) when the Triton kernels can run on ``device`` (a ``torch.device``), else (False, why not).

    On a CUDA device they need the ``triton`` package; on the CPU only Triton's interpreter runs them
    (``TRITON_INTERPRET=1``, set before triton is imported), which the tests use.
    """
    import os
    if importlib.util.find_spec("triton") is None:
        return False, "the triton package is not installed"
    if device.type == "cuda":
        return True, "triton on CUDA"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True, "triton's interpreter on the CPU (TRITON_INTERPRET=1)"
    return False, f"triton kernels need a CUDA device (the model is on {device})"


def warm_triton() -> None:
    """Compute, once per process, what Triton computes before its first compilation or on-disk cache lookup:
    ``triton_key`` (a SHA-256 of Triton's own sources and its ``libtriton`` library, about 400 MB in Triton 3.6:
    0.2 to 0.6 s, most of it in hashlib, which releases the GIL; ``triton/runtime/cache.py``) and the source key of
    each of vramguard's kernels (``JITFunction.cache_key``, behind a lock of its own). Meant for a background thread
    while the model loads, so that the first kernel launch finds both; nothing where Triton is missing or names them
    otherwise."""
    try:
        from triton.runtime.cache import triton_key
    except ImportError:
        try:
            from triton.compiler.compiler import triton_key  # Triton before 3.3
        except ImportError:
            return
    triton_key()
    from vramguard.run.kernels import decode_attention, fused, nf4
    for module in (nf4, fused, decode_attention):
        for value in list(vars(module).values()):
            if type(value).__name__ == "JITFunction":
                value.cache_key  # noqa: B018 -- computed and kept by the function itself
