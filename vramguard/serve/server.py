"""Build and run one serving process: load the model, size the KV pool from the budget, start the engine and the
HTTP server. ``vramguard serve`` is a thin wrapper over :func:`build` and :meth:`Served.run`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field

from vramguard.errors import EXIT_DEVICE_ERROR, ConfigError, Infeasible, InvalidValue, VramguardError
from vramguard.plan.choice import choose
from vramguard.resolve import resolve_model
from vramguard.runtime.device import is_oom, restore_cap, set_cap, total_bytes, usable_bytes
from vramguard.runtime.handle import handle_of, unpin_sdpa
from vramguard.runtime.load import UnloadReport, load_model, unload
from vramguard.serve.api import SHUTDOWN_GRACE_S, ServeOptions, create_app
from vramguard.serve.attention import ATTN_NAME
from vramguard.serve.config import ServeConfig
from vramguard.serve.connections import Registry, connection_cap, install_accept_errors, protocol_class
from vramguard.serve.engine import Engine, Sampling
from vramguard.serve.generate_engine import GenerateEngine, plan_requests
from vramguard.serve.metrics import Metrics
from vramguard.memory.kv import paged_pool_bytes
from vramguard.serve.pool import PoolPlan, blocks_needed, plan_pool, smaller_weights_fix
from vramguard.runtime.first_prefill import usable_after_first_prefill
from vramguard.settings import Settings
from vramguard.units import GiB, fmt_bytes, fmt_gib

log = logging.getLogger("vramguard.serve")

CPU_DEFAULT_BUDGET = 2 * GiB  # host memory for the pool when serving on the CPU without a vram_budget
# The engine thread and the HTTP event loop share the GIL; a shorter switch interval than CPython's 5 ms lets the
# loop answer (e.g. reject with 429) while the engine is busy between kernel launches.
SWITCH_INTERVAL_S = 0.001


def _usable(budget: int | None, model) -> tuple[int, str]:
    import torch
    if torch.cuda.is_available() and next(model.parameters()).is_cuda:
        usable, allocated = usable_bytes(budget)  # the same rule as guarded generation
        return usable, (f"vram_budget= minus {allocated:,} B allocated after loading" if budget is not None
                        else "free memory of the card after loading")
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    if budget is not None:
        import psutil
        avail = psutil.virtual_memory().available + held
        if budget > avail:
            raise InvalidValue("vram_budget", fmt_gib(budget), f"at most the {fmt_gib(avail)} of host memory "
                               "available (no CUDA device: the model and its KV pool live in RAM)",
                               f"pass vram_budget={max(1, int(avail * 0.8) // GiB)}GiB or less")
        return budget - held, f"vram_budget= minus {held:,} B of weights (host memory: no CUDA device)"
    return CPU_DEFAULT_BUDGET, (f"2 GiB of host memory for the pool, the {held:,} B of weights on top (no CUDA "
                                "device and no vram_budget=)")


@dataclass
class Served:
    """A ready server: ``app`` (FastAPI), ``engine``, the ``pool`` plan, load report and the model's handle
    (``loaded``, the :class:`~vramguard.runtime.handle.LoadedModel`). Run it with :meth:`run`."""

    app: object
    engine: Engine
    pool: PoolPlan
    options: ServeOptions
    report: object = None
    exit_code: int = 0
    fatal: BaseException | None = None
    server: object = None
    notes: list[str] = field(default_factory=list)
    cap_before: float | None = None  # the process's memory fraction before build's hard cap (put back by close)
    loaded: object = None

    def _server(self, host: str, port: int, on_listen=None):
        self.server = make_server(self.app, host, port, on_listen, on_shutdown=self._drain)
        return self.server

    async def _drain(self) -> None:
        """On Ctrl-C / SIGTERM: refuse new requests, end the open ones with a 503 error object, stop the engine
        while the event loop still runs (its last outputs need the loop)."""
        import asyncio
        why = ("the server stopped after an unrecoverable device error" if self.fatal is not None
               else "the server is shutting down (Ctrl-C or SIGTERM); retry on another instance")
        n = self.engine.fail_inflight(why)
        if n:
            log.warning("shutting down: %d open request(s) ended with a 503 error", n)
        # half the grace for the engine's last step, the rest for the streams to send their error events
        await asyncio.get_running_loop().run_in_executor(None, self.engine.stop, False, SHUTDOWN_GRACE_S / 2)

    def on_fatal(self, error: BaseException) -> None:
        """The engine died: remember why, exit code 3, and stop the server (which ends the open requests)."""
        self.fatal, self.exit_code = error, EXIT_DEVICE_ERROR
        log.error("unrecoverable device error, shutting down: %s", error)
        if self.server is not None:
            self.server.should_exit = True

    def run(self, host: str = "127.0.0.1", port: int = 8000, on_listen=None) -> int:
        """Serve until interrupted; returns the exit code (0, or 3 after an unrecoverable device error).
        ``on_listen(url)`` is called once the socket listens."""
        server = self._server(host, port, on_listen)
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        try:
            server.run()
        finally:
            self.engine.stop()
        return self.exit_code

    def start_background(self, host: str = "127.0.0.1", port: int = 0, timeout_s: float = 60) -> str:
        """Run in a daemon thread; returns the base URL once the socket listens (``port=0`` picks a free port):
        ``http://host:port``, the OpenAI clients' ``base_url`` being that plus ``/v1``.

        Raises:
            RuntimeError: the server was stopped or closed (its engine does not restart): build a new one.
        """
        if not self.engine.running:
            raise RuntimeError("this server was stopped or closed and its engine does not restart: call "
                               "vramguard.serve.server.build(...) again")
        server = self._server(host, port)
        t = threading.Thread(target=self._run_quiet, daemon=True)
        t.start()
        deadline = time.time() + timeout_s
        while not server.started:
            if not t.is_alive() or time.time() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.02)
        h, p = server.servers[0].sockets[0].getsockname()[:2]
        self._thread = t
        return f"http://{h}:{p}"

    def _run_quiet(self):
        try:
            self.server.run()
        finally:
            self.engine.stop()

    def stop(self) -> None:
        """Stop a server started with :meth:`start_background` and wait for its thread (up to 15 s)."""
        if self.server is not None:
            self.server.should_exit = True
            t = getattr(self, "_thread", None)
            if t is not None:
                t.join(timeout=15)


    def close(self, unload_model: bool = True):
        """Stop the server (as :meth:`stop`) and give its GPU memory back: the engine's KV pool, paged cache and
        CUDA graphs, and, with ``unload_model``, the model (:func:`vramguard.runtime.load.unload`, which also runs the
        garbage collector and empties PyTorch's cache); the memory fraction a ``hard_cap`` build set is put
        back. For a server started in-process (a notebook, a test) that should not keep its memory after it
        stops. Returns the :class:`vramguard.runtime.load.UnloadReport` (``freed_bytes``, ``residual_bytes`` above the
        memory allocated before loading, the largest holders; both None on the CPU, where nothing is measured),
        or None without ``unload_model``. The object cannot serve afterwards; closing twice does nothing more."""
        import gc

        import torch
        on_cuda = torch.cuda.is_available()
        before = torch.cuda.memory_allocated() if on_cuda else None
        self.stop()
        self.engine.release()
        self.server = None
        if self.cap_before is not None:
            restore_cap(self.cap_before)
            self.cap_before = None
        if not unload_model:
            gc.collect()
            return None
        rep = unload(self.loaded if self.loaded is not None else self.engine.model)
        if before is None:
            return rep
        return UnloadReport(before - torch.cuda.memory_allocated(), rep.residual_bytes, rep.holders,
                            rep.workspace_bytes)


def make_server(app, host: str, port: int, on_listen=None, on_shutdown=None):
    """A uvicorn server for ``app`` that calls ``on_listen(base_url)`` once its socket listens and awaits
    ``on_shutdown()`` when a stop begins, before uvicorn waits for open requests (so they can be ended cleanly).
    Connections that send no request are closed after a header timeout, and open connections are capped under
    the descriptor limit (:mod:`vramguard.serve.connections`; the server's ``connections``)."""
    import uvicorn

    class _Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            """Ctrl-C / SIGTERM: a graceful stop and exit code 0 (uvicorn would re-raise the signal)."""
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

        async def shutdown(self, sockets=None):
            """The whole stop within :data:`SHUTDOWN_GRACE_S` of its start: ``on_shutdown`` first, then uvicorn's
            wait for open connections gets what is left of the grace (then cancels them)."""
            deadline = time.monotonic() + SHUTDOWN_GRACE_S - SHUTDOWN_MARGIN_S
            if on_shutdown is not None:
                try:
                    await asyncio.wait_for(on_shutdown(), max(deadline - time.monotonic(), 0.1))
                except asyncio.TimeoutError:
                    log.warning("shutdown: the drain took more than %.1f s; closing the open connections",
                                SHUTDOWN_GRACE_S)
                except Exception as e:  # noqa: BLE001 - stopping anyway: report
                    log.warning("shutdown hook: %s", e)
            self.config.timeout_graceful_shutdown = max(deadline - time.monotonic(), 0.1)
            await super().shutdown(sockets)
            if self.force_exit:  # a second Ctrl-C: uvicorn skips the app's shutdown, which would then be
                try:             # cancelled with a traceback; ours is quick, so run it
                    await asyncio.wait_for(self.lifespan.shutdown(), 2)
                except Exception:  # noqa: BLE001 - forced exit: nothing more to do
                    pass

        async def startup(self, sockets=None):
            install_accept_errors()
            await super().startup(sockets)
            if on_listen is not None and self.started and self.servers:
                h, p = self.servers[0].sockets[0].getsockname()[:2]
                on_listen(f"http://{h}:{p}")

    registry = Registry(connection_cap())
    server = _Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on",
                                    timeout_graceful_shutdown=int(SHUTDOWN_GRACE_S), http=protocol_class(registry)))
    server.connections = registry
    return server


SHUTDOWN_MARGIN_S = 0.5  # of the grace, kept for what follows uvicorn's wait (lifespan end, engine and threads)
SMOKE_TIMEOUT_S = 300.0  # seconds the two-token request before serving may take (a large model's first step)


class ContinuousBatchingRefused(ConfigError):
    """transformers' continuous batching cannot run this model (``why``: what failed); the generate engine can."""

    def __init__(self, model_type: str, why: str):
        self.why = why[:300]
        self.own_attention = False  # it failed with vramguard's varlen attention (transformers' own may run it)
        super().__init__("MODEL", model_type, "an architecture transformers' continuous batching (the engine "
                         "'continuous') can run", f"{self.why}; serve it with the engine 'generate' (the model's own "
                         "generate, one request at a time), which the engine 'auto' picks for such a model")


def _first_request_error(engine) -> str | None:
    """Run one two-token greedy request through a started engine; the error text it ended with, or None."""

    async def one_request():
        h = engine.submit([min(1, engine.vocab_size - 1)] * 2, 2, Sampling(temperature=0))
        while True:
            out = await asyncio.wait_for(h.queue.get(), SMOKE_TIMEOUT_S)
            status = getattr(out.status, "name", str(out.status))
            if out.error or status == "FAILED":
                engine.finish(h.request_id)
                return str(out.error or "the request failed")
            if status == "FINISHED":
                engine.finish(h.request_id)
                return None

    return asyncio.run(one_request())


WARM_UP_NEW_TOKENS = 8  # decode steps of the start-up load (each at the full batch)


def _warm_up(engine) -> str:
    """Run the load the engine is sized for once before serving: ``max_running`` greedy requests (as many as the
    pool holds) of ``max_batch_tokens / 4`` prompt tokens and :data:`WARM_UP_NEW_TOKENS` new ones, so the first
    clients do not pay for first-use work (kernel compiles, library heuristics and module loads per shape, the
    allocator's growth to the step peak). Returns a note with the time taken, or why it was skipped or failed
    (never raises: it is an optimisation)."""
    p = engine.pool
    prompt = max(1, min(p.max_batch_tokens // 4, p.pool_tokens // max(p.max_requests, 1) - WARM_UP_NEW_TOKENS))
    per_request = blocks_needed(prompt + WARM_UP_NEW_TOKENS, p.page_size)
    n = min(engine.max_running, p.num_blocks // max(per_request, 1))
    if n < 1 or prompt < 2:
        return "warm-up skipped: the pool holds no request of the start-up load"
    vocab = max(engine.vocab_size - 1, 2)
    t0 = time.perf_counter()

    async def load():
        hs = [engine.submit([1 + (7 * i + 13 * j) % vocab for j in range(prompt)], WARM_UP_NEW_TOKENS,
                            Sampling(temperature=0)) for i in range(n)]
        for h in hs:
            while True:
                out = await asyncio.wait_for(h.queue.get(), SMOKE_TIMEOUT_S)
                status = getattr(out.status, "name", str(out.status))
                if out.error or status in ("FAILED", "FINISHED"):
                    engine.finish(h.request_id)
                    break

    try:
        asyncio.run(load())
    except Exception as e:  # noqa: BLE001 - reported in the start notes; serving goes on
        return f"warm-up failed, serving without it: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
    return (f"warm-up: {n} requests of {prompt} + {WARM_UP_NEW_TOKENS} tokens before serving, "
            f"{time.perf_counter() - t0:.1f} s")


def _discard(engine) -> None:
    import torch
    engine.stop(hard=True)
    engine.release()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _started_engine(model, tokenizer, pool, warm_up: bool = True, **kw) -> Engine:
    """The continuous-batching engine, started, after one two-token greedy request went through it: transformers'
    continuous batching does not run every architecture (its paged cache holds attention layers of one K/V shape),
    and a model it cannot run is refused here rather than failing every request. The model's attention
    implementation is put back when the engine is refused. When that request fails with vramguard's varlen
    attention (:mod:`vramguard.serve.attention`), the engine is started again with transformers' own, with a note.
    ``warm_up`` (on a CUDA device): :func:`_warm_up` runs before the engine is handed to the server.

    Raises:
        ContinuousBatchingRefused: the engine cannot be built for this model or its first request fails (not out
            of memory).
    """
    try:
        return _start_continuous(model, tokenizer, pool, warm_up, **kw)
    except ContinuousBatchingRefused as e:
        if not e.own_attention:
            raise
        engine = _start_continuous(model, tokenizer, pool, warm_up, own_kernels=False, **kw)
        engine.notes.append(f"attention: transformers' paged attention (vramguard's varlen attention failed this "
                            f"model's first request: {e.why[:200]})")
        return engine


def _start_continuous(model, tokenizer, pool, warm_up: bool, **kw) -> Engine:
    """:func:`_started_engine` for one attention choice (``own_kernels`` in ``kw``: see :class:`Engine`)."""
    model_type = getattr(model.config, "model_type", "?")
    before = model.config._attn_implementation
    engine = None
    try:
        engine = Engine(model, tokenizer, pool, **kw)
        kw["metrics"]._engine_stats = engine.stats
        engine.start()
        engine.probing = True
        try:
            err = _first_request_error(engine)
        finally:
            engine.probing = False
        if err is not None and "out of memory" not in err.lower():
            raise ContinuousBatchingRefused(model_type, f"its first request failed: {engine.probe_error or err}")
        if warm_up and next(model.parameters()).is_cuda:
            engine.notes.append(_warm_up(engine))
    except (ContinuousBatchingRefused, ValueError, NotImplementedError, TypeError, KeyError, AttributeError,
            RuntimeError) as e:  # RuntimeError: transformers 5.17 reports a layer type it lacks as "did not start"
        if is_oom(e):
            raise
        own = model.config._attn_implementation == ATTN_NAME
        if engine is not None:
            _discard(engine)
        if model.config._attn_implementation != before:
            model.set_attn_implementation(before)
        refused = e if isinstance(e, ContinuousBatchingRefused) else ContinuousBatchingRefused(
            model_type, f"{type(e).__name__}: {e}")
        refused.own_attention = own
        raise refused from None
    engine.clear_history()
    return engine


def _generate_engine(model, tokenizer, spec, settings, vram_budget: int | None, **kw):
    """The generate engine (:mod:`vramguard.serve.generate_engine`), its plan made for the memory usable now,
    started after one two-token greedy request went through it.

    Raises:
        Infeasible: not even a two-token request fits. ConfigError: the model's generate failed on that request.
    """
    usable, source = usable_after_first_prefill(handle_of(model), *_usable(vram_budget, model))
    plan = plan_requests(spec, settings, usable, spec.max_position_embeddings, source,
                         smaller_weights_fix(settings.quant, handle_of(model).on_cuda))
    engine = GenerateEngine(model, tokenizer, plan, spec, settings, **kw)
    kw["metrics"]._engine_stats = engine.stats
    engine.start()
    err = _first_request_error(engine)
    if err is not None and "out of memory" not in err.lower():
        _discard(engine)
        raise ConfigError("MODEL", getattr(model.config, "model_type", "?"), "a model whose generate runs",
                          f"its generate failed on a two-token request: {err[:300]}")
    engine.clear_history()
    return engine


def _chosen_engine(choice: str, model, tokenizer, spec, settings, vram_budget: int | None, paged_pool,
                   warm_up: bool = True, **kw):
    """The engine ``choice`` names ("continuous", "generate", or "auto": continuous batching where it runs the
    model, else generate, with a note saying why); ``paged_pool()`` plans the continuous engine's pool;
    ``warm_up``: the continuous engine runs its start-up load (:func:`_warm_up`) first.

    Raises:
        ContinuousBatchingRefused: "continuous" for a model continuous batching cannot run.
    """
    why = None
    if choice != "generate":
        try:
            return _started_engine(model, tokenizer, paged_pool(), warm_up=warm_up, **kw)
        except ContinuousBatchingRefused as e:
            if choice == "continuous":
                raise
            why = e.why
    engine = _generate_engine(model, tokenizer, spec, settings, vram_budget, **kw)
    note = ("engine: the model's own generate, one request at a time ("
            + (f"transformers' continuous batching cannot run {model.config.model_type}: {why}"
               if why else "engine 'generate' chosen") + ")")
    engine.notes.append(note)
    if why:
        log.info("%s", note)  # the expected fallback of 'auto', with its reason: not a warning
    return engine


def _serving_notes(tok, unpinned: str | None) -> list[str]:
    """What /health and the start line say about the tokenizer and the attention backend."""
    notes = []
    if tok is None:
        notes.append("no tokenizer in the model folder: prompts must be token ids, /v1/chat/completions is "
                     "refused, and completions carry no text (usage.completion_tokens counts what was "
                     "generated); add the tokenizer files to the folder to get text")
    if tok is not None and not getattr(tok, "chat_template", None):
        notes.append("the tokenizer has no chat template: chat prompts use 'role: content' lines ending with "
                     "'assistant:'")
    if unpinned:
        notes.append(f"SDPA was pinned to the {unpinned} backend at load; unpinned for serving: paged attention "
                     "passes a block mask, which that backend cannot take")
    return notes


def _check_load_fits(model: str, quant: str, dtype: str | None, budget: int) -> None:
    """Refuse, before loading, a hard cap that the load itself cannot fit under: transformers' warm-up block and
    the load's transients (:func:`vramguard.introspect.generic.load_plan`) must fit in ``budget`` bytes.

    Raises:
        Infeasible: the planned reserved peak of the load is over ``budget``.
    """
    try:
        s = Settings(quant=quant, dtype=dtype)
        ld = choose(resolve_model(model), s).model.load_plan(s)
    except VramguardError:  # an unreadable model or setting: the load reports it with its own error
        return
    if ld is not None and ld.peak_reserved_bytes > budget:
        raise Infeasible("vram_budget", fmt_bytes(budget),
                         f"at least {fmt_bytes(ld.peak_reserved_bytes)}: loading holds the weights "
                         f"({fmt_bytes(ld.weights_bytes)}) and {fmt_bytes(ld.largest_transient_bytes)} beside them",
                         f"raise vram_budget= to at least {fmt_bytes(ld.peak_reserved_bytes)} plus the KV pool, or "
                         "quantize the weights")


def _check_weights_fit(model: str, quant: str | None, dtype: str | None, budget: int) -> None:
    """Refuse, before loading, a budget that the planned weights alone fill (on the CPU too, where no hard cap is
    set): the plan's weight bytes (:meth:`~vramguard.memory.model.MemoryModel.weight_bytes`) are known without
    reading a weight, and a refusal after a load of minutes loses that time.

    Raises:
        Infeasible: the planned weights take ``budget`` bytes or more.
    """
    import torch  # the load that follows imports it too
    try:
        s = Settings(quant=quant, dtype=dtype)
        weights = choose(resolve_model(model), s).model.weight_bytes(s).total_bytes
    except VramguardError:  # an unreadable model or setting: the load reports it with its own error
        return
    if weights >= budget:
        raise Infeasible("vram_budget", fmt_bytes(budget), f"more than the {fmt_bytes(weights)} the weights take "
                         f"(quant={quant}, planned before loading)", "raise vram_budget="
                         + smaller_weights_fix(quant, torch.cuda.is_available()))


def public_name(model: str) -> str:
    """The name a server shows for ``model`` when none is given: a local folder's last part (clients never see a
    path of this machine), else ``model`` itself (a model id such as ``org/name``)."""
    if os.path.isdir(model):
        return os.path.basename(os.path.normpath(os.path.abspath(model)))
    return model


def _paged_pool(spec, m, usable: int, source: str, *, page_size: int, max_batch_tokens: int, max_requests: int,
                max_kv_blocks: int | None, quant: str | None = None) -> PoolPlan:
    """The continuous engine's KV pool for ``usable`` bytes (:func:`~vramguard.serve.pool.plan_pool`), capped at
    ``max_kv_blocks``."""
    import torch
    act_bytes = torch.finfo(m.dtype).bits // 8 if m.dtype.is_floating_point else 2
    flash = "flash" in (m.config._attn_implementation or "")
    on_cuda = next(m.parameters()).is_cuda
    pool = plan_pool(spec, usable, act_bytes=act_bytes, flash=flash, page_size=page_size,
                     max_batch_tokens=max_batch_tokens, max_requests=max_requests, on_cuda=on_cuda, source=source,
                     smaller=smaller_weights_fix(quant, on_cuda))
    if max_kv_blocks is not None and max_kv_blocks < pool.num_blocks:
        pool.num_blocks, pool.pool_tokens = max_kv_blocks, max_kv_blocks * page_size
        pool.pool_bytes = paged_pool_bytes(spec, max_kv_blocks, page_size, act_bytes)
        pool.source += f"; capped at {max_kv_blocks} blocks by max_kv_blocks="
    return pool


def _hard_cap(model: str, quant: str, dtype: str | None, vram_budget: int | None) -> float | None:
    """On a CUDA device with a budget: check the budget against the card and the load, then cap this process's
    memory at it (:func:`vramguard.runtime.device.set_cap`); returns the fraction before, None where nothing was
    capped.

    Raises:
        InvalidValue: the budget is larger than the card. Infeasible: the load alone does not fit it.
    """
    import torch
    if vram_budget is None or not torch.cuda.is_available():
        return None
    total = total_bytes()
    if vram_budget > total:
        raise InvalidValue("vram_budget", vram_budget, f"at most the card's {total:,} B", "pass a smaller vram_budget=")
    _check_load_fits(model, quant, dtype, vram_budget)
    return set_cap(vram_budget)


def build(model: str, config: ServeConfig | None = None, *, loaded=None, **options) -> Served:
    """Load ``model`` and prepare the server (no socket yet) with ``config`` (:class:`ServeConfig`; or its fields
    as keywords, ``options``). ``loaded``: a :class:`~vramguard.runtime.handle.LoadedModel` already loaded, served
    as it is.

    Raises:
        InvalidValue: a limit out of range (from :class:`ServeConfig`). Infeasible: the budget leaves no room for
            the pool.
        UnknownModel / ConfigError: from :func:`vramguard.runtime.load.load_model`.
    """
    c = _config(config, options)
    cap_before = _hard_cap(model, c.quant, c.dtype, c.vram_budget) if c.hard_cap else None
    if loaded is None and c.vram_budget is not None and cap_before is None:  # a cap checked the whole load
        _check_weights_fit(model, c.quant, c.dtype, c.vram_budget)
    if loaded is None:
        loaded = load_model(model, quant=c.quant, dtype=c.dtype, attn=c.attn, trust_remote_code=c.trust_remote_code,
                            allow_pickle=c.allow_pickle, verify=c.verify)
    loaded = handle_of(loaded)
    m, tok, report = loaded
    unpinned = loaded.sdpa_pin.backend if loaded.sdpa_pin is not None else None
    unpin_sdpa(m)
    spec = loaded.spec if loaded.spec is not None else resolve_model(str(model))
    usable, source = _usable(c.vram_budget, m)
    if usable <= 0:
        held = -usable + (c.vram_budget or 0)
        raise Infeasible("vram_budget", fmt_bytes(c.vram_budget or 0), f"more than the {fmt_bytes(held)} already "
                         "taken by the weights and runtime", "raise vram_budget="
                         + smaller_weights_fix(loaded.settings.quant, loaded.on_cuda))
    metrics = Metrics()

    def paged_pool():
        return _paged_pool(spec, m, *usable_after_first_prefill(loaded, usable, source), page_size=c.page_size,
                           max_batch_tokens=c.max_batch_tokens, max_requests=c.max_running,
                           max_kv_blocks=c.max_kv_blocks, quant=loaded.settings.quant)

    engine = _chosen_engine(c.engine_choice, m, tok, spec, loaded.settings, c.vram_budget, paged_pool,
                            warm_up=c.warm_up, max_queue=c.max_queue, seed=c.seed, metrics=metrics,
                            greedy_only=c.greedy, deterministic=c.deterministic)
    options = _http_options(model, m, spec, c)
    options.notes += _serving_notes(tok, unpinned)
    served = Served(app=None, engine=engine, pool=engine.pool, options=options, report=report, cap_before=cap_before,
                    loaded=loaded)
    served.app = create_app(engine, tok, options, metrics, on_fatal=served.on_fatal)
    return served


def _config(config: ServeConfig | None, options: dict) -> ServeConfig:
    """``config``, or the :class:`ServeConfig` of ``options`` (its fields as keywords); both given is a
    TypeError, as an unknown keyword is."""
    if config is not None and options:
        raise TypeError(f"build() takes a ServeConfig or its fields, not both: {', '.join(options)}")
    return config if config is not None else ServeConfig(**options)


def _http_options(model: str, m, spec, c: ServeConfig) -> ServeOptions:
    """The HTTP layer's options: the served name and the names it also answers to, the limits of a request."""
    served_name = c.served_name or public_name(str(model))
    aliases = tuple(sorted({str(model), os.path.abspath(str(model)), os.path.basename(os.path.normpath(str(model))),
                            str(getattr(m.config, "_name_or_path", "") or model)} - {served_name}))
    return ServeOptions(model_id=served_name, model_aliases=aliases, allowed_hosts=c.allowed_hosts,
                        context_length=spec.max_position_embeddings, api_key=c.api_key,
                        max_body_bytes=c.max_body_bytes, body_timeout_s=c.body_timeout_s, n_max=c.n_max,
                        default_max_tokens=c.default_max_tokens)
