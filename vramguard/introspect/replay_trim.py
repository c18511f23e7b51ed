"""One replayed forward (:func:`vramguard.introspect.replay.replay`) of a decoder of N layers from a trace of a few:
the forward runs on the trimmed config of :func:`vramguard.introspect.layer_trim.trim_plan`, its allocations are
recorded (:class:`~vramguard.introspect.replay.Recording`) and expanded to every layer as the allocation tape is
(:func:`vramguard.introspect.layer_trim.expanded`: the cache's tensors adopted before the forward are the first
part, the forward the second), and the result is what the tracker would have found on the full forward: the peak
(live bytes, each allocation rounded to 512 B) with its components and the allocation that reached it, the largest
allocation, and the cache's tensors by layer. None where the trim does not apply or the blocks do not repeat; the
caller replays every layer then. ``tests/test_replay_trim.py`` compares it with the full replay.

The expanded forward is kept as a :data:`~vramguard.introspect.stretch.Sample`: its structure (each event's key and
whether it frees, each allocation's label, the cache's tensors) and its numbers (each allocation's bytes, each
cache tensor's dimensions and storage bytes), so that where a chunked scan makes the numbers periodic in the
tokens, the replays of a search over the prompt come from a few (:func:`stretched_replay`).
"""

from __future__ import annotations

from functools import lru_cache

from vramguard.introspect.build import cached_config, cached_structure, text_config
from vramguard.introspect.layer_trim import expanded, trim_plan
from vramguard.introspect.replayed import TapePeak, replayed_from
from vramguard.introspect.stretch import MARGIN, Sample, Stretch, breakpoints, chunk_period, context, first_periodic
from vramguard.memory.forward import BNB_4BIT_FUSED_MAX_ROWS
from vramguard.settings import Settings


def trimmed_replay(config_json: str, name: str, s: Settings, past: int, chunk: int):
    """The :class:`~vramguard.introspect.replay.Replayed` of one forward of ``chunk`` tokens after ``past`` for the
    model of ``config_json`` with ``s`` (as :func:`vramguard.introspect.generic._replayed`), from a few layers; None
    where that does not apply (see the module docstring).

    Raises what :func:`vramguard.introspect.replay.replay` raises."""
    found = traced(config_json, name, s, past, chunk)
    return None if found is None else replayed_from(*found)


def traced(config_json: str, name: str, s: Settings, past: int, chunk: int) -> Sample | None:
    """:func:`trimmed_replay` before its result: the expanded forward as (structure, numbers) (module docstring);
    None where the trim does not apply."""
    from vramguard.introspect.replay import Recording, cached_replay_model, replay
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
    for entry, nbytes in zip(r.cache_tensors, rec.cache_storage):
        by_layer.setdefault(entry[0], []).append((*entry[1:], nbytes))
    if any(sorted(e[:3] for e in by_layer.get(head + p + 1 + i, [])) != sorted(
            e[:3] for e in by_layer.get(head + 2 * p + 1 + i, [])) for i in range(p)):
        return None  # the repeated layers' caches differ: not the structure the copies assume
    entries = [(i, *e) for i in range(layers + m * p) if src(i) in by_layer for e in by_layer[src(i)]]
    events = [e for part in tape for e in part]

    def note(key) -> tuple[str, str, bool]:
        k = source.get(key, key)
        label, at = rec.notes[k]
        return label, at, k in rec.cache_serials
    structure = (tuple((k, n < 0) for k, n in events), tuple(note(k) for k, n in events if n >= 0),
                 tuple((i, attr, len(shape), dtype) for i, attr, shape, dtype, _ in entries))
    numbers = (*(n for _, n in events if n >= 0), *(d for e in entries for d in e[2]), *(e[4] for e in entries))
    return structure, tuple(numbers)


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


@lru_cache(maxsize=32)
def _stretch(config_json: str, name: str, s: Settings, past: int | None, chunk: int | None, lo: int, end: int,
             period: int | None) -> Stretch:
    """The :class:`~vramguard.introspect.stretch.Stretch` of the forwards of ``s`` over the one of the tokens of a
    prefill (``chunk``, after nothing), those before a decode step (``past``) and the batch given as None."""
    return Stretch(lo, end, period)


def _stretches(config_json: str, name: str, s: Settings, past: int, chunk: int) -> list[tuple[Stretch, int]]:
    """The stretches a forward of ``chunk`` tokens after ``past`` with ``s`` lies in, with its value in each: the
    tokens of a prefill or a decode step from two chunks on (between the config's breakpoints, kept
    :data:`~vramguard.introspect.stretch.MARGIN` tokens clear of them, and within the context), and the batch
    beyond the rows of bitsandbytes' fused 4-bit kernel (the replay's other path:
    :data:`~vramguard.memory.forward.BNB_4BIT_FUSED_MAX_ROWS`); none for a config without a chunked scan's chunk
    or a decoder that is not trimmed."""
    cfg = text_config(cached_config(config_json, name))
    period = chunk_period(cfg)
    if period is None or trim_plan(config_json, name, s.act_dtype, s.quant, s.double_quant,
                                   s.resolved_compute_dtype) is None:
        return []
    out = []
    decode = chunk == 1 and past > 0
    if decode or (not past and chunk > 1):
        x, tokens = (past, past + 1) if decode else (chunk, chunk)
        below = [e for e in breakpoints(cfg) if e < tokens]
        lo = max(below[-1] + MARGIN if below else 0, first_periodic(cfg, period))
        hi = min([e - MARGIN for e in breakpoints(cfg) if e >= tokens] + [context(cfg) + 1])
        out.append((_stretch(config_json, name, s, None if decode else 0, 1 if decode else None, lo - (tokens - x),
                             hi - (tokens - x), period), x))
    out.append((_stretch(config_json, name, s.with_(batch=1), past, chunk, BNB_4BIT_FUSED_MAX_ROWS + 1, 1 << 31,
                         None), s.batch))
    return out


def stretched_replay(config_json: str, name: str, s: Settings, past: int, chunk: int):
    """:func:`trimmed_replay` of a model whose config names a chunked scan's chunk
    (:func:`vramguard.introspect.stretch.chunk_period`): from the polynomial of a stretch it lies in
    (:func:`_stretches`) where one answers, else replayed and kept by its stretches; None where it lies in none
    that keeps it (the caller replays it)."""
    stretches = _stretches(config_json, name, s, past, chunk)
    for st, x in stretches:
        found = st.at(x)
        if found is not None:
            if found[0] != st.structure:
                return replayed_from(*found)
            if "peak" not in st.memo:
                structure: tuple = found[0]  # type: ignore[assignment]
                st.memo["peak"] = TapePeak(structure[0], structure[1])
            return replayed_from(*found, peak=st.memo["peak"])
    wanted = [(st, x) for st, x in stretches if st.wants(x)]
    if not wanted:
        return None
    found = traced(config_json, name, s, past, chunk)
    for st, x in wanted:
        st.keep(x, found)
    return None if found is None else replayed_from(*found)
