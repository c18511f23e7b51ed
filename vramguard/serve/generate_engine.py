"""The serving engine for any architecture transformers' ``generate`` runs: one request at a time through the model's
own ``generate``, admitted by the planner's memory for that architecture; it knows nothing about HTTP.

transformers' continuous batching holds every layer's K/V in one paged cache of one shape, so it cannot run MLA
(DeepSeek-V2/V3), linear-attention, Mamba or chunked-attention layers, nor the models whose attention calls the
cache's own methods (Bloom, Falcon, GPT-NeoX). ``generate`` builds the cache transformers made for the model
(``DynamicCache(config=...)`` with every layer kind), so this engine serves whatever ``generate`` can run.

Memory. A request of ``p`` prompt and ``n`` new tokens needs the plan's peak of ``generate`` for that shape
(:func:`vramguard.plan.estimate`, batch 1, the KV cache at ``p + n`` tokens and the larger of the prefill and decode
peaks; for architectures outside the hand-written families the replay of :mod:`vramguard.introspect.generic`). Each
phase's need grows with its length, so ``need(p, n) <= max(need(T - 1, 1), need(1, T - 1))`` for ``p + n <= T``:
the prefill of ``p <= T - 1`` tokens is at most that of ``T - 1``, and each decode step at most the last one of a
``T``-token run. At start the engine finds the largest ``T`` (:attr:`GeneratePlan.pool_tokens`) whose bound fits the
usable memory, so that such requests are admitted without planning; a longer one is planned on its own
(:func:`vramguard.run.generate.preflight`: the plain dynamic cache, else chunked prefill, a static, quantized or
offloaded cache) and refused when no strategy fits. One request runs at a time, so the planned need is all the
memory it gets and nothing else competes for it.

Out of memory all the same (another process took memory, fragmentation): the request's memory is freed and it goes
on from its prompt plus the tokens generated so far with the next strategy the plan ranks as smaller, or the same
one when none is (greedy requests therefore continue with the same tokens); after ``MAX_OOM_RETRIES`` it fails
alone with a clear error. A device fault stops the engine (as :class:`~vramguard.serve.engine.Engine`); any other
error of a request fails that request alone.
"""

from __future__ import annotations

import copy
import gc
import itertools
import logging
import queue
import threading
import time
from dataclasses import asdict, dataclass, field
from enum import Enum

from vramguard.errors import Infeasible, NotPlannable
from vramguard.plan import choose, estimate
from vramguard.plan.solve import _largest
from vramguard.run.generate import STRATEGIES, preflight
from vramguard.runtime.device import is_oom
from vramguard.runtime.handle import sdpa_unpinned
from vramguard.serve.engine import Engine, EngineStopped, Handle, Sampling, StepRecord
from vramguard.serve.sampler import choice_seed
from vramguard.serve.faults import MAX_FAILURES_IN_A_ROW, MAX_OOM_RETRIES, _first_line, device_fault
from vramguard.units import fmt_bytes, fmt_gib

log = logging.getLogger("vramguard.serve")

_PLAN_LOCK = threading.Lock()  # the replay of a plan runs under global module hooks: one plan at a time


class Status(Enum):
    """A request's state in one output (the names the API reads, as transformers' ``RequestStatus`` has them)."""

    RUNNING = "running"
    FINISHED = "finished"
    FAILED = "failed"


@dataclass
class Output:
    """What the API reads from a handle's queue: the tokens generated so far, the status and an error text."""

    request_id: str
    status: Status
    generated_tokens: list[int]
    error: str | None = None


@dataclass
class GeneratePlan:
    """The memory of the generate engine (bytes; counts in tokens).

    Attributes:
        usable_bytes: memory left for generation after the weights (the budget less what was allocated).
        pool_tokens: the largest ``prompt + max_tokens`` that always fits (longer requests are planned one by one).
        need_bytes: the planned need of a ``pool_tokens`` request (its bound; see the module docstring).
        kv_bytes_per_token: what one more token adds to the cache at ``pool_tokens``.
        context_length: the model's context. source: how the budget was decided.
        page_size, num_blocks, max_requests: the counts the server's stats share with the paged engine (one
            token per block, one request at a time).
    """

    usable_bytes: int
    pool_tokens: int
    need_bytes: int
    kv_bytes_per_token: int
    context_length: int
    source: str
    page_size: int = 1
    num_blocks: int = 0
    max_requests: int = 1

    def __post_init__(self):
        self.num_blocks = self.pool_tokens

    def as_dict(self) -> dict:
        """Every field, for /health and JSON output."""
        return asdict(self)

    def summary(self) -> str:
        """One line for the server's start."""
        return (f"engine: the model's own generate, one request at a time; prompt + max_tokens up to "
                f"{self.pool_tokens:,} tokens always fit (planned {fmt_bytes(self.need_bytes)} of "
                f"{fmt_gib(self.usable_bytes)} usable, {self.source}); longer ones are planned one by one")


def _need(model, s, prompt_tokens: int, max_new_tokens: int) -> int:
    """Planned bytes beyond the loaded weights of one ``generate`` call with the dynamic cache (``model``: the
    :class:`~vramguard.memory.model.MemoryModel` :func:`vramguard.plan.choice.choose` gives)."""
    with _PLAN_LOCK:
        est = estimate(model, s.with_(prompt_tokens=prompt_tokens, max_new_tokens=max_new_tokens, batch=1))
    return est.peak_reserved_bytes - est.weights.total_bytes


def _bound(model, s, tokens: int) -> int:
    """The need that bounds every request of at most ``tokens`` in all (module docstring)."""
    if tokens < 2:
        return _need(model, s, 1, 1)
    return max(_need(model, s, tokens - 1, 1), _need(model, s, 1, tokens - 1))


def plan_requests(spec, s, usable_bytes: int, context_length: int, source: str,
                  smaller: str = ", or quantize the weights") -> GeneratePlan:
    """The :class:`GeneratePlan` of ``spec`` loaded with settings ``s`` for ``usable_bytes``; ``smaller``: the end
    of the refusal's fix that loads smaller weights (:func:`~vramguard.serve.pool.smaller_weights_fix`).

    Raises:
        Infeasible: not even a request of two tokens (one prompt, one new) fits; the message has both numbers.
    """
    model = choose(spec, s).model
    top = max(context_length, 2)
    tokens = _largest(2, top, lambda t: _bound(model, s, t), usable_bytes)
    if tokens is None:
        need = _bound(model, s, 2)
        raise Infeasible("vram_budget", f"{usable_bytes:,} B left after the weights",
                         f"at least {need:,} B ({fmt_bytes(need)}) for one request of 1 prompt + 1 new token",
                         f"raise vram_budget= by at least {fmt_bytes(need - usable_bytes)}{smaller}")
    with _PLAN_LOCK:
        kv = estimate(model, s.with_(prompt_tokens=max(tokens - 1, 1), max_new_tokens=1, batch=1)).kv_bytes_per_token
    return GeneratePlan(usable_bytes, tokens, _bound(model, s, tokens), kv, context_length, source)


@dataclass
class _Job:
    handle: Handle
    prompt: list[int]
    sampling: Sampling
    eos_token_id: int | list[int] | None
    loop: object
    index: int
    order: list | None = None  # (Strategy, planned need) in the order to try; None: the dynamic cache, planned lazily
    generated: list[int] = field(default_factory=list)
    cancelled: threading.Event = field(default_factory=threading.Event)


class GenerateEngine(Engine):
    """One request at a time through ``model.generate`` with a streamer (the tokens as they come) and a stopping
    criterion (cancellation), admitted by the plan (see the module docstring). Same interface as
    :class:`~vramguard.serve.engine.Engine`; ``max_running`` is 1 and the others queue (``max_queue``).

    Args:
        model, tokenizer: a loaded causal LM and its tokenizer.
        plan: the :class:`GeneratePlan` for the usable memory.
        spec, settings: the model's :class:`~vramguard.spec.ModelSpec` and the :class:`~vramguard.settings.Settings`
            it was loaded with (quantization, dtype, attention), for requests planned one by one.
        max_queue, seed, metrics, greedy_only: as for :class:`~vramguard.serve.engine.Engine`.
        deterministic: accepted for the same interface; this engine always is (one request at a time, alone).

    Test hook: ``before_step(index, request_ids)`` runs in the engine thread before each forward of ``generate``;
    raising ``torch.OutOfMemoryError`` there exercises recovery as a real OOM in the forward would.
    """

    name = "generate"

    def __init__(self, model, tokenizer, plan: GeneratePlan, spec, settings, *, max_queue: int = 64,
                 seed: int | None = 0, metrics=None, greedy_only: bool = False, deterministic: bool = False):
        super().__init__(model, tokenizer, plan, max_queue=max_queue, seed=seed, metrics=metrics,
                         greedy_only=greedy_only, deterministic=deterministic)
        self.spec, self.settings = spec, settings
        self.memory = choose(spec, settings).model  # the memory model each request is planned with
        self.max_running = 1
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._running_job: _Job | None = None
        self._thread: threading.Thread | None = None
        self._step_index = itertools.count()
        self._orders: dict[tuple[int, int], list | str] = {}
        self._queued: dict[str, _Job] = {}  # request id -> its job, until finished (under self._lock)
        self._token_steps = itertools.count()
        out = model.get_output_embeddings()
        rows = int(out.weight.shape[0]) if out is not None and hasattr(out, "weight") else 0
        self._no_token = max(self.vocab_size, rows)  # an id no logit has: "never stop on EOS" (ignore_eos)
        gen = model.generation_config
        eos = gen.eos_token_id if gen.eos_token_id is not None else getattr(tokenizer, "eos_token_id", None)
        self._eos = eos
        pad = gen.pad_token_id if gen.pad_token_id is not None else getattr(tokenizer, "pad_token_id", None)
        self._pad = pad if pad is not None else (eos[0] if isinstance(eos, list) and eos else eos) or 0
        self.attn_implementation = model.config._attn_implementation

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the engine thread (no GPU work before the first request)."""
        self._thread = threading.Thread(target=self._loop, name="vramguard-generate", daemon=True)
        self._thread.start()

    def stop(self, hard: bool = False, timeout_s: float = 10.0) -> None:
        """Stop accepting, cancel the running request and stop the thread (idempotent; waits up to ``timeout_s``
        seconds; the running request is always cancelled, so ``hard`` changes nothing here)."""
        self.accepting = False
        if self._stopped:
            return
        self._stopped = True
        job = self._running_job
        if job is not None:
            job.cancelled.set()
        self._jobs.put(None)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=timeout_s)

    def release(self) -> None:
        """Stop the engine and forget its requests (the caller frees the model)."""
        self.stop()
        self.handles.clear()

    def fail_inflight(self, message: str) -> int:
        """Stop admitting and end every unfinished request with ``message`` (event-loop thread only)."""
        self.accepting = False
        n = 0
        for rid, h in list(self.handles.items()):
            if not h.finished:
                h.queue.put_nowait(Output(rid, Status.FAILED, [], message))
                self._cancel_job(rid)
                n += 1
        return n

    @property
    def running(self) -> bool:
        """The engine thread runs, accepts requests, and no unrecoverable error happened."""
        t = self._thread
        return t is not None and t.is_alive() and self.accepting and self.fatal_error is None

    def check_fatal(self) -> BaseException | None:
        """The engine's unrecoverable error, if any."""
        return self.fatal_error

    def kv_blocks_used(self) -> int:
        """Tokens the running request holds (prompt + generated; one token per block here)."""
        job = self._running_job
        return len(job.prompt) + len(job.generated) if job is not None else 0

    # ------------------------------------------------------------------ admission
    def fits_pool(self, tokens: int) -> bool:
        """Whether ``tokens`` in all always fit (:attr:`GeneratePlan.pool_tokens`)."""
        return tokens <= self.pool.pool_tokens

    def budget_refusal(self, prompt_tokens: int, max_new_tokens: int, limit_field: str) -> str | None:
        """Why one request of this shape can never run in the usable memory, or None when it can (planned one by
        one beyond :attr:`GeneratePlan.pool_tokens`). Runs in the API's tokenizer thread."""
        order = self._order(prompt_tokens, max_new_tokens)
        if not isinstance(order, str):
            return None
        return (f"{limit_field}: {prompt_tokens:,} prompt + {max_new_tokens:,} new tokens needs more memory than "
                f"this server has for one request ({order}); keep prompt + {limit_field} <= "
                f"{self.pool.pool_tokens:,}, which always fits")

    def _order(self, prompt_tokens: int, max_new_tokens: int) -> list | str:
        """The strategies to run a request with, first the one to use; or the reason none fits."""
        if prompt_tokens + max_new_tokens <= self.pool.pool_tokens:
            return []  # the dynamic cache, within the bound planned at start
        key = (prompt_tokens, max_new_tokens)
        if key not in self._orders:
            self._orders[key] = self._preflight(prompt_tokens, max_new_tokens)
        return self._orders[key]

    def _preflight(self, prompt_tokens: int, max_new_tokens: int, below: int | None = None) -> list | str:
        """:func:`vramguard.run.generate.preflight` for one request: the strategies that fit (``below``: only those
        planned to need less than that), or the reason none does."""
        s = self.settings.with_(prompt_tokens=prompt_tokens, max_new_tokens=max_new_tokens, batch=1)
        on_cuda = next(self.model.parameters()).is_cuda
        try:
            with _PLAN_LOCK:
                order, _why = preflight(self.spec, s, self.pool.usable_bytes, True, on_cuda, weights_loaded=True)
        except (Infeasible, NotPlannable) as e:
            return e.accepted if isinstance(e, Infeasible) else e.fix
        if below is not None:
            order = [(st, need) for st, need in order if need < below]
        return order

    # ------------------------------------------------------------------ requests
    def submit(self, input_ids: list[int], max_new_tokens: int, sampling: Sampling,
               eos_token_id: int | list[int] | None = None) -> Handle:
        """Queue one request (the caller checked validity and capacity). Must be called from the event loop.

        Raises:
            EngineStopped: the engine stopped accepting (the server is stopping).
        """
        import asyncio
        if not self.accepting or self.fatal_error is not None:
            raise EngineStopped("the engine is not accepting requests (stopping or stopped)")
        index = next(self._ids)
        rid = f"vg-{index}"
        h = Handle(rid, len(input_ids), max_new_tokens, asyncio.Queue())
        self.handles[rid] = h
        order = self._order(len(input_ids), max_new_tokens)
        job = _Job(h, list(input_ids), sampling, eos_token_id, asyncio.get_running_loop(), index,
                   order=order if isinstance(order, list) and order else None)
        with self._lock:
            self._queued[rid] = job
        self._jobs.put(job)
        return h

    def _cancel_job(self, request_id: str) -> None:
        with self._lock:
            job = self._queued.get(request_id)
        if job is not None:
            job.cancelled.set()

    def cancel(self, request_id: str) -> None:
        """Cancel a request: a waiting one never runs; a running one stops after its current step."""
        h = self.handles.pop(request_id, None)
        if h is not None and not h.finished:
            h.finished = True
        self._cancel_job(request_id)
        with self._lock:
            self._queued.pop(request_id, None)

    def sweep(self, older_than_s: float = 5.0) -> None:
        """Nothing to forget: a cancelled request's outputs are never delivered."""

    def finish(self, request_id: str) -> None:
        """Forget a request whose response is complete."""
        super().finish(request_id)
        with self._lock:
            self._queued.pop(request_id, None)

    # ------------------------------------------------------------------ engine thread
    def _deliver(self, job: _Job, status: Status, error: str | None = None) -> None:
        if job.cancelled.is_set() and status is not Status.FAILED:
            return
        out = Output(job.handle.request_id, status, list(job.generated), error)
        try:
            job.loop.call_soon_threadsafe(job.handle.queue.put_nowait, out)
        except RuntimeError:  # the event loop closed (the server stopped): nobody is waiting
            pass

    def _loop(self) -> None:
        import torch
        with torch.inference_mode():
            while True:
                job = self._jobs.get()
                if job is None or self.fatal_error is not None:
                    return
                if job.cancelled.is_set():
                    continue
                self._running_job = job
                try:
                    self._run(job)
                except BaseException as fatal:  # noqa: BLE001 - a device fault: every request fails, loop ends
                    self._deliver(job, Status.FAILED, f"the engine stopped after a device error: "
                                                      f"{_first_line(fatal)}")
                    self._fatal(fatal)
                    return
                finally:
                    self._running_job = None

    def _fatal(self, error: BaseException) -> None:
        self.fatal_error = error
        self.accepting = False
        log.error("generate engine stopped: %s", _first_line(error))
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                self._deliver(job, Status.FAILED, f"the engine stopped after a device error: {_first_line(error)}")

    def _run(self, job: _Job) -> None:
        """Generate one request to its end, continuing after an out-of-memory error with a smaller strategy.

        Raises:
            the error itself when it is a device fault; a known-good request's error after
            ``MAX_FAILURES_IN_A_ROW`` failed requests in a row (:meth:`_probe`).
        """
        h = job.handle
        order = list(job.order) if job.order else [(STRATEGIES[0], None)]
        while True:
            strategy, need = order[0]
            try:
                self._generate(job, strategy)
            except Exception as e:  # noqa: BLE001 - sorted below
                if device_fault(e) is not None:
                    raise
                if not is_oom(e):
                    self._failed(job, e)
                    return
                order = self._after_oom(job, e, strategy, need)
                if not order:
                    return
                continue
            self._failures_in_a_row = 0
            if not job.cancelled.is_set():
                h.finished = True
                self._deliver(job, Status.FINISHED)
            return

    def _failed(self, job: _Job, error: BaseException) -> None:
        """A request's own error (not memory, not the device): it fails alone and the engine goes on."""
        self._failures_in_a_row += 1
        why = _first_line(error)
        job.handle.error_code = "request_failed"
        self._deliver(job, Status.FAILED, f"the engine could not compute this request (alone): {why}; the other "
                                          "requests went on. Send it again with other sampling values, or report "
                                          "it with its body")
        self.step_failure_events.append({"step": self.steps[-1].index if self.steps else None, "error": why,
                                         "failed": [job.handle.request_id], "isolating": []})
        del self.step_failure_events[:-256]
        log.warning("request %s failed: %s", job.handle.request_id, why)
        if self.metrics is not None:
            self.metrics.step_failures.inc()
        if self._failures_in_a_row >= MAX_FAILURES_IN_A_ROW:
            self._probe()

    def _probe(self) -> None:
        """After ``MAX_FAILURES_IN_A_ROW`` failed requests in a row: one known-good step (the start's two-token
        greedy request, one new token). Its success says the requests were to blame (the count starts again);
        its error is the engine's own fault, raised to the fatal path."""
        import torch
        self.probes += 1
        log.warning("%d requests failed in a row: a known-good request checks the engine", self._failures_in_a_row)
        ids = torch.tensor([[min(1, self.vocab_size - 1)] * 2], device=next(self.model.parameters()).device)
        with torch.inference_mode():
            self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False,
                                pad_token_id=self._pad)
        self._failures_in_a_row = 0

    def _after_oom(self, job: _Job, error: BaseException, strategy, need: int | None) -> list:
        """Free the failed attempt's memory and return the strategies to continue with (empty: the request
        failed, its client told why)."""
        import torch
        h = job.handle
        h.retries += 1
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        self.oom_recoveries += 1
        done = len(job.prompt) + len(job.generated)
        left = h.max_new_tokens - len(job.generated)
        if need is None:  # the dynamic cache admitted within the bound: its own plan, for "smaller"
            need = self._need_of(done, left)
        order = self._preflight(done, left, below=need) if h.retries <= MAX_OOM_RETRIES else []
        if h.retries <= MAX_OOM_RETRIES and (not isinstance(order, list) or not order):
            order = [(strategy, need)]  # nothing planned smaller: the same again, its memory given back first
        failed = not order
        self.oom_events.append({"step": self.steps[-1].index if self.steps else None,
                                "error": str(error).splitlines()[0][:200], "strategy": strategy.name,
                                "requeued": [] if failed else [h.request_id], "failed": [h.request_id] if failed
                                else [], "next": None if failed else order[0][0].name})
        del self.oom_events[:-256]
        log.warning("out of memory in request %s (%s): %s", h.request_id, strategy.name,
                    "failed" if failed else f"continues with {order[0][0].name}")
        if self.metrics is not None:
            self.metrics.oom_recoveries.inc()
        if failed:
            h.error_code = "generation_failed"
            self._deliver(job, Status.FAILED, f"out of memory {h.retries} times while computing this request; the "
                                              "server's budget leaves too little room for it: send a shorter "
                                              "prompt or fewer max_tokens")
            return []
        return order

    def _need_of(self, prompt_tokens: int, max_new_tokens: int) -> int:
        return _need(self.memory, self.settings, prompt_tokens, max_new_tokens)

    def _generate(self, job: _Job, strategy) -> None:
        """One ``generate`` call of ``strategy`` from the prompt plus the tokens generated so far."""
        import contextlib

        import torch
        device = next(self.model.parameters()).device
        ids = torch.tensor([job.prompt + job.generated], device=device)
        remaining = job.handle.max_new_tokens - len(job.generated)
        sample = self._sampling(job)
        hook = self.model.register_forward_pre_hook(self._pre_forward(job)) if self.before_step else None
        try:
            with (sdpa_unpinned(self.model, "chunked prefill and the non-dynamic caches pass an attention mask")
                  if strategy.kwargs else contextlib.nullcontext()):
                self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=remaining,
                                    streamer=_Streamer(self, job), stopping_criteria=_stopping(job),
                                    pad_token_id=self._pad, **sample, **copy.deepcopy(strategy.kwargs))
        finally:
            if hook is not None:
                hook.remove()

    def _sampling(self, job: _Job) -> dict:
        """The decoding arguments of one request: greedy (``generate``'s argmax), or its temperature, top-p and
        top-k (0: off), drawn from the generator seeded with the request's own ``seed`` (else the engine's seed and
        the request's index) and the tokens done (a continuation after an OOM draws on). One request runs at a
        time, so no other request draws from that generator meanwhile."""
        import torch
        eos = job.eos_token_id
        kw = {"eos_token_id": self._no_token if eos == -1 else (eos if eos is not None else self._eos)}
        sp = job.sampling
        if self.greedy_only or sp.greedy:
            return {**kw, "do_sample": False}
        if sp.seed is not None:
            torch.manual_seed(choice_seed(sp.seed, len(job.generated)) % 2**64)
        elif self.seed is not None:
            torch.manual_seed(self.seed + job.index * 1_000_003 + len(job.generated))
        return {**kw, "do_sample": True, "temperature": float(sp.temperature), "top_p": float(sp.top_p),
                "top_k": int(sp.top_k)}

    def _pre_forward(self, job: _Job):
        def hook(_module, _args):
            self.before_step(next(self._step_index), [job.handle.request_id])
        return hook

    def _on_token(self, job: _Job, tokens: list[int]) -> None:
        h = job.handle
        job.generated.extend(tokens)
        h.generated = len(job.generated)
        if h.first_token_at is None:
            h.first_token_at = time.perf_counter()
        self.steps.append(StepRecord(next(self._token_steps), (h.request_id,), time.perf_counter()))
        if len(job.generated) < h.max_new_tokens:
            self._deliver(job, Status.RUNNING)


class _Streamer:
    """transformers' streamer protocol (``put`` gets the prompt first, then each new token; ``end``)."""

    def __init__(self, engine: GenerateEngine, job: _Job):
        self.engine, self.job, self.prompt_seen = engine, job, False

    def put(self, value) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.engine._on_token(self.job, [int(x) for x in value.reshape(-1).tolist()])

    def end(self) -> None:
        pass


def _stopping(job: _Job):
    """A stopping criterion that ends ``generate`` once the request is cancelled (after the current step)."""
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    class Cancelled(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), job.cancelled.is_set(), dtype=torch.bool,
                              device=input_ids.device)

    return StoppingCriteriaList([Cancelled()])
