"""KV cache memory.

For one layer holding ``n`` tokens of ``seqs`` sequences, keys and values are two tensors of shape
``(seqs, num_kv_heads, n, head_dim)``:

    16-bit:     2 x seqs x num_kv_heads x n x head_dim x 2 B
    quantized:  2 x seqs x num_kv_heads x head_dim x [n_q x bits/8 + n_q / group x 2 x 2 B + n_r x 2 B]

where the quantized cache (transformers ``QuantizedCache``, quanto/HQQ backends) keeps the last
``residual_length`` tokens (``n_r``) in 16-bit and the rest (``n_q``) at ``bits`` with one 16-bit scale and one
16-bit zero-point per group of ``q_group_size`` values (``axis=0`` grouping). The format's overhead is thus
``4 / group`` B per value: 0.0625 B for groups of 64 (int8: 1.0625 B, int4: 0.5625 B per value).

Layer lengths (transformers 5 ``cache_utils``): full-attention layers hold every token. A dynamic cache's
sliding layer (``DynamicSlidingWindowLayer``) keeps the last ``sliding_window - 1`` tokens after each update,
but during a prefill forward it holds the whole chunk plus that window (the kept slice is a view of the
concatenation). A static cache preallocates ``max_cache_len`` tokens per full layer and
``min(sliding_window, max_cache_len)`` per sliding layer (``StaticSlidingWindowLayer``). An offloaded cache keeps
the layer in use and the one being prefetched on the GPU and the rest in CPU RAM.
"""

from __future__ import annotations

from dataclasses import dataclass

from vramguard.memory.weights import rounded
from vramguard.settings import DTYPE_BYTES, KV_BITS, Settings
from vramguard.spec import ModelSpec

SCALE_ZERO_BYTES = 2 * 2  # one 16-bit scale and one 16-bit zero-point per group (quantized KV cache)


@dataclass(frozen=True)
class KvBytes:
    """KV cache bytes on the GPU (``gpu_bytes``) and in CPU RAM (``cpu_bytes``, offloaded cache)."""

    gpu_bytes: int
    cpu_bytes: int
    full_layer_bytes: int
    sliding_layer_bytes: int
    tokens: int
    largest_tensor_bytes: int = 0




def layer_tokens(spec: ModelSpec, layer_type: str, n_tokens: int, s: Settings, in_prefill_chunk: int = 0) -> int:
    """Tokens one layer holds when ``n_tokens`` have been processed.

    ``in_prefill_chunk``: tokens of the forward that just ran (a dynamic sliding layer still holds them all).
    """
    if layer_type != "sliding_attention" or spec.sliding_window is None:
        return s.cache_len if s.cache == "static" else n_tokens
    w = spec.sliding_window
    if s.cache == "static":
        return min(w, s.cache_len)
    kept = min(n_tokens, w - 1)
    if in_prefill_chunk:
        kept = min(n_tokens, max(w - 1, 0) + in_prefill_chunk)
    return kept


def kv_tensor_bytes(spec: ModelSpec, s: Settings, n_tokens: int, kv_dtype: str | None = None,
                    residual: int | None = None) -> int:
    """Bytes of one K (or V) tensor of one layer holding ``n_tokens`` (allocator-rounded).

    16-bit: ``seqs x num_kv_heads x n_tokens x head_dim x 2``. Quantized: see the module docstring;
    ``residual`` is the number of tokens still in 16-bit (default: ``residual_length``; 0 right after the
    prefill, which quantizes the whole prompt).
    """
    kv = kv_dtype or s.resolved_kv_dtype
    values_per_token = s.sequences * spec.num_kv_heads * spec.head_dim
    if kv in ("bf16", "fp16", "fp32"):
        return rounded(values_per_token * n_tokens * DTYPE_BYTES[kv])
    resid = min(n_tokens, s.kv_residual_length if residual is None else residual)
    quant = n_tokens - resid
    q_bytes = -(-values_per_token * quant * KV_BITS[kv] // 8)
    scale_bytes = -(-values_per_token * quant // s.kv_group_size) * SCALE_ZERO_BYTES
    resid_bytes = values_per_token * resid * DTYPE_BYTES[s.act_dtype if s.act_dtype != "fp32" else "bf16"]
    return rounded(q_bytes) + rounded(scale_bytes) + rounded(resid_bytes)


def kv_per_layer(spec: ModelSpec, s: Settings, n_tokens: int, in_prefill_chunk: int = 0) -> tuple[int, ...]:
    """Bytes of keys and values of each layer after ``n_tokens`` (they sum to :func:`kv_cache_bytes`'s total):
    ``2 x`` :func:`kv_tensor_bytes` of the tokens the layer holds (:func:`layer_tokens`)."""
    return tuple(2 * kv_tensor_bytes(spec, s, layer_tokens(spec, lt, n_tokens, s, in_prefill_chunk),
                                     residual=0 if in_prefill_chunk >= n_tokens else None)
                 for lt in spec.layer_types)


def kv_cache_bytes(spec: ModelSpec, s: Settings, n_tokens: int, in_prefill_chunk: int = 0) -> KvBytes:
    """KV cache of all layers after ``n_tokens`` tokens (keys and values, all sequences).

    Example (Llama-3.1-70B, 131,072 tokens, bf16): 80 layers x 2 x 8 heads x 131,072 x 128 x 2 B
    = 42,949,672,960 B = 40.00 GiB.
    """
    per_layer = kv_per_layer(spec, s, n_tokens, in_prefill_chunk)
    full = sum(b for b, lt in zip(per_layer, spec.layer_types) if lt != "sliding_attention")
    sliding = sum(per_layer) - full
    total = full + sliding
    largest = max(per_layer) // 2 if per_layer else 0
    if s.cache == "offloaded":
        on_gpu = sum(sorted(per_layer)[-2:])  # the layer in use and the one prefetched
        return KvBytes(on_gpu, total, full, sliding, n_tokens, largest)
    return KvBytes(total, 0, full, sliding, n_tokens, largest)


def kv_bytes_per_token(spec: ModelSpec, s: Settings) -> int:
    """Bytes one more token adds to the cache over all full-attention layers (the steady decode growth)."""
    n_full = sum(1 for t in spec.layer_types if t != "sliding_attention")
    values = 2 * n_full * s.sequences * spec.num_kv_heads * spec.head_dim
    kv = s.resolved_kv_dtype
    if kv in ("bf16", "fp16", "fp32"):
        return values * DTYPE_BYTES[kv]
    return values * KV_BITS[kv] // 8 + values * SCALE_ZERO_BYTES // s.kv_group_size


def kv_growth_per_token(spec: ModelSpec, s: Settings, n_tokens: int) -> dict[str, int]:
    """Bytes the next token adds to the cache once ``n_tokens`` are held, per layer type (``full_attention``,
    ``sliding_attention``; only the types the model has): the growth a user sees at that length. A dynamic sliding
    layer grows until it holds ``sliding_window - 1`` tokens, then adds nothing; a static cache never grows.

    Example (Gemma-2-9B: 21 full + 21 sliding layers, 8 KV heads x head_dim 256, window 4,096, bf16, batch 1):
    at 384 tokens each layer type adds 21 x 2 x 8 x 256 x 2 B = 172,032 B; at 8,192 tokens the sliding layers add 0.
    """
    values = 2 * s.sequences * spec.num_kv_heads * spec.head_dim
    kv = s.resolved_kv_dtype
    per_layer = (values * DTYPE_BYTES[kv] if kv in ("bf16", "fp16", "fp32")
                 else values * KV_BITS[kv] // 8 + values * SCALE_ZERO_BYTES // s.kv_group_size)
    out: dict[str, int] = {}
    for lt in spec.layer_types:
        key = "sliding_attention" if lt == "sliding_attention" and spec.sliding_window is not None else "full_attention"
        grows = s.cache != "static" and layer_tokens(spec, lt, n_tokens + 1, s) > layer_tokens(spec, lt, n_tokens, s)
        out[key] = out.get(key, 0) + (per_layer if grows else 0)
    return out


PAGED_TRASH_SECTORS = 2  # sectors before the data that padding tokens write to; never given to a request
PAGED_SECTOR_ALIGN_BYTES = 128


def paged_block_bytes(spec: ModelSpec, page_size: int, kv_element_bytes: int) -> int:
    """Bytes one block of transformers' paged KV pool (continuous batching's ``PagedAttentionCache``) holds:
    ``page_size`` tokens of keys and values for every layer of the model, sliding or not,
    ``num_layers x 2 x kv_heads x head_dim x kv_element_bytes x page_size`` (transformers 5.24:
    ``bytes_per_block = num_hidden_layers x FullAttentionCacheAllocator.get_bytes_per_page(...)`` in
    ``continuous_batching/cache.py``; the pool's ``num_blocks`` is counted in these blocks).

    Sliding-window layers are sized in full here, as transformers sizes them: what they save (a request's sliding
    layers hold at most ``ceil(sliding_window / page_size)`` pages each) frees blocks while requests run, which is
    admission's business, not the pool's size.

    Example (Llama-3-8B, bf16, pages of 256 tokens): 32 x 2 x 8 x 128 x 2 B x 256 = 33,554,432 B (32 MiB).
    """
    return spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * kv_element_bytes * page_size


def paged_pool_bytes(spec: ModelSpec, num_blocks: int, page_size: int, kv_element_bytes: int) -> int:
    """Bytes of the one cache tensor ``PagedAttentionCache`` allocates for ``num_blocks`` blocks
    (:func:`paged_block_bytes`), as transformers 5.24 does it: each attention type's layers share an allocator
    whose block is ``layers of that type x page bytes``; a sector is ``lcm(every allocator's block, 128)`` bytes;
    the pool is ``ceil(num_blocks x block / sector)`` sectors plus :data:`PAGED_TRASH_SECTORS` trash sectors.

    Example (Gemma-2 style, 2 sliding + 2 full layers, 2 KV heads x head_dim 16, bf16, pages of 32 tokens, 10
    blocks): a page is 2 x 2 x 16 x 2 B x 32 = 4,096 B, each allocator's block 2 x 4,096 = 8,192 B = the sector;
    a block is 4 x 4,096 = 16,384 B, so 10 blocks take 20 sectors, and the tensor 22 x 8,192 = 180,224 B.
    A model of one attention type allocates ``(num_blocks + 2) x block`` whenever the block is a multiple of 128 B;
    transformers 5.17 (one tensor per layer of a group, groups of ``gcd`` layers) allocates the same for it.
    """
    import math
    page = 2 * spec.num_kv_heads * spec.head_dim * kv_element_bytes * page_size
    counts: dict[str, int] = {}
    for kind in spec.layer_types or ("full_attention",) * spec.num_layers:
        counts[kind] = counts.get(kind, 0) + 1
    sector = math.lcm(*(n * page for n in counts.values()), PAGED_SECTOR_ALIGN_BYTES)
    sectors = max(1, -(-num_blocks * paged_block_bytes(spec, page_size, kv_element_bytes) // sector))
    return (sectors + PAGED_TRASH_SECTORS) * sector
