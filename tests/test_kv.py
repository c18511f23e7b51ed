"""KV cache: exact bytes for GQA, head_dim overrides, sliding and hybrid layers, quantized and static caches."""

import copy

import pytest

from vramguard.memory.kv import kv_bytes_per_token, kv_cache_bytes, layer_tokens
from vramguard.resolve import resolve_model
from vramguard.settings import Settings
from vramguard.units import GiB


def test_c6_llama31_70b_128k_bf16():
    # 131,072 x 80 layers x 2 (K, V) x 8 KV heads x 128 head_dim x 2 B = 42,949,672,960 B = 40.00 GiB
    spec = resolve_model("llama-3.1-70b")
    kv = kv_cache_bytes(spec, Settings(quant="nf4", prompt_tokens=131_072 - 256, max_new_tokens=256), 131_072)
    assert kv.gpu_bytes == 131_072 * 80 * 2 * 8 * 128 * 2 == 42_949_672_960
    assert kv.gpu_bytes / GiB == 40.0


def test_c6_quantized_kv_with_group_scales():
    """int8/int4 QuantizedCache: 1 or 0.5 B per value, plus a 16-bit scale and zero-point per group of 64 values
    (0.0625 B per value), plus the last 128 tokens (residual_length) in 16-bit."""
    spec = resolve_model("llama-3.1-70b")
    values_per_token = 80 * 2 * 8 * 128  # 163,840 values per token over the model
    quant_tokens = 131_072 - 128
    resid = 128 * values_per_token * 2  # 41,943,040 B
    for kv_dtype, bits in (("int8", 8), ("int4", 4)):
        s = Settings(kv_dtype=kv_dtype, prompt_tokens=131_000, max_new_tokens=72)
        got = kv_cache_bytes(spec, s, 131_072).gpu_bytes
        expected = quant_tokens * values_per_token * bits // 8 + quant_tokens * values_per_token // 64 * 4 + resid
        assert abs(got - expected) <= 80 * 2 * 3 * 512  # per-tensor allocator rounding only
    int8 = kv_cache_bytes(spec, Settings(kv_dtype="int8", prompt_tokens=131_000, max_new_tokens=72), 131_072)
    int4 = kv_cache_bytes(spec, Settings(kv_dtype="int4", prompt_tokens=131_000, max_new_tokens=72), 131_072)
    # about half (1.0625 / 2 = 0.53) and about a quarter (0.5625 / 2 = 0.28) of the 40 GiB
    assert 0.52 < int8.gpu_bytes / (40 * GiB) < 0.54
    assert 0.27 < int4.gpu_bytes / (40 * GiB) < 0.29


@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
def test_quantized_cache_of_the_strategies_holds_the_planned_format(kv_dtype):
    """The cache transformers builds for generate's int8 and int4 strategies (their own cache_config) holds the
    bytes of kv_tensor_bytes for the tokens it has quantized and those still in 16-bit; the plan's bound (the whole
    residual window in 16-bit) is above it. Tiny bf16 Llama: 2 layers, 1 KV head x head_dim 64 = 64 values a token."""
    import torch
    import transformers

    from vramguard.memory.kv import kv_tensor_bytes
    from vramguard.run.generate import STRATEGIES
    from vramguard.spec import spec_from_config
    st = next(st for st in STRATEGIES if st.plan.get("kv_dtype") == kv_dtype)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=1, vocab_size=300, max_position_embeddings=512)
    m = transformers.AutoModelForCausalLM.from_config(cfg).eval().to(torch.bfloat16)
    ids = torch.randint(5, 300, (1, 256))
    out = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=9, min_new_tokens=9, do_sample=False,
                     pad_token_id=0, return_dict_in_generate=True, **copy.deepcopy(st.kwargs))

    def tensors(x):
        if isinstance(x, torch.Tensor):
            return [x]
        if isinstance(x, (tuple, list, dict)):
            return [t for e in (x.values() if isinstance(x, dict) else x) for t in tensors(e)]
        return [t for e in vars(x).values() for t in tensors(e)] if hasattr(x, "__dict__") else []
    layers = out.past_key_values.layers
    assert [la.keys.shape[-2] for la in layers] == [8, 8]  # the prefill quantized all 256; 8 decode tokens since
    real = [sum(-(-t.numel() * t.element_size() // 512) * 512 for t in tensors(getattr(la, attr)))
            for la in layers for attr in ("_quantized_keys", "keys", "_quantized_values", "values")]
    # one K tensor: 256 x 64 values at 1 B (int8) or 0.5 B (int4) + 256 x 64 / 64 groups x (2 B scale + 2 B zero)
    # + 8 x 64 x 2 B residual = 16,384 + 1,024 + 1,024 = 18,432 B (int8), 8,192 + 1,024 + 1,024 = 10,240 B (int4)
    spec, s = spec_from_config(m.config.to_dict()), Settings(kv_dtype=kv_dtype, prompt_tokens=256, max_new_tokens=9)
    per_tensor = kv_tensor_bytes(spec, s, 264, residual=8)
    assert per_tensor == {"int8": 18_432, "int4": 10_240}[kv_dtype]
    assert sum(real) == 2 * 2 * per_tensor  # 2 layers x (K, V)
    assert kv_cache_bytes(spec, s, 264).gpu_bytes > sum(real)


def test_gqa_and_mha():
    s = Settings(prompt_tokens=1000, max_new_tokens=24)
    # Llama-2-7B (MHA, 32 KV heads): 2 x 32 layers x 32 x 128 x 2 B = 524,288 B per token
    assert kv_bytes_per_token(resolve_model("llama-2-7b"), s) == 524_288
    # Llama-3-8B (GQA, 8 KV heads): 131,072 B per token, a quarter
    assert kv_bytes_per_token(resolve_model("llama-3-8b"), s) == 131_072


def test_head_dim_override():
    # Mistral-Nemo: hidden 5120 / 32 heads = 160, but head_dim = 128 in config.json
    spec = resolve_model("mistral-nemo-12b")
    assert spec.head_dim == 128
    # 2 x 40 layers x 8 KV heads x 128 x 2 B = 163,840 B per token
    assert kv_bytes_per_token(spec, Settings()) == 163_840


def test_batch_beams_and_return_sequences_multiply():
    spec = resolve_model("llama-3-8b")
    one = kv_cache_bytes(spec, Settings(prompt_tokens=512, max_new_tokens=0), 512).gpu_bytes
    assert one == 512 * 131_072 == 67_108_864
    beams = Settings(batch=2, num_beams=4, num_return_sequences=2, prompt_tokens=512, max_new_tokens=0)
    assert beams.sequences == 8
    assert kv_cache_bytes(spec, beams, 512).gpu_bytes == 8 * one
    sampled = Settings(batch=3, num_return_sequences=5, do_sample=True, prompt_tokens=512, max_new_tokens=0)
    assert kv_cache_bytes(spec, sampled, 512).gpu_bytes == 15 * one


def test_sliding_window_layers_stop_growing():
    spec = resolve_model("mistral-7b-v0.1")  # every layer slides over 4,096 tokens
    s = Settings(prompt_tokens=16_000, max_new_tokens=384)
    assert layer_tokens(spec, "sliding_attention", 16_384, s) == 4_095  # DynamicSlidingWindowLayer keeps w - 1
    kv = kv_cache_bytes(spec, s, 16_384)
    assert kv.gpu_bytes == 32 * 2 * 4_095 * 8 * 128 * 2
    # during a prefill forward the whole chunk is still held (the kept slice is a view of the concatenation)
    assert layer_tokens(spec, "sliding_attention", 16_000, s, in_prefill_chunk=16_000) == 16_000


def test_hybrid_layers_gemma2():
    spec = resolve_model("gemma-2-9b")
    assert spec.num_sliding_layers == 21 and spec.layer_types[0] == "sliding_attention"
    s = Settings(prompt_tokens=8_000, max_new_tokens=192)
    kv = kv_cache_bytes(spec, s, 8_192)
    per_token_layer = 2 * 8 * 256 * 2  # K and V, 8 KV heads, head_dim 256, 2 B = 8,192 B
    assert kv.full_layer_bytes == 21 * 8_192 * per_token_layer
    assert kv.sliding_layer_bytes == 21 * 4_095 * per_token_layer


def test_static_cache_is_preallocated():
    spec = resolve_model("llama-3-8b")
    s = Settings(cache="static", max_cache_len=4096, prompt_tokens=100, max_new_tokens=100)
    # the whole 4,096-token cache exists from the first token
    assert kv_cache_bytes(spec, s, 100).gpu_bytes == 4096 * 131_072


def test_offloaded_cache_keeps_two_layers_on_gpu():
    spec = resolve_model("llama-3-8b")
    s = Settings(cache="offloaded", prompt_tokens=8000, max_new_tokens=192)
    kv = kv_cache_bytes(spec, s, 8192)
    assert kv.gpu_bytes == 2 * 2 * 8192 * 8 * 128 * 2
    assert kv.cpu_bytes == 8192 * 131_072


def test_growth_per_token_at_the_users_length_per_layer_type():
    from vramguard.memory.kv import kv_growth_per_token
    from vramguard.resolve import resolve_model
    gemma, mistral = resolve_model("gemma-2-9b"), resolve_model("mistral-7b-v0.1")
    s = Settings()
    # Gemma-2-9B: 21 + 21 layers x 2 (K, V) x 8 KV heads x head_dim 256 x 2 B = 172,032 B per layer type
    assert kv_growth_per_token(gemma, s, 384) == {"sliding_attention": 172_032, "full_attention": 172_032}
    # past the window (4,096: the layer keeps 4,095) the sliding layers add nothing
    assert kv_growth_per_token(gemma, s, 8192) == {"sliding_attention": 0, "full_attention": 172_032}
    # Mistral-7B-v0.1: all 32 layers slide; 32 x 2 x 8 x 128 x 2 B = 131,072 B until 4,095 tokens are held
    assert kv_growth_per_token(mistral, s, 4094) == {"sliding_attention": 131_072}
    assert kv_growth_per_token(mistral, s, 4095) == {"sliding_attention": 0}
    assert kv_growth_per_token(mistral, Settings(cache="static"), 10) == {"sliding_attention": 0}


def test_plan_shows_the_growth_a_sliding_window_model_really_has():
    import io

    from rich.console import Console

    from vramguard.plan import plan
    from vramguard.cli.render import plan_to_json, print_plan
    p = plan("mistral-7b-v0.1", Settings(prompt_tokens=4000, max_new_tokens=200), gpu="rtx-4090")
    d = plan_to_json(p)["kv_cache"]
    assert d["growth_per_token_by_layer_type"] == {"sliding_attention": 131_072}
    assert d["sliding_growth_new_tokens"] == 95  # 4,095 - 4,000 prompt tokens
    out = io.StringIO()
    print_plan(p, Console(file=out, width=200))
    text = out.getvalue()
    assert "128.00 KiB in the 32 sliding-window layers until they hold 4,095 tokens (for the first 95 new tokens, " \
           "then 0)" in text


def _paged_cache_bytes(cfg, num_blocks: int, page_size: int) -> int:
    """The bytes transformers' own PagedAttentionCache allocates for ``num_blocks`` (on the CPU, bf16)."""
    import inspect

    import torch
    from transformers import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.cache import PagedAttentionCache
    cb = ContinuousBatchingConfig(num_blocks=num_blocks, page_size=page_size, max_batch_tokens=64,
                                  max_memory_percent=0.9)
    extra = {}
    if "distributed_helper" in inspect.signature(PagedAttentionCache.__init__).parameters:
        from transformers.generation.continuous_batching.distributed import DistributedHelper
        extra["distributed_helper"] = DistributedHelper(None, None)
    cache = PagedAttentionCache(cfg, cb, "cpu", dtype=torch.bfloat16, **extra)
    if not hasattr(cache, "cache_tensor"):
        pytest.skip("transformers before the one-tensor pool (5.24) keeps one tensor per layer of a group")
    return cache.cache_tensor.numel() * cache.cache_tensor.element_size()


@pytest.mark.parametrize("cls, extra, block, pool", [
    # GQA: 4 heads over 2 KV heads; a block is 3 layers x 2 x 2 KV heads x head_dim 16 x 2 B x 32 tokens = 12,288 B
    # (a sector: lcm(12,288, 128)); 10 blocks and 2 trash sectors: 12 x 12,288 = 147,456 B
    ("LlamaConfig", {}, 12_288, 147_456),
    # every layer sliding (Mistral's sliding_window): sized in full all the same
    ("MistralConfig", {"sliding_window": 48}, 12_288, 147_456),
    # Gemma-2 alternates 2 sliding + 2 full layers, head_dim 16: a block is 4 x 4,096 B = 16,384 B, the sector
    # one allocator's 2 x 4,096 = 8,192 B, so 10 blocks take 20 sectors + 2 trash: 22 x 8,192 = 180,224 B
    ("Gemma2Config", {"sliding_window": 48, "head_dim": 16, "num_hidden_layers": 4}, 16_384, 180_224),
])
def test_the_paged_pool_is_what_transformers_allocates(cls, extra, block, pool):
    import transformers

    from vramguard.memory.kv import paged_block_bytes, paged_pool_bytes
    from vramguard.spec import spec_from_config
    kw = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=300, max_position_embeddings=256) | extra
    cfg = getattr(transformers, cls)(**kw)
    spec = spec_from_config(cfg.to_dict())
    assert paged_block_bytes(spec, 32, 2) == block
    assert paged_pool_bytes(spec, 10, 32, 2) == pool == _paged_cache_bytes(cfg, 10, 32)
    assert paged_pool_bytes(spec, 7, 32, 2) == _paged_cache_bytes(cfg, 7, 32)


def test_the_serving_pool_is_sized_by_the_planners_block():
    """serve's pool plan takes the block and the pool tensor from the KV model, not a copy of its own."""
    from vramguard.memory.kv import paged_block_bytes, paged_pool_bytes
    from vramguard.serve import pool as P
    spec = resolve_model("llama-3-8b")
    assert paged_block_bytes(spec, 256, 2) == 32 * 2 * 8 * 128 * 2 * 256 == 33_554_432
    p = P.plan_pool(spec, 8 * 2**30, page_size=256, max_batch_tokens=512, max_requests=8)
    assert p.kv_bytes_per_token == 131_072 and p.pool_bytes == paged_pool_bytes(spec, p.num_blocks, 256, 2)
    assert p.pool_bytes == (p.num_blocks + 2) * 33_554_432  # one attention type: the blocks and 2 trash blocks
    assert p.pool_bytes + p.step_peak_bytes + p.reserve_bytes + p.margin_bytes <= 8 * 2**30
    more = P.plan_pool(spec, 8 * 2**30 + 33_554_432, page_size=256, max_batch_tokens=512, max_requests=8)
    assert more.num_blocks > p.num_blocks  # the largest that fits: one block more of budget, at least one more
    assert not hasattr(P, "kv_bytes_per_token")
