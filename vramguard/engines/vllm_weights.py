"""Weights and activations of one vLLM worker (one tensor-parallel rank of one pipeline stage), in bytes.

Pure functions of a :class:`~vramguard.spec.ModelSpec`; no torch. Every tensor is rounded to the caching
allocator's 512 B block (:func:`vramguard.memory.weights.rounded`), as vLLM allocates each parameter with
``torch.empty`` and reports "Model loading took X GiB" from ``torch.cuda`` allocated bytes
(``vllm/v1/worker/gpu_model_runner.py::GPUModelRunner.load_model`` with ``DeviceMemoryProfiler``,
``vllm/utils/mem_utils.py``).

How vLLM shards a decoder for tensor parallelism (``vllm/model_executor/layers/linear.py``, as the model files use
it, e.g. ``vllm/model_executor/models/llama.py``):

* ``QKVParallelLinear`` (column parallel): ``num_heads / tp`` query heads per rank; KV heads split when
  ``num_kv_heads >= tp`` and replicated (``num_kv_head_replicas = tp / num_kv_heads``) when fewer, so each rank
  holds ``max(1, num_kv_heads / tp)`` KV heads. Its bias is split the same way.
* ``RowParallelLinear`` (``o_proj``, ``down_proj``): the input dimension split by ``tp``; the bias is whole on
  every rank.
* ``MergedColumnParallelLinear`` (``gate_up_proj``): ``2 x intermediate / tp`` output rows.
* ``FusedMoE`` without expert parallelism: every expert on every rank, each expert's intermediate split by
  ``tp``; the router (``ReplicatedLinear``) whole on every rank.
* ``VocabParallelEmbedding`` / ``ParallelLMHead``: the vocabulary padded to a multiple of 64
  (``DEFAULT_VOCAB_PADDING_SIZE``, ``pad_vocab_size``), then ``padded / tp`` rows per rank
  (``vllm/model_executor/layers/vocab_parallel_embedding.py`` at commit 00db0119); tied embeddings share one tensor
  unless pipeline parallelism puts the LM head on another stage.
* Norms are whole on every rank. The rotary ``cos_sin_cache`` buffer (``vllm/model_executor/layers/
  rotary_embedding``: ``[max_positions, rotary_dim]`` in the model dtype, one per distinct rope, shared by all
  layers through ``get_rope``'s cache) is counted: for Llama-3.1-8B it is 131,072 x 128 x 2 = 33,554,432 B, which
  is why vLLM reports 14.9888 GiB (16,094,076,928 B) and not the 14.957 GiB of the parameters alone.
* Pipeline parallelism: ``vllm/distributed/utils.py::get_pp_indices`` gives each stage ``num_layers // pp``
  layers and the remainder one each to the stages before the last; the first stage holds the embeddings, the last
  the final norm and the LM head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vramguard.engines.vllm_quant import WeightFormat, weight_format
from vramguard.errors import ConfigError, InvalidValue
from vramguard.memory.weights import rounded
from vramguard.spec import ModelSpec

VOCAB_PADDING = 64  # DEFAULT_VOCAB_PADDING_SIZE in vocab_parallel_embedding.py


def pad_vocab(vocab_size: int) -> int:
    """``pad_vocab_size``: the vocabulary rounded up to a multiple of 64 (128,256 -> 128,256; 32,064 -> 32,064;
    151,665 -> 151,680)."""
    return -(-vocab_size // VOCAB_PADDING) * VOCAB_PADDING


def _tp_rule_broken(spec: ModelSpec, tp: int) -> tuple[str, str] | None:
    """The first of vLLM's tensor-parallel rules ``tp`` breaks for ``spec``, as (what ``accepted`` says, why the
    size is left out of the sizes that work), or None when vLLM accepts it (see :func:`check_tensor_parallel`)."""
    kv = spec.num_kv_heads
    if spec.num_heads % tp:
        return f"a divisor of num_attention_heads ({spec.num_heads:,})", "num_attention_heads"
    if kv >= tp and kv % tp:
        return f"a divisor of num_key_value_heads ({kv:,})", f"not dividing the {kv} KV heads"
    if kv < tp and tp % kv:
        return (f"a multiple of num_key_value_heads ({kv}) when larger than it",
                f"over the {kv} KV heads and not a multiple of them")
    inter = spec.moe_intermediate_size if spec.is_moe else spec.intermediate_size
    if inter % tp:
        return f"a divisor of the MLP intermediate size ({inter:,})", f"not dividing the MLP's {inter:,}"
    padded = pad_vocab(spec.vocab_size)
    if padded % tp:
        return (f"a divisor of the vocabulary padded to 64 ({padded:,})",
                f"not dividing the padded vocabulary {padded:,}")
    return None


def tensor_parallel_sizes(spec: ModelSpec) -> list[int]:
    """Every ``tensor_parallel_size`` vLLM accepts for ``spec``: the divisors of ``num_attention_heads`` that break
    none of :func:`check_tensor_parallel`'s rules. Qwen2.5-7B (28 heads, 4 KV heads, MLP 18,944): 1, 2 and 4; 7 and
    14 are over the 4 KV heads and not multiples of them, 28 does not divide 18,944."""
    return [d for d in range(1, spec.num_heads + 1) if spec.num_heads % d == 0 and _tp_rule_broken(spec, d) is None]


def check_tensor_parallel(spec: ModelSpec, tp: int) -> None:
    """Raise :class:`InvalidValue` for a ``tp`` vLLM refuses: heads, KV heads, intermediate sizes and the padded
    vocabulary must divide (``vllm/model_executor/models/llama.py`` asserts ``num_heads % tp == 0`` and
    ``num_kv_heads % tp == 0`` or ``tp % num_kv_heads == 0``; ``divide`` asserts the rest). The fix lists every
    size that works (:func:`tensor_parallel_sizes`) and why the other divisors of the heads do not."""
    broken = _tp_rule_broken(spec, tp)
    if broken is None:
        return
    ok = [str(d) for d in tensor_parallel_sizes(spec)]
    why: dict[str, list[str]] = {}
    for d in range(2, spec.num_heads + 1):
        rule = _tp_rule_broken(spec, d) if spec.num_heads % d == 0 else None
        if rule is not None:
            why.setdefault(rule[1], []).append(str(d))
    left_out = "; ".join(f"{', '.join(ds)}: {reason}" for reason, ds in why.items())
    raise InvalidValue("tensor_parallel_size", tp, broken[0],
                       f"pass tensor_parallel_size={', '.join(ok[:-1]) + ' or ' if len(ok) > 1 else ''}{ok[-1]}"
                       + (f" (the other divisors of the {spec.num_heads} heads: {left_out})" if left_out else ""))


def kv_heads_per_rank(spec: ModelSpec, tp: int) -> int:
    """KV heads each rank stores: ``max(1, num_kv_heads // tp)`` (replicated when fewer heads than ranks)."""
    return max(1, spec.num_kv_heads // tp)


def _t(numel: int, dtype_bytes: int) -> int:
    return rounded(numel * dtype_bytes)


@dataclass(frozen=True)
class LayerOptions:
    """What a layer's bytes depend on beyond the spec (the :class:`~vramguard.engines.vllm_arch.VllmModel` of the
    checkpoint, and the card).

    Attributes:
        fmt: the :class:`~vramguard.engines.vllm_quant.WeightFormat` of the linears and experts (None: read from
            the spec's config.json).
        mla: :class:`~vramguard.engines.vllm_arch.MlaShape` for DeepSeek's latent attention, else None.
        expert_bias, sinks: gpt-oss's expert biases and per-head attention sinks.
        mxfp4_backend: the MXFP4 MoE kernel (``marlin``, ``triton``, ``flashinfer``: its padding differs).
        lora_rank, max_loras: ``enable_lora``'s ``max_lora_rank`` and ``max_loras`` (0: LoRA off).
    """

    fmt: WeightFormat | None = None
    mla: Any = None
    expert_bias: bool = False
    sinks: bool = False
    mxfp4_backend: str = "triton"
    lora_rank: int = 0
    max_loras: int = 1


def linear_format(spec: ModelSpec) -> WeightFormat:
    """The :class:`~vramguard.engines.vllm_quant.WeightFormat` of the checkpoint's config.json.

    Raises:
        ConfigError: a quantization vramguard does not model for vLLM, or a spec that says it is pre-quantized
            without the ``quantization_config`` that says how, naming the field.
    """
    cfg = spec.config_dict()
    if spec.prequantized and not cfg.get("quantization_config"):
        raise ConfigError("config.json:quantization_config", spec.prequantized,
                          "the checkpoint's quantization_config (method, bits, group size)",
                          "plan from the checkpoint's config.json, or plan the unquantized model")
    return weight_format(cfg)


def _attention_bytes(spec: ModelSpec, tp: int, dt: int, fmt: WeightFormat, opts: LayerOptions) -> int:
    """Attention of one layer on one rank: fused QKV and O (with their biases), or MLA's projections."""
    h, d = spec.hidden_size, spec.head_dim
    mla = opts.mla
    if mla is not None:  # deepseek_v2.py::DeepseekV2MLAAttention
        heads = spec.num_heads // tp
        qk = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        if mla.q_lora_rank:
            q = (fmt.linear_bytes(mla.q_lora_rank, h, 1, dt) + _t(mla.q_lora_rank, dt)
                 + fmt.linear_bytes(heads * qk, mla.q_lora_rank, 1, dt))
        else:
            q = fmt.linear_bytes(heads * qk, h, 1, dt)
        kv_b = heads * (mla.qk_nope_head_dim + mla.v_head_dim)
        total = (q + fmt.linear_bytes(mla.kv_lora_rank + mla.qk_rope_head_dim, h, 1, dt) + _t(mla.kv_lora_rank, dt)
                 + fmt.linear_bytes(kv_b, mla.kv_lora_rank, 1, dt) + fmt.linear_bytes(h, heads * mla.v_head_dim, 1, dt))
        if fmt.kind != "none":  # mla_attention.py keeps model-dtype copies of a quantized kv_b_proj (W_UK, W_UV)
            total += _t(kv_b * mla.kv_lora_rank, dt)
        return total
    q_out = spec.num_heads // tp * d
    qkv_out = q_out + 2 * kv_heads_per_rank(spec, tp) * d
    total = fmt.linear_bytes(qkv_out, h, 3, dt) + fmt.linear_bytes(h, q_out, 1, dt)
    if spec.qkv_bias:
        total += _t(qkv_out, dt)
    if spec.o_bias:
        total += _t(h, dt)
    if opts.sinks:
        total += _t(spec.num_heads // tp, dt)
    if spec.qk_norm:
        total += 2 * _t(d, dt)
    return total


def _mlp_bytes(spec: ModelSpec, tp: int, dt: int, fmt: WeightFormat, opts: LayerOptions, dense: bool) -> int:
    """The MLP of one layer on one rank: a gated MLP, or the MoE experts, router and shared experts."""
    h = spec.hidden_size
    if dense:
        i = spec.intermediate_size // tp
        total = fmt.linear_bytes(2 * i, h, 2, dt) + fmt.linear_bytes(h, i, 1, dt)
        return total + (_t(2 * i, dt) + _t(h, dt) if spec.mlp_bias else 0)
    e, i = spec.num_experts, spec.moe_intermediate_size // tp
    total = fmt.experts_bytes(e, i, h, dt, opts.mxfp4_backend, bias=opts.expert_bias)
    total += _t(e * h, dt) + (_t(e, dt) if opts.expert_bias else 0)  # the router (ReplicatedLinear)
    if spec.shared_expert_intermediate_size:
        si = spec.shared_expert_intermediate_size // tp
        total += fmt.linear_bytes(2 * si, h, 2, dt) + fmt.linear_bytes(h, si, 1, dt)
        if opts.mla is None:  # Qwen's shared-expert gate
            total += _t(h, dt)
    return total


def lora_layer_bytes(spec: ModelSpec, tp: int, dt: int, rank: int, max_loras: int) -> int:
    """The LoRA slots ``enable_lora`` adds to one decoder layer on one rank (``vllm/lora/layers/base_linear.py::
    create_lora_weights``): per wrapped linear and slice, ``lora_a`` of ``max_loras x rank x input`` and ``lora_b``
    of ``max_loras x output x rank`` in the model dtype; QKV has 3 slices and gate_up 2 (column parallel: full input,
    the rank's outputs), o and down are row parallel (the rank's inputs, full output).

    Example (Qwen2.5-1.5B, rank 64, one LoRA, bf16): 64 x (3 x 1,536 + 2,048 + 1,536 + 1,536 + 2 x 1,536 + 17,920
    + 8,960 + 1,536) x 2 B = 5,275,648 B per layer.
    """
    if not rank:
        return 0
    h, d = spec.hidden_size, spec.head_dim
    q_out = spec.num_heads // tp * d
    qkv_out = q_out + 2 * kv_heads_per_rank(spec, tp) * d
    i = (spec.moe_intermediate_size if spec.is_moe else spec.intermediate_size) // tp
    dense_mlp = 0 if spec.is_moe else (2 * h + 2 * i) + (i + h)  # MoE experts' LoRA: not modelled
    cols = (3 * h + qkv_out) + (q_out + h) + dense_mlp
    return max_loras * rank * cols * dt


def layer_weight_bytes(spec: ModelSpec, tp: int, dtype_bytes: int, opts: LayerOptions | None = None,
                       index: int = 0) -> int:
    """Bytes of decoder layer ``index`` on one rank (see the module docstring for the sharding).

    Example (Llama-3.1-8B, tp=1, bf16): qkv 6,144 x 4,096 + o 4,096 x 4,096 + gate_up 28,672 x 4,096 + down
    4,096 x 14,336 = 218,103,808 weights x 2 B = 436,207,616 B, plus two norms of 4,096 x 2 B -> 436,224,000 B.
    A quantized checkpoint stores its linears per :mod:`vramguard.engines.vllm_quant`.
    """
    opts = opts or LayerOptions()
    fmt = opts.fmt or linear_format(spec)
    dense = not spec.is_moe or (opts.mla is not None and index < opts.mla.first_k_dense_replace)
    total = _attention_bytes(spec, tp, dtype_bytes, fmt, opts) + _mlp_bytes(spec, tp, dtype_bytes, fmt, opts, dense)
    return total + spec.norms_per_layer * _t(spec.hidden_size, dtype_bytes)


def rope_cache_bytes(spec: ModelSpec, dtype_bytes: int) -> int:
    """The rotary ``cos_sin_cache`` buffers, ``positions x rotary_dim x dtype`` each.

    positions (``vllm/model_executor/layers/rotary_embedding/__init__.py::get_rope`` and its classes):
    ``max_position_embeddings`` for the default and ``llama3`` ropes; x ``factor`` for ``linear`` and ``dynamic``;
    ``original_max_position_embeddings x factor`` for ``yarn``; ``original + max`` (short and long caches) for
    ``longrope`` (Phi-3 128k). ``rotary_dim = head_dim x partial_rotary_factor``. Gemma-3 has a local and a global
    rope (two caches). A multimodal checkpoint's rope is its ``text_config``'s (Gemma-3 4B-27B: ``linear`` x 8).
    """
    cfg = spec.config_dict()
    cfg = cfg.get("text_config") or cfg
    rotary_dim = int(spec.head_dim * float(cfg.get("partial_rotary_factor") or 1.0))
    scaling = cfg.get("rope_scaling") or {}
    kind = str(scaling.get("rope_type") or scaling.get("type") or "default")
    factor = float(scaling.get("factor") or 1.0)
    max_pos = spec.max_position_embeddings
    orig = int(scaling.get("original_max_position_embeddings") or max_pos)
    if kind in ("linear", "dynamic"):
        positions = int(max_pos * factor)
    elif kind == "yarn":
        positions = int(orig * factor)
    elif kind in ("longrope", "su"):
        positions = orig + max_pos
    else:
        positions = max_pos
    one = _t(positions * rotary_dim, dtype_bytes)
    if spec.model_type == "gemma3_text":
        return one + _t(max_pos * rotary_dim, dtype_bytes)
    return one


def pp_layer_counts(num_layers: int, pp: int) -> list[int]:
    """Layers per pipeline stage (``get_pp_indices``): ``num_layers // pp`` each, the remainder added one each to
    the stages before the last, counted back from the second-to-last (32 layers, pp=3 -> [11, 11, 10])."""
    base, rem = divmod(num_layers, pp)
    counts = [base] * pp
    for i in range(2, rem + 2):
        counts[-i] += 1
    return counts


@dataclass(frozen=True)
class RankWeights:
    """Weights of one rank of one pipeline stage (bytes).

    ``total_bytes = layers_bytes + embedding_bytes + lm_head_bytes + final_norm_bytes + rope_cache_bytes
    + vision_bytes + lora_bytes`` (the vision encoder of a multimodal checkpoint on the first stage; LoRA slots).
    """

    stage: int
    num_layers: int
    layers_bytes: int
    embedding_bytes: int
    lm_head_bytes: int
    final_norm_bytes: int
    rope_cache_bytes: int
    vision_bytes: int = 0
    lora_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return (self.layers_bytes + self.embedding_bytes + self.lm_head_bytes + self.final_norm_bytes
                + self.rope_cache_bytes + self.vision_bytes + self.lora_bytes)


def rank_weights(spec: ModelSpec, tp: int, pp: int, dtype_bytes: int, opts: LayerOptions | None = None,
                 vision_params: int = 0) -> list[RankWeights]:
    """One :class:`RankWeights` per pipeline stage (every TP rank of a stage holds the same bytes);
    ``vision_params``: a multimodal checkpoint's encoder and projector, whole on the first stage's ranks.

    Example (Llama-3.1-8B, tp=1, pp=1, bf16): 32 layers x 436,224,000 B + embeddings and LM head
    2 x 128,256 x 4,096 x 2 B + final norm 8,192 B + rope cache 33,554,432 B = 16,094,076,928 B (14.9888 GiB,
    what vLLM logs).
    """
    check_tensor_parallel(spec, tp)
    if pp > spec.num_layers:
        raise InvalidValue("pipeline_parallel_size", pp, f"at most num_hidden_layers ({spec.num_layers})",
                           "use fewer pipeline stages")
    opts = opts or LayerOptions()
    vocab_rows = pad_vocab(spec.vocab_size) // tp
    table = _t(vocab_rows * spec.hidden_size, dtype_bytes)
    first_dense = opts.mla.first_k_dense_replace if opts.mla is not None else 0
    dense_layer = layer_weight_bytes(spec, tp, dtype_bytes, opts, 0) if first_dense else 0
    later_layer = layer_weight_bytes(spec, tp, dtype_bytes, opts, first_dense)
    lora = lora_layer_bytes(spec, tp, dtype_bytes, opts.lora_rank, opts.max_loras)
    rope = rope_cache_bytes(spec, dtype_bytes)
    out, start = [], 0
    for stage, n in enumerate(pp_layer_counts(spec.num_layers, pp)):
        first, last = stage == 0, stage == pp - 1
        shares_head = spec.tie_word_embeddings and first
        dense = max(0, min(first_dense, start + n) - start)
        out.append(RankWeights(
            stage=stage, num_layers=n, layers_bytes=dense * dense_layer + (n - dense) * later_layer,
            embedding_bytes=table if first else 0, lm_head_bytes=table if last and not shares_head else 0,
            final_norm_bytes=_t(spec.hidden_size, dtype_bytes) if last else 0, rope_cache_bytes=rope,
            vision_bytes=_t(vision_params, dtype_bytes) if first else 0, lora_bytes=n * lora))
        start += n
    return out


# bytes per (request x vocabulary entry) the dummy sampler holds beside the model-dtype logits, by the top-k/top-p
# path it takes (``GPUModelRunner._dummy_sampler_run`` sets top_k and top_p):
# * "triton" (vLLM 0.33.0 on CUDA, ``vllm/v1/sample/ops/topk_topp_sampler.py::apply_top_k_top_p`` with
#   ``HAS_TRITON``): the fp32 copy (``Sampler.forward``: ``logits.to(torch.float32)``) 4, masked in place by
#   ``apply_top_k_top_p_triton``, then ``forward_native``'s fp32 softmax 4 and the exponential noise ``q`` 4
#   (``random_sample``; ``probs.div_(q)`` in place) = 12, counted from the source;
# * "sort" (V1 releases before the Triton kernel: ``apply_top_k_top_p_pytorch``, a full sort of the vocabulary):
#   36, measured: vLLM's own profile logged 4.76, 5.56, 5.64 and 7.38 GiB of activation for Llama-3.1-8B,
#   Qwen3-0.6B, Qwen3-32B and gpt-oss-20b at 1,024 requests (github.com/llm-d/llm-d-benchmark,
#   config_explorer/empirical-vllm-memory-results.md), 38.3 B per logit with the 2 B logits (the source count of
#   that path, fp32 4 + sorted values 4 + int64 indices 8 + two masks 2 + sorted softmax 4 + scatter 4 = 26, is
#   short of what was measured);
# * "flashinfer" (vLLM 0.10 with FlashInfer's sampler: one ``flashinfer_sample`` call on the fp32 copy): the fp32
#   copy 4 and FlashInfer's probabilities 4 = 8.
SAMPLER_BYTES_PER_LOGIT = {"triton": 12, "sort": 36, "flashinfer": 8}


def forward_peak_bytes(spec: ModelSpec, tp: int, num_tokens: int, dtype_bytes: int) -> int:
    """Peak of the tensors alive inside one decoder layer for a forward over ``num_tokens`` tokens (bytes).

    Three ``N x hidden`` tensors stay alive through a layer: the previous layer's output (the model's loop,
    ``for layer in layers: hidden_states, residual = layer(positions, hidden_states, residual)`` in
    ``vllm/model_executor/models/llama.py``, holds it until the layer returns), the residual and the normed hidden
    states; beside them, in the MLP, the ``gate_up`` output (``N x 2I/tp``) while ``SiluAndMul`` writes
    ``N x I/tp``, or in attention the fused QKV output and the attention output. MoE (``fused_moe``): the expanded
    ``N x top_k`` rows of ``2I/tp`` and ``I/tp`` and the ``N x top_k x hidden`` expert outputs, plus the fp32
    router logits. A hand model of the live tensors, not a trace (torch.compile may fuse some away); against the
    torch peaks vLLM logged for Llama-3.1-8B at 20,000 and 29,000 tokens it is within 0.5% (benchmarks/README.md).

    Example (Llama-3.1-8B, tp=1, 8,192 tokens, bf16): 8,192 x 2 x (3 x 4,096 + 3 x 14,336) = 905,969,664 B.
    """
    n, h, dt = num_tokens, spec.hidden_size, dtype_bytes
    q_out = spec.num_heads // tp * spec.head_dim
    qkv_out = q_out + 2 * kv_heads_per_rank(spec, tp) * spec.head_dim
    attention = n * dt * (3 * h + qkv_out + q_out)
    if spec.is_moe:
        i, k = spec.moe_intermediate_size // tp, max(spec.num_experts_per_tok, 1)
        mlp = n * dt * (3 * h + k * (3 * i + h)) + n * spec.num_experts * 4
        if spec.shared_expert_intermediate_size:
            mlp += n * dt * 3 * spec.shared_expert_intermediate_size // tp
    else:
        mlp = n * dt * (3 * h + 3 * (spec.intermediate_size // tp))
    return max(attention, mlp)


def encoder_peak_bytes(vision: Any, text_hidden: int, num_tokens: int, dtype_bytes: int) -> int:
    """Peak of the vision encoder's profile run (bytes): vLLM encodes as many of the largest images as the
    encoder budget (``max_num_batched_tokens`` of the language model's tokens) holds, at least one
    (``GPUModelRunner.profile_run`` with ``_get_mm_dummy_batch``), and keeps their outputs. Modelled as the live
    tensors of one encoder layer over all their patches (three of the encoder width, three of its MLP width, as
    :func:`forward_peak_bytes` counts a decoder layer) plus the outputs in the text width.

    Example (Pixtral in Mistral-Small-3.1/3.2: 1,540 px images, 12,100 patches, 3,025 tokens each; 8,192 tokens ->
    2 images): 24,200 x 2 x (3 x 1,024 + 3 x 4,096) + 6,050 x 5,120 x 2 = 805,376,000 B.
    """
    items = max(1, num_tokens // vision.tokens_per_image)
    patches = items * vision.max_patches
    return (patches * dtype_bytes * 3 * (vision.hidden_size + vision.intermediate_size)
            + items * vision.tokens_per_image * text_hidden * dtype_bytes)


# streaming multiprocessors per card (NVIDIA's datasheets), for the Triton top-k/top-p kernel's per-program buffer;
# a card not listed is planned with the H100's 132, more than most smaller cards have (the safe side)
SM_COUNTS = {"t4": 40, "v100-16gb": 80, "v100-32gb": 80, "a10": 72, "a10g": 80, "l4": 58, "l40s": 142,
             "a100-40gb": 108, "a100-80gb": 108, "h100-80gb": 132, "h100-nvl": 132, "h200": 132, "rtx-3090": 82,
             "rtx-4090": 128, "rtx-5090": 170, "rtx-a6000": 84, "rtx-6000-ada": 142}
DEFAULT_SM_COUNT = 132


def triton_sampler_buffer_bytes(vocab_size: int, num_reqs: int, sm_count: int = DEFAULT_SM_COUNT) -> int:
    """The fp32 buffer ``apply_top_k_top_p_triton`` keeps for its programs (bytes): ``min(next_power_of_2(min(SMs,
    rows)), SMs)`` rows of the vocabulary, cached in ``_TRITON_BUFFER_CACHE`` and never freed
    (``vllm/v1/sample/ops/topk_topp_triton.py``, read at commit 08a57232; vLLM 0.19.0's H100 logs show the
    activation 0.11-0.12 GiB over the 12 B per logit without it).

    Example (Llama-3.1-8B, 1,024 requests, H100): 132 x 128,256 x 4 = 67,719,168 B.
    """
    programs = min(sm_count, num_reqs)
    rows = min(1 << max(programs - 1, 0).bit_length(), sm_count)
    return rows * pad_vocab(vocab_size) * 4


def sampler_peak_bytes(spec: ModelSpec, num_tokens: int, num_reqs: int, dtype_bytes: int,
                       sampler: str = "triton", sm_count: int = DEFAULT_SM_COUNT) -> int:
    """Peak of the dummy sampler run that follows the profile forward (bytes): the forward's hidden states
    (``num_tokens x hidden``) and the last positions (``num_reqs x hidden``) stay alive while the logits of
    ``num_reqs`` rows over the padded vocabulary are computed in the model dtype and sampled with top-k/top-p
    (:data:`SAMPLER_BYTES_PER_LOGIT` of the ``sampler`` path, and the Triton kernel's buffer on ``sm_count``
    SMs, :func:`triton_sampler_buffer_bytes`). Logits are gathered whole on every TP rank.

    Example (Llama-3.1-8B, 8,192 tokens, 256 requests, bf16, "triton", H100): hidden 67,108,864 + last 2,097,152 +
    logits 256 x 128,256 x (2 + 12) = 459,669,504 + buffer 132 x 128,256 x 4 = 67,719,168 -> 596,594,688 B.
    """
    h, dt = spec.hidden_size, dtype_bytes
    logits = num_reqs * pad_vocab(spec.vocab_size) * (dt + SAMPLER_BYTES_PER_LOGIT[sampler])
    if sampler == "triton":
        logits += triton_sampler_buffer_bytes(spec.vocab_size, num_reqs, sm_count)
    return num_tokens * h * dt + num_reqs * h * dt + logits
