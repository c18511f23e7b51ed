"""The plan's reserved memory, fit and largest prompt from the caching-allocator model: the allocation tape of
:mod:`vramguard.introspect.alloc_replay` placed by :mod:`vramguard.memory.allocator` under each card's cap."""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import os
import pickle
import signal
import sys
import threading
import warnings
from dataclasses import replace
from typing import Callable

from vramguard.allocconf import env_alloc_conf
from vramguard.finding import Finding
from vramguard.introspect.alloc_replay import (allowed_bytes, computed_stretches, loaded_reserved_bytes, not_covered,
                                               replay_generate, share_tapes, supported, take_stretches)
from vramguard.memory.allocator import AllocatorConfig, backend
from vramguard.memory.runtime import CUDA_CONTEXT_BYTES
from vramguard.plan.estimator import misfit_reason, need_bytes
from vramguard.plan.limits import known_needs, largest as _largest
from vramguard.settings import Settings
from vramguard.units import fmt_bytes


def with_allocator(model, s: Settings, est, cards: list, conf: AllocatorConfig, alloc_conf: str, solve: bool,
                   freed_before: bool = False, ahead: Ahead | None = None, rescale: bool | None = None):
    """The estimate and card verdicts of ``model`` (a :class:`~vramguard.memory.model.MemoryModel`) with reserved
    memory, fit and the largest prompt from the allocator model under ``conf``, parsed from ``alloc_conf``
    (``PYTORCH_CUDA_ALLOC_CONF`` text) by :func:`vramguard.plan.choice.choose`; (est, cards) unchanged where the
    tape does not cover ``s``.

    ``freed_before``: a process that has given a model's memory back to CUDA before, where cudaMalloc may place
    new segments above the older ones or below them (:class:`~vramguard.memory.allocator.AllocatorConfig`): both
    layouts are replayed, the estimate is the one that reserves more, and each card is judged on the worse of the
    two (:func:`_worse`); ``est.freed_layout_reserved_bytes`` holds the upward layout's peak reserved.

    A real card has a limit: when ``cudaMalloc`` fails, the allocator frees its cached segments and tries again.
    So the estimate's replay runs under the largest card's memory (less the CUDA context), not without a limit (a
    long generation would otherwise reserve a new segment for every step's larger KV tensor, terabytes). Where it
    does not fit there, the formula's need stands. Each card's need is its own capped replay's peak where that
    fits (so need, fit and headroom agree), else the estimate's. ``ahead``: that replay started earlier
    (:func:`replays_ahead`).

    ``rescale``: the estimate's tape taken from its prompt's stretch (:func:`~vramguard.introspect.alloc_replay.
    replay_generate`: the same replay) as a solved plan takes it (None: where ``solve``), so that an estimate made
    before its plan is solved is the solved plan's own replay, read back from the tape cache."""
    fresh_est, fresh_cards = _with_conf(model, s, est, cards, conf, alloc_conf, solve, ahead, rescale)
    if not freed_before or fresh_est.allocator is None or conf.expandable_segments:  # one layout
        return fresh_est, fresh_cards
    up_est, up_cards = _with_conf(model, s, est, cards, replace(conf, freed_before=True), alloc_conf, solve, ahead,
                                  rescale)
    worse = up_est if up_est.peak_reserved_bytes > fresh_est.peak_reserved_bytes else fresh_est
    return (replace(worse, freed_layout_reserved_bytes=up_est.peak_reserved_bytes,
                    fresh_layout_reserved_bytes=fresh_est.peak_reserved_bytes),
            [_worse(a, b) for a, b in zip(fresh_cards, up_cards)])


def _worse(a, b):
    """The card verdict of the two layouts that leaves less: the failing one, else the one with less headroom, with
    the smaller largest prompt."""
    if a.fits != b.fits:
        return a if not a.fits else b
    w = a if a.headroom_bytes <= b.headroom_bytes else b
    prompts = [x.max_prompt_tokens for x in (a, b)]
    return replace(w, max_prompt_tokens=None if None in prompts else min(prompts))


def _with_conf(model, s: Settings, est, cards: list, conf: AllocatorConfig, alloc_conf: str, solve: bool,
               ahead: Ahead | None = None, rescale: bool | None = None):
    """:func:`with_allocator` under the parsed ``conf``. Each card's largest prompt depends only on its cap (from
    the loaded model's reserved bytes), not on the estimate's replay: where a forked process pays
    (:func:`_fork_pays`), the searches start before that replay and half of them run in the child
    (:func:`_card_edges`); otherwise the estimate's replay comes first, as read from disk where a plan kept it."""
    spec = model.spec
    ctx_bytes = est.cuda_context_bytes
    if not supported(s) or not spec.config_json:  # replay_generate answers None
        return est, cards
    device = replace(conf, allowed_bytes=max(c.usable_bytes for c in cards) - ctx_bytes) if cards else conf
    fork = solve and _fork_pays(len(cards))
    if fork:
        share_tapes(spec, s)  # computed once, before the searches are split
    rescale = solve if rescale is None else rescale  # the searches sample the same stretch
    # the estimate's replay first where nothing is forked (read from disk where a plan kept it: no load replayed)
    r = None if fork else ahead.take(device) if ahead is not None and ahead.has(device) else replay_generate(
        spec, s, device, rescale=rescale)
    if not fork and r is None:
        return est, cards
    base = r.base_reserved_bytes if r is not None else loaded_reserved_bytes(spec, s, conf)
    capped = [replace(conf, allowed_bytes=allowed_bytes(c.usable_bytes - ctx_bytes, base)) for c in cards]
    edges = _card_edges(model, s, cards, capped) if solve else None
    try:
        r = r or replay_generate(spec, s, device, rescale=rescale)
        if r is None:
            return est, cards
        return _judged(model, s, est, cards, conf, capped, r, alloc_conf, edges() if edges else None)
    finally:
        if edges is not None:
            edges.close()


def _judged(model, s: Settings, est, cards: list, conf: AllocatorConfig, capped: list, r, alloc_conf: str,
            edges: list | None):
    """The estimate and card verdicts from the estimate's replay ``r``, each card's capped config and its largest
    prompt (``edges``; None: not solved).

    A card's need where its capped replay fits is that replay's peak (so need, fit and headroom agree); where it
    does not, the estimate's (``est.device_used_bytes``, the table's "card memory in use": the replay under the
    largest card's memory with no room kept free, or the formula's where that replay does not fit either). Such a
    need can be below the card's memory: ``misfit_reason`` (:func:`~vramguard.plan.estimator.misfit_reason`) then
    says which rule still says no, with ``kept_free_bytes``, the room the card's cap keeps free (not that room
    where the estimate's replay did not fit with none kept free: the segments, not the margin, say no)."""
    spec, ctx_bytes = model.spec, est.cuda_context_bytes
    reserved = max(r.peak_reserved_bytes, est.peak_allocated_bytes) if r.fits else est.peak_reserved_bytes
    run_need = reserved + ctx_bytes
    load_need = est.load.peak_reserved_bytes + ctx_bytes if est.load is not None else 0
    gen_phase = ("prefill" if est.decode is None or est.prefill.peak_bytes >= est.decode.peak_bytes
                 else est.decode.phase)
    est = replace(est, allocator_reserve_bytes=reserved - est.peak_allocated_bytes, peak_reserved_bytes=reserved,
                  generate_device_bytes=run_need, device_used_bytes=max(run_need, load_need), allocator=r,
                  alloc_conf=alloc_conf, peak_phase="load" if load_need > run_need else gen_phase)
    out = []
    for i, (c, cap) in enumerate(zip(cards, capped)):
        # without expandable segments a new segment adds exactly what the cap check counts, so a replay that never
        # reserved past the cap runs the same under it: only a larger peak needs the capped replay
        same = r.fits and not conf.expandable_segments and r.peak_reserved_bytes <= cap.allowed_bytes
        mine = r if same else replay_generate(spec, s, cap, rescale=edges is not None) or r  # covered: r's
        fits = mine.fits and load_need <= c.usable_bytes
        need = max(max(mine.peak_reserved_bytes, est.peak_allocated_bytes) + ctx_bytes, load_need) if fits \
            else est.device_used_bytes
        kept_free = c.usable_bytes - ctx_bytes - cap.allowed_bytes
        c = replace(c, need_bytes=need, fits=fits, headroom_bytes=c.usable_bytes - need, kept_free_bytes=kept_free,
                    misfit_reason=misfit_reason(fits, need, c.usable_bytes, kept_free if r.fits else 0))
        if edges is not None:  # no prompt where the load alone does not fit
            c = replace(c, max_prompt_tokens=edges[i] if load_need <= c.usable_bytes else None)
        if edges is not None and fits:  # the run as asked fits: its own figures are the least each limit can be
            c = replace(c, max_prompt_tokens=max(c.max_prompt_tokens or 0, s.prompt_tokens),
                        max_new_tokens=max(c.max_new_tokens or 0, s.max_new_tokens),
                        max_batch=max(c.max_batch or 0, s.batch))
        out.append(c)
    return est, out


FORK_SEARCHES = True  # tests turn the forked card searches off to compare them with the searches in one process


def _card_edges(model, s: Settings, cards: list, capped: list):
    """Start the largest-prompt search of every card (:func:`edge_prompt_tokens` under its capped config, from the
    formula's answer): a callable that returns the edges in card order, with a ``close`` that ends a search left
    running. Where :func:`_fork_pays`, the larger half of the cards (the longest searches) runs in a forked child
    process while this one replays the estimate and the smaller half; the figures are the same either way, each
    search being the same pure computation in either process (``tests/test_plan_speed.py`` compares them). Where
    the child fails, its searches run here."""
    work = [lambda c=c, cap=cap: edge_prompt_tokens(model, s, cap, c.max_prompt_tokens)
            for c, cap in zip(cards, capped)]
    k = (len(work) + 1) // 2 if _fork_pays(len(work)) else len(work)
    child = _Forked(work[k:]) if k < len(work) else None

    def edges() -> list:
        return [w() for w in work[:k]] + (child.result() if child is not None else [])
    edges.close = child.close if child is not None else (lambda: None)  # type: ignore[attr-defined]
    return edges


def _fork_pays(searches: int) -> bool:
    """Whether a forked child is worth it: two searches or more, and :func:`_can_fork` without torch imported."""
    return FORK_SEARCHES and searches >= 2 and "torch" not in sys.modules and _can_fork()


def _can_fork() -> bool:
    """Whether a forked child can work beside this process: at least two CPUs for this process, ``os.fork``, no
    thread but those that say they are safe to fork beside (``fork_safe``: the progress line's, which only draw on
    stderr; a fork copies only the calling thread, and a lock another one held stays held in the child), and CUDA
    not initialized where torch is imported (its state does not survive a fork; its CPU thread pools are not used
    there: :class:`_Forked` runs a child's torch on one thread)."""
    if not hasattr(os, "fork"):
        return False
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return False
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return cpus >= 2 and all(t is threading.main_thread() or getattr(t, "fork_safe", False)
                             for t in threading.enumerate())


def side_by_side(first: Callable[[], object], second: Callable[[], object]) -> tuple[object, object]:
    """``(first(), second())``, ``first`` in a forked child while this process computes ``second`` where a fork
    pays (:func:`_can_fork`, torch allowed: both compute on the meta device), else one after the other. The two
    must be pure computations of the same result in either process (the plans of two paths of a model)."""
    if not (FORK_SEARCHES and _can_fork()):
        return first(), second()
    child = _Forked([first])
    try:
        mine = second()
    except BaseException:
        child.close()
        raise
    return child.result()[0], mine


class _Forked:
    """``[w() for w in work]`` in a forked child process, its results sent back pickled through a pipe."""

    def __init__(self, work: list):
        self.work = work
        read, write = os.pipe()
        gc.freeze()  # the collector leaves the objects of now alone: fewer pages copied on write in both processes
        self.pid = os.fork()
        if self.pid == 0:  # the child: compute, send, and leave without running this process's exit handlers
            os.close(read)
            code = 1
            try:
                if "torch" in sys.modules:  # meta tensors only: no kernel needs the thread pools of the parent
                    sys.modules["torch"].set_num_threads(1)
                warnings.simplefilter("ignore")  # the parent says it once (an unwritable cache folder)
                data = pickle.dumps([w() for w in work])
                with os.fdopen(write, "wb") as f:
                    f.write(data)
                code = 0
            finally:
                os._exit(code)
        os.close(write)
        self.read: int | None = read

    def result(self) -> list:
        """The child's results, or the work done here where the child failed (it raised, or was killed)."""
        read = self.read
        if read is None:
            raise RuntimeError("the forked card searches' results were read already")
        with os.fdopen(read, "rb") as f:
            self.read, data = None, f.read()
        _, status = os.waitpid(self.pid, 0)
        self.pid = 0
        gc.unfreeze()
        return pickle.loads(data) if status == 0 and data else [w() for w in self.work]

    def close(self) -> None:
        """End the child where its result was not taken (this process raised first)."""
        if self.pid:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
            self.pid = 0
            gc.unfreeze()
        if self.read is not None:
            os.close(self.read)
            self.read = None


class Ahead:
    """The estimate's allocator replays (:func:`with_allocator`), one per segment layout, started in a forked child
    before the estimate and the card searches, which run in this process meanwhile: each replay depends only on the
    model, the settings and the allocator config under the largest card's memory, none of which those change."""

    def __init__(self, spec, s: Settings, devices: list[AllocatorConfig], rescale: bool):
        self.devices = devices
        self.child = _Forked([lambda d=d: replay_generate(spec, s, d, rescale=rescale) for d in devices]
                             + [computed_stretches])  # the prompt's stretch: the card searches sample it too
        self.found: list | None = None

    def has(self, device: AllocatorConfig) -> bool:
        return device in self.devices

    def take(self, device: AllocatorConfig):
        """The child's replay under ``device`` (one of :attr:`devices`), waiting for it."""
        if self.found is None:
            self.found = self.child.result()
            take_stretches(self.found[-1])
        return self.found[self.devices.index(device)]

    def close(self) -> None:
        self.child.close()


@contextlib.contextmanager
def replays_ahead(model, s: Settings, gpus: list, conf: AllocatorConfig | None, solve: bool, freed_before: bool):
    """An :class:`Ahead` of ``model``'s estimate replays under ``conf`` (each layout :func:`with_allocator` replays)
    where the plan solves its cards with the allocator model through transformers (the replays take seconds: a
    forward traced on the meta device and every decode step placed) and a child can work beside this process
    (:func:`_can_fork`); else None. A child whose replays were not taken is ended on exit."""
    spec = model.spec
    if not (solve and conf is not None and gpus and model.needs_transformers and supported(s) and spec.config_json
            and _can_fork()):
        yield None
        return
    allowed = max(g.usable_bytes for g in gpus) - CUDA_CONTEXT_BYTES  # as _with_conf's device: the estimate's
    layouts = [conf, replace(conf, freed_before=True)] if freed_before and not conf.expandable_segments else [conf]
    ahead = Ahead(spec, s, [replace(c, allowed_bytes=allowed) for c in layouts], rescale=True)
    try:
        yield ahead
    finally:
        ahead.close()


def auto_alloc_conf(spec, s: Settings) -> tuple[str | None, AllocatorConfig | None, Finding | None]:
    """The ``PYTORCH_CUDA_ALLOC_CONF`` a default plan models (this process's environment, ``""`` when unset), its
    parsed :class:`AllocatorConfig` and None; or (None, None, the :func:`reserve_formula_finding` that says why the
    formula is used instead): no config.json,
    settings the tape does not cover (:func:`~vramguard.introspect.alloc_replay.not_covered`), a generation longer
    than :data:`AUTO_MAX_NEW_TOKENS`, torch or transformers not installed (with the install command), or an
    environment value that is not allocator options (a ``warn``: PyTorch refuses it at the first CUDA allocation)."""
    env = env_alloc_conf()
    if not spec.config_json:
        return None, None, reserve_formula_finding("the model has no config.json to build its forward from")
    if (setting := not_covered(s)) is not None:
        return None, None, reserve_formula_finding(f"its tape does not cover {setting}")
    if s.max_new_tokens > AUTO_MAX_NEW_TOKENS:
        return None, None, reserve_formula_finding(
            f"it replays every decode step, and above {AUTO_MAX_NEW_TOKENS:,} new tokens that takes minutes "
            "(alloc_conf='' asks for it)")
    missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        return None, None, reserve_formula_finding(
            f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed", fix=GPU_EXTRA_FIX)
    if backend(env) != "native":  # a valid setting, but another allocator than the one modelled
        return None, None, reserve_formula_finding(
            f"PYTORCH_CUDA_ALLOC_CONF={env!r} selects the {backend(env)} backend, not the caching allocator the "
            "model follows")
    try:
        config = AllocatorConfig.parse(env)
    except ValueError as e:
        return None, None, reserve_formula_finding(
            f"PYTORCH_CUDA_ALLOC_CONF={env!r} is not valid allocator options ({e}); PyTorch refuses it at the first "
            "CUDA allocation, so run and serve would fail with it too", "warn",
            "fix PYTORCH_CUDA_ALLOC_CONF (e.g. expandable_segments:True) or unset it")
    return env, config, None


FREED_MODEL_BYTES = 1 << 30  # given back to CUDA before: a model's memory, more than a warm-up releases


def process_freed_memory() -> bool:
    """Whether this process's caching allocator has given at least :data:`FREED_MODEL_BYTES` back to CUDA
    (``torch.cuda.memory_stats()["reserved_bytes.all.freed"]`` on any GPU): a model deleted, then
    ``torch.cuda.empty_cache()``. In the H200 traces (benchmarks/README.md) the warm-up of a fresh process released
    8 to 132 MiB and new segments still went below the older ones. False where torch is not imported or CUDA not
    initialized (this never initializes CUDA)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return False
    return any(torch.cuda.memory_stats(i).get("reserved_bytes.all.freed", 0) >= FREED_MODEL_BYTES
               for i in range(torch.cuda.device_count()))


def freed_before_finding(est, asked: bool) -> Finding | None:
    """The ``freed_before`` info finding of a plan for a process that freed memory before (``asked``): both layouts'
    peak reserved bytes, or why the plan has one figure (the reserve formula models no layout; expandable segments
    grow one segment a pool in place); None for a plan of a fresh process."""
    up = est.freed_layout_reserved_bytes
    if not asked:
        return None
    if up is None and est.allocator is None:
        return Finding("freed_before", "info", "planned for a process that has given a model's memory back to CUDA "
                       "before, but reserved memory here is the reserve formula's, which does not model where "
                       "segments go: the figures are those of a fresh process",
                       "for both segment layouts, plan with the caching-allocator model, not the reserve formula "
                       "(the model needs torch and transformers)")
    if up is None:
        return Finding("freed_before", "info", "planned for a process that has given a model's memory back to CUDA "
                       "before, with expandable segments: the freed model's pages were unmapped in place and the "
                       "next blocks fill that range from its low end, but where it ends (at blocks still held, such "
                       "as the cuBLAS workspace) is not visible to the plan, which places them in a fresh segment; "
                       "a request that does not fit the rest of the range goes past those blocks and reserves more",
                       "for a plan that holds to the byte, load the model in a fresh process (vramguard run, or a "
                       "script of its own)")
    fresh = est.fresh_layout_reserved_bytes
    if up > fresh:
        what = f"the fit and the largest prompt are those of the upward layout, the larger by {fmt_bytes(up - fresh)}"
        fix, extra = (f"load the model in a fresh process (vramguard run, or a script of its own): it needs "
                      f"{fmt_bytes(up - fresh)} less"), up - fresh
    else:
        what = ("the two reserve the same, so the plan is a fresh process's" if up == fresh else
                "the fit and the largest prompt are those of the fresh layout, the larger: the plan is a fresh "
                "process's")
        fix, extra = None, None
    return Finding("freed_before", "info",
                   "planned for a process that has given a model's memory back to CUDA before: cudaMalloc may place "
                   f"new segments above the older ones (peak reserved {fmt_bytes(up)}, {up:,} B) or below them, as "
                   f"in a fresh process ({fmt_bytes(fresh)}, {fresh:,} B); {what}", fix, extra)


AUTO_MAX_NEW_TOKENS = 2048  # a default plan of a longer generation: the formula (2,048 takes ~10 s)
GPU_EXTRA_FIX = ("pip install torch transformers (PyTorch's CPU build is enough: pip install torch --index-url "
                 "https://download.pytorch.org/whl/cpu)")


def decode_replay_finding(est) -> Finding | None:
    """An ``info`` finding ``decode_replayed`` where the allocator model's tape could not extrapolate decode steps 3,
    4... from steps 1 and 2 and replayed more of them (the note of
    :func:`~vramguard.introspect.alloc_replay._decode_tape`); None otherwise."""
    note = est.allocator.decode_note if est.allocator is not None else None
    return Finding("decode_replayed", "info", note) if note else None


def reserve_formula_finding(why: str, level: str = "info", fix: str | None = None) -> Finding:
    """The finding of a plan that used the reserve formula (largest allocation plus 30% of the rest,
    :mod:`vramguard.memory.runtime`) instead of the allocator model, for ``why``: the formula is high, so the
    largest prompt is short (12% for Llama-3.1-8B NF4 at 24 GiB, benchmarks/README.md)."""
    return Finding("reserve_formula", level, "reserved memory from the reserve formula (largest allocation plus 30% "
                   "of the rest; it plans the largest prompt short), not the caching-allocator model: " + why, fix)


PROBE_TOKENS = 4096  # the second point of the slope when no start is given


def edge_prompt_tokens(model, s: Settings, config: AllocatorConfig, formula_tokens: int | None) -> int | None:
    """The largest prompt the allocator model places under ``config.allowed_bytes`` (None when a 1-token prompt
    does not fit), found from the formula's answer ``formula_tokens`` (None: start from one token).

    The search (:func:`_edge`) replays the call up to the second decode step, a prefix of it: a prompt whose
    prefix does not fit does not fit, so the bracket's upper end is exact. Its lower end is then replayed in full,
    and where the later decode steps do not fit, steps down from it that double, then bisection, find the edge
    with full replays (:func:`_gallop`)."""
    spec = model.spec
    ctx = spec.max_position_embeddings - s.max_new_tokens

    def replay(p: int, full: bool):
        return replay_generate(spec, s.with_(prompt_tokens=p), config, rescale=True, later_steps=full)

    edge = _edge(lambda p: replay(p, s.max_new_tokens <= 3), model, s, config, formula_tokens, ctx)
    if edge is None or s.max_new_tokens <= 3 or replay(edge, True).fits:
        return edge
    a, b = _gallop(lambda p: p > 0 and replay(p, True).fits, 0, edge, ctx)
    return _bisect(lambda p: replay(p, True).fits, a, b) if b is not None else a


def _edge(replay, model, s: Settings, config: AllocatorConfig, formula_tokens: int | None, ctx: int) -> int | None:
    """The largest prompt for which ``replay(p)`` fits, to 0.25%: a first guess, the prompt at which the formula's
    need (:func:`vramguard.plan.estimator.need_bytes`, which grows with the square of the prompt where attention
    scores do) has grown by the room the replay at the start leaves under the cap; from no start, the line through
    the modelled peaks at 1 and 4,096 tokens. Then steps from the guess that double until the edge is bracketed
    (up while the prompt fits, down while it does not), then bisection to 0.25%. A guess off by a factor k costs
    about log2(k * 100) replays, not k * 50."""
    lo = max(1, min(formula_tokens or 1, ctx))

    def fits(p: int) -> bool:
        return replay(p).fits

    first = replay(lo)
    if not first.fits:
        return _bisect(fits, 0, lo) if lo > 1 else None
    room = max(0, config.allowed_bytes - first.peak_reserved_bytes)
    if formula_tokens is None and lo < PROBE_TOKENS < ctx:  # the line through the modelled peaks up to a probe
        probe = replay(PROBE_TOKENS)
        if not probe.fits:
            return _bisect(fits, lo, PROBE_TOKENS)
        slope = max(1, (probe.peak_reserved_bytes - first.peak_reserved_bytes) // (PROBE_TOKENS - lo))
        lo, guess = PROBE_TOKENS, min(ctx, PROBE_TOKENS + max(0, config.allowed_bytes - probe.peak_reserved_bytes)
                                      // slope)
    else:
        start = need_bytes(model, s.with_(prompt_tokens=lo))
        same = s.cache != "static" or s.max_cache_len is None  # the need the card searches evaluated
        guess = _largest(lo, ctx, lambda p: need_bytes(model, s.with_(prompt_tokens=p)), start + room,
                         known_needs(model, s.with_(prompt_tokens=1), "prompt_tokens", need_bytes) if same else None
                         ) or lo
    a, b = _gallop(fits, lo, guess, ctx)
    return a if b is None else _bisect(fits, a, b)


def _gallop(fits, a: int, guess: int, ctx: int) -> tuple[int, int | None]:
    """A bracket ``(a, b)`` with ``fits(a)`` and not ``fits(b)`` (b None: ``a == ctx`` fits) from a known-good
    ``a`` and a ``guess``: steps of ``max(64, guess // 100)`` tokens from the guess, doubling each time."""
    step = max(64, guess // 100)
    if guess <= a:
        p = min(ctx, a + step)
        if p == a:
            return a, None
        if not fits(p):
            return a, p
        a = p
    elif fits(guess):
        a = guess
    else:
        b = guess
        while True:  # down from a failing guess
            p = max(a, b - step)
            if p == a or fits(p):
                return p, b
            b, step = p, step * 2
    while a < ctx:  # up from a fitting prompt
        p = min(ctx, a + step)
        if not fits(p):
            return a, p
        a, step = p, step * 2
    return a, None


def _bisect(fits, a: int, b: int) -> int | None:
    """The lower end of the bracket ``fits(a) and not fits(b)`` narrowed to 0.25% of ``a`` (``a`` = 0: 1 token);
    None when a 1-token prompt does not fit."""
    while b - a > max(1, a // 400):
        mid = (a + b) // 2
        if fits(mid):
            a = mid
        else:
            b = mid
    return a or None
