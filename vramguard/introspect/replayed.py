"""What one replayed forward found (:class:`Replayed`), and how it is read from the tape of a forward's allocations and
frees with its labels (:class:`TapePeak`, :func:`replayed_from`): the peak of live bytes as the storage tracker
counts them, with its components, place and largest allocation, and the cache's tensors by layer. Needs numpy, not
torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from vramguard.memory.weights import rounded


@dataclass(frozen=True)
class Replayed:
    """One replayed forward (:func:`vramguard.introspect.replay.replay`, or a few layers of it expanded here): its
    peak above the weights by component, and the cache it left.

    ``cache_bytes``: every tensor the cache object holds after the forward (allocator-rounded), by layer index;
    ``cache_tensors``: their (layer, attribute, shape, dtype), for reports and tests.
    """

    peak_bytes: int
    components: dict[str, int]
    at: str
    largest_alloc: int
    cache_bytes: tuple[int, ...]
    cache_tensors: tuple[tuple[int, str, tuple[int, ...], str], ...]


def replayed_from(structure, numbers: tuple[int, ...], peak: TapePeak | None = None) -> Replayed:
    """The :class:`Replayed` of a forward's tape: ``structure`` (each event's key and whether it frees; each
    allocation's (label, where, cached); each cache tensor's (layer, attribute, dimensions, dtype)) and ``numbers``
    (each allocation's bytes, then each cache tensor's dimensions, then each one's storage bytes), as
    :func:`vramguard.introspect.replay_trim.traced` gives them; ``peak``: the structure's :class:`TapePeak`, made
    here when not given."""
    events, notes, cache = structure
    peak = peak or TapePeak(events, notes)
    best, comps, where, largest = peak.at(numbers[:len(notes)])
    pos, tensors, per_layer = len(notes), [], {}  # type: tuple[int, list, dict[int, int]]
    for (i, attr, ndim, dtype), nbytes in zip(cache, numbers[pos + sum(e[2] for e in cache):]):
        shape = numbers[pos:pos + ndim]
        pos += ndim
        size = 1
        for d in shape:
            size *= d
        tensors.append((i, attr, tuple(shape), dtype))
        per_layer[i] = per_layer.get(i, 0) + (rounded(nbytes) if size else 0)
    cache_bytes = tuple(per_layer.get(i, 0) for i in range(max(per_layer) + 1)) if per_layer else ()
    return Replayed(best, comps, where, largest, cache_bytes, tuple(tensors))


class TapePeak:
    """The peak of an expanded tape of fixed structure at any sizes, as
    :class:`~vramguard.introspect.tracker.StorageTracker` counts it: each allocation rounded to 512 B and labelled
    as traced, the cache's tensors after the forward moved to ``kv_cache``; a free drops what the last allocation
    of its key holds (nothing for a key not held). :meth:`at` gives (peak live bytes, its bytes by component in
    the order the live set lists them, where it was reached, the largest allocation); the place is
    :func:`vramguard.introspect.replay._peak_where`'s.

    ``events``: (key, frees) per event; ``notes``: (label, where, cached) per allocation, in order."""

    def __init__(self, events: tuple, notes: tuple):
        import numpy as np

        held: dict = {}  # key -> the allocation that holds it now
        alloc_at: list[int] = []  # each allocation's event
        until: list[int] = []  # each allocation: the next event of its key (it is no longer held from there)
        entered: list[int] = []  # each allocation: the allocation that put its key in the live set (its place)
        frees: list[tuple[int, int]] = []  # (event, allocation freed)
        for i, (key, freed) in enumerate(events):
            if freed:
                a = held.pop(key, None)
                if a is not None:
                    until[a] = i
                    frees.append((i, a))
                continue
            a = len(alloc_at)
            alloc_at.append(i)
            until.append(len(events))
            before = held.get(key)
            if before is not None:
                until[before] = i
            entered.append(a if before is None else entered[before])
            held[key] = a
        names = list(dict.fromkeys("kv_cache" if cached else label for label, _, cached in notes))
        self.names = names
        self.component = np.array([names.index("kv_cache" if c else label) for label, _, c in notes], dtype=np.int64)
        self.where = [at if not at.startswith("aten.") else "in_" + ("kv_cache" if cached else label)
                      for label, at, cached in notes]
        self.n = len(events)
        self.alloc_at = np.array(alloc_at, dtype=np.int64)
        self.until = np.array(until, dtype=np.int64)
        self.entered = np.array(entered, dtype=np.int64)
        self.free_at = np.array([i for i, _ in frees], dtype=np.int64)
        self.freed = np.array([a for _, a in frees], dtype=np.int64)

    def at(self, sizes) -> tuple[int, dict[str, int], str, int]:
        import numpy as np

        raw = np.array(sizes, dtype=np.int64)
        held = np.where(raw > 0, -(-raw // 512) * 512, 0)  # vramguard.memory.weights.rounded; 0 B holds nothing
        largest = int(held.max()) if len(held) else 0
        delta = np.zeros(self.n, dtype=np.int64)
        delta[self.alloc_at] = held
        delta[self.free_at] = -held[self.freed]
        live = np.cumsum(delta)
        if not len(live) or live.max() <= 0:
            return 0, {}, "", largest
        best_at = int(np.argmax(live))  # the first event at the highest live total: an allocation
        alive = (self.alloc_at <= best_at) & (self.until > best_at)
        totals = np.zeros(len(self.names), dtype=np.int64)
        np.add.at(totals, self.component[alive], held[alive])
        first = np.full(len(self.names), self.n, dtype=np.int64)
        np.minimum.at(first, self.component[alive], self.entered[alive])
        order = sorted((int(first[c]), c) for c in range(len(self.names)) if totals[c])
        made = int(np.searchsorted(self.alloc_at, best_at))
        return int(live[best_at]), {self.names[c]: int(totals[c]) for _, c in order}, self.where[made], largest
