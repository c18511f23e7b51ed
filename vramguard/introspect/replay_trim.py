"""One replayed forward (:func:`vramguard.introspect.replay.replay`) of a decoder of N layers from a trace of a few:
the forward runs on the trimmed config of :func:`vramguard.introspect.layer_trim.trim_plan`, its allocations are
recorded (:class:`~vramguard.introspect.replay.Recording`) and expanded to every layer as the allocation tape is
(:func:`vramguard.introspect.layer_trim.expanded`: the cache's tensors adopted before the forward are the first
part, the forward the second), and the result is what the tracker would have found on the full forward: the peak
(live bytes, each allocation rounded to 512 B) with its components and the allocation that reached it, the largest
allocation, and the cache's tensors by layer. None where the trim does not apply or the blocks do not repeat; the
caller replays every layer then. ``tests/test_replay_trim.py`` compares it with the full replay.
"""

from __future__ import annotations

from vramguard.introspect.build import cached_config, cached_structure, text_config
from vramguard.introspect.layer_trim import expanded, trim_plan
from vramguard.memory.weights import rounded
from vramguard.settings import Settings


def trimmed_replay(config_json: str, name: str, s: Settings, past: int, chunk: int):
    """The :class:`~vramguard.introspect.replay.Replayed` of one forward of ``chunk`` tokens after ``past`` for the
    model of ``config_json`` with ``s`` (as :func:`vramguard.introspect.generic._replayed`), from a few layers; None
    where that does not apply (see the module docstring).

    Raises what :func:`vramguard.introspect.replay.replay` raises."""
    from vramguard.introspect.replay import Recording, Replayed, cached_replay_model, replay
    plan = trim_plan(config_json, name, s.act_dtype, s.quant, s.double_quant, s.resolved_compute_dtype)
    if plan is None:
        return None
    trimmed, layers, p, m, head = plan
    model, _note = cached_replay_model(trimmed, name, s.act_dtype, s.effective_attn, s.sdpa_kernel)
    quantized = set(cached_structure(trimmed, name, s.act_dtype, s.quant, s.double_quant,
                               s.resolved_compute_dtype).quantized_modules) if s.is_bnb else set()
    rec = Recording(layers)
    r = replay(model, text_config(cached_config(trimmed, name)), s, past, chunk, quantized, record=rec)
    if not rec.found or len(rec.starts[1]) != layers:
        return None
    found = expanded((tuple(rec.events[:rec.split]), tuple(rec.events[rec.split:rec.end])),
                     [list(x) for x in rec.starts], p, m, head)
    if found is None:
        return None
    tape, source = found
    src = _layer_source(head, p, m)
    by_layer: dict[int, list] = {}
    for entry in r.cache_tensors:
        by_layer.setdefault(entry[0], []).append(entry)
    if any(sorted(e[1:] for e in by_layer.get(head + p + 1 + i, [])) != sorted(
            e[1:] for e in by_layer.get(head + 2 * p + 1 + i, [])) for i in range(p)):
        return None  # the repeated layers' caches differ: not the structure the copies assume
    n = layers + m * p
    kept = [i for i in range(n) if src(i) in by_layer]
    cache_bytes = tuple(r.cache_bytes[src(i)] if src(i) in by_layer else 0
                        for i in range(max(kept) + 1)) if kept else ()
    cache_tensors = tuple((i, *e[1:]) for i in kept for e in by_layer[src(i)])
    peak, comps, at, largest = _peak([e for part in tape for e in part], rec, source)
    return Replayed(peak, comps, at, largest, cache_bytes, cache_tensors)


def _layer_source(head: int, p: int, m: int):
    """Layer i of the full decoder -> the traced layer it repeats: the first ``head + p + 1`` as they are, then
    ``m`` copies of the block of layers ``head + p + 1 .. head + 2p``, then the traced layers from that block on."""
    first = head + p + 1

    def src(i: int) -> int:
        if i < first:
            return i
        if i < first + m * p:
            return first + (i - first) % p
        return i - m * p
    return src


def _peak(events: list, rec, source: dict) -> tuple[int, dict[str, int], str, int]:
    """(peak live bytes, its bytes by component, where it was reached, the largest allocation) of the expanded
    tape, as :class:`~vramguard.introspect.tracker.StorageTracker` counts them: each allocation rounded to 512 B
    and labelled as traced, the cache's tensors after the forward moved to ``kv_cache``; the place is
    :func:`vramguard.introspect.replay._peak_where`'s."""
    def note(key) -> tuple[str, str, bool]:
        k = source.get(key, key)
        label, at = rec.notes[k]
        return label, at, k in rec.cache_serials
    live: dict = {}
    total = best = largest = 0
    best_at = -1
    for i, (key, nbytes) in enumerate(events):
        if nbytes < 0:
            total -= live.pop(key, 0)
            continue
        size = rounded(nbytes) if nbytes else 0
        live[key] = size
        total += size
        largest = max(largest, size)
        if total > best:
            best, best_at = total, i
    if best_at < 0:
        return 0, {}, "", largest
    at_peak: dict = {}
    for key, nbytes in events[:best_at + 1]:
        if nbytes < 0:
            at_peak.pop(key, None)
        else:
            at_peak[key] = rounded(nbytes) if nbytes else 0
    comps: dict[str, int] = {}
    for key, size in at_peak.items():
        label, _, cached = note(key)
        comps["kv_cache" if cached else label] = comps.get("kv_cache" if cached else label, 0) + size
    label, at, cached = note(events[best_at][0])
    where = at if not at.startswith("aten.") else "in_" + ("kv_cache" if cached else label)
    return best, {k: v for k, v in comps.items() if v}, where, largest
