"""The tape of a decoder of N identical layers from a trace of a few: transformers' forward runs on a copy of the
config with ``H + 3P + 2`` layers or a little more (P: the period of ``layer_types``, 1 without; H: the leading
layers that differ from the rest, such as DeepSeek's dense layers before its MoE ones, at most
:data:`MAX_HEAD_LAYERS`), and the events of one block of P layers are repeated for the layers left out. Knows
nothing about the allocator.

A decoder layer allocates the same tensors whatever its index, once its attention type is the same; what differs
is which tensors it frees: those of the block before it (the residual stream), its own, and those of the same
layer one forward earlier (the KV cache a decode step extends). The trace is cut into blocks at each layer's
forward pre-hook; the second and third interior blocks must agree event for event under that classification, and
every tensor of the copied block may be freed only by its own block, the block after it or itself one forward
later. Otherwise, and where the layers' tensors (``Structure``) or the config's per-layer lists are not periodic,
the answer is None and the caller traces every layer. Allocations are numbered in order, as the tracker numbers
them, so an expanded tape equals the full trace's, keys included (``tests/test_layer_trim.py``).
"""

from __future__ import annotations

import json
import re
from functools import lru_cache

from vramguard.introspect.build import cached_config, cached_structure, text_config

MIN_SAVED_LAYERS = 2  # fewer layers than this left out: trace them all
MAX_HEAD_LAYERS = 4  # leading layers unlike the rest that are traced as they are (DeepSeek-V3: 3 dense layers)


def layer_period(cfg, head: int = 0) -> int:
    """The smallest P with ``layer_types[i] == layer_types[head + (i - head) % P]`` for every layer from ``head``
    (1 without ``layer_types``)."""
    types = list(getattr(cfg, "layer_types", None) or [])[head:]
    for p in range(1, len(types) + 1):
        if all(t == types[i % p] for i, t in enumerate(types)):
            return p
    return 1


def _repeats(rows: list, head: int, p: int) -> bool:
    """Whether ``rows[i] == rows[head + (i - head) % p]`` for every ``i >= head``."""
    return all(rows[i] == rows[head + (i - head) % p] for i in range(head, len(rows)))


def _per_layer_lists(cfg, n: int) -> dict[str, list]:
    return {k: list(v) for k, v in vars(cfg).items() if isinstance(v, (list, tuple)) and len(v) == n}


@lru_cache(maxsize=32)
def trim_plan(config_json: str, name: str, dtype: str, quant: str, double_quant: bool, compute: str):
    """``(trimmed config JSON, layers traced T, period P, blocks inserted m, leading layers H)``, or None where the
    layers from H on are not shown to repeat with period P for any H up to :data:`MAX_HEAD_LAYERS`: their tensors
    by layer (names after the index, shapes, dtypes) and every per-layer list of the config must repeat, and at
    least :data:`MIN_SAVED_LAYERS` layers must be left out. The smallest such H is taken (a period as long as the
decoder repeats trivially, but leaves nothing out)."""
    raw = json.loads(config_json)
    cfg = cached_config(config_json, name)
    if text_config(cfg) is not cfg or not isinstance(raw.get("num_hidden_layers"), int):
        return None
    n = cfg.num_hidden_layers
    if n - 5 < MIN_SAVED_LAYERS:  # the fewest layers traced: 3 x 1 + 2
        return None
    lists = _per_layer_lists(cfg, n)
    by_layer: dict[int, list] = {}
    for t in cached_structure(config_json, name, dtype, quant, double_quant, compute).tensors:
        m = re.search(r"\.layers\.(\d+)\.(.*)$", t.name)
        if m:
            by_layer.setdefault(int(m.group(1)), []).append((m.group(2), t.shape, t.dtype, t.kind))
    if sorted(by_layer) != list(range(n)):
        return None
    rows = [sorted(by_layer[i]) for i in range(n)]
    for head in range(min(MAX_HEAD_LAYERS, n) + 1):
        p = layer_period(cfg, head)
        t_layers = head + 3 * p + 2
        t_layers += (n - t_layers) % p
        if n - t_layers >= max(MIN_SAVED_LAYERS, p) and _repeats(rows, head, p) and all(
                _repeats(v, head, p) for v in lists.values()):
            break
    else:
        return None
    raw["num_hidden_layers"] = t_layers
    for k, v in list(raw.items()):
        if isinstance(v, list) and len(v) == n:
            raw[k] = v[:t_layers]
    trimmed = json.dumps(raw, sort_keys=True)
    small = cached_config(trimmed, name)
    kept = {k: v for k, v in _per_layer_lists(small, t_layers).items() if k in lists}  # a list that is as long as
    if small.num_hidden_layers != t_layers or kept != {k: v[:t_layers] for k, v in lists.items()}:  # the trimmed
        return None  # decoder by chance (Falcon-H1's 5 ssm_multipliers) is no per-layer list
    return trimmed, t_layers, p, (n - t_layers) // p, head


def expand(forwards: tuple, starts: list[list[int]], p: int, m: int, head: int = 0) -> tuple | None:
    """The tape of the full decoder from ``forwards`` (one tuple of ``(key, bytes)`` / ``(key, -1)`` events per
    forward, traced with T layers) and ``starts`` (per forward, the index of each layer's first event): ``m``
    copies of the block of layers ``H+P+1 .. H+2P`` inserted before it in every forward (``head``: H), keys
    renumbered in allocation order. None where the blocks do not repeat (see the module docstring)."""
    found = expanded(forwards, starts, p, m, head)
    return None if found is None else _renumber(found[0])


def expanded(forwards: tuple, starts: list[list[int]], p: int, m: int, head: int = 0) -> tuple | None:
    """:func:`expand` before its keys are renumbered: (per forward, its events, a copy's allocations keyed
    ``("copy", forward, copy, index)``; the traced key each copy's allocation repeats), or None."""
    flat = [e for fw in forwards for e in fw]
    bounds, at = [], 0
    for fw in forwards:
        bounds.append((at, at + len(fw)))
        at += len(fw)
    regions = []  # per forward: (b1, b2, b3) as (start, end) in flat
    for f, st in enumerate(starts):
        if len(st) < head + 3 * p + 2:
            return None
        s = [bounds[f][0] + x for x in st[head:]]
        regions.append(((s[1], s[p + 1]), (s[p + 1], s[2 * p + 1]), (s[2 * p + 1], s[3 * p + 1])))
    origin: dict = {}  # key -> (forward, block 0/1/2 or None, alloc index within the block)
    for f, (lo, hi) in enumerate(bounds):
        for b, (a, z) in enumerate(regions[f]):
            j = 0
            for i in range(a, z):
                if flat[i][1] >= 0:
                    origin[flat[i][0]] = (f, b, j)
                    j += 1
        for i in range(lo, hi):
            k, n = flat[i]
            if n >= 0 and k not in origin:
                origin[k] = (f, None, i)
    pattern = [_pattern(flat, origin, f, regions[f], b) for f in range(len(forwards)) for b in (1, 2)]
    if any(x is None for x in pattern) or any(pattern[2 * f] != pattern[2 * f + 1] for f in range(len(forwards))):
        return None
    if any([n for _, n in flat[slice(*r[0])] if n >= 0] != [n for n in pattern[2 * f] if isinstance(n, int)]
           for f, r in enumerate(regions)):
        return None  # the first block's tensors, which the first copy frees, must be the second block's
    if not _frees_stay_local(flat, origin, regions, bounds):
        return None
    source: dict = {}
    return _inserted(flat, origin, regions, bounds, m, source), source


def _pattern(flat, origin, f: int, regions, b: int):
    """Block ``b`` of forward ``f`` as (bytes) per allocation and (-1, class, index) per free: its own tensor,
    the block before's, or its own block's one forward earlier; None for any other free."""
    out = []
    for k, n in flat[slice(*regions[b])]:
        if n >= 0:
            out.append(n)
            continue
        of, ob, j = origin.get(k, (None, None, None))
        if (of, ob) == (f, b):
            out.append((-1, "own", j))
        elif (of, ob) == (f, b - 1):
            out.append((-1, "before", j))
        elif (of, ob) == (f - 1, b):
            out.append((-1, "earlier", j))
        else:
            return None
    return out


def _frees_stay_local(flat, origin, regions, bounds) -> bool:
    """Every tensor of a first or second block is freed by its own block, the block after it, or its own block one
    forward later; a third block's tensors anywhere after it."""
    for f, (lo, hi) in enumerate(bounds):
        for i in range(lo, hi):
            k, n = flat[i]
            if n >= 0 or k not in origin or origin[k][1] is None:
                continue
            of, ob, _ = origin[k]
            here = next((b for b, (a, z) in enumerate(regions[f]) if a <= i < z), None)
            if ob == 2:  # the blocks before it move in the full decoder: only they may not free it
                ok = not ((f == of and i < regions[f][2][0]) or (f > of and here in (0, 1)))
            else:
                ok = (f == of and here in (ob, ob + 1)) or (f == of + 1 and here == ob)
            if not ok:
                return False
    return True


def _inserted(flat, origin, regions, bounds, m: int, source: dict) -> list[list]:
    """Per forward, its events with ``m`` copies of the second block before it; a copy's tensors get keys
    ``("copy", forward, copy, index)``, and ``source`` maps each to the traced key it repeats."""
    out = []
    b1_keys = {}  # (forward, index) -> key of the first block's allocation
    for f in range(len(bounds)):
        for i in range(*regions[f][0]):
            k, n = flat[i]
            if n >= 0:
                b1_keys[(f, origin[k][2])] = k
    for f, (lo, hi) in enumerate(bounds):
        a2, z2 = regions[f][1]
        events = list(flat[lo:a2])
        block = flat[a2:z2]
        for c in range(m):
            j = 0
            for k, n in block:
                if n >= 0:
                    events.append((("copy", f, c, j), n))
                    source[("copy", f, c, j)] = k
                    j += 1
                    continue
                _, ob, idx = origin[k]
                if ob == 1 and origin[k][0] == f:
                    events.append((("copy", f, c, idx), -1))
                elif ob == 0:
                    events.append((b1_keys[(f, idx)] if c == 0 else ("copy", f, c - 1, idx), -1))
                else:  # the same block one forward earlier
                    events.append((("copy", f - 1, c, idx), -1))
        for k, n in block:
            if n < 0 and origin[k][1] == 0:
                k = ("copy", f, m - 1, origin[k][2])
            events.append((k, n))
        events += flat[z2:hi]
        out.append(events)
    return out


def _renumber(forwards: list[list]) -> tuple | None:
    """Keys 0, 1, 2... in allocation order, as the tracker gives them; None for a free of a key never allocated."""
    new: dict = {}
    out = []
    for fw in forwards:
        events = []
        for k, n in fw:
            if n >= 0:
                new[k] = len(new)
                events.append((new[k], n))
            elif k in new:
                events.append((new[k], -1))
            else:
                return None
        out.append(tuple(events))
    return tuple(out)
