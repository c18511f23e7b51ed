"""The two limits every plan applies, single-card or several: the model's context (:func:`check_context`) and
the largest value whose need fits a budget (:func:`largest`). Apart from the one-card planner and its solver, so
that the multi-card planner uses them without importing those (the solver asks it for a second card's split).
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Callable

from vramguard.errors import InvalidValue
from vramguard.settings import Settings
from vramguard.spec import ModelSpec


SECANT_STALLS = 3  # secant steps that each leave over half of the bracket before a bisection: near the boundary
# the secant lands on one side a few times while it closes in (on smooth needs, half the evaluations of stopping at 2)


def largest(lo: int, hi: int, need: Callable[[int], int], usable: int,
            known: dict[int, int] | None = None) -> int | None:
    """Largest ``v`` in ``[lo, hi]`` with ``need(v) <= usable``, for a non-decreasing ``need``; None if none.

    Keeps a bracket ``need(a) <= usable < need(b)`` and tries the point where the straight line through the two
    points evaluated last crosses ``usable`` (first the bracket's ends; within it); :data:`SECANT_STALLS` steps in
    a row that each leave more than half of the bracket are followed by a bisection.

    ``known``: needs of this same ``need`` evaluated before (value -> bytes; each new one is added): the search
    starts from the tightest bracket they give, which holds the same answer for a non-decreasing ``need``, so
    searches of one need against several budgets (a plan's cards) replay fewer points. Known needs that decrease
    somewhere are not used.

    Example: ``need(v) = 10 * v``, ``usable = 95``, ``known = {3: 30, 12: 120}``: the bracket starts at (3, 12)
    instead of (lo, hi), and the answer is 9 either way.
    """
    if hi < lo:
        return None
    memo: dict[int, int] = {} if known is None else known

    def f(v: int) -> int:
        if v not in memo:
            memo[v] = need(v)
        return memo[v]
    a, b = _known_bracket(lo, hi, memo, usable)
    if a is None:
        if f(lo) > usable:
            return None
        a = lo
    if b is None:
        if f(hi) <= usable:
            return hi
        b = hi
    last = [(a, memo[a]), (b, memo[b])]  # the two points evaluated last, for the secant
    stalls = 0
    while b - a > 1:
        (x0, f0), (x1, f1) = last
        if stalls >= SECANT_STALLS or f1 == f0:
            mid = (a + b) // 2
            stalls = 0
        else:
            mid = x1 + math.floor((usable - f1) * (x1 - x0) / (f1 - f0))
            mid = min(max(mid, a + 1), b - 1)
        width = b - a
        x = f(mid)
        if x <= usable:
            a = mid
        else:
            b = mid
        last = [last[1], (mid, x)]
        stalls = stalls + 1 if (b - a) * 2 > width else 0
    return a


@lru_cache(maxsize=64)
def known_needs(model, s: Settings, var: str, need: Callable) -> dict[int, int]:
    """The store of needs (value of ``var`` -> bytes) that ``need(model, s)`` gave in this process with ``s``'s
    ``var`` changed, ``s`` given with ``var`` at 1: the ``known`` of :func:`largest` for every search of that need
    (the card searches of :mod:`vramguard.plan.solve` and the first guess of the allocator's largest prompt)."""
    return {}


def _known_bracket(lo: int, hi: int, known: dict[int, int], usable: int) -> tuple[int | None, int | None]:
    """(the largest known value in ``[lo, hi]`` whose need fits ``usable``, the smallest above it whose need does
    not), each None where none is known; (None, None) where the known needs in ``[lo, hi]`` decrease somewhere (the
    search then starts from its ends, as without them)."""
    points = sorted((v, n) for v, n in known.items() if lo <= v <= hi)
    if any(n1 > n2 for (_, n1), (_, n2) in zip(points, points[1:])):
        return None, None
    fit = [v for v, n in points if n <= usable]
    over = [v for v, n in points if n > usable]
    return (fit[-1] if fit else None), (over[0] if over else None)


CONTEXT_NOTE = "context set to"  # the note that starts so: a spec whose context the user set


def context_set(spec: ModelSpec) -> bool:
    """Whether the user set ``spec``'s context (``--context``, ``context=``: :func:`~vramguard.plan.planner.
    with_context` notes it), rather than the config."""
    return any(n.startswith(CONTEXT_NOTE) for n in spec.notes)


def context_words(spec: ModelSpec) -> str:
    """What caps prompt + new tokens of ``spec``, in words: the context the user set (``--context``,
    ``context=``) or the config's ``max_position_embeddings``."""
    if context_set(spec):
        return f"the context you set, {spec.max_position_embeddings:,} tokens"
    return f"the model's context, max_position_embeddings {spec.max_position_embeddings:,}"


def check_context(spec: ModelSpec, s: Settings,
                  beyond: str | None = " (a RoPE-scaled model may allow more: plan with context=N)",
                  field: str = "prompt_tokens + max_new_tokens") -> None:
    """Raise InvalidValue when ``prompt + new tokens`` exceeds the model's ``max_position_embeddings``; ``beyond``
    ends the fix (how to plan past the config's context; None where that is not possible, e.g. a loaded model);
    ``field``: the error's field, the settings that set the two (``prompt + max_new_tokens`` where the prompt is a
    text)."""
    ctx, prompt, new = spec.max_position_embeddings, s.prompt_tokens, s.max_new_tokens
    if s.total_tokens > ctx:
        def tokens(n: int, kind: str = "") -> str:
            return f"{n:,} {kind}token" + ("" if n == 1 else "s")
        ways = []
        if prompt < ctx:
            ways.append(f"at most {tokens(ctx - prompt, 'new ')} with this prompt")
        if new < ctx:
            ways.append(f"a prompt of at most {tokens(ctx - new)} with {tokens(new, 'new ')}")
        if not ways:
            ways.append(f"prompt and new tokens together at most {ctx:,} (e.g. {ctx - ctx // 2:,} + {ctx // 2:,})")
        given = context_set(spec)  # the user set it: no need to say how
        raise InvalidValue(field, f"{prompt:,} + {new:,} = {s.total_tokens:,}",
                           f"at most the context you set, {ctx:,} tokens" if given else
                           f"at most the model's context, max_position_embeddings={ctx}",
                           " or ".join(ways) + (" (or a larger context, where the model's RoPE scaling allows it)"
                                                if given and beyond else (beyond or "")))


def bound_by(spec: ModelSpec, s: Settings, max_prompt_tokens: int | None,
             max_new_tokens: int | None) -> dict[str, str | None]:
    """What caps each largest figure of a plan: ``"context"`` when it equals the model's context less the other
    part (``max_position_embeddings - max_new_tokens`` for the prompt, ``- prompt_tokens`` for the new tokens; the
    solver's upper end, so memory would allow more), ``"memory"`` when it is below that, None when nothing fits.

    Example: a context of 8,192 with 512 new tokens caps the prompt at 8,192 - 512 = 7,680 tokens; a largest
    prompt of 7,680 is bound by the context, one of 5,000 by memory.
    """
    ctx = spec.max_position_embeddings

    def why(value: int | None, cap: int) -> str | None:
        return None if value is None else ("context" if value >= cap else "memory")
    return {"max_prompt_tokens": why(max_prompt_tokens, ctx - s.max_new_tokens),
            "max_new_tokens": why(max_new_tokens, ctx - s.prompt_tokens)}
