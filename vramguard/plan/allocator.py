"""The plan's reserved memory, fit and largest prompt from the caching-allocator model: the allocation tape of
:mod:`vramguard.introspect.alloc_replay` placed by :mod:`vramguard.memory.allocator` under each card's cap."""

from __future__ import annotations

from vramguard.introspect.alloc_replay import allowed_bytes, replay_generate
from vramguard.memory.allocator import AllocatorConfig
from vramguard.settings import Settings


def with_allocator(spec, s: Settings, est, cards: list, alloc_conf: str, solve: bool):
    """The estimate and card verdicts with reserved memory, fit and the largest prompt from the allocator model
    under ``alloc_conf`` (``PYTORCH_CUDA_ALLOC_CONF`` text); (est, cards) unchanged where the tape does not cover
    ``s``. Raises ValueError for an ``alloc_conf`` value that is not a boolean or a number."""
    from dataclasses import replace
    conf = AllocatorConfig.parse(alloc_conf)
    r = replay_generate(spec, s, conf, rescale=solve)  # the edge search samples the same stretch: share its replays
    if r is None:
        return est, cards
    reserved = max(r.peak_reserved_bytes, est.peak_allocated_bytes)
    run_need = reserved + est.cuda_context_bytes
    load_need = est.load.peak_reserved_bytes + est.cuda_context_bytes if est.load is not None else 0
    gen_phase = ("prefill" if est.decode is None or est.prefill.peak_bytes >= est.decode.peak_bytes
                 else est.decode.phase)
    est = replace(est, allocator_reserve_bytes=reserved - est.peak_allocated_bytes, peak_reserved_bytes=reserved,
                  generate_device_bytes=run_need, device_used_bytes=max(run_need, load_need), allocator=r,
                  alloc_conf=alloc_conf, peak_phase="load" if load_need > run_need else gen_phase)
    out = []
    for c in cards:
        cap = c.usable_bytes - est.cuda_context_bytes
        capped = replace(conf, allowed_bytes=allowed_bytes(cap, r.base_reserved_bytes))
        # without expandable segments a new segment adds exactly what the cap check counts, so a replay that never
        # reserved past the cap runs the same under it: only a larger peak needs the capped replay
        same = not conf.expandable_segments and r.peak_reserved_bytes <= capped.allowed_bytes
        fits = same or replay_generate(spec, s, capped, rescale=solve).fits
        fits = fits and load_need <= c.usable_bytes
        c = replace(c, need_bytes=est.device_used_bytes, fits=fits,
                    headroom_bytes=c.usable_bytes - est.device_used_bytes)
        if solve:
            c = replace(c, max_prompt_tokens=edge_prompt_tokens(spec, s, capped, c.max_prompt_tokens))
        out.append(c)
    return est, out


PROBE_TOKENS = 4096  # the second point of the slope when no start is given


def edge_prompt_tokens(spec, s: Settings, config: AllocatorConfig, formula_tokens: int | None) -> int | None:
    """The largest prompt the allocator model places under ``config.allowed_bytes`` (None when a 1-token prompt
    does not fit), found from the formula's answer ``formula_tokens`` (None: start from one token). A first guess:
    the prompt at which the formula's need (:func:`vramguard.plan.estimator.need_bytes`, which grows with the
    square of the prompt where attention scores do) has grown by the room the replay at the start leaves under the
    cap; from no start, the line through the modelled peaks at 1 and 4,096 tokens. Then steps from the guess that
    double until the edge is bracketed (up while the prompt fits, down while it does not), then bisection to
    0.25%. A guess off by a factor k costs about log2(k * 100) replays, not k * 50."""
    from vramguard.plan.estimator import need_bytes
    from vramguard.plan.solve import _largest
    ctx = spec.max_position_embeddings - s.max_new_tokens
    lo = max(1, min(formula_tokens or 1, ctx))

    def fits(p: int) -> bool:
        return replay_generate(spec, s.with_(prompt_tokens=p), config, rescale=True).fits

    first = replay_generate(spec, s.with_(prompt_tokens=lo), config, rescale=True)
    if not first.fits:
        return _bisect(fits, 0, lo) if lo > 1 else None
    room = max(0, config.allowed_bytes - first.peak_reserved_bytes)
    if formula_tokens is None and lo < PROBE_TOKENS < ctx:  # the line through the modelled peaks up to a probe
        probe = replay_generate(spec, s.with_(prompt_tokens=PROBE_TOKENS), config, rescale=True)
        if not probe.fits:
            return _bisect(fits, lo, PROBE_TOKENS)
        slope = max(1, (probe.peak_reserved_bytes - first.peak_reserved_bytes) // (PROBE_TOKENS - lo))
        lo, guess = PROBE_TOKENS, min(ctx, PROBE_TOKENS + max(0, config.allowed_bytes - probe.peak_reserved_bytes)
                                      // slope)
    else:
        start = need_bytes(spec, s.with_(prompt_tokens=lo))
        guess = _largest(lo, ctx, lambda p: need_bytes(spec, s.with_(prompt_tokens=p)), start + room) or lo
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
