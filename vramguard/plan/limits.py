"""The two limits every plan applies, single-card or several: the model's context (:func:`check_context`) and
the largest value whose need fits a budget (:func:`largest`). Apart from the one-card planner and its solver, so
that the multi-card planner uses them without importing those (the solver asks it for a second card's split).
"""

from __future__ import annotations

from typing import Callable

from vramguard.errors import InvalidValue
from vramguard.settings import Settings
from vramguard.spec import ModelSpec


def largest(lo: int, hi: int, need: Callable[[int], int], usable: int) -> int | None:
    """Largest ``v`` in ``[lo, hi]`` with ``need(v) <= usable``, for a non-decreasing ``need``; None if none.

    Keeps a bracket ``need(a) <= usable < need(b)`` and tries the point where the straight line between its ends
    crosses ``usable``; a step that leaves more than half of the bracket is followed by a bisection.
    """
    if hi < lo:
        return None
    f_lo = need(lo)
    if f_lo > usable:
        return None
    f_hi = need(hi)
    if f_hi <= usable:
        return hi
    a, b, fa, fb = lo, hi, f_lo, f_hi
    bisect = False
    while b - a > 1:
        if bisect or fb <= fa:
            mid = (a + b) // 2
        else:
            mid = a + int((usable - fa) * (b - a) / (fb - fa))
            mid = min(max(mid, a + 1), b - 1)
        width = b - a
        f = need(mid)
        if f <= usable:
            a, fa = mid, f
        else:
            b, fb = mid, f
        bisect = (b - a) * 2 > width and not bisect
    return a



def check_context(spec: ModelSpec, s: Settings,
                  beyond: str | None = " (a RoPE-scaled model may allow more: plan with context=N)") -> None:
    """Raise InvalidValue when ``prompt + new tokens`` exceeds the model's ``max_position_embeddings``; ``beyond``
    ends the fix (how to plan past the config's context; None where that is not possible, e.g. a loaded model)."""
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
        raise InvalidValue("prompt + new tokens", f"{prompt:,} + {new:,} = {s.total_tokens:,}",
                           f"at most the model's context, max_position_embeddings={ctx}",
                           " or ".join(ways) + (beyond or ""))


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
