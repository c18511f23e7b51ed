"""The memory each card needs when one process runs a model over several GPUs, and the verdict: the run fits when
every card's need fits that card (the largest need against its own card, never a sum over cards).

Two layouts, as transformers loads them:

* ``device_map="auto"`` or ``"sequential"`` (:mod:`vramguard.plan.multigpu.devicemap`): whole decoder layers on
  each card, run one card after the other. A card holds its weights, the KV cache of its own layers
  (``DynamicCache`` keeps each layer's keys and values on that layer's device), and at its moment of the forward
  the activations of one decoder layer (every card with layers runs the same layer program; the last layer, with
  the longest cache, is the largest).
  The card of ``lm_head`` computes the logits; accelerate's hook on the whole model (``io_same_device``) returns
  them to the input's card, where ``generate`` takes its float32 copy, beside the forward's inputs (embeddings
  output, rotary cos/sin, masks) that card keeps to the end. With every layer on one card this is the single-card
  plan's need (the tests check it).
* ``tp_plan="auto"`` (:mod:`vramguard.plan.multigpu.tensorparallel`): every rank runs every layer on its shard: its
  weights, ``num_key_value_heads / tp`` KV heads per layer, query heads and MLP intermediate divided by ``tp``,
  the residual stream and the norms whole, and the logits gathered whole (``colwise_gather_output``).

Per card: ``weights + cuBLAS workspace + max over prefill and decode of (KV + activations + allocator reserve) +
CUDA context`` (the terms of :mod:`vramguard.memory.runtime`, each card a CUDA context of its own). The activations
of each card are the model's :meth:`~vramguard.memory.model.MemoryModel.forward_parts`: a hand-written family's
replayed layer program (:mod:`vramguard.memory.forward`); another architecture's whole forward as transformers
replays it, kept whole on every card holding layers (an upper bound). Not in
the need: NCCL's communicator buffers under tensor parallelism (allocated outside PyTorch's allocator) and the
load's transients; both are said in :attr:`MultiGpuPlan.notes`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vramguard.catalog.gpus import GpuSpec
from vramguard.errors import InvalidValue
from vramguard.hardware import require_gpu_specs
from vramguard.memory.model import MemoryModel
from vramguard.memory.runtime import CUBLAS_WORKSPACE_BYTES, CUDA_CONTEXT_BYTES, allocator_reserve_bytes
from vramguard.settings import Settings
from vramguard.spec import ModelSpec

MAX_CARDS = 64


@dataclass(frozen=True)
class CardNeed:
    """One card's need at its peak and its fit (bytes; ``headroom_bytes`` negative: short by that much).

    ``holds`` names what besides decoder layers the card keeps (``input embeddings``, ``lm_head``); ``layers``
    the decoder layers (all of them under tensor parallelism); ``phase`` the phase of the card's peak.
    """

    card: int
    gpu: GpuSpec
    weights_bytes: int
    kv_cache_bytes: int
    activation_bytes: int
    reserve_bytes: int
    cublas_workspace_bytes: int
    cuda_context_bytes: int
    need_bytes: int
    usable_bytes: int
    headroom_bytes: int
    fits: bool
    layers: tuple[int, ...]
    holds: tuple[str, ...]
    phase: str


@dataclass(frozen=True)
class MaxMemoryFix:
    """A ``from_pretrained(device_map=..., max_memory=...)`` under which every card fits: ``max_memory_bytes`` per
    card (whole MiB), the layers each card then holds, and each card's need."""

    device_map: str
    max_memory_bytes: tuple[int, ...]
    layers: tuple[tuple[int, ...], ...]
    cards: tuple[CardNeed, ...]


@dataclass(frozen=True)
class MultiGpuPlan:
    """The plan over several cards: ``layout`` is ``device_map`` or ``tp``; ``limit_card`` the card in use with the
    least headroom; ``max_prompt_tokens`` the largest prompt every card fits with the same new tokens (None: none does,
    or not solved); ``split`` the :class:`~vramguard.plan.multigpu.devicemap.DeviceSplit` or
    :class:`~vramguard.plan.multigpu.tensorparallel.TpShards`."""

    model: ModelSpec
    settings: Settings
    layout: str
    cards: tuple[CardNeed, ...]
    limit_card: int
    max_prompt_tokens: int | None
    split: object
    notes: list[str] = field(default_factory=list)
    offloaded_bytes: int = 0
    device_map: str = "auto"
    fix: "MaxMemoryFix | None" = None

    @property
    def fits(self) -> bool:
        """Every card fits its need, and no module is left to the CPU."""
        return all(c.fits for c in self.cards) and not self.offloaded_bytes


def phases(s: Settings) -> list[tuple[str, int, int]]:
    """(phase, cached tokens, tokens in the forward) of the forwards that can hold the peak: the (last full and
    last partial) prefill chunk and the last decode step, as :mod:`vramguard.memory.forward` picks them."""
    p, c = s.prompt_tokens, s.prefill_chunk
    out = []
    if not c or c >= p:
        out.append(("prefill", 0, p))
    else:
        n_full, rest = divmod(p, c)
        out.append(("prefill", (n_full - 1) * c, c))
        if rest:
            out.append(("prefill", n_full * c, rest))
    if s.max_new_tokens > 1:
        out.append(("decode", p + s.max_new_tokens - 2, 1))
    return out


def _card(i: int, gpu: GpuSpec, weights: int, runs: bool, per_phase: list[tuple[str, int, int, int]],
          layers: tuple[int, ...], holds: tuple[str, ...], static_cache: bool) -> CardNeed:
    """A card's need from its weights and, per phase, (phase, KV, activations, largest allocation); the allocator
    reserve is :func:`~vramguard.memory.runtime.allocator_reserve_bytes` of what the phase allocates on the card
    (a static cache, allocated once, excluded)."""
    rows = []
    for phase, kv, act, largest in per_phase:
        dynamic = act + (0 if static_cache else kv)
        reserve = allocator_reserve_bytes(dynamic, min(largest, dynamic)) if dynamic else 0
        rows.append((kv + act + reserve, phase, kv, act, reserve))
    total, phase, kv, act, reserve = max(rows, key=lambda r: r[0])  # the first of the largest
    cublas = CUBLAS_WORKSPACE_BYTES if runs else 0
    context = CUDA_CONTEXT_BYTES if runs or weights else 0  # a card given nothing is never touched
    need = weights + cublas + total + context
    usable = gpu.usable_bytes
    return CardNeed(i, gpu, weights, kv, act, reserve, cublas, context, need, usable, usable - need,
                    need <= usable, layers, holds, phase if need else "unused")


def device_map_needs(model: MemoryModel, s: Settings, split, gpus: list[GpuSpec]) -> tuple[CardNeed, ...]:
    """Each card's need under the :class:`~vramguard.plan.multigpu.devicemap.DeviceSplit` ``split``."""
    per_phase: list[list[tuple[str, int, int, int]]] = [[] for _ in gpus]
    for phase, past, chunk in phases(s):
        kv_layers = model.kv_per_layer(s, past + chunk, in_prefill_chunk=chunk if phase == "prefill" else 0)
        f = model.forward_parts(s, past, chunk)
        for c in range(len(gpus)):
            layers = split.layers[c]
            act = f.layer + f.cat if layers else 0
            largest = f.largest if layers else 0
            if c == split.output_card:  # lm_head's output (and, on the input's card, the float32 copy)
                both = c == split.input_card
                at_logits = f.hidden + f.logits + f.softcap + (f.logits_fp32 + f.inputs if both else 0)
                act, largest = max(act, at_logits), max(largest, f.logits_fp32 if both else f.logits)
            elif c == split.input_card:  # the logits returned to the input's card, and generate's float32 copy
                act, largest = max(act, f.inputs + f.logits + f.logits_fp32), max(largest, f.logits_fp32)
            kv = sum(kv_layers[i] for i in layers if i < len(kv_layers))
            per_phase[c].append((phase, kv, act, largest))
    out = []
    for c, gpu in enumerate(gpus):
        holds = tuple(h for h, card in (("input embeddings", split.input_card), ("lm_head", split.output_card))
                      if card == c)
        out.append(_card(c, gpu, split.weight_bytes[c], bool(split.layers[c]) or bool(holds), per_phase[c],
                         split.layers[c], holds, s.cache == "static"))
    return tuple(out)


def tp_needs(model: MemoryModel, s: Settings, shards, gpus: list[GpuSpec]) -> tuple[CardNeed, ...]:
    """Each rank's need under tensor parallelism (:class:`~vramguard.plan.multigpu.tensorparallel.TpShards`): rank ``r``
    on card ``r``, computing the model of :meth:`~vramguard.memory.model.MemoryModel.tp_rank` (a hand family's
    heads and MLP divided; transformers' whole model with its KV divided by ``tp``, activations kept whole)."""
    rank, kv_divisor = model.tp_rank(shards)
    per_phase = []
    for phase, past, chunk in phases(s):
        kv = sum(rank.kv_per_layer(s, past + chunk, in_prefill_chunk=chunk if phase == "prefill" else 0))
        kv //= kv_divisor
        f = rank.forward_parts(s, past, chunk)
        local_logits = f.logits // shards.tp  # this rank's columns of lm_head before the gather
        at_logits = f.hidden + local_logits + f.logits + f.softcap + f.logits_fp32
        per_phase.append((phase, kv, max(f.layer + f.cat, at_logits), max(f.largest, f.logits_fp32)))
    layers = tuple(range(model.spec.num_layers))
    return tuple(_card(r, gpu, shards.weight_bytes[r], True, per_phase, layers, ("every layer, sharded",),
                       s.cache == "static") for r, gpu in enumerate(gpus))


def check_cards(gpus: list[GpuSpec], tp: int | None) -> None:
    """Raise InvalidValue for a ``gpus`` that is not a list of GpuSpec, fewer than 2 cards, more than
    :data:`MAX_CARDS`, or a ``tp`` other than the count."""
    require_gpu_specs(gpus)
    if not 2 <= len(gpus) <= MAX_CARDS:
        raise InvalidValue("gpus", len(gpus), f"2 to {MAX_CARDS} cards used together",
                           "name two or more cards (one card is a single-GPU plan)")
    if tp is not None and tp != len(gpus):
        raise InvalidValue("tp", tp, f"the number of cards ({len(gpus)}): one tensor-parallel rank per card",
                           f"pass tp={len(gpus)}, or as many cards as ranks")
