"""Size the paged KV pool of the serving engine from the memory budget.

transformers' continuous-batching engine sizes its pool from "a percentage of whatever is free" unless it is given
``num_blocks``; here the pool is what is left of the budget once the weights, the runtime and the largest step of
the engine (``max_batch_tokens`` query tokens reading the whole pool) are paid for.

Cost of one engine step, in bytes (a = activation bytes per element, M = max_batch_tokens, N = pool tokens,
R = max requests per step, V = vocab):

* per batch token: the largest of the attention peak ``a x (hidden + heads x head_dim + 2 x kv_heads x head_dim
  + kv_read_heads x head_dim)`` and the MLP peak ``a x (hidden + 3 x intermediate)`` (gate, up and their product
  live together), plus the residual stream ``2 x a x hidden`` and 48 B of index tensors. The attention peak and
  the index tensors follow transformers' ``PagedAttentionMemoryHandler`` (continuous_batching/cache.py, 5.24);
  the MLP term is ours: that handler leaves it out, and for Llama-3-8B it is the larger of the two.
* the pool itself: transformers' ``PagedAttentionCache`` tensor for the blocks, with its sectors and trash
  sectors (:func:`vramguard.memory.kv.paged_pool_bytes`; every layer sized in full,
  :func:`vramguard.memory.kv.paged_block_bytes`).
* per pool token: the KV itself, ``layers x 2 x kv_heads x head_dim x a`` (the block over its tokens); plus,
  when attention is not FlashAttention, the key/value states read back from the pool for one layer with KV heads
  repeated to the query heads (``(2 x heads + kv_heads) x head_dim x a``, same handler) and one column of the
  ``[M, N + M]`` attention mask (``M x a``).
* per request row of logits: ``V x 34`` B: the float32 logits, the temperature-scaled copy, top-k/top-p sort values
  (float32) and indices (int64), softmax, cumulative sum, masks and the sampling probabilities.
* the caching allocator's reserve on the step's transient memory:
  :func:`vramguard.memory.runtime.allocator_reserve_bytes`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from vramguard.errors import Infeasible
from vramguard.memory.kv import paged_block_bytes, paged_pool_bytes
from vramguard.memory.runtime import allocator_reserve_bytes
from vramguard.units import MiB, fmt_bytes, fmt_gib

LOGIT_ROW_BYTES_PER_VOCAB = 34
INDEX_BYTES_PER_BATCH_TOKEN = 48
GRAPH_MARGIN_BYTES = 256 * MiB  # CUDA-graph pools and kernel workspaces of the engine on a GPU (not modelled)


@dataclass
class PoolPlan:
    """The paged KV pool chosen for a budget. All sizes in bytes, counts in blocks/tokens.

    Attributes:
        usable_bytes: budget left after the weights and runtime already allocated.
        page_size: tokens per block. num_blocks: blocks in the pool. pool_tokens: ``num_blocks x page_size``.
        kv_bytes_per_token: KV of one token over all layers. pool_bytes: the cache tensor transformers allocates
            for ``num_blocks`` (:func:`~vramguard.memory.kv.paged_pool_bytes`: the blocks and two trash sectors).
        step_peak_bytes: the largest step's transient memory (activations, mask, read-back KV, logits).
        reserve_bytes: allocator reserve on top of it. margin_bytes: fixed margin for CUDA graphs (GPU only).
        max_batch_tokens, max_requests: the step limits the engine is given.
        source: how the budget was decided (``vram_budget=``, the card's free memory, or host RAM on the CPU).
    """

    usable_bytes: int
    page_size: int
    num_blocks: int
    pool_tokens: int
    kv_bytes_per_token: int
    pool_bytes: int
    step_peak_bytes: int
    reserve_bytes: int
    margin_bytes: int
    max_batch_tokens: int
    max_requests: int
    source: str

    def as_dict(self) -> dict:
        """Every field, for /health and JSON output."""
        return asdict(self)

    def summary(self) -> str:
        """One line for the server's start: blocks, tokens, bytes, what is left beside them, and the budget source."""
        return (f"KV pool {self.num_blocks} blocks x {self.page_size} tokens = {self.pool_tokens:,} tokens "
                f"({fmt_gib(self.pool_bytes)}) of {fmt_gib(self.usable_bytes)} usable ({self.source}); "
                f"step peak {fmt_gib(self.step_peak_bytes)} + reserve {fmt_gib(self.reserve_bytes)}")


def _step_bytes(spec, a: int, flash: bool, m: int, n: int, r: int) -> tuple[int, int]:
    """(transient bytes of the largest step, its largest single allocation) for M=m, N=n, R=r."""
    hd, h = spec.head_dim, spec.hidden_size
    kv_read_heads = 2 * spec.num_kv_heads if flash else 2 * spec.num_heads + spec.num_kv_heads
    attention = a * (h + spec.num_heads * hd + 2 * spec.num_kv_heads * hd + kv_read_heads * hd)
    inter = max(spec.intermediate_size, spec.moe_intermediate_size * max(spec.num_experts_per_tok, 1))
    mlp = a * (h + 3 * inter)
    per_batch = max(attention, mlp) + 2 * a * h + INDEX_BYTES_PER_BATCH_TOKEN
    read_back = 0 if flash else (2 * spec.num_heads + spec.num_kv_heads) * hd * a
    mask = 0 if flash else m * (n + m) * a
    logits = r * spec.vocab_size * LOGIT_ROW_BYTES_PER_VOCAB
    transient = m * per_batch + n * read_back + mask + logits
    largest = max(mask, m * inter * a, n * spec.num_heads * hd * a if not flash else 0, r * spec.vocab_size * 8)
    return transient, largest


def smaller_weights_fix(quant: str | None, on_cuda: bool) -> str:
    """The end of a fix that frees room by loading smaller weights, for weights loaded as ``quant``: none for 4-bit
    weights; NF4 on a CUDA device; on the CPU 16-bit weights, none for them (NF4 dequantizes every weight at each
    step there: `vramguard run` of SmolLM2-135M, 10 tokens, decoded 200.6 ms/token in NF4 against 131.7 in float32
    and 42.1 in bf16 on a 2-core AVX2 CPU, 2026-12-03)."""
    if quant in ("nf4", "fp4") or (not on_cuda and quant in ("bf16", "fp16")):
        return ""
    return ", or quantize the weights (quant=nf4)" if on_cuda else \
        ", or load 16-bit weights (quant=bf16: half of float32's memory)"


def plan_pool(spec, usable_bytes: int, *, act_bytes: int = 2, flash: bool = False, page_size: int = 256,
              max_batch_tokens: int = 2048, max_requests: int = 64, on_cuda: bool = True,
              source: str = "vram_budget=", smaller: str = ", or quantize the weights") -> PoolPlan:
    """The largest pool that fits ``usable_bytes`` with the engine's largest step beside it.

    Args:
        spec: the model's :class:`~vramguard.spec.ModelSpec`.
        usable_bytes: bytes left for the pool and the steps (budget minus what is allocated after loading).
        act_bytes: bytes per activation/KV element (2 for bf16/fp16, 4 for fp32).
        flash: attention reads the pool natively (FlashAttention); else read-back and mask terms are counted.
        page_size, max_batch_tokens, max_requests: the engine's block size and step limits.
        smaller: the end of the refusal's fix that loads smaller weights (:func:`smaller_weights_fix`).

    Raises:
        Infeasible: not even one request of ``page_size`` tokens fits; the message gives the numbers and the fix.
    """
    kv_tok = paged_block_bytes(spec, page_size, act_bytes) // page_size
    margin = GRAPH_MARGIN_BYTES if on_cuda else 0
    n = 0
    for _ in range(4):  # the reserve depends on n: iterate to a fixed point (decreasing)
        transient, largest = _step_bytes(spec, act_bytes, flash, max_batch_tokens, n, max_requests)
        reserve = allocator_reserve_bytes(transient, largest) if on_cuda else 0
        fixed, _ = _step_bytes(spec, act_bytes, flash, max_batch_tokens, 0, max_requests)
        per_tok = (_step_bytes(spec, act_bytes, flash, max_batch_tokens, 1, max_requests)[0] - fixed) + kv_tok
        left = usable_bytes - margin - fixed - (reserve - 0)
        new_n = max(left // per_tok, 0)
        if new_n == n:
            break
        n = new_n
    blocks = max(n, 0) // page_size
    while True:  # the fixed point from above, now with the pool as transformers allocates it
        transient, largest = _step_bytes(spec, act_bytes, flash, max_batch_tokens, blocks * page_size, max_requests)
        reserve = allocator_reserve_bytes(transient, largest) if on_cuda else 0
        pool_bytes = paged_pool_bytes(spec, max(blocks, 1), page_size, act_bytes)
        if blocks < 1 or pool_bytes + transient + reserve + margin <= usable_bytes:
            break
        blocks -= 1
    if blocks < 1:
        need = pool_bytes + transient + reserve + margin
        raise Infeasible("vram_budget", f"{usable_bytes:,} B left after the weights",
                         f"at least {need:,} B ({fmt_bytes(need)}) for one {page_size}-token block beside the largest "
                         f"step ({max_batch_tokens} batch tokens, {max_requests} requests)",
                         f"raise vram_budget= by at least {fmt_bytes(need - usable_bytes)}, lower max_batch_tokens= "
                         f"or max_running={smaller}")
    return PoolPlan(usable_bytes=usable_bytes, page_size=page_size, num_blocks=blocks, pool_tokens=blocks * page_size,
                    kv_bytes_per_token=kv_tok, pool_bytes=pool_bytes, step_peak_bytes=transient,
                    reserve_bytes=reserve, margin_bytes=margin, max_batch_tokens=max_batch_tokens,
                    max_requests=max_requests, source=source)


def blocks_needed(tokens: int, page_size: int) -> int:
    """Blocks a request of ``tokens`` (prompt + max new tokens) holds at its end: ``ceil(tokens / page_size)``."""
    return math.ceil(tokens / page_size)
