"""What the hand-written memory model (:mod:`~vramguard.memory.weights`, :mod:`~vramguard.memory.kv`,
:mod:`~vramguard.memory.forward`) and the one taken from transformers (:mod:`vramguard.introspect`) share: the
caching allocator's rounding, bitsandbytes' layout of one quantized tensor, the quantized KV cache's scale and
zero-point, when SDPA runs its math kernel, and the result types. Importing nothing of either side, it lets the
hand model hand a generic spec to :mod:`vramguard.introspect` without an import cycle.
"""

from __future__ import annotations

from dataclasses import dataclass

from vramguard.settings import Settings

ALLOC_ROUND = 512  # bytes; CUDA caching allocator minimum block (kMinBlockSize)
BNB_4BIT_BLOCKSIZE = 64  # weights per absmax (bitsandbytes Params4bit default on CUDA)
BNB_DQ_BLOCKSIZE = 256  # absmax values per second-level absmax (quantize_blockwise in double quant)
# bitsandbytes 0.50 ``gemm_4bit`` on CUDA (``bitsandbytes/backends/cuda/ops.py``: ``_GEMM_4BIT_CUSTOM_FLOOR_M``): up to
# this many rows of input the fused 4-bit kernel runs on every CUDA GPU and no weight is dequantized; above it a
# per-architecture rule picks the kernel or ``dequantize_4bit`` + ``linear`` (up to 1,536 rows), then always the
# latter, which the model assumes. H200 traces (benchmarks/README.md): no dequantized weight in batch-4 decode.
BNB_4BIT_FUSED_MAX_ROWS = 4
SCALE_ZERO_BYTES = 2 * 2  # one 16-bit scale and one 16-bit zero-point per group (quantized KV cache)


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


@dataclass(frozen=True)
class KvBytes:
    """KV cache bytes on the GPU (``gpu_bytes``) and in CPU RAM (``cpu_bytes``, offloaded cache)."""

    gpu_bytes: int
    cpu_bytes: int
    full_layer_bytes: int
    sliding_layer_bytes: int
    tokens: int
    largest_tensor_bytes: int = 0


@dataclass(frozen=True)
class ForwardPeak:
    """Peak bytes of one forward above the weights, by component (``components`` sums to ``peak_bytes``)."""

    phase: str
    past_tokens: int
    chunk_tokens: int
    peak_bytes: int
    components: dict[str, int]
    at: str
    largest_alloc: int


def sdpa_runs_math(s: Settings) -> bool:
    """SDPA runs its math kernel (float32 scores): pinned to math, or float32 activations with a pinned flash or
    cuDNN kernel (both need 16-bit inputs). Otherwise a flash-class kernel runs (memory-efficient accepts float32
    and masks)."""
    return s.sdpa_kernel == "math" or (s.act_dtype == "fp32" and s.sdpa_kernel in ("flash", "cudnn"))
