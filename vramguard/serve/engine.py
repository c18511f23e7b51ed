"""The serving engine: transformers' continuous-batching manager with a sized pool, admission and recovery inside a
step; it knows nothing about HTTP.

transformers' engine treats any exception inside a step as fatal: it fails every request and stops. Here the
engine's own loop catches it and sorts it into one of three kinds:

* out of memory: the requests of the failed step give back their KV blocks and go back to the front of the queue as
  "prompt + tokens generated so far" (the engine's own soft-reset, ``RequestState.create_equivalent_initial_request``),
  the step budget is halved, the allocator cache is emptied, and the loop goes on; greedy requests therefore continue
  with the same tokens. The step budget doubles back after ``RESTORE_AFTER_STEPS`` steps without another OOM. A
  request is charged an OOM only when it ran alone; one charged ``MAX_OOM_RETRIES`` times in a row (no token
  between) fails with a clear error. A batch that runs out of memory at the smallest step budget is isolated (one
  request per step).
* a device fault (:func:`device_fault`: a CUDA/cuBLAS/cuDNN/NCCL error, an illegal access, a device-side assert):
  unrecoverable; the engine stops, every request fails with a 503 error object and :attr:`Engine.fatal_error` is set.
* anything else (a value of one request the step cannot compute, such as a top-k beyond int32 or NaN probabilities):
  the request alone is to blame when the step held one request; it fails with that error and the loop goes on. When
  the step held several, they are soft-reset like an OOM and the engine *isolates*: one request per step, suspects
  first, until each suspect has either produced a token alone (cleared, and queued again behind the others) or
  failed alone (its error to its client). Then batching resumes. A request in ``MAX_STEP_FAILURES`` failed steps
  since its last token fails whatever the count of its companions, so no combination loops forever (each reset
  needs a token). Such failures are the requests'
  and never stop the engine; only a failure that recurs ``MAX_FAILURES_IN_A_ROW`` times with no request in the
  step, or a known-good request failing alone (queued after that many failures charged to requests in a row),
  is the engine's own fault, handled as a device fault.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from vramguard.errors import Infeasible
from vramguard.serve import _compat
from vramguard.serve.decode_graphs import SIZES, DecodeGraphs, choose_gemm, unsupported
# the failure rules the module docstring names, defined with the rest of them in serve/faults.py
from vramguard.runtime.device import is_oom  # noqa: F401
from vramguard.serve.faults import (DEVICE_FAULT_MARKERS, MAX_FAILURES_IN_A_ROW, MAX_OOM_RETRIES,  # noqa: F401
                                    MAX_STEP_FAILURES, device_fault)
from vramguard.serve.attention import choose as choose_attention
from vramguard.serve.pool import PoolPlan, blocks_needed
from vramguard.serve.sampler import DRAW, GREEDY, SEEDED, RowSampler, sampling_rows
from vramguard.units import fmt_bytes

log = logging.getLogger("vramguard.serve")

GRAPHS = True  # False: decode steps run eagerly (for comparisons)


def _quiet_manager(cls, model, gen, cfg):
    """Builds transformers' continuous-batching manager with its "does not support setting its attention
    implementation dynamically" warning dropped: a model that keeps its attention is refused or served by us, with
    the reason in the engine's notes."""
    import torch

    quiet = _DropRecord("does not support setting its attention implementation dynamically")
    hf_log = logging.getLogger("transformers.modeling_utils")
    hf_log.addFilter(quiet)
    try:
        with torch.inference_mode(False):
            return cls(model=model, generation_config=gen, continuous_batching_config=cfg)
    finally:
        hf_log.removeFilter(quiet)


class _DropRecord(logging.Filter):
    """Drops the log records whose message contains ``text`` (one known library message), keeps every other."""

    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()

RESTORE_AFTER_STEPS = 200  # steps without an OOM before a halved step budget doubles again
DRAIN_WINDOW_STEPS = 64  # recent steps whose rate estimates when admission slots free up (Retry-After)
DRAIN_WINDOW_S = 30.0  # ... counting only steps this recent
# Values of the generation config that make transformers build the per-request temperature, top-k and top-p
# processors; every request then passes its own three values, so these defaults are never applied to a request.
_PROCESSOR_SEEDS = {"temperature": 0.5, "top_k": 50, "top_p": 0.9}


@dataclass
class Sampling:
    """Per-request decoding: ``temperature`` 0 means greedy (the argmax of the logits, the first of equal maxima, as
    transformers' ``generate(do_sample=False)``); ``seed``: the request's own random stream for a draw (None: the
    engine's generator, seeded by the server's ``seed=``)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def row_mode(self) -> tuple[int, int]:
        """(mode, seed) of this request's rows for :class:`~vramguard.serve.sampler.RowSampler`."""
        if self.greedy:
            return GREEDY, 0
        return (SEEDED, self.seed) if self.seed is not None else (DRAW, 0)

    def processor_kwargs(self, vocab_size: int) -> dict:
        """The per-request values for transformers' temperature, top-k and top-p processors (all three, always)."""
        if self.temperature == 0:
            return {"temperature": 1.0, "top_k": 1, "top_p": 1.0}
        return {"temperature": float(self.temperature), "top_k": int(self.top_k or vocab_size),
                "top_p": float(self.top_p)}


@dataclass
class Handle:
    """One admitted request as the API sees it: an asyncio queue of transformers ``GenerationOutput``."""

    request_id: str
    prompt_tokens: int
    max_new_tokens: int
    queue: asyncio.Queue
    submitted: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    finished: bool = False
    retries: int = 0  # out-of-memory errors it ran into alone, since its last token
    step_failures: int = 0  # other failed steps it was part of, since its last token
    generated: int = 0  # tokens generated so far (as last delivered)
    error_code: str | None = None  # set by the engine when it fails the request alone ("request_failed")


@dataclass
class StepRecord:
    """One engine step: its index and the requests it computed (kept for the last ``STEP_HISTORY`` steps)."""

    index: int
    request_ids: tuple[str, ...]
    at: float


STEP_HISTORY = 4096


class EngineStopped(RuntimeError):
    """A request reached :meth:`Engine.submit` after the engine stopped accepting (the server is stopping)."""


class Engine:
    """Continuous batching with a planned pool. Thread model: the model runs in transformers' background thread;
    :meth:`submit`, :meth:`cancel` and :meth:`stats` are called from the asyncio loop of the server.

    Args:
        model, tokenizer: a loaded causal LM and its tokenizer.
        pool: the :class:`~vramguard.serve.pool.PoolPlan` (``num_blocks``, ``page_size``, step limits).
        max_queue: requests allowed to wait for their first token beyond those the engine runs at once.
        seed: the seed of the engine's generator, which draws for the requests without a ``seed`` of their own
            (a request's own seed draws from its own stream: :mod:`vramguard.serve.sampler`).
        metrics: optional :class:`~vramguard.serve.metrics.Metrics`.
        greedy_only: decode every request greedily with a plain argmax (no sampling processors in the step);
            requests that ask for sampling are refused by the API.
        own_kernels: run vramguard's varlen attention and decode CUDA graphs where they can run
            (:mod:`vramguard.serve.attention`, :mod:`vramguard.serve.decode_graphs`); False: transformers' own.
        deterministic: every step computes one request, so a request's text does not depend on what else is in
            the batch (a step's kernels and their rounding depend on its row count; in 16-bit weights a near-tie
            can flip). Requests still run concurrently, one step each in turn; throughput falls with the count of
            requests running (benchmarks/README.md has the cost).

    Test hooks: ``before_step(index, request_ids)`` is called in the engine thread before each step's forward;
    raising ``torch.OutOfMemoryError`` there exercises recovery exactly as a real OOM in the forward would.
    """

    name = "continuous"  # the value of serve's engine choice that selects this engine

    def __init__(self, model, tokenizer, pool: PoolPlan, *, max_queue: int = 64, seed: int | None = 0,
                 metrics=None, greedy_only: bool = False, own_kernels: bool = True, deterministic: bool = False):
        self.model, self.tokenizer, self.pool = model, tokenizer, pool
        self._cb_blocks_per_block = 1  # transformers' KV blocks per pool block, known at start
        self.own_kernels = own_kernels
        self.max_queue = max_queue
        self.greedy_only = greedy_only
        self.deterministic = deterministic
        self.reserved = 0  # admission slots held by requests being validated (event-loop thread only)
        self.accepting = True
        self._stopped = False
        self.max_running = pool.max_requests
        self.seed = seed
        self.metrics = metrics
        self.handles: dict[str, Handle] = {}
        self.steps: deque[StepRecord] = deque(maxlen=STEP_HISTORY)
        self.oom_recoveries = 0
        self.oom_events: list[dict] = []
        self.step_failure_events: list[dict] = []  # one per failed step that was not an OOM (kept last 256)
        self._suspects: set[str] = set()  # requests of a failed step not yet run alone (engine thread only)
        self._batch_limit: int | None = None  # the scheduler's requests per step before isolation began
        self._failures_in_a_row = 0  # failed iterations with no request in the step (the engine's own fault)
        self._charged_in_a_row = 0  # failed steps charged to their requests, without a good step between
        self._probe_id: str | None = None  # the known-good request queued to check the engine (recovery.add_probe)
        self.probes = 0
        self.fatal_error: BaseException | None = None
        self.before_step: Callable[[int, list[str]], None] | None = None
        self.attn_implementation: str | None = None
        self.notes: list[str] = []
        self.probing = False  # True while the start's two-token request runs: its failure is a finding, not a fault
        self.probe_error: str | None = None  # the error of a step that failed while probing
        self._ids = itertools.count()
        self._cancelled: deque[tuple[float, str]] = deque()
        self._steps_since_oom = 0
        self._lock = threading.Lock()
        self._manager = None
        self._cache = None
        self._graphs = None  # DecodeGraphs, made in the engine thread at the first step (None: not (yet) made)
        self.graphs_wanted = False  # decode-only steps from CUDA graphs (set when the varlen attention runs)
        self._gemm_route = None  # the decode graphs' 4-bit matmul route (decode_graphs.choose_gemm), or None
        self._row_modes: dict[str, tuple[int, int]] = {}  # request id -> (mode, seed) of its rows (sampler.py)
        self._sampler: RowSampler | None = None  # made with the batch processor (install_sampler)
        self.vocab_size = int(model.config.get_text_config().vocab_size)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Build the engine with the planned pool and start its background thread (no GPU work before this).

        Raises:
            Infeasible: transformers' engine refused the pool (its own free-memory check); the message has both
                numbers and the fix. RuntimeError: the engine thread died while starting for another reason.
        """
        cb_log = logging.getLogger("ContinuousBatchingLogger")
        level = cb_log.level
        cb_log.setLevel(logging.CRITICAL)  # a refusal while starting is reported by us, with the fix, not a traceback
        try:
            self._start()
        finally:
            cb_log.setLevel(level)

    def _start(self) -> None:
        import torch
        from transformers import GenerationConfig
        text_cfg = self.model.config.get_text_config()
        self._cb_blocks_per_block = _compat.blocks_per_pool_block(text_cfg)
        eos = getattr(self.model.generation_config, "eos_token_id", None)
        if eos is None and self.tokenizer is not None:
            eos = self.tokenizer.eos_token_id
        sampling = {} if self.greedy_only else {"do_sample": True, **_PROCESSOR_SEEDS}
        gen = GenerationConfig(max_new_tokens=16, eos_token_id=eos if eos is not None else -1,
                               pad_token_id=getattr(text_cfg, "pad_token_id", None) or 0,
                               **(sampling or {"do_sample": False}))
        cfg = _compat.cb_config(num_blocks=self.pool.num_blocks * self._cb_blocks_per_block,
                                page_size=self.pool.page_size, max_batch_tokens=self.pool.max_batch_tokens,
                                max_requests_per_batch=1 if self.deterministic else self.pool.max_requests,
                                use_async_batching=False, per_request_processors=not self.greedy_only,
                                drop_unsupported_processors=False,
                                max_memory_percent=1.0, seed=self.seed, allow_block_sharing=False)
        before = self.model.config._attn_implementation
        cls = _compat.guarded_manager_class()  # through the module: a test replaces it
        switched_from, note = choose_attention(self.model) if self.own_kernels else (None, None)
        try:
            self._manager = _quiet_manager(cls, self.model, gen, cfg)
        except ValueError as e:  # this transformers takes no custom attention in continuous batching
            if switched_from is None:
                raise
            self.model.set_attn_implementation(switched_from)
            note = f"attention: transformers' paged attention (its continuous batching refused ours: {str(e)[:120]})"
            switched_from = None
            self._manager = _quiet_manager(cls, self.model, gen, cfg)
        if note is not None:
            self.notes.append(note)
        if self.deterministic:
            self.notes.append("deterministic: one request per step, so a request's text does not depend on the "
                              "others running (they take turns, step by step)")
        self.graphs_wanted = switched_from is not None and GRAPHS
        if self.graphs_wanted:
            self._gemm_route, note = choose_gemm(self.model)
            if note is not None:
                self.notes.append(note)
        self._manager.vg_engine = self
        self.attn_implementation = self.model.config._attn_implementation
        if self.attn_implementation != before and switched_from is None:
            self.notes.append(f"attention: the continuous-batching engine runs {self.attn_implementation!r} "
                              f"(loaded as {before!r}); it needs a paged attention implementation")
        if next(self.model.parameters()).is_cuda:
            t0 = time.perf_counter()
            try:  # CUDA graphs / compiled paths are prepared now rather than on the first requests
                with torch.inference_mode(False):
                    self._manager.warmup()
                self.notes.append(f"engine warm-up (CUDA graph capture where enabled) took "
                                  f"{time.perf_counter() - t0:.1f} s")
            except MemoryError as e:
                raise self._refused(e) from None
            except Exception as e:  # noqa: BLE001 - warm-up is an optimisation: report and serve without it
                self.notes.append(f"engine warm-up failed, serving without it: {type(e).__name__}: "
                                  f"{str(e).splitlines()[0][:160]}")
        self._manager.start()
        deadline = time.time() + 120
        while getattr(self._manager, "batch_processor", None) is None and time.time() < deadline:
            if self._manager.background_thread_status.fatal_error is not None:
                break
            time.sleep(0.01)
        bp = getattr(self._manager, "batch_processor", None)
        if bp is None:
            err = self._manager.background_thread_status.fatal_error
            if isinstance(err, MemoryError):
                raise self._refused(err)
            raise RuntimeError(f"the continuous-batching engine did not start: {err!r}")
        self._cache = bp.cache
        per = self._cb_blocks_per_block
        actual = int(getattr(self._cache, "num_blocks", self.pool.num_blocks * per)) // per
        if actual != self.pool.num_blocks:
            self.notes.append(f"the engine made {actual} blocks of the {self.pool.num_blocks} planned")
        self.pool.num_blocks = actual
        self.pool.pool_tokens = actual * self.pool.page_size

    def _refused(self, err: BaseException):
        """transformers' engine refused the pool: its own check of free memory (on the CPU: host RAM, less what
        this process holds) is stricter than the budget. An :class:`Infeasible` naming both numbers and the fix."""
        import re
        nums = [int(x) for x in re.findall(r"\d{4,}", str(err))]
        p = self.pool
        seen, fix = str(err), "lower vram_budget= (or cap the pool with max_kv_blocks=) and start again"
        if len(nums) >= 2:
            short = nums[0] - nums[1]
            seen = f"the engine needs {fmt_bytes(nums[0])} with this pool and sees {fmt_bytes(nums[1])} available"
            fewer = -(-short // max(p.page_size * p.kv_bytes_per_token, 1))
            fix = (f"lower vram_budget= by at least {fmt_bytes(short)}, or cap the pool "
                   f"with max_kv_blocks={max(p.num_blocks - fewer - 1, 1)}, and start again")
        self.stop()
        return Infeasible("vram_budget", f"a KV pool of {p.num_blocks} blocks ({fmt_bytes(p.pool_bytes)})",
                          f"a pool the engine accepts ({seen})", fix)

    def stop(self, hard: bool = False, timeout_s: float = 10.0) -> None:
        """Stop the engine thread (idempotent; waits up to ``timeout_s`` seconds). ``hard``: without finishing the
        requests it holds (transformers' ``hard_stop``, where the installed version has it), for an engine being
        discarded."""
        import inspect
        self.accepting = False
        if self._manager is not None and not self._stopped:
            self._stopped = True
            kw = {"hard_stop": True} if hard and "hard_stop" in inspect.signature(self._manager.stop).parameters else {}
            try:
                self._manager.stop(block=True, timeout=timeout_s, **kw)
            except Exception as e:  # noqa: BLE001 - shutting down: report, never raise
                log.warning("engine stop: %s", e)

    def release(self) -> None:
        """Stop the engine and drop its KV pool, paged cache and any captured CUDA graphs (the references this
        engine holds; the caller frees the model). The engine cannot serve afterwards."""
        self.stop()
        self._manager = None
        self._cache = None
        self._graphs = None
        self.handles.clear()

    def fail_inflight(self, message: str) -> int:
        """Stop admitting and end every unfinished request with ``message`` (an error the API turns into a 503
        error object). Event-loop thread only. Returns how many requests were ended."""
        from types import SimpleNamespace
        self.accepting = False
        n = 0
        for rid, h in list(self.handles.items()):
            if not h.finished:
                h.queue.put_nowait(SimpleNamespace(status=SimpleNamespace(name="FAILED"), error=message,
                                                   generated_tokens=[], request_id=rid))
                if self._manager is not None:
                    self._manager.cancel_request(rid)
                n += 1
        return n

    # ------------------------------------------------------------------ state
    @property
    def running(self) -> bool:
        """The engine thread runs, accepts requests, and no unrecoverable error happened."""
        m = self._manager
        return m is not None and self.accepting and m.is_running() and self.fatal_error is None

    def check_fatal(self) -> BaseException | None:
        """The engine's unrecoverable error, if its loop died (also when it died outside a step)."""
        if self.fatal_error is None and self._manager is not None:
            err = self._manager.background_thread_status.fatal_error
            if err is not None:
                self.fatal_error = err
        return self.fatal_error

    def in_flight(self) -> int:
        """Admitted requests not finished."""
        return sum(1 for h in self.handles.values() if not h.finished)

    def waiting(self) -> int:
        """Admitted requests without a first token yet."""
        return sum(1 for h in self.handles.values() if not h.finished and h.first_token_at is None)

    def capacity_left(self) -> int:
        """Requests that may still be admitted: ``max_running + max_queue - in flight - being validated``."""
        return self.max_running + self.max_queue - self.in_flight() - self.reserved

    def kv_blocks_used(self) -> int:
        """Blocks held now, from the engine's own pool (whole-model blocks of ``page_size`` tokens)."""
        c = self._cache
        if c is None:
            return 0
        total = self.pool.num_blocks
        if hasattr(c, "compute_free_capacity"):
            return total - int(round(c.compute_free_capacity(relative=True) * total))
        if hasattr(c, "get_num_free_blocks"):  # transformers 5.17: blocks of one layer group
            return total - int(c.get_num_free_blocks()) // self._cb_blocks_per_block
        return 0

    def kv_tokens_reserved(self) -> int:
        """Tokens promised to admitted, unfinished requests (prompt + max new tokens)."""
        return sum(h.prompt_tokens + h.max_new_tokens for h in self.handles.values() if not h.finished)

    def stats(self) -> dict:
        """Counts for /health, the metrics and the router (requests, KV blocks and tokens, recoveries, steps)."""
        return {"engine": self.name, "running": self.running, "in_flight": self.in_flight(), "waiting": self.waiting(),
                "max_running": self.max_running, "max_queue": self.max_queue,
                "kv_blocks_total": self.pool.num_blocks, "kv_blocks_used": self.kv_blocks_used(),
                "kv_page_size": self.pool.page_size,
                "kv_tokens_total": self.pool.pool_tokens, "kv_tokens_reserved": self.kv_tokens_reserved(),
                "oom_recoveries": self.oom_recoveries, "step_failures": len(self.step_failure_events),
                "engine_probes": self.probes,
                "isolating": len(self._suspects), "steps": self.steps[-1].index + 1 if self.steps else 0,
                "retry_after_s": self.retry_after_s(1),
                "decode_graphs": len(self._graphs[1].graphs) if self._graphs else 0}

    def retry_after_s(self, need: int) -> int:
        """Seconds until ``need`` more requests can be admitted, from the engine's real drain rate.

        An admission slot frees when an admitted request finishes. The running requests finish after their
        remaining tokens (``max_new_tokens`` less those generated), one per step; each queued request starts, in
        order, when a running one finishes and then needs its own ``max_new_tokens``. The ``k``-th of these finishes,
        ``k`` being how many must free, divided by the steps per second of the recent steps, is the wait. At least
        1 s. With fewer than two steps measured, 10 steps/s is assumed (the rate of nothing measured is unknown)."""
        import heapq
        over = self.in_flight() + self.reserved + need - self.max_running - self.max_queue
        live = [h for h in list(self.handles.values()) if not h.finished]
        if over <= 0 or not live:
            return 1
        running = [max(h.max_new_tokens - h.generated, 1) for h in live if h.first_token_at is not None]
        queued = [h.max_new_tokens for h in sorted(live, key=lambda h: h.submitted) if h.first_token_at is None]
        heap, free, finishes = list(running), max(self.max_running - len(running), 0), []
        heapq.heapify(heap)
        for steps in queued:
            if free:
                start, free = 0, free - 1
            else:
                start = heapq.heappop(heap)
                finishes.append(start)
            heapq.heappush(heap, start + steps)
        finishes += sorted(heap)
        steps = finishes[min(over, len(finishes)) - 1]
        return max(1, math.ceil(steps / self.steps_per_s()))

    def steps_per_s(self) -> float:
        """Engine steps per second over the last ``DRAIN_WINDOW_STEPS`` steps of the last ``DRAIN_WINDOW_S``
        seconds (10.0 when fewer than two are known)."""
        now = time.perf_counter()
        recent = [st.at for st in list(self.steps)[-DRAIN_WINDOW_STEPS:] if now - st.at <= DRAIN_WINDOW_S]
        if len(recent) < 2 or recent[-1] <= recent[0]:
            return 10.0
        return (len(recent) - 1) / (recent[-1] - recent[0])

    # ------------------------------------------------------------------ requests
    def fits_pool(self, tokens: int) -> bool:
        """Whether one request of ``tokens`` (prompt + max new) can ever be held by the pool."""
        return blocks_needed(tokens, self.pool.page_size) <= self.pool.num_blocks

    def budget_refusal(self, prompt_tokens: int, max_new_tokens: int, limit_field: str) -> str | None:
        """Why one request of this shape can never run here (it needs more KV blocks than the whole pool), or
        None when it can."""
        if self.fits_pool(prompt_tokens + max_new_tokens):
            return None
        return (f"{limit_field}: {prompt_tokens:,} prompt + {max_new_tokens:,} new tokens needs more KV cache than "
                f"this server's whole KV cache pool ({self.pool.pool_tokens:,} tokens, as the server was started); "
                f"it can never run here: keep prompt + {limit_field} <= {self.pool.pool_tokens:,}")

    def submit(self, input_ids: list[int], max_new_tokens: int, sampling: Sampling,
               eos_token_id: int | list[int] | None = None) -> Handle:
        """Admit one request (the caller checked validity and capacity). Must be called from the event loop.

        Raises:
            EngineStopped: the server began stopping (Ctrl-C, SIGTERM, a device error) after the request was
                admitted: nothing was queued, and the caller answers 503.
        """
        if not self.accepting or self._manager is None or self.fatal_error is not None:
            raise EngineStopped("the engine is not accepting requests (stopping or stopped)")
        rid = f"vg-{next(self._ids)}"
        h = Handle(rid, len(input_ids), max_new_tokens, asyncio.Queue())
        self.handles[rid] = h

        def deliver(output, h=h):
            if h.first_token_at is None and output.generated_tokens:
                h.first_token_at = time.perf_counter()
            h.generated = len(output.generated_tokens)
            h.queue.put_nowait(output)

        self._manager.register_result_handler(rid, deliver)
        self._row_modes[rid] = (GREEDY, 0) if self.greedy_only else sampling.row_mode()
        kw = {} if self.greedy_only else sampling.processor_kwargs(self.vocab_size)
        if eos_token_id is not None:
            kw["eos_token_id"] = eos_token_id
        ok = self._manager.add_request(list(input_ids), request_id=rid, max_new_tokens=max_new_tokens,
                                       streaming=True, **kw)
        if ok is None:
            h.finished = True
            self.handles.pop(rid, None)
            raise EngineStopped("the engine is not accepting requests (stopping or stopped)")
        return h

    def cancel(self, request_id: str) -> None:
        """Cancel a request: a waiting one never reaches the GPU; a running one frees its blocks at the next step."""
        h = self.handles.pop(request_id, None)
        self._row_modes.pop(request_id, None)
        if h is not None and not h.finished:
            h.finished = True
            if self._manager is not None:
                self._manager.cancel_request(request_id)
                router = self._manager.output_router
                with router._lock:  # late outputs go nowhere; the entry is dropped by sweep()
                    if request_id in router.result_handlers:
                        router.result_handlers[request_id] = (lambda _o: None, router.result_handlers[request_id][1])
                self._cancelled.append((time.perf_counter(), request_id))

    def sweep(self, older_than_s: float = 5.0) -> None:
        """Forget the output handlers of requests cancelled more than ``older_than_s`` ago."""
        now = time.perf_counter()
        while self._cancelled and now - self._cancelled[0][0] > older_than_s:
            _, rid = self._cancelled.popleft()
            with self._manager.output_router._lock:
                self._manager.output_router.result_handlers.pop(rid, None)

    def clear_history(self) -> None:
        """Forget the recorded steps (after the server's own check request, which no client sent)."""
        self.steps.clear()

    def finish(self, request_id: str) -> None:
        """Forget a request whose response is complete."""
        self._row_modes.pop(request_id, None)
        h = self.handles.pop(request_id, None)
        if h is not None:
            h.finished = True

    # ------------------------------------------------------------------ engine thread
    def decode_graphs(self, bp):
        """The engine's :class:`~vramguard.serve.decode_graphs.DecodeGraphs` for batch processor ``bp`` (made at
        the first call, in the engine thread), or None when decode steps run eagerly (with the reason in the notes)."""
        if not self.graphs_wanted:
            return None
        if self._graphs is None or self._graphs[0] is not bp:
            why = unsupported(bp)
            if why is not None:
                self.graphs_wanted = False
                self.notes.append(f"decode steps: eager, without CUDA graphs ({why})")
                return None
            self._graphs = (bp, DecodeGraphs(bp, self.pool.max_requests, self._gemm_route))
            self.notes.append("decode steps: CUDA graphs (vramguard.serve.decode_graphs), captured at the first "
                              "step of each size")
        return self._graphs[1]

    def install_sampler(self, bp) -> None:
        """Give batch processor ``bp`` this engine's token choice (:class:`~vramguard.serve.sampler.RowSampler`),
        before any step of it runs or is captured in a CUDA graph."""
        rows = max(self.pool.max_batch_tokens, self.pool.max_requests, SIZES[-1])  # logits rows <= query tokens
        device = next(self.model.parameters()).device
        if self._sampler is None or self._sampler.args.device != device:
            self._sampler = RowSampler(rows, device)
        bp.model_runner._sample = self._sampler

    def _fill_rows(self, bp) -> None:
        """Write the prepared step's (mode, seed, position) rows for the sampler (engine thread, before the
        forward). A request this engine did not submit (transformers' warm-up) is greedy."""
        if self._sampler is None:
            return
        io = bp.inputs_and_outputs
        rows = sampling_rows(getattr(io, "requests_in_batch", []),
                             lambda rid: self._row_modes.get(rid, (GREEDY, 0)))
        self._sampler.fill(rows, getattr(io, "compute_stream", None))

    def _on_step(self, index: int, request_ids: list[str], bp=None) -> None:
        self.steps.append(StepRecord(index, tuple(request_ids), time.perf_counter()))
        self._steps_since_oom += 1
        if (bp is not None and self._steps_since_oom >= RESTORE_AFTER_STEPS
                and bp.max_batch_tokens < self.pool.max_batch_tokens):  # the step budget halved by an OOM grows back
            bp.max_batch_tokens = min(self.pool.max_batch_tokens, bp.max_batch_tokens * 2)
            self._steps_since_oom = 0
            log.info("max_batch_tokens back to %d after %d steps without OOM", bp.max_batch_tokens,
                     RESTORE_AFTER_STEPS)
        if self.before_step is not None:
            self.before_step(index, request_ids)
