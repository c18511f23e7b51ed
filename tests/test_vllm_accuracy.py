"""vLLM's memory model against what vLLM printed at start in public reports (each value with its source), within
the stated tolerance: weights 1%, KV cache tokens (or bytes where the tokens were not printed) 5%.

The table with every planned value is in benchmarks/README.md. Cases logged by vLLM's V0 engine (0.6-0.7) are
planned with what V0 profiled: ``max_num_batched_tokens = max_model_len`` (no chunked prefill below 32k tokens),
256 sequences, CUDA graphs outside the budget.
"""

import pytest

from vramguard.catalog.gpus import GpuSpec
from vramguard.engines import vllm_kv as kv
from vramguard.engines import vllm_weights as w
from vramguard.engines.vllm import VllmSettings, plan_vllm
from vramguard.resolve import resolve_model
from vramguard.spec import spec_from_config
from vramguard.units import GiB

QWEN3_30B_A3B = {"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
                 "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
                 "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                 "vocab_size": 151936, "max_position_embeddings": 40960, "tie_word_embeddings": False,
                 "torch_dtype": "bfloat16"}  # Qwen/Qwen3-30B-A3B config.json
R1_DISTILL_QWEN_14B = {"model_type": "qwen2", "hidden_size": 5120, "intermediate_size": 13824,
                       "num_hidden_layers": 48, "num_attention_heads": 40, "num_key_value_heads": 8,
                       "vocab_size": 152064, "max_position_embeddings": 131072, "tie_word_embeddings": False,
                       "torch_dtype": "bfloat16"}  # deepseek-ai/DeepSeek-R1-Distill-Qwen-14B config.json


def _spec(model):
    return resolve_model(model) if isinstance(model, str) else spec_from_config(model, name="case")


# (model, tensor parallel, GiB vLLM logged as its weights, source)
WEIGHTS = [
    # "Loading model weights took 14.9888 GB" (V0, RTX 3090)
    ("llama-3.1-8b", 1, 14.9888, "https://github.com/vllm-project/vllm/issues/10517"),
    # "model weights take 14.96GiB" and, with -tp 2, "7.48GiB" (H100)
    ("llama-3-8b", 1, 14.96, "https://github.com/vllm-project/vllm/pull/10511"),
    ("llama-3-8b", 2, 7.48, "https://github.com/vllm-project/vllm/pull/10511"),
    # "Model loading took 14.2474 GiB" on each of 4 A10s (vLLM 0.8.5, V1)
    (QWEN3_30B_A3B, 4, 14.2474, "https://github.com/vllm-project/vllm/issues/17469"),
]


@pytest.mark.parametrize("model, tp, logged_gib, source", WEIGHTS)
def test_weights_within_1_percent(model, tp, logged_gib, source):
    planned = w.rank_weights(_spec(model), tp, 1, 2)[0].total_bytes / GiB
    assert abs(planned / logged_gib - 1) <= 0.01, f"{planned:.4f} GiB planned, {logged_gib} logged ({source})"


@pytest.mark.xfail(strict=True, reason="13.787 GiB planned against 13.9476 logged (-1.15%): vLLM 0.7.2's V0 loader "
                   "at TP=2 held 0.16 GiB more than the parameters; not explained by the sharding")
def test_weights_r1_distill_qwen_14b_tp2():
    # "the model weights only tooks 13.9476 GB" on 2 x RTX 4090 (https://github.com/vllm-project/vllm/issues/13061)
    planned = w.rank_weights(_spec(R1_DISTILL_QWEN_14B), 2, 1, 2)[0].total_bytes / GiB
    assert abs(planned / 13.9476 - 1) <= 0.01


# (model, total GiB the log printed, utilization, max_model_len, GPU blocks logged, source)
TOKENS = [
    # "total_gpu_memory=23.58GiB ... GPU blocks: 1952" and "1478" (V0, RTX 3090)
    ("llama-3.1-8b", 23.58, 0.9, 20_000, 1952, "https://github.com/vllm-project/vllm/issues/10517"),
    ("llama-3.1-8b", 23.58, 0.9, 29_000, 1478, "https://github.com/vllm-project/vllm/issues/10517"),
]


def _v0_plan(model, total_gib, util, max_len):
    gpu = GpuSpec("case", "logged card", int(total_gib * GiB), (8, 6))
    s = VllmSettings(gpu_memory_utilization=util, max_model_len=max_len, max_num_batched_tokens=max_len,
                     max_num_seqs=256, cudagraph_in_budget=False)
    return plan_vllm(_spec(model), gpu, s)


@pytest.mark.parametrize("model, total_gib, util, max_len, blocks, source", TOKENS)
def test_kv_tokens_within_5_percent(model, total_gib, util, max_len, blocks, source):
    p = _v0_plan(model, total_gib, util, max_len)
    assert abs(p.kv_tokens_by_blocks / (blocks * 16) - 1) <= 0.05, f"{p.kv_tokens_by_blocks:,} planned ({source})"


def test_kv_bytes_llama3_8b_h100_within_5_percent():
    # "total_gpu_memory 79.22GiB, gpu_memory_utilization 0.90 ... available_kv_cache_memory 53.29GiB"
    # (https://github.com/vllm-project/vllm/pull/10511; the tokens were not printed)
    p = _v0_plan("llama-3-8b", 79.22, 0.9, 8192)
    assert abs(p.available_kv_bytes / GiB / 53.29 - 1) <= 0.05


def test_kv_tokens_from_the_logged_memory_qwen3_14b():
    # "Available KV cache memory: 6.51 GiB" -> "GPU KV cache size: 42,656 tokens"
    # (https://github.com/LMCache/LMCache/issues/1739): exact from the logged memory
    spec = spec_from_config({"model_type": "qwen3", "hidden_size": 5120, "intermediate_size": 17408,
                             "num_hidden_layers": 40, "num_attention_heads": 40, "num_key_value_heads": 8,
                             "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960}, name="q")
    groups = kv.kv_groups(spec, list(spec.layer_types), kv.page_bytes(spec, 1, 2, 16))
    assert kv.kv_tokens(groups, kv.num_blocks(groups, int(6.51 * GiB)), 32768, 2048, 16) == 42_656


@pytest.mark.parametrize("max_len, logged_gib", [(20_000, 2.07), (29_000, 2.99)])
def test_activation_peak_against_the_logged_torch_peak(max_len, logged_gib):
    # peak_torch_memory 17.06 / 17.98 GiB minus the 14.99 GiB weights (https://github.com/vllm-project/vllm/issues/10517)
    p = _v0_plan("llama-3.1-8b", 23.58, 0.9, max_len)
    assert abs(p.activation_bytes / GiB / logged_gib - 1) <= 0.02
