"""``plan``: the estimate of a run, a verdict per card, the findings and the ranked changes.

No CUDA call. Where each figure comes from (a hand-written family's arithmetic, transformers on the meta device, a
pre-quantized checkpoint's headers; the reserve formula or the caching-allocator replay) is decided once, by
:func:`vramguard.plan.choice.choose`; the estimate is :mod:`vramguard.plan.estimator`, the solvers
:mod:`vramguard.plan.solve`, the findings :mod:`vramguard.plan.findings`.
"""

from __future__ import annotations

from vramguard import diskcache as cache
from vramguard.allocconf import env_alloc_conf
from vramguard.catalog.gpus import GpuSpec
from vramguard.errors import InvalidValue, NotPlannable
from vramguard.finding import Finding
from vramguard.hardware import require_card_name, require_gpu_specs, resolve_gpus
from vramguard.hub import for_cards
from vramguard.hub.prequant import prequant_findings
from vramguard.introspect.alloc_replay import offload_to_fit_bytes
from vramguard.memory.model import MemoryModel
from vramguard.plan import verified
from vramguard.plan.allocator import (Ahead, decode_replay_finding, freed_before_finding, process_freed_memory,
                                      replays_ahead, reserve_formula_finding, side_by_side, with_allocator)
from vramguard.plan.choice import AUTO, Choice, choose
from vramguard.plan.estimator import CardVerdict, MemoryEstimate, Plan, estimate, verdict
from vramguard.plan.findings import plan_findings
from vramguard.plan.kernels import choose_path, kernel_finding
from vramguard.plan.limits import CONTEXT_NOTE, check_context
from vramguard.plan.solve import offload_change, ranked_changes, solve_card
from vramguard.resolve import resolve_model
from vramguard.settings import MAX_TOKENS, Settings, require_bool, require_settings
from vramguard.spec import ModelSpec

__all__ = ["AUTO", "plan", "with_context"]


def plan(model: str | ModelSpec, settings: Settings | None = None, *, gpu: str | None = None,
         vram: str | None = None, gpus: list[GpuSpec] | None = None, solve: bool = True,
         context: int | None = None, alloc_conf: str | None = AUTO, freed_before: bool | None = None) -> Plan:
    """Plan the memory of running ``model`` with ``settings`` on a GPU.

    Args:
        model: a ModelSpec, or anything :func:`vramguard.resolve.resolve_model` accepts.
        settings: the run's settings (default: :class:`Settings` defaults).
        gpu / vram / gpus: the card(s): a catalog name, a size such as ``"24GiB"``, or explicit GpuSpecs;
            none of them: the detected GPU, else 8, 12, 16 and 24 GiB cards.
        solve: also find the largest prompt, new tokens and batch per card, and rank the changes.
        context: the context length to allow, replacing ``max_position_embeddings`` (a RoPE-scaled model run
            beyond its config, e.g. Qwen2-7B with YaRN at 131,072 tokens).
        alloc_conf: ``PYTORCH_CUDA_ALLOC_CONF`` text (``""``: the default allocator,
            ``"expandable_segments:True"``): reserved memory, the fit and the largest prompt of each card come from
            the caching-allocator model (:mod:`vramguard.introspect.alloc_replay`, needs torch and transformers)
            instead of the reserve formula of :mod:`vramguard.memory.runtime`. None: the formula. ``"auto"`` (the
            default): the allocator model under the ``PYTORCH_CUDA_ALLOC_CONF`` of this process's environment
            where it can run (torch and transformers installed, a config, settings its tape covers), else the
            formula with an ``info`` finding ``reserve_formula`` that says why.
        freed_before: a process that has given a model's memory back to CUDA (a model deleted, then
            ``torch.cuda.empty_cache()``): both segment layouts cudaMalloc gives there are replayed, each card judged
            on the worse (finding ``freed_before``). None: this process's own state
            (:func:`vramguard.plan.allocator.process_freed_memory`).

    Raises:
        UnknownModel, ConfigError: the model cannot be read. UnknownGpu, InvalidValue: bad card or size.
        InvalidValue: ``prompt + new tokens`` beyond the model's context; an ``alloc_conf`` that is not allocator
            options; a ``freed_before`` that is not a bool or None; an argument of another type than the one named
            here (:func:`_check_arguments`).
    """

    _check_arguments(settings, gpu, vram, gpus, solve, alloc_conf)
    spec = model if isinstance(model, ModelSpec) else resolve_model(model)
    s = settings or Settings()
    if context is not None:
        spec = with_context(spec, context)
    if s.total_tokens > spec.max_position_embeddings:
        check_context(spec, s, beyond=None if choose(spec).model.learned_positions() else
                      " (a RoPE-scaled model may allow more: plan with context=N)")
    if gpus is None:
        gpus, why = resolve_gpus(gpu, vram)
    else:
        why = "given"
    spec = for_cards(spec, gpus)  # the card decides how a pre-quantized checkpoint loads
    path = _cache_entry(spec, s, gpus, why, solve, alloc_conf, freed_before)
    found = cache.read(path)
    if isinstance(found, Plan):
        return found
    _check_freed_before(freed_before)
    p = _compute(choose(spec, s, alloc_conf), s, gpus, why, solve, freed_before)
    cache.write(path, p)
    return p


def _kv_growth_at(model: MemoryModel, s: Settings) -> dict[int, dict[str, int]]:
    """The KV growth per new token by layer kind where a plan's output reports it: once the prompt is held (JSON)
    and at the run's last token (the table line of a model that reports it per layer kind)."""
    return {n: model.kv_growth_per_token(s, n) for n in sorted({s.prompt_tokens, max(s.total_tokens - 1, 0)})}


def _cache_entry(spec: ModelSpec, s: Settings, gpus: list[GpuSpec], why: str, solve: bool, alloc_conf: str | None,
                 freed_before: bool | None):
    """The plan cache's file for these inputs (:mod:`vramguard.diskcache`): the spec with its config text and
    checkpoint headers, the settings, the cards, the allocator settings (this process's ``PYTORCH_CUDA_ALLOC_CONF``
    where ``alloc_conf`` is ``"auto"``) and whether this process freed memory before; None when the cache is off or
    ``freed_before`` is not a bool or None (the plan refuses it)."""
    if freed_before is not None and not isinstance(freed_before, bool):
        return None
    freed = process_freed_memory() if freed_before is None else freed_before
    env = env_alloc_conf() if alloc_conf == AUTO else None
    return cache.entry_key("plan", spec, spec.config_json, spec.checkpoint, s, gpus, why, solve, alloc_conf, env,
                           freed)


def _compute(choice: Choice, s: Settings, gpus: list[GpuSpec], why: str, solve: bool,
             freed_before: bool | None) -> Plan:
    """:func:`plan` for a resolved spec and cards, computed with the memory model and reserve ``choice`` gives, on
    the kernel path of :func:`vramguard.plan.kernels.choose_path` (both paths where it cannot be known, the larger
    kept), which it names."""
    from dataclasses import replace

    def compute(ps: Settings) -> Plan:
        return _compute_path(choice, ps, gpus, why, solve, freed_before)

    def estimates(fast: Settings, torch: Settings) -> tuple:  # side by side where a forked child pays
        return side_by_side(lambda: _estimated(choice, fast, gpus, solve, freed_before),
                            lambda: _estimated(choice, torch, gpus, solve, freed_before))
    p, path = choose_path(choice.model, s, gpus, why, compute, estimates)
    if path is None:
        if s.kernels is not None:  # said, not dropped silently
            p.findings.append(Finding("kernels_ignored", "info", f"kernels='{s.kernels}' changes nothing for "
                                      f"{choice.model.spec.model_type}: its forward has no Mamba scan, causal "
                                      "convolution or gated delta rule (the layers with package kernels)"))
        return p
    p = replace(p, kernel_path=path)
    p.findings.append(kernel_finding(p))
    return p


def _compute_path(choice: Choice, s: Settings, gpus: list[GpuSpec], why: str, solve: bool,
                  freed_before: bool | None) -> Plan:
    """:func:`plan` for a resolved spec, cards and kernel path (``s.kernels``), computed."""
    model = choice.model
    conf = choice.reserve.config if choice.reserve.alloc_conf is not None else None  # None: the reserve formula
    freed = process_freed_memory() if freed_before is None else freed_before
    with replays_ahead(model, s, gpus, conf, solve, freed) as ahead:  # beside the estimate and the searches
        est = estimate(model, s)
        cards = [verdict(est, g) for g in gpus]
        if solve:
            cards = [solve_card(model, s, c) for c in cards]
        changes = ranked_changes(model, s, gpus) if solve else []  # before the replays ahead are waited for
        est, cards, reserved_findings = _reserved(choice, s, est, cards, solve, freed_before, ahead)
    cards, unverified = _mark_unverified(model, s, cards)
    logits_case = ("all positions: a forward over the whole prompt (scoring, output_logits), with a float32 copy"
                   if s.logits == "all" else
                   "last position only: generate() passes logits_to_keep=1 and copies that row to float32")
    p = Plan(model.spec, s, est, cards, why, logits_case, kv_growth_at=_kv_growth_at(model, s),
             layer_kinds=model.layer_kinds())
    p.findings.extend(plan_findings(p, model))
    p.findings.extend(prequant_findings(p))
    p.findings.extend(reserved_findings)
    p.findings.extend(unverified)
    if solve:
        p.changes.extend(_as_the_cards_say(choice, s, cards, changes, freed_before))
    return p


def _estimated(choice: Choice, s: Settings, gpus: list[GpuSpec], solve: bool, freed_before: bool | None):
    """The estimate :func:`_compute_path` gives ``s`` on ``gpus`` (its need and peaks; the same replays), without
    solving the cards: what :func:`~vramguard.plan.kernels.choose_path` compares before it solves one path."""
    est = estimate(choice.model, s)
    est, _, _ = _reserved(choice, s, est, [verdict(est, g) for g in gpus], False, freed_before, rescale=solve)
    return est


def _as_the_cards_say(choice: Choice, s: Settings, cards: list[CardVerdict], changes: list,
                      freed_before: bool | None) -> list:
    """``changes`` measured as the card table measures, where the allocator model judged the cards: against the
    need of the card the changes are solved for (:func:`vramguard.plan.solve.ranked_changes`' target, the largest
    card the run does not fit), not the reserve formula's, and fitting by the card's own rule.

    The shorter prompt is the one the card table gives (the card's largest prompt; the reserve formula of
    :func:`~vramguard.plan.solve.max_prompt_tokens` plans it shorter: two answers to one question otherwise), its
    need that card's plan at it, its saving the target's need less that. The weights left in CPU RAM are what
    the target's need must lose to fit under its cap, which keeps 1/100 of the room above the loaded model free
    (:func:`~vramguard.introspect.alloc_replay.offload_to_fit_bytes`), not just its memory."""
    from dataclasses import replace
    failing = [c for c in cards if not c.fits]
    if not failing or choice.reserve.config is None:
        return changes
    target = max(failing, key=lambda c: c.gpu.total_bytes)
    prompt = target.max_prompt_tokens
    out = []
    for ch in changes:
        if set(ch.settings) == {"prompt_tokens"} and prompt is not None:
            s2 = s.with_(prompt_tokens=prompt)
            est2 = estimate(choice.model, s2)
            _, mine, _ = _reserved(choice, s2, est2, [verdict(est2, target.gpu)], False, freed_before)
            need = mine[0].need_bytes
            if mine[0].fits:
                ch = replace(ch, description=f"shorter prompt: {prompt:,} tokens", settings={"prompt_tokens": prompt},
                             need_bytes=need, saved_bytes=max(0, target.need_bytes - need),
                             fits_on=tuple(c.gpu.name for c in cards if need <= c.usable_bytes))
        elif "cpu_offload_bytes" in ch.settings and target.kept_free_bytes is not None:
            short = offload_to_fit_bytes(target.need_bytes, target.usable_bytes, target.kept_free_bytes)
            if short:  # 0: the need is below the cap (fragmentation): the formula's offload stands
                ch = offload_change(short, target.need_bytes - short, target.gpu.name)
        out.append(ch)
    return out


def _mark_unverified(model: MemoryModel, s: Settings, cards: list[CardVerdict]):
    """(cards, findings): each card's ``unverified`` set where a part of the forward has no GPU measurement
    (:func:`vramguard.plan.verified.unverified`), with a ``warn`` finding ``unverified_path`` that says which;
    unchanged, and no finding, where every part is measured."""
    from dataclasses import replace

    missing = verified.unverified(model, s)
    if not missing:
        return cards, []
    why = verified.describe(missing)
    return [replace(c, unverified=why) for c in cards], [Finding(
        "unverified_path", "warn", why, "measure it before relying on the fit: vramguard profile MODEL with these "
        "settings on the card (or vramguard fit), then plan with the measured peak in mind")]


def with_context(spec: ModelSpec, context: object) -> ModelSpec:
    """``spec`` run at ``context`` tokens (its ``max_position_embeddings`` replaced, with a note). Raises
    InvalidValue for a ``context`` that is not an int from 1 to MAX_TOKENS, or beyond a model's learned position
    embeddings."""
    from dataclasses import replace

    if isinstance(context, bool) or not isinstance(context, int) or not 1 <= context <= MAX_TOKENS:
        raise InvalidValue("context", context, f"a number of tokens from 1 to {MAX_TOKENS:,}",
                           "pass the context length the model runs at, e.g. context=131072")
    if context > spec.max_position_embeddings:
        learned = choose(spec).model.learned_positions()
        if learned:
            raise InvalidValue("context", context, f"at most {learned:,}: the model has {learned:,} learned "
                               "position embeddings, which no scaling extends", f"pass context={learned}")
    return replace(spec, max_position_embeddings=context,
                   notes=spec.notes + (f"{CONTEXT_NOTE} {context:,} tokens (config: "
                                       f"{spec.max_position_embeddings:,})",))


def _check_arguments(settings: object, gpu: object, vram: object, gpus: object, solve: object,
                     alloc_conf: object) -> None:
    """Raise InvalidValue for an argument of :func:`plan` of the wrong type: ``settings`` not a Settings or None,
    ``gpu`` not a card name or None, ``gpus`` not a non-empty list of GpuSpec or given with ``gpu`` / ``vram``,
    ``solve`` not a bool, ``alloc_conf`` not a str or None (``model`` is checked by ``resolve_model``, ``vram``
    by its size parser, ``freed_before`` by :func:`_check_freed_before`)."""
    require_settings(settings)
    require_card_name(gpu)
    if gpus is not None:
        require_gpu_specs(gpus)
        if gpu is not None or vram is not None:
            raise InvalidValue("gpus", gpus, "gpus alone: gpu and vram name the card(s) another way",
                               "pass either gpus or one of gpu / vram")
    require_bool("solve", solve, "pass solve=True to find the largest prompt, new tokens and batch, else False")
    if alloc_conf is not None and not isinstance(alloc_conf, str):
        raise InvalidValue("alloc_conf", alloc_conf, f"PYTORCH_CUDA_ALLOC_CONF options as a str, '{AUTO}' or None, "
                           f"not type {type(alloc_conf).__name__}",
                           "pass e.g. alloc_conf='expandable_segments:True', '' (the default allocator) or None "
                           "(the reserve formula)")


def _check_freed_before(freed_before: object) -> None:
    """Raise InvalidValue for a ``freed_before`` that is not a bool or None."""
    if freed_before is not None and not isinstance(freed_before, bool):
        raise InvalidValue("freed_before", freed_before, "True, False or None (this process's own state)",
                           "pass freed_before=True to plan for a process that has deleted a model and emptied the "
                           "cache")


def _reserved(choice: Choice, s: Settings, est: MemoryEstimate, cards: list[CardVerdict], solve: bool,
              freed_before: bool | None, ahead: Ahead | None = None, rescale: bool | None = None):
    """(est, cards, findings): est and cards with reserved memory from the allocator model where ``choice`` took
    it (:attr:`Choice.reserve`; ``freed_before`` as :func:`plan`, None: this process's state; ``rescale`` as
    :func:`~vramguard.plan.allocator.with_allocator`), with the
    ``reserve_formula``, ``freed_before`` and decode-replay findings where they apply. A replay the default
    (``"auto"``) chose that transformers cannot record falls back to the formula, said; one asked for raises.
    ``ahead``: the estimate's replays, started before (:func:`~vramguard.plan.allocator.replays_ahead`)."""
    freed = process_freed_memory() if freed_before is None else freed_before
    why, reserve = choice.finding, choice.reserve
    if reserve.config is not None and reserve.alloc_conf is not None:  # the allocator model
        try:
            est, cards = with_allocator(choice.model, s, est, cards, reserve.config, reserve.alloc_conf, solve, freed,
                                        ahead, rescale)
        except NotPlannable as e:
            if reserve.asked:
                raise
            why = reserve_formula_finding(f"transformers' forward could not be recorded for it ({e})")
    return est, cards, [f for f in (why, freed_before_finding(est, freed), decode_replay_finding(est))
                        if f is not None]
