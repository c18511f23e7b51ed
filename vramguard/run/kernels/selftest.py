"""``kernels.selftest``: each kernel once on a model's real weights and cache, against the library it replaces.

Run by :class:`vramguard.run.fastdecode.GraphDecoder` before its first kernel step: a kernel that fails to compile or
disagrees raises here, before it has written anything, and the decoder turns it off with the reason.
"""

from __future__ import annotations

TOLERANCE = 2e-2  # relative (Frobenius); bfloat16 rounding of the outputs alone is about 4e-3


def _generator(device):
    """A seeded generator of its own: the checks must not move the global RNG that seeded sampling uses."""
    import torch
    return torch.Generator(device=device).manual_seed(0)


def _rel(got, want) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30))


def check_4bit_layers(model, kernels, dtype, rows: int = 1, every_shape: bool = False) -> None:
    """One bitsandbytes 4-bit layer per distinct (in_features, double quant), or with ``every_shape`` per distinct
    (out_features, in_features, double quant): its output for ``rows`` random rows with ``kernels()`` active (the
    routed Triton kernels) against bitsandbytes' own.

    Raises:
        RuntimeError: a relative difference of :data:`TOLERANCE` or more (or NaN).
    """
    import torch
    seen = set()
    for m in model.modules():
        qs = getattr(getattr(m, "weight", None), "quant_state", None)
        key = (tuple(qs.shape) if every_shape else qs.shape[1], qs.nested) if qs is not None else None
        if qs is None or key in seen:
            continue
        seen.add(key)
        x = torch.randn((1, rows, qs.shape[1]), generator=_generator(m.weight.device),
                        device=m.weight.device).to(dtype)
        with kernels():
            got = m(x)
        err = _rel(got, m(x))
        if not err < TOLERANCE:
            raise RuntimeError(f"it differs from bitsandbytes by {err:.3g} (relative) on {list(qs.shape)} at "
                               f"{rows} row(s)")


def check_decode_attention(keys, values, num_heads: int, filled: int) -> None:
    """:func:`~vramguard.run.kernels.decode_attention.decode_attention` on one layer's cache (``[1, Hkv, L, D]``,
    ``filled`` slots written) for a random query, against a float32 softmax over those slots.

    Raises:
        RuntimeError: a relative difference of :data:`TOLERANCE` or more (or NaN).
    """
    import torch

    from vramguard.run.kernels.decode_attention import decode_attention
    d = keys.shape[-1]
    q = torch.randn((1, num_heads, 1, d), generator=_generator(keys.device), device=keys.device).to(keys.dtype)
    got = decode_attention(q, keys, values, torch.tensor([filled - 1], device=keys.device), d ** -0.5)
    g = num_heads // keys.shape[1]
    kk = keys[:, :, :filled].float().repeat_interleave(g, 1)
    w = torch.softmax(q.float() @ kk.transpose(-1, -2) * d ** -0.5, dim=-1)
    want = (w @ values[:, :, :filled].float().repeat_interleave(g, 1)).transpose(1, 2)
    err = _rel(got, want)
    if not err < TOLERANCE:
        raise RuntimeError(f"it differs from a float32 softmax by {err:.3g} (relative)")


def check_4bit_layers_or_gather(model, kernels, dtype, **kw) -> str | None:
    """:func:`check_4bit_layers` with the register lookup (:data:`vramguard.run.kernels.nf4.LUT`); if that fails, with
    the gather from the table instead (``LUT`` is then switched off for this process); ``kw``: ``rows`` and
    ``every_shape`` of :func:`check_4bit_layers`. Returns a note when the lookup was switched off, None otherwise.

    Raises:
        RuntimeError (or the compile error): the gather version fails too.
    """
    import torch

    from vramguard.run.kernels import nf4
    if not nf4.LUT:
        check_4bit_layers(model, kernels, dtype, **kw)
        return None
    try:
        check_4bit_layers(model, kernels, dtype, **kw)
        return None
    except Exception as e:  # noqa: BLE001 -- a PTX or compile failure of the lookup: the gather version is tried
        if isinstance(e, torch.OutOfMemoryError):
            raise
        nf4.LUT = False
        check_4bit_layers(model, kernels, dtype, **kw)
        return f"register lookup off ({type(e).__name__}: {str(e).strip()[:200]}), values gathered from the table"
