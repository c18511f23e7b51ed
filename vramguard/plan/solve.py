"""Solving: the largest prompt, new tokens and batch that fit a card, and the changes that would make a run fit.

Every memory need is monotone in prompt tokens, new tokens and batch, so each maximum is the exact boundary of the
integer model (:func:`vramguard.plan.need_bytes`): ``need(v) <= usable < need(v + 1)``, never an extrapolation. The
search interpolates between the bracket's ends (the need is nearly linear in each variable) and bisects whenever
interpolation stops halving the bracket, so a boundary costs a few evaluations, which matters when each one is a
replay of transformers' forward (:class:`~vramguard.introspect.model.TransformersModel`).
"""

from __future__ import annotations

from dataclasses import replace

from vramguard.catalog.gpus import GPUS, GpuSpec
from vramguard.errors import VramguardError
from vramguard.memory.model import MemoryModel
from vramguard.plan.estimator import CardVerdict, Change, estimate, need_bytes
from vramguard.plan.limits import known_needs as known_store, largest as _largest
from vramguard.settings import Settings
from vramguard.units import fmt_bytes

MAX_BATCH_SEARCH = 1 << 16
# lossy: on SmolLM2-135M's real text an int4 cache (HQQ) changed 27% of the top-1 tokens, +38% perplexity (int8:
# 3.5%, +0.3%; benchmarks/results/h200_final_1202/quality_kv_int4.md)
INT4_KV_CHANGE = "KV cache: int4 quantized cache (lossy: +38% perplexity measured on SmolLM2-135M)"
MIN_USEFUL_TOKENS = 64  # a shorter prompt or generation below this is no answer to "what fits"


_need = need_bytes  # the need the searches evaluate (tests replace it)


def known_needs(model: MemoryModel, s: Settings, var: str) -> dict[int, int]:
    """The needs evaluated so far in this process for ``model`` with ``s`` and other values of ``var``
    (``prompt_tokens``, ``max_new_tokens``, ``batch``), shared by the searches of every card
    (:func:`vramguard.plan.limits.known_needs`)."""
    return known_store(model, _with(s, **{var: 1}), var, _need)


def _linear_guess(x0: int, f0: int, x1: int, f1: int, usable: int, hi: int) -> int:
    """Where the line through ``(x0, f0)`` and ``(x1, f1)`` crosses ``usable``, plus one, within ``[x1, hi]``
    (``hi`` for a line that does not rise)."""
    if f1 <= f0:
        return hi
    return min(max(x1 + (usable - f1) * (x1 - x0) // (f1 - f0) + 1, x1), hi)


def max_prompt_tokens(model: MemoryModel, s: Settings, usable_bytes: int) -> int | None:
    """Largest prompt (tokens) that fits ``usable_bytes`` with ``s.max_new_tokens`` new tokens, or None."""
    hi = model.spec.max_position_embeddings - s.max_new_tokens
    return _largest(1, hi, lambda p: _need(model, _with(s, prompt_tokens=p)), usable_bytes,
                    known_needs(model, s, "prompt_tokens"))


def max_new_tokens(model: MemoryModel, s: Settings, usable_bytes: int) -> int | None:
    """Largest number of new tokens that fits with ``s.prompt_tokens``, or None when the prompt alone does not."""
    hi = model.spec.max_position_embeddings - s.prompt_tokens
    return _largest(0, hi, lambda n: _need(model, _with(s, max_new_tokens=n)), usable_bytes,
                    known_needs(model, s, "max_new_tokens"))


def batch_search_cap(s: Settings) -> int:
    """Where the batch search stops: :data:`MAX_BATCH_SEARCH`, or the batch of ``s`` when it is larger (so that a
    batch asked for that fits is found). A result equal to it is a bound: a larger batch may fit too."""
    return max(MAX_BATCH_SEARCH, s.batch)


def max_batch(model: MemoryModel, s: Settings, usable_bytes: int) -> int | None:
    """Largest batch that fits, up to :func:`batch_search_cap` (a bound: a larger one may fit too), or None when
    1 does not. The need is nearly linear in the batch:
    the line through batch 1 and 2 gives the first upper end of the bracket (doubled while it still fits), then
    :func:`_largest` finds the exact boundary inside it."""
    known = known_needs(model, s, "batch")

    def need(b: int) -> int:
        if b not in known:
            known[b] = _need(model, _with(s, batch=b))
        return known[b]
    f1 = need(1)
    if f1 > usable_bytes:
        return None
    f2 = need(2)
    if f2 > usable_bytes:
        return 1
    cap = batch_search_cap(s)
    lo, hi = 2, _linear_guess(1, f1, 2, f2, usable_bytes, cap)
    while hi < cap and need(hi) <= usable_bytes:
        lo, hi = hi, min(hi * 2, cap)
    return _largest(lo, hi, need, usable_bytes, known)


def _with(s: Settings, **changes) -> Settings:
    if s.cache == "static" and s.max_cache_len is not None:
        changes.setdefault("max_cache_len", None)
    return replace(s, **changes)


def solve_card(model: MemoryModel, s: Settings, v: CardVerdict) -> CardVerdict:
    """``v`` with the largest prompt, new tokens and batch for its card filled in."""
    u = v.usable_bytes
    return replace(v, max_prompt_tokens=max_prompt_tokens(model, s, u), max_new_tokens=max_new_tokens(model, s, u),
                   max_batch=max_batch(model, s, u))


def _candidates(model: MemoryModel, s: Settings, target: GpuSpec | None) -> list[tuple[str, dict]]:
    c: list[tuple[str, dict]] = []
    if s.output_attentions:
        c.append(("stop requesting attention maps (output_attentions=False)", {"output_attentions": False}))
    if (s.effective_attn == "eager" and not s.output_attentions) or s.sdpa_kernel == "math":
        c.append(("attention: sdpa with a flash-class kernel instead of eager/math",
                  {"attn": "sdpa", "sdpa_kernel": "auto", "output_attentions": False}))
    if s.quant in ("fp32", "fp16", "bf16", "int8", "fp4") or not s.double_quant:
        c.append(("weights: NF4 with double quant (bitsandbytes 4-bit)", {"quant": "nf4", "double_quant": True}))
    if s.act_dtype == "fp32":
        c.append(("dtype: bfloat16 instead of float32 (fp16 below compute capability 8.0)",
                  {"quant": "bf16", "dtype": None} if s.quant == "fp32" else {"dtype": "bf16"}))
    if s.resolved_compute_dtype != s.act_dtype and s.is_4bit:
        c.append((f"4-bit compute dtype: {s.act_dtype} (same as the activations)", {"compute_dtype": None}))
    if s.resolved_kv_dtype in ("bf16", "fp16", "fp32"):
        c.append(("KV cache: int8 quantized cache", {"kv_dtype": "int8"}))
        c.append((INT4_KV_CHANGE, {"kv_dtype": "int4"}))
    elif s.resolved_kv_dtype == "int8":
        c.append((INT4_KV_CHANGE, {"kv_dtype": "int4"}))
    if s.cache != "offloaded":
        kv = estimate(model, s).kv_full
        c.append((f"KV cache offloaded to CPU RAM (OffloadedCache: up to {fmt_bytes(kv.gpu_bytes + kv.cpu_bytes)} "
                  "of CPU RAM)", {"cache": "offloaded"}))
    for chunk in (2048, 512):
        if s.logits == "all" or s.output_attentions:
            break  # every position's logits or maps are kept anyway: chunking would not lower the peak
        if s.prompt_tokens > chunk and (s.prefill_chunk is None or s.prefill_chunk > chunk):
            c.append((f"chunked prefill of {chunk} tokens", {"prefill_chunk": chunk}))
    if s.logits == "all":
        c.append(("logits for the last position only", {"logits": "last"}))
    if target is not None:
        u = target.usable_bytes
        n = max_new_tokens(model, s, u)
        if n is not None and MIN_USEFUL_TOKENS <= n < s.max_new_tokens:
            c.append((f"shorter generation: {n:,} new tokens", {"max_new_tokens": n}))
        p = max_prompt_tokens(model, s, u)
        if p is not None and MIN_USEFUL_TOKENS <= p < s.prompt_tokens:
            c.append((f"shorter prompt: {p:,} tokens", {"prompt_tokens": p}))
        b = max_batch(model, s, u)
        if b is not None and b < s.batch:
            c.append((f"smaller batch: {b}", {"batch": b}))
    if s.num_beams > 1 or s.num_return_sequences > 1:
        c.append(("one sequence per prompt (num_beams=1, num_return_sequences=1)",
                  {"num_beams": 1, "num_return_sequences": 1}))
    return c


def ranked_changes(model: MemoryModel, s: Settings, gpus: list[GpuSpec]) -> list[Change]:
    """Changes that lower the memory need, largest saving first, each with the cards it would fit.

    Changes that keep the request whole (attention, quantization, KV cache type, chunked prefill, offload) rank
    first, by bytes saved; then those that give up part of the request (shorter prompt or generation, smaller
    batch, fewer beams), by bytes saved. The length and batch changes are solved for the largest card the run
    does not fit (the smallest change that makes it fit somewhere); when it fits every card they are omitted.
    When a card is too small, the settings changes that make it fit there come first, then
    :func:`hardware_changes` that fit a card, then the rest in the order above (a change of hardware that fits no
    card among those that keep the request).
    """
    need = _need(model, s)
    usable = {g.name: g.usable_bytes for g in gpus}
    not_fitting = [g for g in gpus if need > usable[g.name]]
    target = max(not_fitting, key=lambda g: g.total_bytes) if not_fitting else None
    out: list[Change] = []
    for desc, ch in _candidates(model, s, target):
        try:
            s2 = _with(s, **ch)
            need2 = _need(model, s2)
        except VramguardError:
            continue
        if need2 < need:
            fits = tuple(g.name for g in gpus if need2 <= usable[g.name])
            reduces = bool({"prompt_tokens", "max_new_tokens", "batch", "num_beams"} & set(ch))
            out.append(Change(desc, ch, need2, need - need2, fits, reduces))
    out.sort(key=lambda c: (c.reduces_request, -c.saved_bytes))
    combined = _combined(model, s, out, usable, need, target)
    if combined:
        out.insert(0, combined)
    if target is None:
        return out
    # what makes the run fit the target as asked: settings that fit it, then other hardware, then the rest
    # (a change of hardware that fits no card, e.g. a second card still too small, goes with the rest by saving)
    hw = hardware_changes(model, s, target, need)
    fit = [c for c in out if target.name in c.fits_on and not c.reduces_request]
    rest = [c for c in out if c not in fit] + [c for c in hw if not c.fits_on]
    rest.sort(key=lambda c: (c.reduces_request, -c.saved_bytes))
    return fit + [c for c in hw if c.fits_on] + rest


HARDWARE_KEYS = ("cpu_offload_bytes", "gpus", "gpu")  # Change.settings keys of changes of hardware, not settings


def hardware_changes(model: MemoryModel, s: Settings, target: GpuSpec, need: int) -> list[Change]:
    """Changes of hardware that make the run fit as asked when ``target`` is too small, each with the bytes it
    needs: weights offloaded to CPU RAM (the shortfall), a second such card (:func:`_second_card`: the two-card
    plan's split, its fuller card's need; left out when it lowers nothing), the smallest catalog card whose
    reported total holds ``need``."""
    usable = target.usable_bytes
    if need <= usable:
        return []
    est = estimate(model, s)
    short = need - usable
    out: list[Change] = []
    if short < est.weights.total_bytes:
        out.append(offload_change(short, usable, target.name))
    second = _second_card(model, s, target, need)
    if second is not None and (second.fits_on or second.saved_bytes > 0):
        out.append(second)  # a second card that takes no layer (one layer above the card) is no change
    bigger = sorted((g for g in GPUS.values() if g.total_bytes >= need), key=lambda g: g.total_bytes)
    if bigger:
        g = bigger[0]
        label = g.label.replace("NVIDIA ", "").replace("GeForce ", "")
        out.append(Change(f"a larger card: {label} ({fmt_bytes(g.total_bytes)} as its driver reports, "
                          f"{fmt_bytes(g.total_bytes - need)} to spare)", {"gpu": g.name}, need, 0, (g.name,)))
    return sorted(out, key=lambda c: (not c.fits_on, c.need_bytes > usable))


def offload_change(short_bytes: int, need_after_bytes: int, card: str) -> Change:
    """The change that leaves ``short_bytes`` of weights for CPU RAM (``device_map='auto'`` with ``max_memory``),
    after which the run needs ``need_after_bytes`` and fits the card named ``card``."""
    return Change(f"weights: {fmt_bytes(short_bytes)} of them in CPU RAM (device_map='auto' with max_memory; "
                  "slower: offloaded layers cross PCIe each forward)",
                  {"device_map": "auto", "cpu_offload_bytes": short_bytes}, need_after_bytes, short_bytes, (card,))


def _second_card(model: MemoryModel, s: Settings, target: GpuSpec, need: int) -> Change | None:
    """A second card like ``target``, planned as the two-card plan plans it (the split of
    :func:`vramguard.plan.multigpu.plan_gpus`, ``device_map='auto'``): the need of its fuller card, and fits only
    when every card fits and no module is left for CPU RAM. None when that split cannot be computed here (a
    package it needs is missing)."""
    from vramguard.plan.multigpu import plan_gpus  # several cards' planner: loaded when one is suggested
    try:
        two = plan_gpus(model, s, gpus=[target, target], solve=False)
    except VramguardError:
        return None
    worst = max(c.need_bytes for c in two.cards)
    name = target.label.replace("NVIDIA ", "").replace("GeForce ", "")
    each = " and ".join(f"{fmt_bytes(c.need_bytes)} on card {c.card}" for c in two.cards)
    left = (f"; {fmt_bytes(two.offloaded_bytes)} of weights still left for CPU RAM" if two.offloaded_bytes else "")
    return Change(f"a second {name}: the layers split over two cards (device_map='auto'), {each}{left}",
                  {"gpus": 2}, worst, need - worst, (target.name,) if two.fits else ())


def _combined(model: MemoryModel, s: Settings, changes: list[Change], usable: dict, need: int,
              target: GpuSpec | None) -> Change | None:
    """When no single change that keeps the request makes the run fit the target card, apply them in order of
    saving, one setting family at a time, until it fits; None when a single change suffices or none helps."""
    if target is None:
        return None
    keep = [c for c in changes if not c.reduces_request]
    if not keep or any(target.name in c.fits_on for c in keep):
        return None
    applied: dict = {}
    names: list[str] = []
    for c in keep:
        if set(c.settings) & set(applied) - {"output_attentions", "sdpa_kernel"}:
            continue  # one value per setting: the larger saving came first
        trial = {**applied, **c.settings}
        try:
            need2 = _need(model, _with(s, **trial))
        except VramguardError:
            continue
        applied, names = trial, names + [c.description]
        if need2 <= usable[target.name]:
            fits = tuple(name for name, u in usable.items() if need2 <= u)
            return Change("together: " + " + ".join(names), applied, need2, need - need2, fits, False)
    return None
