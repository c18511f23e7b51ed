"""The memory estimate of a transformers inference run, by component, before anything is loaded.

No CUDA call: every figure comes from the :class:`~vramguard.memory.model.MemoryModel` it is given (pure
arithmetic for a hand-written family; transformers on the meta device for any other architecture and for a load,
as :func:`vramguard.plan.choice.choose` picked). The GPU to plan against comes from :mod:`vramguard.hardware`.

What is predicted (all ints of bytes):

* ``peak_allocated_bytes``: ``torch.cuda.max_memory_allocated()`` over the whole ``generate`` call, weights
  included: ``weights + cuBLAS workspace + max(prefill peak, decode peak)``.
* ``peak_reserved_bytes``: the caching allocator's reserved peak (``allocated + reserve``).
* ``device_used_bytes``: what ``nvidia-smi`` shows for this process at the peak (``reserved + CUDA context``), of
  ``generate`` or of the load, whichever is larger: a load holds transients beside the weights (a weight in 16-bit
  while bitsandbytes quantizes it; MoE experts fused from per-expert checkpoint tensors): the model's
  :meth:`~vramguard.memory.model.MemoryModel.load_plan` (None: not planned).

A card fits when ``device_used_bytes <= total - memory used by other processes``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vramguard.catalog.gpus import GpuSpec
from vramguard.finding import Finding
from vramguard.memory.forward import ForwardPeak
from vramguard.memory.kv import KvBytes
from vramguard.memory.weights import WeightBytes
from vramguard.memory.model import LoadPlan, MemoryModel
from vramguard.memory.runtime import CUBLAS_WORKSPACE_BYTES, CUDA_CONTEXT_BYTES, allocator_reserve_bytes
from vramguard.plan.kernels import KernelChoice
from vramguard.settings import Settings
from vramguard.spec import ModelSpec
from vramguard.units import fmt_bytes, fmt_gib

COMPONENT_ORDER = ("weights", "quant_state", "kv_cache", "attention", "activations", "dequant", "logits",
                   "cublas_workspace")


@dataclass(frozen=True)
class CardVerdict:
    """Whether the run fits one card: ``headroom_bytes = usable_bytes - need_bytes`` (negative: short by; 0 or more
    with ``fits`` False where the need is within the memory and another rule says no, ``misfit_reason``).

    ``misfit_reason``: None where it fits, else why not (:func:`misfit_reason`): ``memory`` (the need is above
    the card's memory), ``kept_free`` (the need is within it, but reaches into the room the allocator model's fit
    keeps free, ``kept_free_bytes``) or ``fragmentation`` (the need is below even that, but the allocator model's
    segments do not hold the run under the card's cap). ``kept_free_bytes``: what the allocator model keeps free
    on this card (1/100 of the room above the loaded model, :func:`vramguard.introspect.alloc_replay.allowed_bytes`);
    None under the reserve formula, which keeps none.
    """

    gpu: GpuSpec
    usable_bytes: int
    need_bytes: int
    fits: bool
    headroom_bytes: int
    max_prompt_tokens: int | None = None
    max_new_tokens: int | None = None
    max_batch: int | None = None
    unverified: str | None = None  # why ``fits`` rests on a replay no GPU measurement covers (plan.verified)
    misfit_reason: str | None = None
    kept_free_bytes: int | None = None


@dataclass(frozen=True)
class MemoryEstimate:
    """The memory model's prediction for one (model, settings), independent of any card."""

    weights: WeightBytes
    kv_full: KvBytes
    prefill: ForwardPeak
    decode: ForwardPeak | None
    peak_phase: str
    components: dict[str, int]
    peak_allocated_bytes: int
    allocator_reserve_bytes: int
    peak_reserved_bytes: int
    cuda_context_bytes: int
    device_used_bytes: int
    kv_bytes_per_token: int
    load: LoadPlan | None = None  # None: the model plans no load (no transformers, a pre-quantized checkpoint)
    generate_device_bytes: int = 0  # device_used_bytes of generate alone (device_used_bytes is the larger of the
    # load and generate needs)
    allocator: object | None = None  # vramguard.introspect.alloc_replay.AllocatorReplay when reserved memory is
    # the caching-allocator model's, None where it is the formula of vramguard.memory.runtime
    alloc_conf: str | None = None  # the PYTORCH_CUDA_ALLOC_CONF the allocator model followed
    freed_layout_reserved_bytes: int | None = None  # planned for a process that freed memory before: the peak
    # reserved with new segments above the older ones, and below them as in a fresh process (peak_reserved_bytes
    # is the larger of the two)
    fresh_layout_reserved_bytes: int | None = None


def _peak(model: MemoryModel, s: Settings) -> tuple[WeightBytes, ForwardPeak, ForwardPeak | None, ForwardPeak,
                                                    dict[str, int], int, int]:
    """(weights, prefill, decode, the larger of the two, components at the peak, allocated, reserve)."""
    w = model.weight_bytes(s)
    pf = model.prefill_peak(s)
    dc = model.decode_peak(s)
    peak = pf if dc is None or pf.peak_bytes >= dc.peak_bytes else dc
    comps = {"weights": w.total_bytes - w.quant_state_bytes, "quant_state": w.quant_state_bytes,
             "cublas_workspace": CUBLAS_WORKSPACE_BYTES}
    for k, v in peak.components.items():
        comps[k] = comps.get(k, 0) + v
    allocated = sum(comps.values())
    # a static cache is allocated once, before anything else, and never re-requested: it does not fragment
    static_kv = peak.components.get("kv_cache", 0) if s.cache == "static" else 0
    reserve = allocator_reserve_bytes(peak.peak_bytes - static_kv, peak.largest_alloc)
    return w, pf, dc, peak, comps, allocated, reserve


def need_bytes(model: MemoryModel, s: Settings) -> int:
    """``estimate(model, s).device_used_bytes`` without the parts of the estimate the need does not use (the KV
    cache at the end of the run and its growth per token): what the solvers evaluate many times."""
    *_, allocated, reserve = _peak(model, s)
    load = model.load_plan(s)
    return max(allocated + reserve, load.peak_reserved_bytes if load else 0) + CUDA_CONTEXT_BYTES


def estimate(model: MemoryModel, s: Settings) -> MemoryEstimate:
    """Predict the memory of ``generate`` for ``model`` (:func:`vramguard.plan.choice.choose`) with settings ``s``
    (see the module docstring)."""
    w, pf, dc, peak, comps, allocated, reserve = _peak(model, s)
    kv_full = model.kv_cache_bytes(s, s.total_tokens)
    load = model.load_plan(s)
    run_need = allocated + reserve + CUDA_CONTEXT_BYTES
    load_need = load.peak_reserved_bytes + CUDA_CONTEXT_BYTES if load else 0
    return MemoryEstimate(
        weights=w, kv_full=kv_full, prefill=pf, decode=dc,
        peak_phase="load" if load_need > run_need else peak.phase,
        components={k: comps[k] for k in COMPONENT_ORDER if comps.get(k)} | {k: v for k, v in comps.items()
                                                                           if k not in COMPONENT_ORDER and v},
        peak_allocated_bytes=allocated, allocator_reserve_bytes=reserve, peak_reserved_bytes=allocated + reserve,
        cuda_context_bytes=CUDA_CONTEXT_BYTES, device_used_bytes=max(run_need, load_need),
        kv_bytes_per_token=model.kv_bytes_per_token(s), load=load, generate_device_bytes=run_need)


MISFIT_REASONS = ("memory", "kept_free", "fragmentation")


def misfit_reason(fits: bool, need_bytes: int, usable_bytes: int, kept_free_bytes: int | None) -> str | None:
    """Why a run does not fit a card (None where it ``fits``), one of :data:`MISFIT_REASONS`: ``memory`` where
    ``need_bytes`` is above ``usable_bytes``; else ``kept_free`` where it is above ``usable_bytes -
    kept_free_bytes`` (the peak reaches into the room the fit keeps free); else ``fragmentation``. Example: an
    8 GiB card (8,589,934,592 B) that keeps 19,587,399 B free and a need of 8,583,643,136 B: that is at most
    8,589,934,592 but above 8,589,934,592 - 19,587,399 = 8,570,347,193, so ``kept_free``."""
    if fits:
        return None
    if need_bytes > usable_bytes:
        return "memory"
    return "kept_free" if need_bytes > usable_bytes - (kept_free_bytes or 0) else "fragmentation"


def misfit_text(v: CardVerdict) -> str:
    """Why the run does not fit ``v``'s card, in words ("" where it fits): the need against the memory, and for a
    need within the memory the rule that still says no."""
    need, usable = fmt_gib(v.need_bytes), fmt_gib(v.usable_bytes)
    if v.misfit_reason is None:
        return ""
    if v.misfit_reason == "memory":
        return f"needs {need} of {usable}: short by {fmt_bytes(v.need_bytes - v.usable_bytes)}"
    kept = fmt_bytes(v.kept_free_bytes or 0)
    if v.misfit_reason == "kept_free":
        return (f"needs {need} of {usable}, but the fit keeps 1/100 of the room above the loaded model free ({kept}, "
                "the allocator model's largest shortfall at a measured edge) and the peak reaches into it")
    return (f"needs {need} of {usable}, but the allocator model's segments do not hold the run under the card's "
            f"cap ({kept} kept free): fragmentation under the cap")


def verdict(est: MemoryEstimate, gpu: GpuSpec) -> CardVerdict:
    """Fit of an estimate on one card (no solving)."""
    usable = gpu.usable_bytes
    need = est.device_used_bytes
    return CardVerdict(gpu, usable, need, need <= usable, usable - need,
                       misfit_reason=misfit_reason(need <= usable, need, usable, None))


@dataclass(frozen=True)
class Change:
    """A change of settings that lowers the memory need by ``saved_bytes``.

    ``reduces_request``: the change gives up part of what was asked (a shorter prompt or generation, a smaller
    batch, fewer beams); such changes rank after those that keep the request whole.
    """

    description: str
    settings: dict
    need_bytes: int
    saved_bytes: int
    fits_on: tuple[str, ...]
    reduces_request: bool = False


@dataclass(frozen=True)
class Plan:
    """The result of :func:`plan`: the estimate, a verdict per card, findings and ranked changes."""

    model: ModelSpec
    settings: Settings
    estimate: MemoryEstimate
    cards: list[CardVerdict]
    cards_reason: str
    logits_case: str
    findings: list[Finding] = field(default_factory=list)
    changes: list[Change] = field(default_factory=list)
    kv_growth_at: dict[int, dict[str, int]] = field(default_factory=dict)  # tokens held -> bytes the next token
    # adds per layer kind (MemoryModel.kv_growth_per_token), at the prompt and the run's last token: transformers'
    # is a replay of its cache, kept with the plan so that printing it replays nothing
    layer_kinds: tuple[str, ...] = ()  # MemoryModel.layer_kinds: the config's names where the growth is reported
    # per layer kind (transformers' model); () for a hand family (full and sliding layers)
    kernel_path: KernelChoice | None = None  # the path replayed for kernel-backed mixers (None: the model has none)

    @property
    def fits(self) -> bool:
        return all(c.fits for c in self.cards)
