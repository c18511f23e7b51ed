"""A reference mixer's Python loop over chunks, replayed until it is seen to repeat: the iterations left out hold
nothing the replay needs. Knows nothing about the plan.

transformers' reference gated delta rule (``torch_chunk_gated_delta_rule`` of Qwen3-Next, Qwen3.5, Olmo-Hybrid,
Kimi-Linear..., the path ``generate`` runs where ``fla`` is missing) scans the sequence in a Python loop, one
iteration per 64-token chunk: ``for i in range(num_chunks)``. On meta tensors every iteration allocates and frees
the same tensors (one chunk's products and the next recurrent state) into a preallocated output, so a replay at
32,768 tokens ran 512 alike iterations per layer, and each length a search asked for had a different number of
them (no structure common to two lengths: :mod:`vramguard.introspect.stretch` could not fit them).

:func:`steady` copies such a function with ``range`` bound to :func:`steady_range`, whose loop, replayed under a
:class:`~vramguard.introspect.tracker.StorageTracker`, ends as soon as :data:`ALIKE` consecutive iterations are
alike: the same allocations (bytes, in order), each free naming a tensor of its own iteration or of the one before
at the same index, and every tensor of an iteration freed by the end of the next. From then on each iteration
starts from the same live bytes and allocates and frees the same, so the peak of the full loop is reached within
those iterations, and the tape without the rest equals the full one less a run of iterations that end where they
start (``tests/test_loop_trim.py`` compares plans with and without it). A loop whose iterations never agree, or that
allocates nothing (``list(range(n))``), runs every iteration, as without it; so does every loop with no tracker
active. The iterations a replay left out are counted (:data:`SKIPPED`).
"""

from __future__ import annotations

import inspect
import types

from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from vramguard.introspect.tracker import StorageTracker

ALIKE = 3  # consecutive iterations that must agree before the rest are left out
FIRST = 1  # iterations before those that may differ (the first frees the initial state, made before the loop)
SKIPPED: list[int] = [0]  # iterations left out in this process (a count the tests read)


def steady(fn):
    """``fn`` with every ``range`` it calls bound to :func:`steady_range` (module docstring); ``fn`` itself where
    it is no plain function that calls ``range`` (a closure, a builtin, a wrapper)."""
    code = getattr(fn, "__code__", None)
    if not isinstance(fn, types.FunctionType) or fn.__closure__ or "range" not in code.co_names:
        return fn

    def run(*args, **kwargs):
        scope = {**fn.__globals__, "range": steady_range}  # the module's globals as they are at the call
        copy = types.FunctionType(code, scope, fn.__name__, fn.__defaults__)
        copy.__kwdefaults__ = fn.__kwdefaults__
        return copy(*args, **kwargs)
    run.__signature__ = inspect.signature(fn)  # type: ignore[attr-defined]
    run.__name__ = fn.__name__
    return run


def steady_range(*args):
    """``range(*args)``, whose iteration ends once the loop repeats under the active tracker (module docstring):
    the range itself where no :class:`~vramguard.introspect.tracker.StorageTracker` is active or it is too short to
    repeat, else a :class:`SteadyRange` (its length, items and reversal those of the whole range)."""
    r = range(*args)
    tracker = next((m for m in reversed(_get_current_dispatch_mode_stack()) if isinstance(m, StorageTracker)), None)
    return r if tracker is None or len(r) <= FIRST + ALIKE + 1 else SteadyRange(r, tracker)


class SteadyRange:
    """A range whose iteration ends once the loop over it repeats under ``tracker`` (:func:`_steady`); anything else
    asked of it (``len``, an item, ``in``, ``reversed``) is the whole range's answer."""

    def __init__(self, r: range, tracker: StorageTracker):
        self.range, self.tracker = r, tracker

    def __iter__(self):
        return _steady(self.range, self.tracker)

    def __len__(self) -> int:
        return len(self.range)

    def __getitem__(self, i):
        return self.range[i]

    def __contains__(self, x) -> bool:
        return x in self.range

    def __reversed__(self):
        return reversed(self.range)


def _steady(r: range, tracker: StorageTracker):
    """The values of ``r`` until the loop repeats; a tracker that counts nothing (a forward that only fills a
    cache) counts the loop's allocations while it runs, to see that."""
    starts: list[int] = []  # where each iteration's events start in the tracker's log
    counted, tracker.count = tracker.count, True
    try:
        for n, value in enumerate(r):
            starts.append(tracker.log_length())
            if n >= FIRST + ALIKE and _alike(tracker, starts[n - ALIKE - 1:]):
                SKIPPED[0] += len(r) - n
                return
            yield value
    finally:
        tracker.count = counted


def _alike(tracker: StorageTracker, starts: list[int]) -> bool:
    """Whether the iterations between ``starts`` (one more start than iterations, the iteration before the first
    included to classify its frees) agree as the module docstring says."""
    log = tracker.log_since(starts[0])
    at = [s - starts[0] for s in starts]
    owner: dict[int, tuple[int, int]] = {}  # serial -> (iteration, index among its allocations)
    for it in range(len(at) - 1):
        j = 0
        for serial, nbytes in log[at[it]:at[it + 1]]:
            if nbytes >= 0:
                owner[serial] = (it, j)
                j += 1
    patterns = []
    for it in range(1, len(at) - 1):
        pattern: list[int | tuple[str, int]] = []  # bytes per allocation, (whose, index) per free
        freed: set[int] = set()
        for serial, nbytes in log[at[it]:at[it + 1]]:
            if nbytes >= 0:
                pattern.append(nbytes)
                continue
            of = owner.get(serial)
            if of is None or of[0] not in (it, it - 1):
                return False
            pattern.append(("own" if of[0] == it else "before", of[1]))
            freed.add(serial)
        if not any(isinstance(p, int) for p in pattern):
            return False
        patterns.append((pattern, freed))
    for it in range(1, len(patterns)):  # every tensor of an iteration freed by the end of the next
        made = {s for s, o in owner.items() if o[0] == it}
        if made - patterns[it - 1][1] - patterns[it][1]:
            return False
    return all(p[0] == patterns[0][0] for p in patterns)
