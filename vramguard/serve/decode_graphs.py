"""CUDA graphs for the continuous-batching engine's decode-only steps (every request of the step adds one token).

At a few dozen requests a decode step of an 8B 4-bit model is a few tens of milliseconds of GPU work behind
thousands of kernel launches from Python (bitsandbytes' 4-bit matmul alone is a Python call per layer and
projection), so the engine thread, not the GPU, sets the pace. A step replayed from a CUDA graph launches once.

transformers' own graphs (``use_cuda_graph``) pad every step of the varlen path, prefills included, to buckets of
64 query and 16,384 cache tokens, one graph per bucket pair, captured the first time a bucket appears; with SDPA they
also need the block-diagonal mask. Here only decode-only steps are captured, padded to a power of two of requests
(:data:`SIZES`) and of the longest request's keys (at least :data:`MIN_KEYS`): one graph per pair, at most a few.
A padding request has no query token (its offsets plateau), writes its key and value to the cache's trash row and
reuses a real request's sampling arguments; its token is never read. Steps with a prefill run as before.

Inside a decode step bitsandbytes' ``gemm_4bit`` calls of 2 to 64 rows go to vramguard's 4-bit kernels
(:func:`choose_gemm`: the fused GEMV up to 8 rows, the small-batch GEMM of :mod:`vramguard.run.kernels.nf4_gemm`
above), which read the packed weights once instead of dequantizing each weight to bfloat16 first; they are checked
against bitsandbytes' own output at start, and bitsandbytes' own kernels run when the check fails.

It needs the varlen attention (:mod:`vramguard.serve.attention`), which reads nothing back to the host in a decode
step, and transformers 5.17's batch layout (``ContinuousBatchingIOs``: the static bulk tensors, ``write_index`` /
``read_index`` storage, ``compute_stream``); :func:`unsupported` says why not when they are missing. A capture that
fails turns the graphs off for the engine (the step's result comes from the eager run before the capture).
"""

from __future__ import annotations

import contextlib
import logging

from vramguard.run.kernels import nf4
from vramguard.run.kernels.selftest import GEMM_PATHS, check_4bit_layers_or_gather, fastest_4bit_paths
from vramguard.run.kernels.verdict import GemmChoice, read_verdict, verdict_key, write_verdict
from vramguard.runtime.device import is_oom

log = logging.getLogger("vramguard.serve")

SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # requests a decode graph is padded to
MIN_KEYS = 1024  # the smallest longest-request key bucket (keys per request a graph's split plan covers)
MAX_GRAPHS = 48  # captured graphs kept per engine (each pair of buckets once)
GEMM = True  # False: decode steps keep bitsandbytes' own 4-bit matmul (for comparisons)
CHECK_ROWS = (2, 4, 8, 16, 32, 64)  # rows at which choose_gemm compares the 4-bit kernels with bitsandbytes
TIMED_ROWS = {"gemv": 8, "gemm": 64}  # rows at which choose_gemm times them against bitsandbytes, per kind
_IO_FIELDS = ("input_ids", "position_ids", "cumulative_seqlens_q", "cumulative_seqlens_k", "logits_indices",
              "write_index_storage", "read_index_storage", "compute_stream", "num_q_tokens", "num_request_in_batch",
              "total_seqlen_k", "get_model_kwargs", "get_cb_kwargs", "retrieve_device_outputs", "_write_trash_index")


def unsupported(bp) -> str | None:
    """Why decode steps of batch processor ``bp`` cannot be captured here (None: they can)."""
    io = getattr(bp, "inputs_and_outputs", None)
    missing = [f for f in _IO_FIELDS if not hasattr(io, f)]
    if missing:
        return f"this transformers' batch layout lacks {', '.join(missing[:3])}"
    if getattr(io, "compute_stream", None) is None:
        return "no CUDA compute stream"
    if not hasattr(getattr(bp, "model_runner", None), "_forward_process_and_sample"):
        return "this transformers' model runner has no _forward_process_and_sample"
    if len(io.cumulative_seqlens_k) != 1:
        return "more than one attention layer type"
    return None


def choose_gemm(model) -> tuple[object | None, str | None]:
    """The 4-bit matmul of decode steps: a factory of :func:`vramguard.run.kernels.route.gemm_4bit_route` (the fused
    GEMV up to 8 rows, :mod:`vramguard.run.kernels.nf4_gemm` up to 64) when every bitsandbytes 4-bit projection
    shape of ``model`` agrees with bitsandbytes' own output at each of :data:`CHECK_ROWS` rows
    (:func:`~vramguard.run.kernels.selftest.check_4bit_layers_or_gather`), each shape and kind (GEMV, GEMM)
    running the path its GPU timing at :data:`TIMED_ROWS` rows finds fastest, bitsandbytes' own included
    (:func:`~vramguard.run.kernels.selftest.fastest_4bit_paths`). None: bitsandbytes' own runs everywhere.
    Returns (the factory or None, a note for the engine's notes, None when the model has no 4-bit layer)."""
    import functools

    import torch
    if not any(getattr(getattr(m, "weight", None), "quant_state", None) is not None for m in model.modules()):
        return None, None
    if not GEMM:
        return None, "decode steps: bitsandbytes' 4-bit matmul (vramguard's switched off)"
    from vramguard.run.kernels import nf4_gemm
    from vramguard.run.kernels.route import gemm_4bit_route
    route = functools.partial(gemm_4bit_route, nf4_gemm.MAX_ROWS)
    p = next(model.parameters())
    dtype = model.dtype if model.dtype.is_floating_point else p.dtype
    choice, times, kept = {}, [], False
    try:
        with torch.inference_mode():
            if p.is_cuda:  # the fastest path per shape and kind first, then a check of those paths at every size
                choice, times, kept = timed_paths(model, route, dtype, p.device)
            notes = [check_4bit_layers_or_gather(model, functools.partial(route, choice), dtype, rows=rows,
                                                 every_shape=True) for rows in CHECK_ROWS]
    except Exception as e:  # noqa: BLE001 - a kernel that fails to compile or disagrees is not used: say why
        if is_oom(e):
            raise
        return None, (f"decode steps: bitsandbytes' 4-bit matmul (vramguard's failed its check: "
                      f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''})")
    timed = ("kept from an earlier process: " if times and kept else "") + "; ".join(
        f"{t['shape'][0]}x{t['shape'][1]} at {t['rows']} rows: "
        + ", ".join(f"{k[:-3]} {v:g}" for k, v in t.items() if k.endswith("_us"))
        + (f" (failed: {t['failed']})" if "failed" in t else "") for t in times)
    if times and all(v == "bnb" for v in choice.values()):
        return None, f"decode steps: bitsandbytes' 4-bit matmul (the fastest here for every shape, us a call: {timed})"
    extra = "; ".join(n for n in notes if n)
    return functools.partial(route, choice), (
        "decode steps: vramguard's 4-bit matmul for 2 to 64 rows (Triton), the fastest path per shape and kind, "
        f"checked against bitsandbytes on every projection shape at {', '.join(map(str, CHECK_ROWS))} rows "
        f"({', '.join(f'{n}x{k} {kind}: {v}' for (n, k, kind), v in choice.items())}; GPU us per call: {timed})"
        + (f"; {extra}" if extra else ""))


def timed_paths(model, route, dtype, device) -> tuple[dict, list, bool]:
    """(choice, times, kept): :func:`~vramguard.run.kernels.selftest.fastest_4bit_paths` at :data:`TIMED_ROWS`
    rows, or what it chose for the same model, GPU, dtype and versions in an earlier process (kept on disk beside
    the kernel verdicts, :mod:`vramguard.run.kernels.verdict`; ``kept`` True then). Only the timing is kept: the
    chosen paths are checked against bitsandbytes in every process (:func:`choose_gemm`)."""
    key = verdict_key(model, device, dtype, ("serve_gemm", tuple(sorted(TIMED_ROWS.items())), GEMM_PATHS, nf4.LUT))
    found, _ = read_verdict(key, GemmChoice)
    if found is not None:
        return found.choice, found.times, True
    choice, times = fastest_4bit_paths(model, route, dtype, TIMED_ROWS)
    write_verdict(key, GemmChoice(choice, times))
    return choice, times, False


def _bucket(n: int, floor: int = 1) -> int:
    b = floor
    while b < n:
        b *= 2
    return b


class DecodeGraphs:
    """The captured decode steps of one engine and the static inputs they read (sized for ``max_requests``)."""

    def __init__(self, bp, max_requests: int, route=None):
        import torch
        self.route = route  # None, or a factory of the context that routes the 4-bit matmul (choose_gemm)
        io = bp.inputs_and_outputs
        self.size_max = next((s for s in SIZES if s >= max_requests), SIZES[-1])
        dev = io.input_ids.device
        t = self.size_max
        i32 = dict(dtype=io.input_ids.dtype, device=dev)
        self.input_ids = torch.zeros((1, t), **i32)
        self.position_ids = torch.zeros((1, t), **i32)
        self.cu_q = torch.zeros(t + 1, **i32)
        self.cu_k = torch.zeros(t + 1, **i32)
        self.logits_indices = torch.zeros(t, **i32)
        self.write_index = torch.zeros((io.write_index_storage.shape[0], t), dtype=io.write_index_storage.dtype,
                                       device=dev)
        self.graphs: dict[tuple[int, int], object] = {}
        self.pool = None  # the memory pool the graphs share (made at the first capture)
        self.lp_args = None
        self.failed: str | None = None
        self.replays = 0

    def accepts(self, bp) -> bool:
        """Whether this step is a decode-only step a graph can run (and the graphs are on)."""
        io = bp.inputs_and_outputs
        n = int(io.num_request_in_batch)
        return (self.failed is None and 0 < n <= self.size_max and int(io.num_q_tokens) == n
                and not getattr(io, "use_block_table", False))

    def _fill(self, io, kw, n: int, size: int) -> None:
        """Copy the step's inputs into the static buffers, padded to ``size`` requests."""
        total_k = int(next(iter(io.total_seqlen_k.values())))
        cu_k = kw["cu_seq_lens_k"]
        cu_k = next(iter(cu_k.values())) if isinstance(cu_k, dict) else cu_k
        self.input_ids[0, :n].copy_(kw["input_ids"][0])
        self.position_ids[0, :n].copy_(kw["position_ids"][0])
        self.cu_q[:n + 1].copy_(kw["cu_seq_lens_q"])
        self.cu_q[n + 1:size + 1].fill_(n)
        self.cu_k[:n + 1].copy_(cu_k)
        self.cu_k[n + 1:size + 1].fill_(total_k)
        self.logits_indices[:n].copy_(kw["logits_indices"])
        self.logits_indices[n:size].fill_(0)
        for g, w in enumerate(kw["write_index"]):
            self.write_index[g, :n].copy_(w)
            self.write_index[g, n:size].fill_(io._write_trash_index)
        lp = kw["logits_processor_args"]
        if lp.numel():
            if self.lp_args is None or self.lp_args.shape[0] != lp.shape[0]:
                import torch
                self.lp_args = torch.zeros((lp.shape[0], self.size_max), dtype=lp.dtype, device=lp.device)
            self.lp_args[:, :n].copy_(lp)
            self.lp_args[:, n:size].copy_(lp[:, :1].expand(-1, size - n))

    def _batch(self, io, kw, size: int, keys: int, runner, model) -> dict:
        """The model's keyword arguments over the static buffers (the same tensors at every replay)."""
        data = dict(kw)
        one_type = isinstance(kw["cu_seq_lens_k"], dict)
        layer_type = next(iter(io.cumulative_seqlens_k))
        data.update(input_ids=self.input_ids[:, :size], position_ids=self.position_ids[:, :size],
                    cu_seq_lens_q=self.cu_q[:size + 1], max_seqlen_q=1,
                    cu_seq_lens_k={layer_type: self.cu_k[:size + 1]} if one_type else self.cu_k[:size + 1],
                    max_seqlen_k={layer_type: keys} if one_type else keys,
                    logits_indices=self.logits_indices[:size],
                    write_index=[self.write_index[g, :size] for g in range(len(kw["write_index"]))],
                    read_index=[io.read_index_storage[g] for g in range(len(kw["read_index"]))],
                    attention_mask=None)
        if self.lp_args is not None:
            data["logits_processor_args"] = self.lp_args[:, :size]
        if runner.supports_logits_to_keep(model):
            data["logits_to_keep"] = data["logits_indices"]
        return data

    def step(self, bp, model) -> None:
        """Run the prepared decode step: replay its graph, or run it eagerly on the static buffers and capture it
        (the eager run gives this step's tokens). Raises what the eager run raises (an OOM is then handled by the
        engine as for any step); a failed capture only turns the graphs off."""
        import torch
        io, runner = bp.inputs_and_outputs, bp.model_runner
        kw = io.get_model_kwargs(use_padding=False)
        n = int(io.num_request_in_batch)
        size = next(s for s in SIZES if s >= n)
        max_k = kw["max_seqlen_k"]
        keys = _bucket(int(next(iter(max_k.values())) if isinstance(max_k, dict) else max_k), MIN_KEYS)
        stream = io.compute_stream
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._fill(io, kw, n, size)
        data = self._batch(io, kw, size, keys, runner, model)
        args = (model, data, *io.get_cb_kwargs())
        graph = self.graphs.get((size, keys))
        if graph is not None:
            with torch.cuda.stream(stream):
                graph.replay()
            self.replays += 1
        else:
            with torch.cuda.stream(stream), self._routed():
                runner._forward_process_and_sample(*args)
            if len(self.graphs) < MAX_GRAPHS:
                self._capture(runner, args, stream, (size, keys))
        io.retrieve_device_outputs()

    def _routed(self):
        return self.route() if self.route is not None else contextlib.nullcontext()

    def _capture(self, runner, args, stream, key) -> None:
        import torch
        try:
            stream.synchronize()
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=stream, capture_error_mode="thread_local"), \
                    self._routed():
                runner._forward_process_and_sample(*args)
            self.graphs[key] = graph
            log.info("decode graph captured for %d requests, %d keys per request", *key)
        except Exception as e:  # noqa: BLE001 - graphs are an optimisation: off, with the reason kept
            self.failed = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            log.warning("decode graphs off (capture failed): %s", self.failed)
