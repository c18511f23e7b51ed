"""vLLM's KV cache on one worker: page sizes, KV cache groups, blocks, the tokens and concurrency it logs.

Source: vLLM 0.33.0 ``vllm/v1/kv_cache_interface.py``, ``vllm/v1/core/kv_cache_planning.py`` and
``vllm/v1/core/kv_cache_utils.py`` (the same arithmetic in vllm-project/vllm main at commit 001cabc1):

* page of one layer = ``2 x block_size x kv_heads x head_size x dtype`` (``AttentionSpec.real_page_size_bytes``);
  MLA stores one latent of ``kv_lora_rank + qk_rope_head_dim`` per token, not K and V
  (``MLAAttentionSpec``: ``block_size x 1 x head_size x dtype``), the same on every TP rank.
* all layers alike (``_get_kv_cache_groups_uniform_spec``): one group of every layer; a model with sliding and full
  layers (``_get_kv_cache_groups_uniform_page_size``): layers grouped by kind, each kind split into groups of
  ``group_size`` layers (the fewest layers of any kind, or the most when that is < 1.5 x the fewest), the last group
  of a kind padded.
* ``num_blocks = available // (page x group_size)`` (``get_kv_cache_config_from_groups``); the log line "GPU KV
  cache size: N tokens" is ``int(max_concurrency x max_model_len)`` in 0.33.0 (``get_kv_cache_capacity``); earlier
  V1 releases logged ``num_blocks // num_groups x block_size`` (``_report_kv_cache_config``), the same number for a
  model of one kind of layer when ``max_model_len`` is a multiple of the block size.
* a request of ``max_model_len`` needs ``cdiv(max_model_len, block)`` pages per full group and
  ``cdiv(min(window - 1 + max_num_batched_tokens, max_model_len), block) + 1`` per sliding group
  (``max_memory_usage_bytes``); "Maximum concurrency for L tokens per request: X" is ``num_blocks`` over the
  pages of one such request (``get_max_concurrency_for_kv_cache_config``). vLLM refuses to start when one request
  does not fit (``_check_enough_kv_cache_memory``: "To serve at least one request with the model's max seq len").
"""

from __future__ import annotations

from dataclasses import dataclass

from vramguard.engines.vllm_weights import kv_heads_per_rank
from vramguard.spec import ModelSpec


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KvGroup:
    """One KV cache group: ``num_layers`` layers (padding included) of one kind.

    Attributes:
        kind: ``full_attention``, ``sliding_attention`` or ``mla``.
        num_layers: layers in the group (the group size; padded groups count their padding).
        page_bytes: bytes of one block of one layer.
        sliding_window: tokens, for sliding groups.
    """

    kind: str
    num_layers: int
    page_bytes: int
    sliding_window: int | None = None

    def pages_per_request(self, max_model_len: int, max_num_batched_tokens: int, block_size: int) -> int:
        """Pages one request of ``max_model_len`` tokens holds in this group (``max_memory_usage_bytes``)."""
        if self.kind == "sliding_attention" and self.sliding_window:
            tokens = min(self.sliding_window - 1 + max_num_batched_tokens, max_model_len)
            return cdiv(tokens, block_size) + 1
        return cdiv(max_model_len, block_size)


def mla_head_size(spec: ModelSpec) -> int | None:
    """``kv_lora_rank + qk_rope_head_dim`` for an MLA model (DeepSeek-V2/V3 configs), else None."""
    cfg = spec.config_dict()
    rank, rope = cfg.get("kv_lora_rank"), cfg.get("qk_rope_head_dim")
    if isinstance(rank, int) and isinstance(rope, int) and rank > 0:
        return rank + rope
    return None


def page_bytes(spec: ModelSpec, tp: int, kv_dtype_bytes: int, block_size: int) -> int:
    """Bytes of one block of one layer on one rank.

    Example (Llama-3.1-8B, tp=1, bf16, block 16): 2 x 16 x 8 x 128 x 2 = 65,536 B.
    """
    mla = mla_head_size(spec)
    if mla:
        return block_size * mla * kv_dtype_bytes
    return 2 * block_size * kv_heads_per_rank(spec, tp) * spec.head_dim * kv_dtype_bytes


def kv_groups(spec: ModelSpec, layer_kinds: list[str], page: int, hybrid: bool = True) -> list[KvGroup]:
    """The KV cache groups of one worker holding layers of ``layer_kinds`` (the layers of its pipeline stage).

    ``hybrid=False`` is ``--disable-hybrid-kv-cache-manager``: sliding layers are kept whole, as full attention
    (``unify_hybrid_kv_cache_specs``). Example (Gemma-2-9B: 21 sliding and 21 full layers): group size 21, two
    groups. Gemma-3-27B (52 sliding, 10 full): group size 10, six sliding groups (the last padded by 8) and one
    full group.
    """
    if mla_head_size(spec):
        return [KvGroup("mla", len(layer_kinds), page)]
    kinds = [k if hybrid else "full_attention" for k in layer_kinds]
    if len(set(kinds)) == 1 and kinds:
        window = spec.sliding_window if kinds[0] == "sliding_attention" else None
        return [KvGroup(kinds[0], len(kinds), page, window)]
    counts = {k: kinds.count(k) for k in dict.fromkeys(kinds)}
    fewest, most = min(counts.values()), max(counts.values())
    size = most if most < fewest * 1.5 else fewest
    groups = []
    for kind, n in counts.items():
        window = spec.sliding_window if kind == "sliding_attention" else None
        groups += [KvGroup(kind, size, page, window) for _ in range(cdiv(n, size))]
    return groups


def padding_layers(layer_kinds: list[str], groups: list[KvGroup]) -> int:
    """Layers vLLM adds to fill the last group of each kind ("Add N padding layers, may waste ...")."""
    return sum(g.num_layers for g in groups) - len(layer_kinds) if len(groups) > 1 else 0


def num_blocks(groups: list[KvGroup], available_bytes: int) -> int:
    """``available // page // group_size`` (0 when nothing is available)."""
    if not groups or available_bytes <= 0:
        return 0
    size = max(g.num_layers for g in groups)
    return available_bytes // groups[0].page_bytes // size


def kv_tokens_by_blocks(groups: list[KvGroup], blocks: int, block_size: int) -> int:
    """"GPU KV cache size: N tokens" as V1 releases before 0.33 logged it: ``blocks // len(groups) x block_size``."""
    return blocks // len(groups) * block_size if groups else 0


def kv_tokens(groups: list[KvGroup], blocks: int, max_model_len: int, max_num_batched_tokens: int,
              block_size: int) -> int:
    """"GPU KV cache size: N tokens" as vLLM 0.33.0 logs it: ``int(max_concurrency x max_model_len)``.

    Example: 26,783 blocks, max_model_len 32,768, block 16 -> 26,783 / 2,048 x 32,768 = 428,528 tokens.
    """
    return int(max_concurrency(groups, blocks, max_model_len, max_num_batched_tokens, block_size) * max_model_len)


def pages_per_request(groups: list[KvGroup], max_model_len: int, max_num_batched_tokens: int,
                      block_size: int) -> int:
    """Blocks one request of ``max_model_len`` tokens takes across all groups."""
    return sum(g.pages_per_request(max_model_len, max_num_batched_tokens, block_size) for g in groups)


def max_concurrency(groups: list[KvGroup], blocks: int, max_model_len: int, max_num_batched_tokens: int,
                    block_size: int) -> float:
    """"Maximum concurrency for L tokens per request: X": ``blocks / pages_per_request``.

    Example: 127,626 blocks, 2,048 tokens per request, block 16 -> 127,626 / 128 = 997.08 (the log in
    github.com/vllm-project/vllm/pull/13596).
    """
    per = pages_per_request(groups, max_model_len, max_num_batched_tokens, block_size)
    return blocks / per if per else 0.0


def request_kv_bytes(groups: list[KvGroup], max_model_len: int, max_num_batched_tokens: int,
                     block_size: int) -> int:
    """KV bytes one request of ``max_model_len`` tokens needs on this worker (what vLLM checks at start)."""
    if not groups:
        return 0
    size = max(g.num_layers for g in groups)
    return size * groups[0].page_bytes * pages_per_request(groups, max_model_len, max_num_batched_tokens, block_size)


def largest_model_len(groups: list[KvGroup], available_bytes: int, max_model_len: int,
                      max_num_batched_tokens: int, block_size: int) -> int:
    """The longest ``max_model_len`` whose one request fits in ``available_bytes`` (vLLM's binary search in
    ``estimate_max_model_len``), 0 when not even one token fits."""
    lo, hi, best = 1, max_model_len, 0
    while lo <= hi:
        mid = (lo + hi) // 2
        if request_kv_bytes(groups, mid, max_num_batched_tokens, block_size) <= available_bytes:
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    return best
