"""Planning one process over several GPUs: ``device_map="auto"`` across cards and ``tp_plan="auto"`` per rank.

The split comes from transformers itself on the meta model (:mod:`vramguard.plan.multigpu.devicemap`,
:mod:`vramguard.plan.multigpu.tensorparallel`); each card's need and the verdict from
:mod:`vramguard.plan.multigpu.cards`.
Needs torch, transformers and accelerate; pure otherwise (no CUDA call).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from vramguard.catalog.gpus import GpuSpec
from vramguard.errors import InvalidValue, NotPlannable
from vramguard.extras import needed_by
from vramguard.memory.model import MemoryModel
from vramguard.memory.runtime import CUDA_CONTEXT_BYTES
from vramguard.plan.choice import choose
from vramguard.plan.limits import check_context, largest
from vramguard.plan.multigpu.cards import (CardNeed, MaxMemoryFix, MultiGpuPlan, check_cards, device_map_needs,
                                           tp_needs)
from vramguard.plan.multigpu.devicemap import split_weights
from vramguard.plan.multigpu.tensorparallel import check_tp_heads, check_tp_quant, tp_shards
from vramguard.resolve import resolve_model
from vramguard.settings import Settings
from vramguard.spec import ModelSpec
from vramguard.units import MiB

__all__ = ["CardNeed", "MaxMemoryFix", "MultiGpuPlan", "default_max_memory", "fix_max_memory", "plan_gpus"]

NCCL_NOTE = ("not counted: NCCL's communicator buffers on each rank (allocated outside PyTorch's allocator, "
             "typically a few hundred MiB)")
LOAD_NOTE = "not counted: the load's transients (a weight in 16-bit while bitsandbytes quantizes it)"


def default_max_memory(gpus: list[GpuSpec]) -> tuple[int, ...]:
    """What ``from_pretrained`` takes as each card's ``max_memory`` when none is given: the free memory once the
    CUDA context exists (accelerate's ``get_max_memory`` reads ``torch.cuda.mem_get_info`` after creating it):
    ``total - used by other processes - CUDA context`` bytes."""
    return tuple(max(g.usable_bytes - CUDA_CONTEXT_BYTES, 0) for g in gpus)


def _require_libraries(field: str = "gpus") -> None:
    """Raise NotPlannable naming the missing package (for the option ``field`` that asked for the split): the split
    is transformers' and accelerate's own."""
    for package in needed_by("load"):
        try:
            __import__(package)
        except ImportError as e:
            raise NotPlannable(field, package, f"{', '.join(needed_by('load'))} installed (the split over several "
                               "cards is theirs, computed on the meta device)",
                               f"pip install 'vramguard[gpu]' ({str(e).splitlines()[0][:120]})") from None


def _needs(model: MemoryModel, s: Settings, split, gpus: list[GpuSpec], layout: str) -> tuple[CardNeed, ...]:
    return tp_needs(model, s, split, gpus) if layout == "tp" else device_map_needs(model, s, split, gpus)


def _largest_prompt(model: MemoryModel, s: Settings, split, gpus: list[GpuSpec], layout: str) -> int | None:
    """The largest prompt with which every card fits (``s.max_new_tokens`` new tokens), or None."""

    def worst(p: int) -> int:
        return max(c.need_bytes - c.usable_bytes for c in _needs(model, replace(s, prompt_tokens=p), split, gpus,
                                                                  layout))
    return largest(1, model.spec.max_position_embeddings - s.max_new_tokens, worst, 0)


def plan_gpus(model: str | ModelSpec | MemoryModel, settings: Settings | None = None, *, gpus: list[GpuSpec],
              tp: int | None = None,
              max_memory: list[int] | tuple[int, ...] | None = None, device_map: str = "auto",
              solve: bool = True) -> MultiGpuPlan:
    """Plan ``model`` run by one process over ``gpus`` together.

    Args:
        model: a MemoryModel (:func:`vramguard.plan.choice.choose`), a ModelSpec, or anything
            :func:`vramguard.resolve.resolve_model` accepts.
        settings: the run's settings (default :class:`Settings`).
        gpus: the cards, in device order (2 or more; they may differ).
        tp: tensor parallelism over the cards (``tp_plan="auto"``, one rank per card); None: ``device_map="auto"``.
        max_memory: bytes per card handed to ``from_pretrained(max_memory=...)``; default
            :func:`default_max_memory`.
        device_map: ``auto`` (balanced over the cards, transformers' default) or ``sequential`` (each card filled
            in turn).
        solve: also find the largest prompt every card fits, and, when a card does not fit while others have room,
            a ``max_memory`` under which every card fits (:func:`fix_max_memory`).

    Returns:
        A :class:`MultiGpuPlan`: per card weights, KV cache, activations, reserve, workspace, CUDA context, need and
        headroom; the limiting card; the largest prompt.

    Raises:
        InvalidValue: fewer than 2 cards, ``tp`` not the number of cards or not dividing the KV heads,
            ``max_memory`` not one positive size per card, or bitsandbytes weights with ``tp``.
        NotPlannable: no tensor-parallel plan for the architecture.
        UnknownModel, ConfigError: the model cannot be read.
    """
    if not isinstance(model, MemoryModel):
        model = choose(model if isinstance(model, ModelSpec) else resolve_model(model)).model
    spec = model.spec
    check_tp_heads(model, tp)
    check_tp_quant(settings or Settings(), tp)
    if tp is not None or model.needs_transformers:  # a hand family's device_map split also runs without them
        _require_libraries("tp" if tp is not None else "gpus")
    s = settings or Settings()
    check_context(spec, s)
    check_cards(gpus, tp)
    notes = []
    split: Any  # the tensor-parallel shards, or the device_map split
    if tp is not None:
        split, layout = tp_shards(spec, s, tp), "tp"
        notes.append(NCCL_NOTE)
        if model.needs_transformers:
            notes.append("activations of this architecture are kept whole on every rank (an upper bound); its KV "
                         "cache is divided by tp")
    else:
        mm = tuple(max_memory) if max_memory is not None else default_max_memory(gpus)
        if len(mm) != len(gpus) or any(isinstance(b, bool) or not isinstance(b, int) or b <= 0 for b in mm):
            raise InvalidValue("max_memory", list(mm), f"one positive size in bytes per card ({len(gpus)})",
                               "give as many sizes as cards")
        if device_map not in ("auto", "sequential"):
            raise InvalidValue("device_map", device_map, "auto or sequential",
                               "pass device_map='auto' (balanced) or 'sequential'")
        split, layout = split_weights(model, s, mm, device_map), "device_map"
        if split.offloaded:
            notes.append(f"{len(split.offloaded)} module(s) do not fit the cards' max_memory and go to CPU RAM "
                         f"({sum(split.offloaded.values()):,} B): device_map='{device_map}' runs them from the CPU, "
                         "slowly"
                         + ("; transformers refuses to load bitsandbytes weights so placed unless "
                            "BitsAndBytesConfig(llm_int8_enable_fp32_cpu_offload=True), and those modules then run "
                            "unquantized in float32 on the CPU" if s.is_bnb else ""))
        if s.is_bnb:
            notes.append(LOAD_NOTE)
    cards = _needs(model, s, split, gpus, layout)
    used = [c for c in cards if c.need_bytes] or list(cards)
    limit = min(used, key=lambda c: c.headroom_bytes).card  # of the cards in use: the least headroom
    best = _largest_prompt(model, s, split, gpus, layout) if solve else None
    offloaded = sum(split.offloaded.values()) if layout == "device_map" else 0
    fits = all(c.fits for c in cards) and not offloaded
    fix = fix_max_memory(model, s, gpus, cards) if solve and layout == "device_map" and not fits else None
    return MultiGpuPlan(spec, s, layout, cards, limit, best, split, notes, offloaded, device_map, fix)


FIX_ROUNDS = 8


def fix_max_memory(model: MemoryModel, s: Settings, gpus: list[GpuSpec], cards) -> MaxMemoryFix | None:
    """A ``device_map="sequential"`` ``max_memory`` under which every card fits, or None.

    Each card starts with room for weights of ``usable - (need - weights)`` (what its runtime leaves), whole MiB;
    transformers' split is taken with it, and a card still short loses that much room, up to :data:`FIX_ROUNDS`
    times (the layers it gives up move to the next card, with their KV cache). ``auto`` cannot do this: it caps
    every card but the last at half the model, whatever their sizes.
    """
    if sum(c.usable_bytes for c in cards) < sum(c.need_bytes for c in cards):
        return None
    room = [max(c.usable_bytes - (c.need_bytes - c.weights_bytes), 0) // MiB * MiB for c in cards]
    for _ in range(FIX_ROUNDS):
        if not all(room):
            return None
        split = split_weights(model, s, tuple(room), "sequential")
        needs = device_map_needs(model, s, split, gpus)
        if all(c.fits for c in needs) and not split.offloaded:
            return MaxMemoryFix("sequential", tuple(room), split.layers, needs)
        room = [r - (-(-(-c.headroom_bytes) // MiB) * MiB if not c.fits else 0) for r, c in zip(room, needs)]
    return None
