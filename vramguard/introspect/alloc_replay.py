"""The allocation tape of a whole ``generate`` call, replayed through the caching-allocator model: reserved memory
at the peak, and the first allocation that cannot be placed under a cap. Needs torch and transformers.

The tape, in program order:

1. The load (``from_pretrained`` with a device map): transformers' ``caching_allocator_warmup`` requests one block
   of the weights' size and frees it, then every parameter, buffer and bitsandbytes quantization-state tensor is
   allocated in the order the meta model lists them (:func:`vramguard.introspect.build.structure`); tensors of at
   most 1 MiB go to the small pool, the others split the warm-up block. A parameter transformers makes from one
   checkpoint tensor per expert (a MoE's stacked experts) is preceded by those tensors and its stacks, freed once
   it is made (:func:`vramguard.introspect.load_tape._fused_at_load`): the holes they leave stay reserved. Unless
   bitsandbytes quantizes on the fly, transformers reads the checkpoint in four threads ahead of the conversions
   (``core_model_loading``), so the tensors it frees lie between others, and a hole is no larger than the largest
   of them (ERNIE-4.5 on the H200: at most 503 MB, one expert stack); the tape, one parameter's sources together,
   merges them (a 1.24 GB hole that took a 1.2 GB request the GPU placed in a new segment), so the free blocks
   left are cut to that size (:meth:`~vramguard.memory.allocator.CachingAllocator.split_free_blocks`).
2. A warm-up ``generate``: the cuBLAS workspace (32 MiB, :data:`vramguard.memory.runtime.CUBLAS_WORKSPACE_BYTES`)
   and 512 B beside it stay allocated; then ``torch.cuda.empty_cache()``.
3. ``generate`` itself: the input ids and mask, the prefill forward and every decode forward, as transformers' own
   forward allocates and frees them on the meta device (:class:`~vramguard.introspect.tracker.StorageTracker`,
   the replay rules of :mod:`vramguard.introspect.replay`), each decode step's new ids and mask, and the float32
   copy of the last logits. Decode steps differ only in tensor lengths, which grow by one token a step: steps 1
   and 2 are replayed and each later step's sizes are extrapolated from them (every size is linear in the
   position; a sliding-window layer's cache stops growing at its window, so past it the steps are planned
   high by at most the new tokens' rows of those layers). Where steps 1 and 2 differ in structure (a cache of one
   or two tokens takes other branches of the mask code), more steps are replayed until two consecutive ones agree,
   or all of them (:func:`_decode_tape`; the plan says so). While the small pool
   cycles through the same states, later steps place only their large requests (:mod:`vramguard.memory.
   decode_steps`, exact: the same peaks and out-of-memory point as placing every request). Over many prompts (the
   search for the largest one) the three forwards are rescaled from four sample replays instead
   (:func:`_rescaled_events`): between the config's breakpoints every size is a quadratic in the prompt, or, where
   a chunked scan pads the prompt to its chunk, a polynomial in the prompt and that padding
   (:mod:`vramguard.introspect.stretch`: six to eight sample replays, and one more at the first prompt beyond). Each
   replay traces a few decoder layers and repeats them (:mod:`vramguard.introspect.layer_trim`), and is kept on
   disk (:mod:`vramguard.introspect.tape_cache`).

Settings the tape does not cover (a quantized or offloaded KV cache, chunked prefill, all-position logits,
attention maps in the output) answer None, and the plan keeps its formula for them.
"""

from __future__ import annotations

import collections
import contextlib
import os
from dataclasses import dataclass, replace
from functools import lru_cache

from vramguard.errors import NotPlannable
from vramguard.introspect import hand, tape_cache
from vramguard.introspect.build import _quiet, cached_config, text_config
from vramguard.introspect.generic import _replay_model, _structure
from vramguard.introspect.layer_trim import expand, trim_plan
from vramguard.introspect.load_tape import load_events
from vramguard.introspect.stretch import MARGIN, breakpoints, chunk_period
from vramguard.introspect.tape_stretch import periodic_events
from vramguard.memory import hand_tape
from vramguard.memory.allocator import AllocatorConfig, Block, CachingAllocator, OutOfMemory
from vramguard.memory.decode_steps import DecodeSteps, Placer
from vramguard.memory.forward import BNB_4BIT_FUSED_MAX_ROWS, sdpa_runs_math
from vramguard.memory.runtime import CUBLAS_WORKSPACE_BYTES
from vramguard.settings import DTYPE_BYTES, Settings
from vramguard.spec import SUPPORTED_MODEL_TYPES, spec_from_config

@dataclass(frozen=True)
class AllocatorReplay:
    """What the allocator model gives for one ``generate`` (bytes): peaks over the call (weights included), the
    reserved memory it starts from, and the first request that could not be placed under the cap (None: all)."""

    peak_allocated_bytes: int
    peak_reserved_bytes: int
    base_reserved_bytes: int
    segments_at_peak: int
    oom: OutOfMemory | None
    expandable_segments: bool
    decode_note: str | None = None  # how the decode steps were replayed where the shortcut did not apply

    @property
    def fits(self) -> bool:
        return self.oom is None


def supported(s: Settings) -> bool:
    """Whether the tape covers ``s`` (see the module docstring)."""
    return not_covered(s) is None


def not_covered(s: Settings) -> str | None:
    """The setting of ``s`` the tape does not cover, in words (``"an int8 KV cache"``); None where it covers all."""
    if s.cache not in ("dynamic", "static"):
        return f"an {s.cache} KV cache"
    if s.resolved_kv_dtype in ("int8", "int4"):
        return f"an {s.resolved_kv_dtype} KV cache"
    if s.prefill_chunk is not None:
        return "chunked prefill"
    if s.logits != "last":
        return "logits of every position"
    return "returned attention maps" if s.output_attentions else None


def _load(alloc: CachingAllocator, spec, s: Settings, workspace: bool = True) -> list:
    """The load (:func:`load_events`), then the warm-up ``generate``'s cuBLAS workspace (``workspace``; a later
    model of the same process finds it held already) and ``empty_cache``; returns the handles of what stays: the
    weights, buffers and quantization state (to free them, as a process that deletes the model does)."""
    warm, events = load_events(spec, s)
    if warm:
        alloc.free(alloc.malloc(warm))  # caching_allocator_warmup
    live: dict[int, Block | None] = {}
    freed = 0  # the largest tensor the load frees
    for key, nbytes in events:
        if nbytes < 0:
            block = live.pop(key)
            freed = max(freed, block.size if block is not None else 0)
            alloc.free(block)
        else:
            live[key] = alloc.malloc(nbytes)
    if workspace:
        alloc.malloc(CUBLAS_WORKSPACE_BYTES)
        alloc.malloc(512)
    alloc.empty_cache()
    if freed and not s.is_bnb:
        alloc.split_free_blocks(freed)  # holes of the reader threads' load (the module docstring, step 1)
    return list(live.values())


def loaded_reserved_bytes(spec, s: Settings, config: AllocatorConfig) -> int:
    """The reserved bytes after the load and the warm-up (:func:`_load`): the ``base_reserved_bytes`` of every
    :func:`replay_generate` of ``spec`` with ``s``'s load settings under ``config``, whatever its cap (the load
    is replayed without one)."""
    return _loaded(spec, s.with_(prompt_tokens=1, max_new_tokens=1), replace(config, allowed_bytes=None)).reserved_bytes


@lru_cache(maxsize=8)
def _loaded(spec, key: Settings, config: AllocatorConfig) -> CachingAllocator:
    """The allocator after :func:`_load` under ``config`` (no cap), for settings ``key`` with a 1-token prompt and
    one new token: the load reads only the weights' settings (dtype, quantization), never the prompt or the
    generation, so every replay of ``spec`` continues a copy of this state (:meth:`CachingAllocator.copy`)."""
    alloc = CachingAllocator(config)
    _load(alloc, spec, key)
    return alloc


def share_tapes(spec, s: Settings) -> None:
    """Compute the forwards' tapes of ``s``'s prompt stretch (:func:`_decode_tape` with ``rescale``) into this
    process's caches, so that processes forked after it (the card searches of a plan) find them there instead of
    each computing them again. Where they cannot be computed (NotPlannable), nothing: the replay that needs them
    says so."""
    if supported(s) and spec.config_json:
        with contextlib.suppress(NotPlannable):
            _decode_tape(spec, s, True, later_steps=False)


def replay_generate(spec, s: Settings, config: AllocatorConfig, rescale: bool = False,
                    later_steps: bool = True) -> AllocatorReplay | None:
    """Replay load, warm-up and ``generate`` for ``spec`` with ``s`` through the allocator model under ``config``
    (its ``allowed_bytes`` is the cap on reserved memory). None where :func:`supported` is false. ``rescale``: the
    tape's sizes from the prompt's stretch (:func:`generate_events`): the same replay, cheaper over many prompts.
    ``later_steps=False``: only up to the second decode step (a prefix of the call: what does not fit there does
    not fit at all).

    Raises NotPlannable where transformers' forward cannot run for these settings (as the planner's replay)."""
    if not supported(s) or not spec.config_json:
        return None
    path = tape_cache.tape_path("replay", repr(spec), s, config, rescale, later_steps)
    found = tape_cache.read_record(path) if path is not None else None
    if found is not None:
        try:
            oom = found.pop("oom")
            return AllocatorReplay(**found, oom=None if oom is None else OutOfMemory(**oom))
        except (TypeError, KeyError):  # not a record of this code: replayed again
            pass
    r = _replay(spec, s, config, rescale, later_steps)
    if path is not None:
        from dataclasses import asdict
        tape_cache.write_record(path, asdict(r))
    return r


def _replay(spec, s: Settings, config: AllocatorConfig, rescale: bool, later_steps: bool) -> AllocatorReplay:
    """:func:`replay_generate`, replayed."""
    alloc = _loaded(spec, s.with_(prompt_tokens=1, max_new_tokens=1), replace(config, allowed_bytes=None)).copy()
    base = alloc.reserved_bytes
    alloc.config = config
    alloc.peak_reserved_bytes, alloc.peak_allocated_bytes = alloc.reserved_bytes, alloc.allocated_bytes
    head, steps, note = _decode_tape(spec, s, rescale, later_steps)
    placer = Placer(alloc)
    if placer.place(head) and steps is not None and later_steps:
        placer.decode(steps)
    return AllocatorReplay(alloc.peak_allocated_bytes, alloc.peak_reserved_bytes, base, placer.segments_at_peak,
                           alloc.oom, config.expandable_segments, note)


def generate_events(spec, s: Settings, rescale: bool = False) -> list[tuple[int, int]]:
    """The allocation tape of ``generate`` above the loaded model: ``(key, bytes)`` per allocation and
    ``(key, -1)`` per free, in program order (see the module docstring). ``rescale``: take the first three
    forwards from :func:`_rescaled_events` where it applies (the same tape, without a replay per prompt)."""
    head, steps = _tape(spec, s, rescale)
    return head + ([] if steps is None else [e for j in range(steps.n) for e in steps.events(j)])


def _tape(spec, s: Settings, rescale: bool) -> tuple[list[tuple[int, int]], DecodeSteps | None]:
    """:func:`generate_events` as the forwards replayed in full, then the later steps (None: none)."""
    return _decode_tape(spec, s, rescale)[:2]


FALLBACK_STEPS = 8  # decode forwards replayed to find two consecutive ones of one structure (see _decode_tape)
FULL_REPLAY_MAX_NEW_TOKENS = 64  # beyond that, a generation whose steps never repeat in structure is not replayed


def _decode_tape(spec, s: Settings, rescale: bool,
                 later_steps: bool = True) -> tuple[list[tuple[int, int]], DecodeSteps | None, str | None]:
    """(the forwards replayed in full as one tape, the later decode steps extrapolated from the last two of them or
    None, a note where the shortcut did not apply as the module docstring describes it, else None).

    The shortcut extrapolates decode steps 3, 4... from steps 1 and 2, which must allocate the same tensors. Where
    they do not (a cache of one or two tokens takes other branches of transformers' mask code than a longer one),
    up to :data:`FALLBACK_STEPS` forwards are replayed and the first two consecutive decode steps of one structure
    are extrapolated from; where none are found, every step is replayed (the full replay) up to
    :data:`FULL_REPLAY_MAX_NEW_TOKENS` new tokens.

    ``later_steps=False``: the same forwards, without the later steps (None) where steps 1 and 2 allocate as many
    tensors (the one condition of :meth:`DecodeSteps.from_steps`, so the answer takes the same branch), for the
    replays of a prefix of the call.

    Raises:
        NotPlannable: no two consecutive decode steps of one structure and a longer generation than that.
    """
    new = s.max_new_tokens if s.cache == "static" else min(s.max_new_tokens, 3)
    key = s.with_(prompt_tokens=1, max_new_tokens=1)
    found = _rescaled_events(spec.config_json, spec.name, key, s.prompt_tokens, new) if rescale else None
    forwards = found or _cached_events(spec.config_json, spec.name, key, s.prompt_tokens, new)
    more = s.max_new_tokens - 3
    if more <= 0 or not later_steps and _count(forwards[1]) == _count(forwards[2]):
        return [e for fw in forwards for e in fw], None, None
    steps = _extrapolated(forwards[1], forwards[2], more)
    if steps is None and found is not None:
        forwards = _cached_events(spec.config_json, spec.name, key, s.prompt_tokens, new)
        steps = _extrapolated(forwards[1], forwards[2], more)
    if steps is not None:
        return [e for fw in forwards for e in fw], steps, None
    why = (f"decode steps 1 and 2 allocate {_count(forwards[1])} and {_count(forwards[2])} tensors (the first "
           "steps' forwards differ in structure)")
    for n in dict.fromkeys((min(FALLBACK_STEPS, s.max_new_tokens), s.max_new_tokens)):
        if n > FULL_REPLAY_MAX_NEW_TOKENS and n > FALLBACK_STEPS:
            break
        forwards = _cached_events(spec.config_json, spec.name, key, s.prompt_tokens,
                                  s.max_new_tokens if s.cache == "static" else n, n)
        if n == s.max_new_tokens:
            return [e for fw in forwards for e in fw], None, f"{why}: all {n} forwards were replayed in full"
        for k in range(1, n - 1):  # forwards[k]: decode step k
            steps = _extrapolated(forwards[k], forwards[k + 1], s.max_new_tokens - k - 2)
            if steps is not None:
                return [e for fw in forwards[:k + 2] for e in fw], steps, (
                    f"{why}: the prefill and decode steps 1 to {k + 1} were replayed in full, later steps "
                    f"extrapolated from steps {k} and {k + 1}")
    raise NotPlannable("max_new_tokens", s.max_new_tokens, f"at most {FULL_REPLAY_MAX_NEW_TOKENS} new tokens "
                       f"where no two of the first {FALLBACK_STEPS} decode steps allocate the same tensors ({why})",
                       f"plan max_new_tokens={FULL_REPLAY_MAX_NEW_TOKENS} or fewer, or with alloc_conf=None (the "
                       "reserve formula)")


def _count(forward) -> int:
    return sum(1 for _, b in forward if b >= 0)


def _extrapolated(step1, step2, more: int) -> DecodeSteps | None:
    """:meth:`DecodeSteps.from_steps`, or None where the two steps differ in structure."""
    try:
        return DecodeSteps.from_steps(step1, step2, more)
    except ValueError:
        return None


SAMPLE_OFFSETS = (8, 45, 109, 181)  # prompts lo + offset sample a stretch; a quadratic through 3, checked at the 4th
RESCALE_MARGIN = MARGIN  # tokens kept clear of a window's edge: decode steps cross it a step or two later


def _breakpoints(config_json: str, name: str) -> tuple[int, ...]:
    """Prompt lengths where a tensor's size stops following one polynomial: the sliding window, the attention chunk
    and the original context of a long-RoPE model, as the model's config gives them."""
    spec = _hand_spec(config_json, name)
    if spec is not None:
        return hand.breakpoints(spec)
    return breakpoints(text_config(cached_config(config_json, name)))


_HANDED: dict = {}  # stretches computed by another process for this one (take_stretches), each taken once
_COMPUTED: collections.deque = collections.deque(maxlen=4)  # the last stretches made: (process id, arguments, value)


def computed_stretches() -> dict:
    """The last few stretches this process made (:func:`_stretch_events`; not those of the process it was forked
    from), by their arguments: what a forked child hands to its parent, which would otherwise make them again
    (:class:`vramguard.plan.allocator.Ahead`)."""
    pid = os.getpid()
    return {args: found for made_by, args, found in _COMPUTED if made_by == pid}


def take_stretches(found: dict) -> None:
    """Take stretches another process made (:func:`computed_stretches`) as this one's own (those handed before and
    not taken are dropped)."""
    _HANDED.clear()
    _HANDED.update(found)


@lru_cache(maxsize=32)
def _stretch_events(config_json: str, name: str, key: Settings, lo: int, new: int) -> tuple | None:
    """The tape of the first three forwards for every prompt of the stretch from ``lo``, as (keys, sizes, forward
    lengths, denominator), each size None (a free), an int (the same at every prompt) or the quadratic's
    coefficients times the denominator:
    each event's size is exactly ``a + b p + c p**2`` in the prompt p (activations grow with p, attention scores
    and masks with p**2) through the replays at ``lo + SAMPLE_OFFSETS[:3]``, which the fourth replay must match
    event for event (else None: the sizes follow no quadratic there, or the forwards differ in structure).
    One another process computed and handed over (:func:`take_stretches`) is taken as it is."""
    args = (config_json, name, key, lo, new)
    found = _HANDED.pop(args) if args in _HANDED else _fitted_stretch(*args)
    _COMPUTED.append((os.getpid(), args, found))
    return found


def _fitted_stretch(config_json: str, name: str, key: Settings, lo: int, new: int) -> tuple | None:
    """:func:`_stretch_events`, fitted to the replays at ``lo + SAMPLE_OFFSETS``."""
    from fractions import Fraction
    xs = [lo + o for o in SAMPLE_OFFSETS]
    tapes = [_cached_events(config_json, name, key, x, new) for x in xs]
    flat = [[e for forward in t for e in forward] for t in tapes]
    marks = [len(f) for f in tapes[0]]
    if any([len(f) for f in t] != marks for t in tapes) or any(
            [(k, n < 0) for k, n in f] != [(k, n < 0) for k, n in flat[0]] for f in flat[1:]):
        return None
    x0, x1, x2, x3 = xs
    den = (x1 - x0) * (x2 - x0) * (x2 - x1)
    poly: list[int | tuple[int, int, int] | None] = []
    for y0, y1, y2, y3 in zip(*[[n for _, n in f] for f in flat]):
        if y0 < 0:
            poly.append(None)
            continue
        c = Fraction(y2 - y1, (x2 - x1) * (x2 - x0)) - Fraction(y1 - y0, (x1 - x0) * (x2 - x0))
        b = Fraction(y1 - y0, x1 - x0) - c * (x0 + x1)
        a = y0 - b * x0 - c * x0 * x0
        if a + b * x3 + c * x3 * x3 != y3:
            return None
        poly.append(int(a) if b == c == 0 else (int(a * den), int(b * den), int(c * den)))  # den: a multiple of
        # every denominator; a constant size (an integer: y0) is kept as it is
    return [k for k, _ in flat[0]], poly, marks, den


def _rescaled_events(config_json: str, name: str, key: Settings, prompt: int, new: int) -> tuple | None:
    """:func:`_cached_events` for ``prompt`` from the sizes of its stretch: a polynomial in the prompt and its
    padding where the config names a chunked scan's chunk (:func:`~vramguard.introspect.tape_stretch.
    periodic_events`; a stretch too short for it is cut at the chunk's multiples), else a quadratic in the prompt
    (:func:`_stretch_events`); None where the prompt lies within ``RESCALE_MARGIN`` of a breakpoint
    (:func:`_breakpoints`; with a static cache, within ``RESCALE_MARGIN + new`` below it) or of one token, or in a
    stretch that follows neither. Stretches run between breakpoints; their samples sit at the start."""
    edges = [0, *_breakpoints(config_json, name)]
    lo = max(e for e in edges if e < prompt)
    hi = min((e for e in edges if e >= prompt), default=None)
    below = RESCALE_MARGIN + (new if key.cache == "static" else 0)  # a static cache holds prompt + new tokens
    if prompt - lo < max(RESCALE_MARGIN, SAMPLE_OFFSETS[0]) or (hi is not None and hi - prompt < below):
        return None
    period = None if _hand_spec(config_json, name) is not None else \
        chunk_period(text_config(cached_config(config_json, name)))  # a hand family has none (nor the config)
    if period is not None:
        applies, periodic = periodic_events(_cached_events, config_json, name, key, prompt, new, lo + RESCALE_MARGIN,
                                            hi - below + 1 if hi else None, period)
        if applies:
            return periodic
        # the stretch holds less than two chunks: the padded length is one between two multiples of the chunk, and
        # a quadratic in the prompt holds there alone (not across a chunk's end)
        lo, hi = max(lo, (prompt - 1) // period * period), min(hi or prompt + period, -(-prompt // period) * period)
        if prompt - lo < max(RESCALE_MARGIN, SAMPLE_OFFSETS[0]) or hi - prompt < below:
            return None
    if hi is not None and lo + SAMPLE_OFFSETS[-1] + below > hi:
        return None
    found = _stretch_events(config_json, name, key, lo, new)
    if found is None:
        return None
    keys, poly, marks, den = found
    p2, out, i = prompt * prompt, [], 0
    sizes = [-1 if abc is None else abc if abc.__class__ is int else (abc[0] + abc[1] * prompt + abc[2] * p2) // den
             for abc in poly]
    for count in marks:
        out.append(tuple(zip(keys[i:i + count], sizes[i:i + count])))
        i += count
    return tuple(out)


@lru_cache(maxsize=64)
def _cached_events(config_json: str, name: str, key: Settings, prompt: int, new: int, steps: int = 3) -> tuple:
    """The events of the first ``min(new, steps)`` forwards (the prefill, decode step 1, 2...) replayed on the meta
    device, one tuple per forward (empty tuples up to three); read from the tape cache on disk where a plan of the
    same model, settings and code recorded them (:mod:`vramguard.introspect.tape_cache`). A hand family's
    forwards come from its hand tape (:mod:`vramguard.memory.hand_tape`: the same events, without torch)."""
    spec = _hand_spec(config_json, name)
    if spec is not None and hand_tape.covers(spec, key):
        return hand.forwards(spec, key, prompt, new, steps)
    path = tape_cache.tape_path(config_json, name, key, prompt, new, steps)
    if path is None:
        return _record_events(config_json, name, key, prompt, new, steps)
    found = tape_cache.read(path)
    if found is None:
        found = _record_events(config_json, name, key, prompt, new, steps)
        tape_cache.write(path, found)
    return found


@lru_cache(maxsize=8)
def _hand_spec(config_json: str, name: str):
    """The hand family's spec of ``config_json`` where :mod:`vramguard.introspect.hand` answers it, else None."""
    import json

    raw = json.loads(config_json)
    if raw.get("model_type") not in hand.FAMILIES or raw.get("model_type") not in SUPPORTED_MODEL_TYPES:
        return None
    spec = spec_from_config(raw, name=name)
    return spec if hand.covers(spec) else None


def _record_events(config_json: str, name: str, key: Settings, prompt: int, new: int, steps: int = 3) -> tuple:
    """:func:`_cached_events` recorded: transformers' forward on the meta device under the storage tracker, on a
    decoder of a few layers whose blocks are repeated where its layers repeat
    (:mod:`vramguard.introspect.layer_trim`: the same tape, keys included), else on every layer."""
    s = key
    plan = trim_plan(config_json, name, s.act_dtype, s.quant, s.double_quant, s.resolved_compute_dtype)
    if plan is not None:
        trimmed, layers, period, copies, head = plan
        traced = _trace(trimmed, name, key, prompt, new, steps, layers)
        ran = [i for i, fw in enumerate(traced[0]) if fw] if traced is not None else []
        found = expand(tuple(traced[0][i] for i in ran), [traced[1][i] for i in ran], period, copies, head) \
            if traced is not None else None
        if found is not None and traced is not None:
            return found + ((),) * (len(traced[0]) - len(found))
    traced = _trace(config_json, name, key, prompt, new, steps)
    if traced is None:  # without ``layers`` the trace always has its events
        raise NotPlannable("model", name, "a forward whose allocations can be traced",
                           "plan with alloc_conf=None (the reserve formula)")
    return traced[0]


def _trace(config_json: str, name: str, key: Settings, prompt: int, new: int, steps: int,
           layers: int | None = None) -> tuple | None:
    """The forwards' events, and with ``layers`` (the decoder's layer count) the index of each layer's first event
    in its forward (None where no one list of that many decoder layers is found)."""
    import torch

    from vramguard.introspect.replay import _new_cache, cache_keyword, layer_starts, replayed_paths
    from vramguard.introspect.tracker import DataPolicy, StorageTracker
    s = key.with_(prompt_tokens=prompt, max_new_tokens=new)
    model, _note = _replay_model(config_json, name, s.act_dtype, s.effective_attn, s.sdpa_kernel)
    quantized = set(_structure(config_json, name, s.act_dtype, s.quant, s.double_quant,
                               s.resolved_compute_dtype).quantized_modules) if s.is_bnb else set()
    cfg = text_config(cached_config(config_json, name))
    events: list[tuple[int, int]] = []
    marks: list[int] = []
    tracker = StorageTracker(policy=DataPolicy(), events=events)
    flash = model.config._attn_implementation == "sdpa" and not sdpa_runs_math(s)
    seqs, meta = s.sequences, torch.device("meta")
    starts: list[int] = []
    with layer_starts(model, layers, lambda: starts.append(len(events))) as found, _quiet(), torch.no_grad(), \
            replayed_paths(model, s.kernels), tracker, _bnb_kernels(model, quantized, s), \
            (_fused_sdpa_mode() if flash else contextlib.nullcontext()):
        if not found:
            return None
        cache, name = _new_cache(model, cfg, s), cache_keyword(model)
        ids = torch.zeros((seqs, prompt), dtype=torch.long, device=meta)
        mask = torch.ones((seqs, prompt), dtype=torch.long, device=meta)
        step_ids = ids
        for step in range(min(new, steps)):
            past = prompt + step - 1 if step else 0
            if not s.padded:
                tracker.fill(mask, 1)
            pos = torch.arange(past, past + step_ids.shape[1], device=meta).unsqueeze(0).expand(seqs, -1)
            out = model(input_ids=step_ids, attention_mask=mask, position_ids=pos, **{name: cache},
                        use_cache=True, logits_to_keep=1)
            last = out.logits[:, -1, :].to(copy=True, dtype=torch.float32)  # generate's next-token logits
            cache = getattr(out, name)
            del out, pos
            step_ids = last.argmax(-1)[:, None]
            del last
            ids = torch.cat([ids, step_ids], dim=-1)  # generate: input_ids grows by the chosen token
            mask = torch.cat([mask, mask.new_ones((seqs, 1))], dim=-1)
            marks.append(len(events))
        del cache, ids, mask, step_ids
    marks += [len(events)] * (3 - len(marks))
    forwards = tuple(tuple(events[a:b]) for a, b in zip([0] + marks, marks))
    per = [[x - a for x in starts if a <= x < b] for a, b in zip([0] + marks, marks)]
    return forwards, per


def _fused_sdpa_mode():
    """A ``TorchFunctionMode`` that replaces ``F.scaled_dot_product_attention`` by what the fused CUDA kernel
    allocates in inference, as the allocator traces of torch 2.11 on an H200 record it (``benchmarks/results/
    h200_edge/run2``): the output alone, laid out as (batch, tokens, heads, head_dim) and returned as a (batch,
    heads, tokens, head_dim) view, so that the caller's ``transpose(1, 2).contiguous()`` copies nothing; no
    log-sum-exp of 1 MiB or more."""
    import torch
    from torch.overrides import TorchFunctionMode

    class FusedSdpa(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is not torch.nn.functional.scaled_dot_product_attention:
                return func(*args, **kwargs)
            q, v = args[0], args[2] if len(args) > 2 else kwargs["value"]
            if q.dim() != 4:
                return torch.empty((*q.shape[:-1], v.shape[-1]), dtype=q.dtype, device=q.device)
            b, h, t, _ = q.shape
            return torch.empty((b, t, h, v.shape[-1]), dtype=q.dtype, device=q.device).transpose(1, 2)

    return FusedSdpa()


@contextlib.contextmanager
def _bnb_kernels(model, quantized: set[str], s: Settings):
    """While a converted layer runs, the tensors its bitsandbytes kernel allocates, in the order the caching
    allocator's trace of bitsandbytes 0.50 under torch 2.11 on an H200 records them (``benchmarks/results/h200_edge/
    run2``): for more than :data:`~vramguard.memory.forward.BNB_4BIT_FUSED_MAX_ROWS` rows (``dequantize_4bit``, then
    ``linear``), with double quant two float32 copies of the absmax (``ceil(numel / 64) x 4`` B each), then the
    weight in the compute dtype, all held until the layer's output is allocated and freed in that order; for up to
    that many rows (the fused kernel) nothing of 1 MiB or more; int8 holds its int8 input and int32 product (as
    :func:`vramguard.memory.forward._Forward.linear`).
    """
    import torch

    from vramguard.introspect.replay import _features, hold_while_running
    if not quantized or not s.is_bnb:
        yield
        return
    act, comp = DTYPE_BYTES[s.act_dtype], DTYPE_BYTES[s.resolved_compute_dtype]

    def empty(nbytes: int):
        return torch.empty(nbytes, dtype=torch.uint8, device="meta")

    def pre(module, args):
        x = args[0]
        rows = x.numel() // x.shape[-1]
        fin, fout = _features(module)
        if s.quant == "int8":
            return empty(rows * fin + rows * fout * 4)
        cast = [empty(rows * fin * comp)] if comp != act else []
        if rows <= BNB_4BIT_FUSED_MAX_ROWS:
            return cast
        absmax = [empty(-(-fin * fout // 64) * 4) for _ in range(2)] if s.double_quant else []
        weight = empty(fin * fout * comp)
        return (cast, weight, *absmax[::-1])  # a tuple drops its items last first: absmax, absmax, weight

    with hold_while_running(model, quantized, pre):
        yield


EDGE_MARGIN_NUM, EDGE_MARGIN_DEN = 1, 100  # of the memory above the loaded model: what the edge keeps free


def allowed_bytes(cap_bytes: int, base_reserved_bytes: int) -> int:
    """What the plan lets the allocator model reserve under a cap of ``cap_bytes`` on PyTorch's reserved memory:
    the cap less 1/100 of the room above the loaded model (``base_reserved_bytes``), the largest shortfall of the
    modelled reserved memory at a measured edge (benchmarks/README.md). Example: a 24 GiB cap (25,769,803,776 B)
    above 5,754,585,088 B of weights keeps (25,769,803,776 - 5,754,585,088) // 100 = 200,152,186 B free."""
    return cap_bytes - max(0, cap_bytes - base_reserved_bytes) * EDGE_MARGIN_NUM // EDGE_MARGIN_DEN


def offload_to_fit_bytes(need_bytes: int, usable_bytes: int, kept_free_bytes: int) -> int:
    """The bytes of weights a run that needs ``need_bytes`` on a card of ``usable_bytes`` must leave for CPU RAM
    to fit under :func:`allowed_bytes`' cap, which keeps ``kept_free_bytes`` free now (0 where it fits already).
    A weight that leaves lowers the need by its bytes and the loaded model by as much, so the room kept free grows
    by 1/100 of it: ``x >= (need - usable + kept_free) * 100 / 99``, plus 1 B for the floor of the kept room.
    Example: 8,583,643,136 B on an 8 GiB card (8,589,934,592 B) keeping 19,587,399 B free: the excess
    13,295,943 B * 100 / 99 = 13,430,246 B (rounded up) + 1 = 13,430,247 B."""
    excess = need_bytes - usable_bytes + kept_free_bytes
    if excess <= 0:
        return 0
    keep = EDGE_MARGIN_DEN - EDGE_MARGIN_NUM
    return -(-excess * EDGE_MARGIN_DEN // keep) + 1
