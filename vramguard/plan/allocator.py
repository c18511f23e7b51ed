"""The plan's reserved memory, fit and largest prompt from the caching-allocator model: the allocation tape of
:mod:`vramguard.introspect.alloc_replay` placed by :mod:`vramguard.memory.allocator` under each card's cap."""

from __future__ import annotations

from vramguard.introspect.alloc_replay import allowed_bytes, largest_prompt, replay_generate
from vramguard.memory.allocator import AllocatorConfig
from vramguard.settings import Settings


def with_allocator(spec, s: Settings, est, cards: list, alloc_conf: str, solve: bool):
    """The estimate and card verdicts with reserved memory, fit and the largest prompt from the allocator model
    under ``alloc_conf`` (``PYTORCH_CUDA_ALLOC_CONF`` text); (est, cards) unchanged where the tape does not cover
    ``s``. Raises ValueError for an ``alloc_conf`` value that is not a boolean or a number."""
    from dataclasses import replace
    conf = AllocatorConfig.parse(alloc_conf)
    r = replay_generate(spec, s, conf)
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
        rc = replay_generate(spec, s, capped)
        fits = rc.fits and load_need <= c.usable_bytes
        c = replace(c, need_bytes=est.device_used_bytes, fits=fits,
                    headroom_bytes=c.usable_bytes - est.device_used_bytes)
        if solve:
            c = replace(c, max_prompt_tokens=edge_prompt_tokens(spec, s, capped, c.max_prompt_tokens))
        out.append(c)
    return est, out


def edge_prompt_tokens(spec, s: Settings, config: AllocatorConfig, formula_tokens: int | None) -> int | None:
    """The largest prompt the allocator model places under ``config.allowed_bytes`` (None when a 1-token prompt
    does not fit), found from the formula's answer ``formula_tokens`` (which holds more in reserve): a first guess
    where its modelled reserved peak plus the allocated bytes per token (:func:`vramguard.plan.estimator.need_bytes`'s
    slope) reach the cap, a bracket of 2% steps around it, then bisection to 0.25%."""
    from vramguard.plan.estimator import need_bytes
    ctx = spec.max_position_embeddings - s.max_new_tokens
    lo = max(1, min(formula_tokens or 1, ctx))

    def run(p: int):
        return replay_generate(spec, s.with_(prompt_tokens=p), config)

    first = run(lo)
    if not first.fits:
        return largest_prompt(spec, s, config, 1, lo) if lo > 1 else None
    dp = max(1, lo // 100)
    slope = max(1, (need_bytes(spec, s.with_(prompt_tokens=min(ctx, lo + dp))) - need_bytes(
        spec, s.with_(prompt_tokens=lo))) // dp)
    guess = min(ctx, lo + max(0, config.allowed_bytes - first.peak_reserved_bytes) // slope)
    step = max(64, guess // 50)
    a, b = lo, None
    p = guess
    while p > a and (b is None or p < b):
        if run(p).fits:
            a = p
            if p >= ctx:
                return ctx
            p = min(ctx, p + step)
        else:
            b = p
            p = max(a, p - step)
    if b is None:
        return a
    return largest_prompt(spec, s, config, a, b) if b - a > max(1, a // 400) else a
