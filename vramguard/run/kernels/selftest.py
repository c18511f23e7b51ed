"""``kernels.selftest``: each kernel once on a model's real weights and cache, against the library it replaces.

Run by :class:`vramguard.run.fastdecode.GraphDecoder` before its first kernel step: a kernel that fails to compile or
disagrees raises here, before it has written anything, and the decoder turns it off with the reason.
"""

from __future__ import annotations

from vramguard.runtime.device import is_oom

TOLERANCE = 2e-2  # relative (Frobenius); bfloat16 rounding of the outputs alone is about 4e-3


def _generator(device):
    """A seeded generator of its own: the checks must not move the global RNG that seeded sampling uses."""
    import torch
    return torch.Generator(device=device).manual_seed(0)


def _rel(got, want) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30))


def check_4bit_layers(model, kernels, dtype, rows: int = 1, every_shape: bool = False,
                      limit: int | None = None) -> None:
    """One bitsandbytes 4-bit layer per distinct (in_features, double quant), or with ``every_shape`` per distinct
    (out_features, in_features, double quant), the first ``limit`` of them (None: all): its output for ``rows``
    random rows with ``kernels()`` active (the routed Triton kernels) against bitsandbytes' own.

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
        if limit is not None and len(seen) >= limit:
            return
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
    from vramguard.run.kernels import nf4
    if not nf4.LUT:
        check_4bit_layers(model, kernels, dtype, **kw)
        return None
    try:
        check_4bit_layers(model, kernels, dtype, **kw)
        return None
    except Exception as e:  # noqa: BLE001 -- a PTX or compile failure of the lookup: the gather version is tried
        if is_oom(e):
            raise
        nf4.LUT = False
        check_4bit_layers(model, kernels, dtype, **kw)
        return f"register lookup off ({type(e).__name__}: {str(e).strip()[:200]}), values gathered from the table"


def graph_us(fn, calls: int = 5, reps: int = 3) -> float:
    """GPU microseconds per call of ``fn`` replayed from one CUDA graph of ``calls`` calls (no Python in the time,
    as in a captured decode step); ``fn`` must have run once (compiled) before."""
    import torch
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(calls):
            fn()
    graph.replay()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        graph.replay()
    b.record()
    torch.cuda.synchronize()
    del graph
    return 1000 * a.elapsed_time(b) / reps / calls


GEMM_PATHS = ("gather", "lut")  # vramguard.run.kernels.route._route_gemm_4bit's paths (how the 4-bit values are read)


def fastest_4bit_paths(model, route, dtype, rows_by_kind: dict) -> tuple[dict, list[dict]]:
    """For each distinct ``(N, K)`` of ``model``'s bitsandbytes 4-bit layers and kind ("gemv", "gemm") timed at
    ``rows_by_kind[kind]`` rows (:func:`graph_us`): the fastest of bitsandbytes ("bnb") and ``route(choice)``'s
    paths (the GEMV; the GEMM's :data:`GEMM_PATHS`, "lut" for bfloat16 only). Returns (``{(N, K, kind): path}``,
    the timings ``[{"shape", "rows", "<path>_us"..., "failed": {path: why} where one did not run}]``)."""
    import torch
    choice, times, seen = {}, [], set()
    for m in model.modules():
        qs = getattr(getattr(m, "weight", None), "quant_state", None)
        if qs is None or tuple(qs.shape) in seen:
            continue
        seen.add(tuple(qs.shape))
        n, k = int(qs.shape[0]), int(qs.shape[1])
        for kind, rows in rows_by_kind.items():
            x = torch.randn((1, rows, k), generator=_generator(m.weight.device), device=m.weight.device).to(dtype)
            us = {"bnb": graph_us(lambda: m(x))}
            paths = ("gather",) if kind == "gemv" else [p for p in GEMM_PATHS
                                                        if dtype == torch.bfloat16 or not p.startswith("lut")]
            failed = {}
            for path in paths:
                try:
                    with route({(n, k, kind): path}):
                        m(x)  # compiled outside the capture
                        us[path] = graph_us(lambda: m(x))
                except Exception as e:  # noqa: BLE001 - a path that does not compile here is left out, with why
                    if is_oom(e):
                        raise
                    failed[path] = f"{type(e).__name__}: {str(e).strip()[:120]}"
            choice[(n, k, kind)] = min(us, key=us.get)
            times.append({"shape": [n, k], "rows": rows, **{f"{p}_us": round(t, 1) for p, t in us.items()},
                          **({"failed": failed} if failed else {})})
    return choice, times
