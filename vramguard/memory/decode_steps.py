"""Decode steps through the caching-allocator model, with the small pool skipped while it repeats itself exactly.

A decode step of ``generate`` makes the same small requests (at most 1 MiB: the one token's activations) step after
step, while a few grow with the position: the KV cache's concatenations (the large pool) and the mask and ids
(8 B and 1 B a token). In a replay of 256 new tokens, the small pool's requests are about 95% of all requests.

The shortcut, exact by construction:

* The small and large pools never share memory (``get_pool`` in ``c10/cuda/CUDACachingAllocator.cpp``), so a small
  request is placed from the small pool's state alone, except when a large request fails the cap check and
  ``release_cached_blocks`` frees every entirely free segment of both pools.
* A step whose small pool starts in state S, whose small requests are the same (rounded sizes, in order, frees of
  the same tensors) as the step before's, and that step having started in S and ended in S without opening a small
  segment, ends in S again: the allocator is deterministic. Its small requests are then only counted (requests,
  allocated bytes, the allocated peak in program order); its large requests are placed as always.
* Should a large request of a skipped step need ``release_cached_blocks``, the small requests of that step up to it
  are placed after all (the small pool still holds S: nothing was placed), and the rest of the step is replayed.

The state S is the small pool's segments (address, and each block's size and state, in address order) and where
the previous step's small tensors that are still alive lie.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from vramguard.memory.allocator import K_MIN_BLOCK, K_SMALL_SIZE, CachingAllocator, round_size

ALLOC, FREE_SAME, FREE_PREV, FREE_OTHER = range(4)
MAX_PERIOD = 12  # the longest cycle of steps looked for (Llama-3.1-8B repeats every 6 steps, Qwen2.5-7B every 1)


@dataclass(frozen=True)
class DecodeSteps:
    """Decode steps 3 .. 2 + ``n`` from the tapes ``(key, bytes)`` / ``(key, -1)`` of steps 1 and 2: every
    allocation of step 2 grows each step by its growth from step 1 (sizes are linear in the position); a free of a
    tensor of step 2 frees the same tensor of the step, a free of a tensor of step 1 frees the previous step's.
    Step ``j`` (0: step 3) numbers its allocations from ``first_key + j * allocs``."""

    pattern: tuple[tuple[int, int], ...]  # per event of step 2: (ALLOC, i) / (FREE_SAME, i) / (FREE_PREV, i) /
    # (FREE_OTHER, key)
    size2: tuple[int, ...]
    growth: tuple[int, ...]
    step2_keys: tuple[int, ...]
    first_key: int
    n: int

    @classmethod
    def from_steps(cls, step1, step2, n: int) -> DecodeSteps:
        """Raises ValueError when steps 1 and 2 do not allocate the same number of tensors."""
        a1 = [k for k, b in step1 if b >= 0]
        a2 = [k for k, b in step2 if b >= 0]
        if len(a1) != len(a2):
            raise ValueError("decode steps 1 and 2 differ in structure")
        idx1 = {k: i for i, k in enumerate(a1)}
        idx2 = {k: i for i, k in enumerate(a2)}
        size1 = [b for _, b in step1 if b >= 0]
        size2 = [b for _, b in step2 if b >= 0]
        pattern = []
        for k, b in step2:
            if b >= 0:
                pattern.append((ALLOC, idx2[k]))
            elif k in idx2:
                pattern.append((FREE_SAME, idx2[k]))
            elif k in idx1:
                pattern.append((FREE_PREV, idx1[k]))
            else:
                pattern.append((FREE_OTHER, k))
        first = max(max(a2, default=0), max(a1, default=0)) + 1
        return cls(tuple(pattern), tuple(size2), tuple(y - x for x, y in zip(size1, size2)), tuple(a2), first, n)

    @functools.cached_property
    def _compiled(self) -> tuple[tuple[int, int, int, int], ...]:
        """:meth:`events` for steps after the first as (0: this step's keys, 1: the previous step's, 2: none; the
        key's offset; bytes at step 2, -1 for a free; growth a step, 0 for a free)."""
        return tuple((0, i, self.size2[i], self.growth[i]) if op == ALLOC else (0, i, -1, 0) if op == FREE_SAME
                     else (1, i, -1, 0) if op == FREE_PREV else (2, i, -1, 0) for op, i in self.pattern)

    @property
    def allocs(self) -> int:
        return len(self.size2)

    def key(self, j: int, i: int) -> int:
        """The key of allocation ``i`` of step ``j``."""
        return self.first_key + j * len(self.size2) + i

    def prev_key(self, j: int, i: int) -> int:
        """The key of allocation ``i`` of the step before step ``j`` (step 2's own key for ``j`` = 0)."""
        return self.step2_keys[i] if j == 0 else self.key(j - 1, i)

    def size(self, j: int, i: int) -> int:
        """Bytes of allocation ``i`` in step ``j``: step 2's size plus ``j + 1`` growths."""
        return self.size2[i] + self.growth[i] * (j + 1)

    def events(self, j: int) -> list[tuple[int, int]]:
        """Step ``j``'s tape, ``(key, bytes)`` and ``(key, -1)``."""
        n = len(self.size2)
        base, grow, size2, growth = self.first_key + j * n, j + 1, self.size2, self.growth
        if j > 0:  # per event (which base its key adds to, the offset, size and growth: -1 and 0 for a free)
            bases = (base, base - n, 0)
            return [(bases[b] + i, s + g * grow) for b, i, s, g in self._compiled]
        if j == 0:
            prev = self.step2_keys
            return [(base + i, size2[i] + growth[i] * grow) if op == ALLOC else (base + i, -1) if op == FREE_SAME
                    else (prev[i], -1) if op == FREE_PREV else (i, -1) for op, i in self.pattern]
        pb = base - n
        return [(base + i, size2[i] + growth[i] * grow) if op == ALLOC else (base + i, -1) if op == FREE_SAME
                else (pb + i, -1) if op == FREE_PREV else (i, -1) for op, i in self.pattern]

    def small_requests(self, j: int) -> tuple[int, ...]:
        """What decides step ``j``'s small requests beyond the constant ones: each growing allocation's rounded
        size while it is small, -1 once it is large."""
        grow, unit = j + 1, K_MIN_BLOCK
        rounded = (-(-n // unit) * unit if n > unit else unit for n in (s + g * grow for s, g in self._growing))
        return tuple(-1 if r > K_SMALL_SIZE else r for r in rounded)  # round_size, written out

    @functools.cached_property
    def _growing(self) -> tuple[tuple[int, int], ...]:
        """(bytes at step 2, growth a step) of every allocation that grows."""
        return tuple((s, g) for s, g in zip(self.size2, self.growth) if g)


@dataclass(frozen=True)
class _Template:
    """A skipped step: ``items`` in program order, ``("run", requests, net, peak)`` for small requests (bytes
    allocated less freed, and the highest point of that sum) and ``(position, op, i)`` for a large one;
    ``carried``: the small allocations that live on into the next step."""

    requests: tuple[int, ...]
    items: tuple
    carried: tuple[int, ...]


class Placer:
    """Places a tape on ``alloc``: ``live`` maps keys to blocks; ``segments_at_peak``: the segment count when the
    reserved peak was last raised."""

    def __init__(self, alloc: CachingAllocator):
        self.alloc = alloc
        self.live: dict = {}
        self.segments_at_peak = len(alloc.segments)
        self.skipped_steps = 0  # decode steps whose small requests were only counted
        self.placed_in_full = 0  # cycles a large request's release_cached_blocks made place in full

    def place(self, events) -> bool:
        """Place ``events``; False (and stop) at the first request that cannot be placed."""
        alloc, live = self.alloc, self.live
        if alloc.oom is not None:
            return False
        malloc, free, pop = alloc.malloc, alloc.free, live.pop
        peak = alloc.peak_reserved_bytes
        for key, nbytes in events:
            if nbytes < 0:
                free(pop(key, None))
                continue
            block = live[key] = malloc(nbytes)
            if block is None:  # malloc answers None only where it could not place the request (alloc.oom)
                return False
            if alloc.peak_reserved_bytes > peak:
                peak = alloc.peak_reserved_bytes
                self.segments_at_peak = len(alloc.segments)
        return True

    def decode(self, steps: DecodeSteps) -> None:
        """Place decode steps ``0 .. steps.n - 1``, skipping the small pool of cycles of steps that repeat (module
        docstring); the result is that of ``place(steps.events(j))`` for every step."""
        seen: list = []
        alloc, template, period, j = self.alloc, None, 0, 0
        known: dict[int, tuple] = {}
        last: tuple = (-1, None)  # the state before step last[0], read after the step before was placed

        def small_requests(j: int) -> tuple:  # each step's, computed once
            found = known.get(j)
            if found is None:
                found = known[j] = steps.small_requests(j)
            return found
        while j < steps.n:
            if template is not None and j + period <= steps.n and all(
                    small_requests(j + m) == template.requests for m in range(period)):
                done = self._skip(steps, j, period, template)
                if done is None:
                    return
                j += abs(done)
                self.skipped_steps += max(done, 0)
                seen = []
                if done < 0:  # placed in full: find the cycle again
                    template = None
                    self.placed_in_full += 1
                continue
            template = None
            now_q, ahead = small_requests(j), small_requests(j + 1)
            if ahead != now_q or (seen and seen[-1][2] != now_q):  # a cycle has the same small requests throughout
                seen = []
            if ahead == now_q:  # only such steps can start a cycle: no state is read for the others
                state = last[1] if last[0] == j else (self._state(steps, j), alloc.small_segments_opened, now_q)
                seen = [*seen, state][-MAX_PERIOD:]
            if not self.place(steps.events(j)):
                return
            j += 1
            if ahead != now_q:
                continue
            now = (self._state(steps, j), alloc.small_segments_opened, ahead)
            last = (j, now)
            for period in range(1, len(seen) + 1):
                if seen[-period] == now and all(q == now[2] for _, _, q in seen[-period:]):
                    template = self._template(steps, j, now[2])
                    break

    def _state(self, steps: DecodeSteps, j: int):
        """The small pool before step ``j``: its segments' blocks, and where the previous step's tensors lie."""
        pool = tuple((s.addr, tuple((b.size, b.state) for b in s.blocks())) for s in self.alloc.segments if s.small)
        get = self.live.get
        keys = steps.step2_keys if j == 0 else range(steps.key(j - 1, 0), steps.key(j, 0))
        carried = tuple((i, b.addr) for i, k in enumerate(keys) if (b := get(k)) is not None and b.seg.small)
        return pool, carried

    def _template(self, steps: DecodeSteps, j: int, requests: tuple) -> _Template | None:
        """How step ``j`` is skipped; None where it frees a tensor of an earlier step that is still alive."""
        small = [round_size(steps.size(j, i)) <= K_SMALL_SIZE for i in range(steps.allocs)]
        freed = {i for op, i in steps.pattern if op == FREE_SAME}
        carried = tuple(i for op, i in steps.pattern if op == ALLOC and small[i] and i not in freed)
        alive = set(carried)  # a free of the previous step's tensor i frees something only if it lived on
        items, run = [], [0, 0, 0]
        for pos, (op, i) in enumerate(steps.pattern):
            if op == FREE_OTHER:
                if i in self.live:
                    return None
                continue
            if not small[i]:
                if run[0] or run[1] or run[2]:
                    items.append(("run", *run))
                    run = [0, 0, 0]
                items.append((pos, op, i))
                continue
            nbytes = round_size(steps.size(j, i))
            if op == ALLOC:
                run[0] += 1
                run[1] += nbytes
                run[2] = max(run[2], run[1])
            elif op == FREE_SAME or i in alive:
                run[1] -= nbytes
        if run[0] or run[1] or run[2]:
            items.append(("run", *run))
        return _Template(requests, tuple(items), carried)

    def _skip(self, steps: DecodeSteps, j: int, period: int, t: _Template) -> int | None:
        """Steps ``j .. j + period - 1`` by template ``t``, a cycle that ends where it started: ``period`` when
        skipped; ``-m`` when a large request of step ``j + m - 1`` needed the small pool (steps ``j`` to there were
        then placed in full); None at a request that cannot be placed."""
        alloc, live = self.alloc, self.live
        counted, net = 0, 0
        for m in range(period):
            for item in t.items:
                if item[0] == "run":
                    _, requests, delta, high = item
                    alloc.requests += requests
                    counted += requests
                    alloc.peak_allocated_bytes = max(alloc.peak_allocated_bytes, alloc.allocated_bytes + high)
                    alloc.allocated_bytes += delta
                    net += delta
                    continue
                pos, op, i = item
                if op != ALLOC:
                    alloc.free(live.pop(steps.key(j + m, i) if op == FREE_SAME else steps.prev_key(j + m, i), None))
                    continue
                before = alloc.peak_reserved_bytes
                block = alloc.malloc(steps.size(j + m, i), release=False)
                if block is None:  # release_cached_blocks would see the small pool mid-cycle: place it in full
                    alloc.requests -= counted
                    alloc.allocated_bytes -= net
                    return -(m + 1) if self._place_from(steps, j, m, pos) else None
                live[steps.key(j + m, i)] = block
                if alloc.peak_reserved_bytes > before:
                    self.segments_at_peak = len(alloc.segments)
        for i in t.carried:
            live[steps.key(j + period - 1, i)] = live.pop(steps.prev_key(j, i))
        return period

    def _place_from(self, steps: DecodeSteps, j: int, m: int, pos: int) -> bool:
        """Steps ``j .. j + m`` with their large requests before step ``j + m``'s event ``pos`` already placed: the
        small requests of those steps before that point, then the rest of step ``j + m``. False at a request that
        cannot be placed."""
        for step in range(j, j + m + 1):
            events = steps.events(step)
            end = pos if step == j + m else len(events)
            small = [ev for (op, i), ev in zip(steps.pattern[:end], events[:end])
                     if op != FREE_OTHER and round_size(steps.size(step, i)) <= K_SMALL_SIZE]
            if not self.place(small):
                return False
        return self.place(events[pos:])  # the last step's events
