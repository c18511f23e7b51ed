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
of a hand-written family come from its replayed forward (:mod:`vramguard.memory.forward`); a generic architecture's
from transformers' replay of the whole forward, kept whole on every card holding layers (an upper bound). Not in
the need: NCCL's communicator buffers under tensor parallelism (allocated outside PyTorch's allocator) and the
load's transients; both are said in :attr:`MultiGpuPlan.notes`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from vramguard.catalog.gpus import GpuSpec
from vramguard.errors import InvalidValue
from vramguard.memory.forward import forward_peak, logits_bytes
from vramguard.memory.kv import kv_tensor_bytes, layer_tokens
from vramguard.memory.runtime import CUBLAS_WORKSPACE_BYTES, CUDA_CONTEXT_BYTES, allocator_reserve_bytes
from vramguard.settings import DTYPE_BYTES, Settings
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


def kv_per_layer(spec: ModelSpec, s: Settings, n_tokens: int, in_prefill_chunk: int = 0) -> tuple[int, ...]:
    """Bytes of keys and values of each layer after ``n_tokens`` (the per-layer terms of
    :func:`vramguard.memory.kv.kv_cache_bytes`, which sum to it; a generic spec: the cache transformers builds,
    layer by layer)."""
    if spec.generic:
        from vramguard.introspect.generic import kv_cache_bytes, replayed
        r = replayed(spec, s, max(n_tokens - 1, 0), 1) if n_tokens > 1 else replayed(spec, s, 0, 1)
        per = list(r.cache_bytes)
        total = kv_cache_bytes(spec, s, n_tokens, in_prefill_chunk).gpu_bytes
        if per and sum(per) != total:  # a quantized cache: its bytes shared out by the 16-bit layer sizes
            scaled = [b * total // sum(per) for b in per]
            scaled[-1] += total - sum(scaled)
            per = scaled
        return tuple(per)
    out = []
    for lt in spec.layer_types:
        n = layer_tokens(spec, lt, n_tokens, s, in_prefill_chunk)
        out.append(2 * kv_tensor_bytes(spec, s, n, residual=0 if in_prefill_chunk >= n_tokens else None))
    return tuple(out)


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


@dataclass(frozen=True)
class _Forward:
    """One forward's memory by where it lives: ``layer`` bytes of one decoder layer's program (no KV, no logits),
    ``largest`` its largest allocation, ``hidden`` one residual-stream tensor, ``logits``/``logits_fp32`` the
    output rows and their float32 copy, ``softcap`` the transient of a final soft-capping."""

    layer: int
    largest: int
    hidden: int
    logits: int
    logits_fp32: int
    softcap: int
    cat: int
    inputs: int = 0  # what the input's card keeps for the whole forward: embeddings output, rotary cos/sin, masks


def forward_parts(spec: ModelSpec, s: Settings, past: int, chunk: int) -> _Forward:
    """The parts of one forward's peak (see :class:`_Forward`). A hand family is replayed without logits (a
    vocabulary of 1) for the layer's own program; a generic one keeps its whole replayed peak above the KV."""
    if spec.generic:
        fp = forward_peak(spec, s, past, chunk)
        layer = fp.peak_bytes - fp.components.get("kv_cache", 0)
    else:
        fp = forward_peak(replace(spec, vocab_size=1), s, past, chunk)
        layer = fp.peak_bytes - fp.components.get("kv_cache", 0) - fp.components.get("logits", 0)
    positions = chunk if s.logits == "all" else 1
    native, fp32 = logits_bytes(spec, s.sequences, positions, s.act_dtype)
    hidden = s.sequences * chunk * spec.hidden_size * DTYPE_BYTES[s.act_dtype]
    cat = kv_tensor_bytes(spec, s, past) if past and s.cache == "dynamic" and not spec.generic else 0
    return _Forward(layer, fp.largest_alloc, hidden, native, fp32,
                    2 * native if spec.final_logit_softcapping else 0, cat,
                    0 if spec.generic else _inputs_bytes(spec, s, past, chunk, hidden))


def _inputs_bytes(spec: ModelSpec, s: Settings, past: int, chunk: int, hidden: int) -> int:
    """The tensors of the forward's start that stay alive to its end, as the hand model's replay has them
    (:mod:`vramguard.memory.forward`): the embeddings' output (and its scaled copy), the rotary cos/sin and the
    attention masks."""
    from vramguard.memory.forward import _Forward as Replay
    r = Replay(spec, s, past, chunk, "prefill")
    r.masks()
    embeds = hidden * (2 if spec.scaled_embeddings else 1)
    return embeds + 2 * s.sequences * chunk * spec.head_dim * DTYPE_BYTES[s.act_dtype] + r.t.live_bytes


def _card(i: int, gpu: GpuSpec, weights: int, runs: bool, per_phase: list[tuple[str, int, int, int]],
          layers: tuple[int, ...], holds: tuple[str, ...], static_cache: bool) -> CardNeed:
    """A card's need from its weights and, per phase, (phase, KV, activations, largest allocation); the allocator
    reserve is :func:`~vramguard.memory.runtime.allocator_reserve_bytes` of what the phase allocates on the card
    (a static cache, allocated once, excluded)."""
    best = None
    for phase, kv, act, largest in per_phase:
        dynamic = act + (0 if static_cache else kv)
        reserve = allocator_reserve_bytes(dynamic, min(largest, dynamic)) if dynamic else 0
        total = kv + act + reserve
        if best is None or total > best[0]:
            best = (total, phase, kv, act, reserve)
    total, phase, kv, act, reserve = best
    cublas = CUBLAS_WORKSPACE_BYTES if runs else 0
    context = CUDA_CONTEXT_BYTES if runs or weights else 0  # a card given nothing is never touched
    need = weights + cublas + total + context
    usable = gpu.total_bytes - gpu.used_by_others_bytes
    return CardNeed(i, gpu, weights, kv, act, reserve, cublas, context, need, usable, usable - need,
                    need <= usable, layers, holds, phase if need else "unused")


def device_map_needs(spec: ModelSpec, s: Settings, split, gpus: list[GpuSpec]) -> tuple[CardNeed, ...]:
    """Each card's need under the :class:`~vramguard.plan.multigpu.devicemap.DeviceSplit` ``split``."""
    per_phase: list[list[tuple[str, int, int, int]]] = [[] for _ in gpus]
    for phase, past, chunk in phases(s):
        kv_layers = kv_per_layer(spec, s, past + chunk, in_prefill_chunk=chunk if phase == "prefill" else 0)
        f = forward_parts(spec, s, past, chunk)
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


def rank_spec(spec: ModelSpec, shards) -> ModelSpec:
    """The model as one tensor-parallel rank computes it: query and KV heads, and the MLP intermediate (dense,
    experts, shared expert), divided as rank 0 holds them (the largest shard, ``ceil(n / tp)``)."""
    from vramguard.plan.multigpu.tensorparallel import chunk_size
    tp = shards.tp
    changes: dict = {}
    if shards.heads_sharded:
        changes.update(num_heads=spec.num_heads // tp, num_kv_heads=shards.kv_heads_per_rank)
    if shards.mlp_sharded:
        changes.update(intermediate_size=chunk_size(spec.intermediate_size, tp, 0),
                       moe_intermediate_size=chunk_size(spec.moe_intermediate_size, tp, 0),
                       shared_expert_intermediate_size=chunk_size(spec.shared_expert_intermediate_size, tp, 0))
    return replace(spec, **changes)


def tp_needs(spec: ModelSpec, s: Settings, shards, gpus: list[GpuSpec]) -> tuple[CardNeed, ...]:
    """Each rank's need under tensor parallelism (:class:`~vramguard.plan.multigpu.tensorparallel.TpShards`): rank ``r``
    on card ``r``. A generic architecture's KV is divided by ``tp`` (its cache tensors keep heads on one dim) and its
    activations are kept whole (an upper bound)."""
    rs = spec if spec.generic else rank_spec(spec, shards)
    per_phase = []
    for phase, past, chunk in phases(s):
        kv = sum(kv_per_layer(rs, s, past + chunk, in_prefill_chunk=chunk if phase == "prefill" else 0))
        if spec.generic and shards.heads_sharded:
            kv //= shards.tp
        f = forward_parts(rs, s, past, chunk)
        local_logits = f.logits // shards.tp  # this rank's columns of lm_head before the gather
        at_logits = f.hidden + local_logits + f.logits + f.softcap + f.logits_fp32
        per_phase.append((phase, kv, max(f.layer + f.cat, at_logits), max(f.largest, f.logits_fp32)))
    layers = tuple(range(spec.num_layers))
    return tuple(_card(r, gpu, shards.weight_bytes[r], True, per_phase, layers, ("every layer, sharded",),
                       s.cache == "static") for r, gpu in enumerate(gpus))


def check_cards(gpus: list[GpuSpec], tp: int | None) -> None:
    """Raise InvalidValue for a ``gpus`` that is not a list of GpuSpec, fewer than 2 cards, more than
    :data:`MAX_CARDS`, or a ``tp`` other than the count."""
    from vramguard.hardware import require_gpu_specs
    require_gpu_specs(gpus)
    if not 2 <= len(gpus) <= MAX_CARDS:
        raise InvalidValue("gpus", len(gpus), f"2 to {MAX_CARDS} cards used together",
                           "name two or more cards (one card is a single-GPU plan)")
    if tp is not None and tp != len(gpus):
        raise InvalidValue("tp", tp, f"the number of cards ({len(gpus)}): one tensor-parallel rank per card",
                           f"pass tp={len(gpus)}, or as many cards as ranks")
