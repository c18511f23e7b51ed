"""vLLM's memory model (vramguard.engines.vllm*): exact integers with the arithmetic, the refusals vLLM makes at
start, and the CLI (`plan --engine vllm`). No torch, no vLLM."""

import json

import pytest

from vramguard.catalog.gpus import GpuSpec
from vramguard.engines import vllm_kv as kv
from vramguard.engines import vllm_weights as w
from vramguard.engines.vllm import VllmSettings, batch_defaults, plan_vllm
from vramguard.errors import InvalidValue
from vramguard.hardware import gpu_from_catalog
from vramguard.memory.weights import weight_bytes
from vramguard.resolve import resolve_model
from vramguard.settings import Settings
from vramguard.spec import spec_from_config
from vramguard.units import GiB, MiB

LLAMA31 = resolve_model("llama-3.1-8b")


def card(total_bytes: int, label: str = "test card") -> GpuSpec:
    return GpuSpec("test", label, total_bytes, (9, 0))


def test_vocab_padding_to_64():
    assert w.pad_vocab(128_256) == 128_256  # 2,004 x 64
    assert w.pad_vocab(151_665) == 151_680  # 2,370 x 64 = 151,680
    assert w.pad_vocab(32_000) == 32_000


def test_llama31_weights_are_what_vllm_logs():
    # 32 layers x 436,224,000 + embeddings and LM head 2 x 128,256 x 4,096 x 2 + final norm 8,192
    # + rope cos_sin_cache 131,072 x 128 x 2 = 16,094,076,928 B = 14.9888 GiB ("Loading model weights took 14.9888 GB",
    # github.com/vllm-project/vllm/issues/10517)
    r = w.rank_weights(LLAMA31, 1, 1, 2)[0]
    assert w.layer_weight_bytes(LLAMA31, 1, 2) == 436_224_000
    assert r.rope_cache_bytes == 33_554_432
    assert r.total_bytes == 16_094_076_928
    assert round(r.total_bytes / GiB, 4) == 14.9888


def test_weights_without_rope_equal_vramguards_transformers_weights():
    # the same parameters as the hand model of the transformers plan when the vocabulary needs no padding
    r = w.rank_weights(LLAMA31, 1, 1, 2)[0]
    assert r.total_bytes - r.rope_cache_bytes == weight_bytes(LLAMA31, Settings(quant="bf16")).total_bytes


def test_tensor_parallel_shards():
    # tp=2: qkv (16 + 2 x 4) x 128 = 3,072 rows x 4,096; o 4,096 x 2,048; gate_up 14,336 x 4,096; down 4,096 x 7,168
    # = 109,051,904 weights x 2 B + two norms 16,384 B = 218,120,192 B
    assert w.layer_weight_bytes(LLAMA31, 2, 2) == 218_120_192
    # embeddings and LM head: 128,256 / 2 rows each
    r = w.rank_weights(LLAMA31, 2, 1, 2)[0]
    assert r.embedding_bytes == r.lm_head_bytes == 64_128 * 4_096 * 2
    # tp=16 over 8 KV heads: each rank keeps one replicated KV head
    assert w.kv_heads_per_rank(LLAMA31, 16) == 1
    assert kv.page_bytes(LLAMA31, 16, 2, 16) == 2 * 16 * 1 * 128 * 2


@pytest.mark.parametrize("tp, what", [(3, "num_attention_heads"), (5, "num_attention_heads")])
def test_tensor_parallel_vllm_refuses(tp, what):
    with pytest.raises(InvalidValue) as e:
        w.rank_weights(LLAMA31, tp, 1, 2)
    assert e.value.field == "tensor_parallel_size" and what in e.value.accepted


def test_pipeline_stages_split_like_get_pp_indices():
    assert w.pp_layer_counts(32, 3) == [11, 11, 10]
    assert w.pp_layer_counts(80, 3) == [27, 27, 26]
    assert w.pp_layer_counts(32, 2) == [16, 16]
    stages = w.rank_weights(LLAMA31, 1, 2, 2)
    assert stages[0].embedding_bytes and not stages[0].lm_head_bytes
    assert stages[1].lm_head_bytes and not stages[1].embedding_bytes


def test_kv_page_and_groups():
    assert kv.page_bytes(LLAMA31, 1, 2, 16) == 65_536  # 2 x 16 x 8 x 128 x 2
    gemma2 = resolve_model("gemma-2-9b")
    groups = kv.kv_groups(gemma2, list(gemma2.layer_types), 1)
    assert [(g.kind, g.num_layers) for g in groups] == [("sliding_attention", 21), ("full_attention", 21)]
    # Gemma-3-27B: 62 layers, every sixth full -> 10 full, 52 sliding: group size 10, six sliding groups (the last
    # padded by 8 layers) and one full group
    kinds = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(62)]
    groups = kv.kv_groups(gemma2, kinds, 1)
    assert len(groups) == 7 and {g.num_layers for g in groups} == {10}
    assert kv.padding_layers(kinds, groups) == 8
    # --disable-hybrid-kv-cache-manager: one group of every layer, kept whole
    assert [(g.kind, g.num_layers) for g in kv.kv_groups(gemma2, kinds, 1, hybrid=False)] == [("full_attention", 62)]


def test_mla_page_is_one_latent_per_token():
    import dataclasses
    # DeepSeek-V3's kv_lora_rank 512 + qk_rope_head_dim 64 = 576 values per token, one tensor, every TP rank:
    # 16 x 576 x 2 = 18,432 B per block and layer
    mla = dataclasses.replace(LLAMA31, config_json=json.dumps({"kv_lora_rank": 512, "qk_rope_head_dim": 64}))
    assert kv.page_bytes(mla, 8, 2, 16) == 18_432
    assert [g.kind for g in kv.kv_groups(mla, ["full_attention"] * 61, 18_432)] == ["mla"]


def test_families_without_a_vllm_model_are_refused():
    import dataclasses

    from vramguard.errors import ConfigError
    with pytest.raises(ConfigError) as e:
        plan_vllm(dataclasses.replace(LLAMA31, generic=True, model_type="olmoe"), card(80 * GiB))
    assert e.value.field == "config.json:model_type"
    assert e.value.fix.startswith("plan it for transformers, the default engine (vramguard.plan); vLLM itself may "
                                  "serve olmoe")
    with pytest.raises(ConfigError) as e:  # says it is AWQ, without the quantization_config that says how
        plan_vllm(dataclasses.replace(LLAMA31, prequantized="awq"), card(80 * GiB))
    assert e.value.field == "config.json:quantization_config"


def _quantized(llama_cfg: dict, weights: dict, method: str = "compressed-tensors") -> dict:
    q = {"quant_method": method, "ignore": ["lm_head"],
         "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                       "input_activations": {"num_bits": 8, "type": "float", "dynamic": True}}}}
    return {**llama_cfg, "quantization_config": q}


def test_8bit_compressed_tensors_linears():
    from vramguard.spec import spec_from_config
    cfg = {k: v for k, v in json.loads(LLAMA31.config_json).items() if k != "source"}
    fp8 = spec_from_config(_quantized(cfg, {"num_bits": 8, "type": "float", "strategy": "channel"}), name="fp8")
    # qkv 6,144 x 4,096 x 1 B + 6,144 fp32 scales, o 4,096 x 4,096 + 4,096 x 4, gate_up 28,672 x 4,096 + 28,672 x 4,
    # down 4,096 x 14,336 + 4,096 x 4, two bf16 norms of 4,096: 218,292,224 B
    assert w.layer_weight_bytes(fp8, 1, 2) == 218_292_224
    # embeddings and LM head stay bf16 (lm_head ignored): 2 x 128,256 x 4,096 x 2 B
    r = w.rank_weights(fp8, 1, 1, 2)[0]
    assert r.embedding_bytes + r.lm_head_bytes == 2 * 128_256 * 4_096 * 2
    # W4A16 (Marlin, group 128): o_proj 4,096 x 4,096 / 2 B + 32 x 4,096 x 2 B scales = 8,650,752 B
    w4 = spec_from_config(_quantized(cfg, {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}),
                          name="w4")
    assert w.linear_format(w4).linear_bytes(4096, 4096, 1, 2) == 8_650_752
    # block FP8: 1 B per weight + one fp32 per 128 x 128 block: 16,777,216 + 32 x 32 x 4 = 16,781,312 B
    blk = spec_from_config(_quantized(cfg, {"num_bits": 8, "type": "float", "strategy": "block",
                                            "block_structure": [128, 128]}), name="blk")
    assert w.linear_format(blk).linear_bytes(4096, 4096, 1, 2) == 16_781_312
    for q in (w4, blk):
        assert plan_vllm(q, card(80 * GiB)).starts
    from vramguard.errors import ConfigError
    bad = _quantized(cfg, {"num_bits": 2, "type": "int", "strategy": "group"})
    with pytest.raises(ConfigError) as e:
        plan_vllm(spec_from_config(bad, name="q"), card(80 * GiB))
    assert e.value.field == "config.json:quantization_config.config_groups"


def test_blocks_tokens_and_concurrency_match_vllm_logs():
    # github.com/vllm-project/vllm/pull/13596: 127,626 blocks, 2,048 tokens per request -> 2,042,016 tokens, 997.08x
    g = [kv.KvGroup("full_attention", 32, 65_536)]
    assert kv.kv_tokens_by_blocks(g, 127_626, 16) == 2_042_016
    assert kv.kv_tokens(g, 127_626, 2048, 2048, 16) == 2_042_016
    assert f"{kv.max_concurrency(g, 127_626, 2048, 2048, 16):.2f}" == "997.08"
    # a sliding group needs cdiv(min(window - 1 + batched, len), 16) + 1 pages: min(4,095 + 2,048, 8,192) = 6,143
    # -> 384 + 1 = 385, beside 512 for the full group
    s = kv.KvGroup("sliding_attention", 21, 1, 4096)
    assert s.pages_per_request(8192, 2048, 16) == 385
    assert kv.pages_per_request([s, kv.KvGroup("full_attention", 21, 1)], 8192, 2048, 16) == 897


def test_qwen3_14b_tokens_from_the_logged_kv_memory():
    # github.com/LMCache/LMCache/issues/1739: "Available KV cache memory: 6.51 GiB", "GPU KV cache size: 42,656
    # tokens", "Maximum concurrency for 32,768 tokens per request: 1.30x". Page: 2 x 16 x 8 x 128 x 2 = 65,536 B
    # per layer, 40 layers -> 2,621,440 B per block; int(6.51 GiB) // 2,621,440 = 2,666 blocks = 42,656 tokens.
    spec = spec_from_config({"model_type": "qwen3", "hidden_size": 5120, "intermediate_size": 17408,
                             "num_hidden_layers": 40, "num_attention_heads": 40, "num_key_value_heads": 8,
                             "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960}, name="q")
    groups = kv.kv_groups(spec, list(spec.layer_types), kv.page_bytes(spec, 1, 2, 16))
    blocks = kv.num_blocks(groups, int(6.51 * GiB))
    assert blocks == 2_666
    assert kv.kv_tokens(groups, blocks, 32768, 2048, 16) == 42_656
    assert f"{kv.max_concurrency(groups, blocks, 32768, 2048, 16):.2f}" == "1.30"


def test_largest_model_len_is_vllms_binary_search():
    g = [kv.KvGroup("full_attention", 32, 65_536)]
    # 100 blocks of 32 layers fit 100 x 16 = 1,600 tokens of one request
    assert kv.largest_model_len(g, 100 * 32 * 65_536, 131_072, 2048, 16) == 1_600


def test_batch_defaults_by_card():
    assert batch_defaults(card(180 * GiB, "NVIDIA B200")) == (16384, 1024)  # at least 160 GiB
    assert batch_defaults(gpu_from_catalog("h200")) == (8192, 1024)  # 139.8 GiB
    assert batch_defaults(gpu_from_catalog("h100")) == (8192, 1024)
    assert batch_defaults(gpu_from_catalog("a100-80gb")) == (2048, 256)
    assert batch_defaults(gpu_from_catalog("rtx-4090")) == (2048, 256)


def test_activation_terms():
    # forward at 8,192 tokens: 8,192 x 2 x (3 x 4,096 + 3 x 14,336) = 905,969,664 B
    assert w.forward_peak_bytes(LLAMA31, 1, 8192, 2) == 905_969_664
    # sampler (0.33.0's Triton top-k/top-p): hidden 8,192 x 4,096 x 2 + last 256 x 4,096 x 2
    # + 256 x 128,256 x (2 + 12)
    # + the Triton kernel's buffer, 132 SMs x 128,256 x 4 B
    assert w.sampler_peak_bytes(LLAMA31, 8192, 256, 2) == 67_108_864 + 2_097_152 + 459_669_504 + 67_719_168
    assert w.triton_sampler_buffer_bytes(128256, 5, 40) == 8 * 128256 * 4  # 5 programs -> a buffer of 8 rows
    # the sort path of earlier V1 releases: 256 x 128,256 x (2 + 36); FlashInfer's: 256 x 128,256 x (2 + 8)
    assert w.sampler_peak_bytes(LLAMA31, 8192, 256, 2, "sort") == 67_108_864 + 2_097_152 + 1_247_674_368
    assert w.sampler_peak_bytes(LLAMA31, 8192, 256, 2, "flashinfer") == 67_108_864 + 2_097_152 + 328_335_360


def test_budget_terms_add_up():
    p = plan_vllm(LLAMA31, card(80 * GiB), VllmSettings(max_model_len=8192))
    assert p.requested_bytes == int(80 * GiB * 0.9)
    assert p.available_kv_bytes == (p.requested_bytes - p.weights_bytes - p.activation_bytes - p.non_torch_bytes
                                    - p.cudagraph_bytes)
    assert p.num_blocks == p.available_kv_bytes // (65_536 * 32)
    assert p.kv_tokens == p.num_blocks * 16 and p.starts
    old = plan_vllm(LLAMA31, card(80 * GiB), VllmSettings(max_model_len=8192, cudagraph_in_budget=False))
    assert old.available_kv_bytes - p.available_kv_bytes == p.cudagraph_bytes
    tp2 = plan_vllm(LLAMA31, card(80 * GiB), VllmSettings(max_model_len=8192, tensor_parallel_size=2))
    assert tp2.nccl_bytes > 0 and tp2.weights_bytes < p.weights_bytes
    # 0.33.0 initialises NCCL before its start snapshot: the buffers lower the free memory at start, not the KV cache
    assert p.free_at_start_bytes - tp2.free_at_start_bytes == tp2.nccl_bytes == 420 * MiB
    assert tp2.available_kv_bytes == (tp2.requested_bytes - tp2.weights_bytes - tp2.activation_bytes
                                      - tp2.non_torch_bytes - tp2.cudagraph_bytes)
    old_tp2 = plan_vllm(LLAMA31, card(80 * GiB), VllmSettings(max_model_len=8192, tensor_parallel_size=2,
                                                             nccl_in_budget=True))
    assert tp2.available_kv_bytes - old_tp2.available_kv_bytes == 420 * MiB
    assert kv.page_bytes(LLAMA31, 2, 2, 16) == 32_768  # 4 KV heads per rank


def test_vllm_refusals():
    # the free memory after the CUDA context is below 0.98 x total on a 24 GiB card
    p = plan_vllm(LLAMA31, card(24 * GiB), VllmSettings(gpu_memory_utilization=0.98, max_model_len=4096))
    assert p.refusal.startswith("Free memory on device")
    # 128k tokens of Llama-3.1-8B need 16 GiB of KV cache: more than a 24 GiB card has left
    p = plan_vllm(LLAMA31, card(24 * GiB))
    assert "To serve at least one request with the model's max seq len (131072)" in p.refusal
    assert 0 < p.largest_model_len < 131_072
    p = plan_vllm(LLAMA31, card(16 * GiB), VllmSettings(max_model_len=4096))
    assert p.refusal == "No available memory for the cache blocks"


def test_fp8_kv_halves_the_page():
    a = plan_vllm(LLAMA31, card(80 * GiB), VllmSettings(max_model_len=8192))
    b = plan_vllm(LLAMA31, card(80 * GiB), VllmSettings(max_model_len=8192, kv_cache_dtype="fp8"))
    assert b.kv_groups[0].page_bytes * 2 == a.kv_groups[0].page_bytes
    assert b.num_blocks == a.available_kv_bytes // (32_768 * 32)


@pytest.mark.parametrize("field, value", [("tensor_parallel_size", 0), ("gpu_memory_utilization", 1.5),
                                          ("max_model_len", -1), ("kv_cache_dtype", "int4"),
                                          ("sampler", "greedy")])
def test_bad_settings_name_the_field(field, value):
    with pytest.raises(InvalidValue) as e:
        VllmSettings(**{field: value})
    assert e.value.field == field


def test_cli_plan_engine_vllm():
    from conftest import run_cli
    r = run_cli("plan", "llama-3.1-8b", "--engine", "vllm", "--gpu", "h100", "--max-model-len", "32768", "--tp", "2",
                "--format", "json")
    assert r.returncode == 0
    data = json.loads(r.stdout)
    assert data["flags"]["tensor-parallel-size"] == 2 and data["flags"]["max-model-len"] == 32768
    assert data["per_gpu"]["weights_bytes"] == w.rank_weights(LLAMA31, 2, 1, 2)[0].total_bytes
    assert data["kv_cache"]["kv_tokens"] == data["kv_cache"]["num_blocks"] * 16
    assert data["command"].startswith("vllm serve meta-llama/Llama-3.1-8B-Instruct --tensor-parallel-size 2")


def test_cli_plan_engine_vllm_bad_tp():
    from conftest import run_cli
    r = run_cli("plan", "llama-3.1-8b", "--engine", "vllm", "--gpu", "h100", "--tp", "3")
    assert r.returncode == 2
    assert "--tp: 3 is not valid" in r.stderr
