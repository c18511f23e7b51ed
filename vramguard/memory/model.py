"""The memory of one model, by component, from one source: the interface every part of the planner asks.

A :class:`MemoryModel` answers the weights, the KV cache (in all, per layer, per layer kind), the peak of one
forward and the load's peak, and says where its numbers come from (:attr:`MemoryModel.sources`). Implementations:

* :class:`HandModel`: the hand-written families' arithmetic (:mod:`vramguard.memory.weights`, :mod:`~.kv`,
  :mod:`~.forward`): pure, no torch, no transformers; the load's peak is given to it (transformers' meta model, or
  none).
* ``vramguard.introspect.model.TransformersModel``: every figure from transformers itself (the module tree on the
  meta device, its quantizer's rules, a replay of its forward and cache), for any architecture.
* ``vramguard.hub.prequant.CheckpointModel``: the weights a pre-quantized checkpoint's safetensors headers store,
  over a base model that answers the rest.

One function picks the model for a spec and settings, with its reason (``vramguard.plan.choice.choose``); nothing
below it asks which kind of spec it holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, ClassVar

from vramguard.finding import Finding
from vramguard.memory import forward as hand_forward
from vramguard.memory import kv as hand_kv
from vramguard.memory import weights as hand_weights
from vramguard.memory.forward import ForwardPeak
from vramguard.memory.kv import KvBytes
from vramguard.memory.weights import LinearGroup, WeightBytes
from vramguard.settings import DTYPE_BYTES, Settings
from vramguard.spec import ModelSpec


@dataclass(frozen=True)
class LoadPlan:
    """Memory while ``from_pretrained`` loads the model (bytes).

    ``warmup_bytes``: transformers 5's ``caching_allocator_warmup`` allocates, before reading any weight, one block
    of the model's size by its own count (``get_total_byte_count``: every parameter's ``numel`` times
    ``hf_quantizer.param_element_size``, 0.5 B for a 4-bit weight, tied ones once) and frees it into the cache;
    under a per-process cap that block must fit in one piece. ``largest_transient_bytes``: the largest weight held
    in 16-bit on the GPU while bitsandbytes quantizes it (0 without quantization). ``peak_reserved_bytes``: the
    final weights plus that transient plus one 20 MiB segment.
    """

    weights_bytes: int
    warmup_bytes: int
    largest_transient_bytes: int
    peak_reserved_bytes: int
    converted: tuple[str, ...] = ()


@dataclass(frozen=True)
class ForwardParts:
    """One forward's memory by where it lives, for a split over several cards: ``layer`` bytes of one decoder
    layer's program (no KV, no logits), ``largest`` its largest allocation, ``hidden`` one residual-stream tensor,
    ``logits``/``logits_fp32`` the output rows and their float32 copy, ``softcap`` the transient of a final
    soft-capping, ``cat`` the concatenation a dynamic cache makes of one layer's keys, ``inputs`` what the input's
    card keeps for the whole forward (embeddings output, rotary cos/sin, masks)."""

    layer: int
    largest: int
    hidden: int
    logits: int
    logits_fp32: int
    softcap: int
    cat: int
    inputs: int = 0


def logit_parts(spec: ModelSpec, s: Settings, chunk: int) -> tuple[int, int, int, int]:
    """(logits, their float32 copy, the soft-capping transient, one hidden-state tensor) of a forward of ``chunk``
    tokens, in bytes."""
    positions = chunk if s.logits == "all" else 1
    native, fp32 = hand_forward.logits_bytes(spec, s.sequences, positions, s.act_dtype)
    hidden = s.sequences * chunk * spec.hidden_size * DTYPE_BYTES[s.act_dtype]
    return native, fp32, 2 * native if spec.final_logit_softcapping else 0, hidden


class MemoryModel:
    """The memory of :attr:`spec` by component (every size an int of bytes; see the module docstring).

    Subclasses answer :meth:`weight_bytes`, :meth:`linear_groups`, :meth:`kv_cache_bytes`, :meth:`kv_per_layer`,
    :meth:`kv_bytes_per_token`, :meth:`kv_growth_per_token`, :meth:`forward_peak` and :meth:`forward_parts`;
    the rest have defaults that hold for a model whose figures need nothing but the spec.
    """

    spec: ModelSpec
    # its figures come from transformers: torch and transformers must be installed
    needs_transformers: ClassVar[bool] = False

    @property
    def sources(self) -> dict[str, str]:
        """Where each figure comes from: ``weights``, ``kv_cache``, ``forward``, ``load`` -> a phrase."""
        raise NotImplementedError

    @property
    def source(self) -> str:
        """:attr:`sources` in one line."""
        return "; ".join(f"{k}: {v}" for k, v in self.sources.items())

    def with_spec(self, spec: ModelSpec) -> MemoryModel:
        """The same kind of model over ``spec`` (a changed context, a pre-quantized checkpoint planned for a card)."""
        raise NotImplementedError

    # ---- weights
    def weight_bytes(self, s: Settings) -> WeightBytes:
        raise NotImplementedError

    def linear_groups(self, s: Settings | None = None) -> list[LinearGroup]:
        """The projection matrices, grouped by shape (the layers a quantizer converts, and ``lm_head``)."""
        raise NotImplementedError

    # ---- KV cache
    def kv_cache_bytes(self, s: Settings, n_tokens: int, in_prefill_chunk: int = 0) -> KvBytes:
        raise NotImplementedError

    def kv_per_layer(self, s: Settings, n_tokens: int, in_prefill_chunk: int = 0) -> tuple[int, ...]:
        """Bytes of each layer's cache after ``n_tokens`` (they sum to :meth:`kv_cache_bytes`'s GPU bytes)."""
        raise NotImplementedError

    def kv_bytes_per_token(self, s: Settings) -> int:
        raise NotImplementedError

    def kv_growth_per_token(self, s: Settings, n_tokens: int) -> dict[str, int]:
        raise NotImplementedError

    def layer_kinds(self) -> tuple[str, ...]:
        """Each decoder layer's kind where the model reports the KV growth per layer kind as the config names them
        (``linear_attention``, ``mamba``...); () where the growth is reported per full and sliding layer."""
        return ()

    # ---- the forward
    def forward_peak(self, s: Settings, past: int, chunk: int, phase: str = "prefill") -> ForwardPeak:
        raise NotImplementedError

    def prefill_peak(self, s: Settings) -> ForwardPeak:
        """:func:`vramguard.memory.forward.prefill_peak` over this model's forward."""
        return hand_forward.prefill_peak(self.spec, s, self.forward_peak)

    def decode_peak(self, s: Settings) -> ForwardPeak | None:
        """:func:`vramguard.memory.forward.decode_peak` over this model's forward."""
        return hand_forward.decode_peak(self.spec, s, self.forward_peak)

    def forward_parts(self, s: Settings, past: int, chunk: int) -> ForwardParts:
        raise NotImplementedError

    def tp_rank(self, shards) -> tuple[MemoryModel, int]:
        """(the model one tensor-parallel rank of ``shards`` computes, the divisor of its KV cache)."""
        raise NotImplementedError

    # ---- the load, the context, what no measurement covers
    def load_plan(self, s: Settings) -> LoadPlan | None:
        """The load's memory, None where no source gives it."""
        return None

    def learned_positions(self) -> int | None:
        """The number of learned position embeddings, which no context setting exceeds; None where there are none
        (RoPE, ALiBi)."""
        return None

    def findings(self, s: Settings) -> list[Finding]:
        """What the user should know about how the figures of a run with ``s`` were taken ([] where nothing)."""
        return []

    def forward_parts_measured(self, s: Settings) -> tuple[str, ...]:
        """The parts of the forward of a run with ``s`` a GPU measurement must cover (``layer:KIND``,
        ``path:PACKAGE:kernel|reference``); () where the model's whole forward is measured as one."""
        return ()


@dataclass(frozen=True)
class HandModel(MemoryModel):
    """A hand-written family's memory (pure arithmetic on :attr:`spec`); ``load`` gives the load's peak (None: no
    source), ``load_source`` says where it comes from."""

    spec: ModelSpec
    load: Callable[[ModelSpec, Settings], LoadPlan | None] | None = field(default=None, compare=False)
    load_source: str = "not planned"

    @property
    def sources(self) -> dict[str, str]:
        hand = f"the hand-written {self.spec.model_type} model"
        return {"weights": hand, "kv_cache": hand, "forward": hand, "load": self.load_source}

    def with_spec(self, spec: ModelSpec) -> HandModel:
        return replace(self, spec=spec)

    def weight_bytes(self, s: Settings) -> WeightBytes:
        return hand_weights.weight_bytes(self.spec, s)

    def linear_groups(self, s: Settings | None = None) -> list[LinearGroup]:
        return hand_weights.linear_groups(self.spec)

    def kv_cache_bytes(self, s: Settings, n_tokens: int, in_prefill_chunk: int = 0) -> KvBytes:
        return hand_kv.kv_cache_bytes(self.spec, s, n_tokens, in_prefill_chunk)

    def kv_per_layer(self, s: Settings, n_tokens: int, in_prefill_chunk: int = 0) -> tuple[int, ...]:
        return hand_kv.kv_per_layer(self.spec, s, n_tokens, in_prefill_chunk)

    def kv_bytes_per_token(self, s: Settings) -> int:
        return hand_kv.kv_bytes_per_token(self.spec, s)

    def kv_growth_per_token(self, s: Settings, n_tokens: int) -> dict[str, int]:
        return hand_kv.kv_growth_per_token(self.spec, s, n_tokens)

    def forward_peak(self, s: Settings, past: int, chunk: int, phase: str = "prefill") -> ForwardPeak:
        return hand_forward.forward_peak(self.spec, s, past, chunk, phase)

    def forward_parts(self, s: Settings, past: int, chunk: int) -> ForwardParts:
        """The hand model replayed without logits (a vocabulary of 1) for the layer's own program; the inputs the
        input's card keeps (:func:`vramguard.memory.forward.inputs_bytes`)."""
        spec = self.spec
        fp = hand_forward.forward_peak(replace(spec, vocab_size=1), s, past, chunk)
        layer = fp.peak_bytes - fp.components.get("kv_cache", 0) - fp.components.get("logits", 0)
        native, fp32, softcap, hidden = logit_parts(spec, s, chunk)
        cat = hand_kv.kv_tensor_bytes(spec, s, past) if past and s.cache == "dynamic" else 0
        return ForwardParts(layer, fp.largest_alloc, hidden, native, fp32, softcap, cat,
                            hand_forward.inputs_bytes(spec, s, past, chunk, hidden))

    def tp_rank(self, shards) -> tuple[MemoryModel, int]:
        """The model as one rank computes it: query and KV heads, and the MLP intermediate (dense, experts, shared
        expert), divided as rank 0 holds them (the largest shard, ``ceil(n / tp)``, as ``torch.chunk`` splits);
        its KV cache is its own (divisor 1)."""
        spec, tp = self.spec, shards.tp
        changes: dict = {}
        if shards.heads_sharded:
            changes.update(num_heads=spec.num_heads // tp, num_kv_heads=shards.kv_heads_per_rank)
        if shards.mlp_sharded:
            changes.update(intermediate_size=-(-spec.intermediate_size // tp),
                           moe_intermediate_size=-(-spec.moe_intermediate_size // tp),
                           shared_expert_intermediate_size=-(-spec.shared_expert_intermediate_size // tp))
        return self.with_spec(replace(spec, **changes)), 1

    def load_plan(self, s: Settings) -> LoadPlan | None:
        return self.load(self.spec, s) if self.load is not None else None

