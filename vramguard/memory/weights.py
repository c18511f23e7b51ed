"""Weight memory by quantization, with the modules that stay unquantized and the quantization state.

Every size is an int of bytes as the CUDA caching allocator accounts it: each tensor is rounded up to 512 B
(``kMinBlockSize`` in c10/cuda/CUDACachingAllocator.cpp).

bitsandbytes layouts (bitsandbytes 0.4x-0.50, ``functional.quantize_4bit`` / ``Int8Params``):

* 4-bit (NF4/FP4): two weights per byte, ``ceil(n / 2)`` B; one absmax per block of 64 weights
  (``blocksize=64``). Without double quant the absmax are float32 (4 B per block). With double quant the absmax
  are quantized to uint8 (1 B per block) with a second level of one float32 absmax per 256 blocks, a 256-entry
  float32 code (1,024 B) and a float32 offset; each weight also keeps its 16-entry float32 code.
* 8-bit (LLM.int8): one int8 per weight plus one float32 scale per output row (``SCB``).

transformers keeps ``lm_head`` (and so tied embeddings) unquantized (``get_keys_to_not_convert``); embeddings
and norms are not ``nn.Linear`` and stay in the model dtype. MoE routers and the fused 3-D expert parameters of
transformers 5 (``MixtralExperts.gate_up_proj``...) are not ``nn.Linear`` either and stay unquantized.
"""

from __future__ import annotations

from dataclasses import dataclass

from vramguard.settings import DTYPE_BYTES, Settings
from vramguard.spec import ModelSpec

ALLOC_ROUND = 512  # bytes; CUDA caching allocator minimum block (kMinBlockSize)
BNB_4BIT_BLOCKSIZE = 64  # weights per absmax (bitsandbytes Params4bit default on CUDA)
BNB_DQ_BLOCKSIZE = 256  # absmax values per second-level absmax (quantize_blockwise in double quant)


def rounded(nbytes: int) -> int:
    """Bytes the caching allocator reserves for one tensor of ``nbytes``: ceil to a multiple of 512."""
    return -(-nbytes // ALLOC_ROUND) * ALLOC_ROUND


@dataclass(frozen=True)
class LinearGroup:
    """``count`` matrices of shape (out_features, in_features) in the whole model."""

    name: str
    out_features: int
    in_features: int
    count: int
    bias: bool = False
    quantizable: bool = True

    @property
    def numel(self) -> int:
        return self.out_features * self.in_features


def quantized_tensor_bytes(numel: int, quant: str, double_quant: bool, out_features: int) -> tuple[int, int]:
    """(weight bytes, quantization-state bytes) of one quantized matrix of ``numel`` weights.

    4-bit: weight ``ceil(numel/2)``; state = absmax ``nblocks`` x (1 B with double quant, else 4 B) with
    ``nblocks = ceil(numel/64)``, plus with double quant ``ceil(nblocks/256) x 4`` B second-level absmax, a
    1,024 B code and a 4 B offset; plus the 64 B 4-bit code. 8-bit: weight ``numel`` B, state ``out_features x 4``.
    Each tensor is rounded to 512 B.

    Example (Llama-2-7B q_proj, 4096 x 4096 = 16,777,216 weights, NF4 + double quant):
    weight 8,388,608 B; nblocks 262,144 -> absmax 262,144 B, second level 1,024 x 4 = 4,096 B,
    code2 1,024 B, offset 512 B (rounded), code 512 B (rounded) -> state 268,288 B.
    """
    if quant == "int8":
        return rounded(numel), rounded(out_features * 4)
    nblocks = -(-numel // BNB_4BIT_BLOCKSIZE)
    state = rounded(16 * 4)  # the NF4/FP4 code of this tensor
    if double_quant:
        state += rounded(nblocks) + rounded(-(-nblocks // BNB_DQ_BLOCKSIZE) * 4) + rounded(256 * 4) + rounded(4)
    else:
        state += rounded(nblocks * 4)
    return rounded(-(-numel // 2)), state


@dataclass(frozen=True)
class WeightBytes:
    """Weight memory on the GPU, by component (bytes).

    ``total_bytes = quantized_linear_bytes + quant_state_bytes + dense_linear_bytes + embedding_bytes
    + lm_head_bytes + norm_bytes + bias_bytes + buffer_bytes``. ``buffer_bytes``: registered buffers (rotary
    ``inv_freq``...), counted by the generic path only (a few KiB).
    """

    quantized_linear_bytes: int
    quant_state_bytes: int
    dense_linear_bytes: int
    embedding_bytes: int
    lm_head_bytes: int
    norm_bytes: int
    bias_bytes: int
    parameter_count: int
    quantized_parameter_count: int
    buffer_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return (self.quantized_linear_bytes + self.quant_state_bytes + self.dense_linear_bytes
                + self.embedding_bytes + self.lm_head_bytes + self.norm_bytes + self.bias_bytes + self.buffer_bytes)




def linear_groups(spec: ModelSpec) -> list[LinearGroup]:
    """All projection matrices of a hand-written family's model, grouped by shape (decoder layers, experts and
    lm_head)."""
    h, nh, nkv, d, n = spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.num_layers
    g: list[LinearGroup] = []
    if spec.fused_qkv:
        g.append(LinearGroup("qkv_proj", (nh + 2 * nkv) * d, h, n, spec.qkv_bias))
    else:
        g += [LinearGroup("q_proj", nh * d, h, n, spec.qkv_bias),
              LinearGroup("k_proj", nkv * d, h, n, spec.qkv_bias),
              LinearGroup("v_proj", nkv * d, h, n, spec.qkv_bias)]
    g.append(LinearGroup("o_proj", h, nh * d, n, spec.o_bias))
    if spec.is_moe:
        i = spec.moe_intermediate_size
        g += [LinearGroup("experts.gate_up", 2 * i, h, n * spec.num_experts, quantizable=False),
              LinearGroup("experts.down", h, i, n * spec.num_experts, quantizable=False),
              LinearGroup("router", spec.num_experts, h, n, quantizable=False)]
        if spec.shared_expert_intermediate_size:
            si = spec.shared_expert_intermediate_size
            g += [LinearGroup("shared_expert.gate_up", 2 * si, h, n), LinearGroup("shared_expert.down", h, si, n),
                  LinearGroup("shared_expert_gate", 1, h, n, quantizable=False)]
    else:
        i = spec.intermediate_size
        if spec.fused_gate_up:
            g.append(LinearGroup("gate_up_proj", 2 * i, h, n, spec.mlp_bias))
        else:
            g += [LinearGroup("gate_proj", i, h, n, spec.mlp_bias), LinearGroup("up_proj", i, h, n, spec.mlp_bias)]
        g.append(LinearGroup("down_proj", h, i, n, spec.mlp_bias))
    if not spec.tie_word_embeddings:
        g.append(LinearGroup("lm_head", spec.vocab_size, h, 1, quantizable=False))
    return g


def parameter_count(spec: ModelSpec) -> int:
    """Number of parameters (tied embeddings counted once), as ``model.num_parameters()`` reports."""
    n = sum(grp.numel * grp.count + (grp.out_features * grp.count if grp.bias else 0) for grp in linear_groups(spec))
    return n + spec.vocab_size * spec.hidden_size + _norm_numel(spec)


def _norm_numel(spec: ModelSpec) -> int:
    per_layer = spec.norms_per_layer * spec.hidden_size + (2 * spec.head_dim if spec.qk_norm else 0)
    return spec.num_layers * per_layer + spec.hidden_size


def weight_bytes(spec: ModelSpec, s: Settings) -> WeightBytes:
    """Weight memory of a hand-written family's ``spec`` loaded with ``s.quant`` (see the module docstring for each
    layout).

    Unquantized modules (embeddings, lm_head, norms, biases, routers) take ``s.dtype`` bytes per value.
    Example (Llama-2-7B, NF4 + double quant, bf16): 224 quantized matrices with 6,476,005,376 weights ->
    3,238,002,688 B packed + 107,868,160 B state; embeddings and lm_head 2 x 32,000 x 4,096 x 2 =
    524,288,000 B; norms (2 x 32 + 1) x 4,096 x 2 = 532,480 B (each rounded to 512 B) -> 3,870,691,328 B.
    Measured after load on an H200: 3,876,562,944 B (benchmarks/results).

    transformers 5 stores MoE experts as fused 3-D parameters, which bitsandbytes does not convert: they stay in
    ``s.act_dtype`` (``integrations/bitsandbytes.py::replace_with_bnb_linear`` swaps ``nn.Linear`` only).
    """
    dt = DTYPE_BYTES[s.act_dtype]
    q_lin = q_state = dense = bias = n_q = 0
    lm_head = 0
    for grp in linear_groups(spec):
        if grp.bias:
            bias += grp.count * rounded(grp.out_features * dt)
        if grp.name == "lm_head":
            lm_head = rounded(grp.numel * dt)
            continue
        if s.is_bnb and grp.quantizable:
            w, st = quantized_tensor_bytes(grp.numel, s.quant, s.double_quant, grp.out_features)
            q_lin += grp.count * w
            q_state += grp.count * st
            n_q += grp.count * grp.numel
        else:
            dense += grp.count * rounded(grp.numel * DTYPE_BYTES[s.weight_dtype] if grp.quantizable else grp.numel * dt)
    embed = rounded(spec.vocab_size * spec.hidden_size * dt)
    per_layer_norms = spec.norms_per_layer * rounded(spec.hidden_size * dt)
    if spec.qk_norm:
        per_layer_norms += 2 * rounded(spec.head_dim * dt)
    norms = spec.num_layers * per_layer_norms + rounded(spec.hidden_size * dt)
    return WeightBytes(q_lin, q_state, dense, embed, lm_head, norms, bias, parameter_count(spec), n_q)
