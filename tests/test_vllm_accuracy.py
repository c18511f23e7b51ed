"""vLLM's memory model against what vLLM printed at start in public reports (each value with its source), within
the stated tolerance: weights 1%, KV cache tokens (or bytes where the tokens were not printed) 5%.

Three kinds of check (the table with every planned value is in
benchmarks/results/vllm_engine/README.md):

* weights: "Model loading took X GiB" (torch allocated bytes after the load) against the per-rank shards;
* KV from the logged memory (the exact rule): "Available KV cache memory: X GiB" turned into blocks, tokens and
  concurrency by vLLM's KV cache groups; this checks the pages, groups and the two log lines, not the budget;
* the full budget: card total x utilization - weights - activation - non-torch (- NCCL, - CUDA graphs where that
  version put them in the budget) against the logged KV memory or tokens, with the version's profile settings
  (batch limits, top-k/top-p path of the dummy sampler, where NCCL and CUDA graphs sit).

Cases logged by vLLM's V0 engine (0.6-0.7) are planned with what V0 profiled: ``max_num_batched_tokens =
max_model_len`` (no chunked prefill below 32k tokens), 256 sequences, the sort sampler, CUDA graphs outside the
budget. Model configs not in the catalog are vendored in tests/data/vllm_case_configs.json with their sources.
"""

import json
from pathlib import Path

import pytest

from vramguard.catalog.gpus import GpuSpec
from vramguard.engines import vllm_kv as kv
from vramguard.engines import vllm_weights as w
from vramguard.engines.vllm import VllmSettings, plan_vllm, settings_for_version
from vramguard.hardware import gpu_from_catalog
from vramguard.resolve import resolve_model
from vramguard.spec import spec_from_config
from vramguard.units import GiB

CONFIGS = json.loads((Path(__file__).parent / "data" / "vllm_case_configs.json").read_text())
QWEN3_30B_A3B = {"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
                 "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
                 "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                 "vocab_size": 151936, "max_position_embeddings": 40960, "tie_word_embeddings": False,
                 "torch_dtype": "bfloat16"}  # Qwen/Qwen3-30B-A3B config.json
R1_DISTILL_QWEN_14B = {"model_type": "qwen2", "hidden_size": 5120, "intermediate_size": 13824,
                       "num_hidden_layers": 48, "num_attention_heads": 40, "num_key_value_heads": 8,
                       "vocab_size": 152064, "max_position_embeddings": 131072, "tie_word_embeddings": False,
                       "torch_dtype": "bfloat16"}  # deepseek-ai/DeepSeek-R1-Distill-Qwen-14B config.json
QWEN3_14B = {"model_type": "qwen3", "hidden_size": 5120, "intermediate_size": 17408, "num_hidden_layers": 40,
             "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
             "max_position_embeddings": 40960}  # Qwen/Qwen3-14B config.json

FP8_70B = "RedHatAI/Llama-3.3-70B-Instruct-FP8-dynamic"
LLM_D = ("https://github.com/llm-d/llm-d-benchmark/blob/259334868c5075da530cc6c90b43fceb11b6e6a7/"
         "config_explorer/empirical-vllm-memory-results.md")
DENNIS = "https://github.com/dennislee22/vLLM-benchmarking/blob/"
A100_TP1 = DENNIS + "391660db66f5a6e44ea8ed82decf48a88e55e992/log/vllm-7B-1gpuA10080GB-0.25GRAM.log"
A100_TP2 = DENNIS + "e514a58512f7c1ced8a2bffb191be171e7ad99b2/log/vllm-7B-2gpuA10080GB-0.5GRAM-same-node.log"
ROCM_RAY = ("https://github.com/ROCm/rocm-blogs/blob/b5d535ecc683b9ada1e01e91672be9609a2b8541/"
            "blogs/artificial-intelligence/rocm-ray/README.md")
EOLE = "https://github.com/eole-nlp/eole/blob/6633d065dba3b01eea1d2152016464b1e242ac33/benchmarks/genai/results.md"
LMCACHE_FAQ = "https://github.com/LMCache/LMCache/pull/1769"


def _spec(model):
    if isinstance(model, dict):
        return spec_from_config(model, name="case")
    if model in CONFIGS:
        return spec_from_config(CONFIGS[model]["config"], name=model)
    return resolve_model(model)


# (model, tensor parallel, GiB vLLM logged as its weights, source)
WEIGHTS = [
    # "Loading model weights took 14.9888 GB" (V0, RTX 3090)
    ("llama-3.1-8b", 1, 14.9888, "https://github.com/vllm-project/vllm/issues/10517"),
    # "Model loading took 14.99 GiB" (V1, H100)
    ("llama-3.1-8b", 1, 14.99, LLM_D),
    # "model weights take 14.96GiB" and, with -tp 2, "7.48GiB" (H100)
    ("llama-3-8b", 1, 14.96, "https://github.com/vllm-project/vllm/pull/10511"),
    ("llama-3-8b", 2, 7.48, "https://github.com/vllm-project/vllm/pull/10511"),
    # "Model loading took 14.2474 GiB" on each of 4 A10s (vLLM 0.8.5, V1)
    (QWEN3_30B_A3B, 4, 14.2474, "https://github.com/vllm-project/vllm/issues/17469"),
    # "Model loading took 14.2488 GiB" / "7.1217 GiB" per GPU (vLLM 0.10.1.1, A100 80GB)
    ("qwen2-7b", 1, 14.2488, A100_TP1),
    ("qwen2-7b", 2, 7.1217, A100_TP2),
    # "Model loading took 1.12 GiB" / "61.03 GiB" (V1, H100)
    ("Qwen/Qwen3-0.6B", 1, 1.12, LLM_D),
    ("Qwen/Qwen3-32B", 1, 61.03, LLM_D),
    # 8-bit compressed-tensors linears (1 B per weight + an fp32 scale per output row), bf16 embeddings and LM head:
    # "Model loading took 67.72 GiB" / "33.88 GiB" (FP8, H100), "Loading model weights took 67.7229 GB" (INT8 W8A8)
    (FP8_70B, 1, 67.72, LLM_D),
    (FP8_70B, 2, 33.88, LLM_D),
    ("neuralmagic/Meta-Llama-3.1-70B-Instruct-quantized.w8a8", 1, 67.7229,
     "https://github.com/vllm-project/vllm/pull/12569"),
]


@pytest.mark.parametrize("model, tp, logged_gib, source", WEIGHTS)
def test_weights_within_1_percent(model, tp, logged_gib, source):
    planned = w.rank_weights(_spec(model), tp, 1, 2)[0].total_bytes / GiB
    assert abs(planned / logged_gib - 1) <= 0.01, f"{planned:.4f} GiB planned, {logged_gib} logged ({source})"


@pytest.mark.xfail(strict=True, reason="13.787 GiB planned against 13.9476 logged (-1.15%): vLLM 0.7.2's V0 loader "
                   "at TP=2 held 0.16 GiB more than the parameters and the rotary cache; vLLM 0.10's V1 logs of the "
                   "same Qwen2 layout are 0.02-0.06 GiB over the plan (within 0.4%); the rest is not in "
                   "vllm/model_executor/models/qwen2.py")
def test_weights_r1_distill_qwen_14b_tp2():
    # "the model weights only tooks 13.9476 GB" on 2 x RTX 4090 (https://github.com/vllm-project/vllm/issues/13061)
    planned = w.rank_weights(_spec(R1_DISTILL_QWEN_14B), 2, 1, 2)[0].total_bytes / GiB
    assert abs(planned / 13.9476 - 1) <= 0.01


@pytest.mark.xfail(strict=True, reason="1.8937 GiB planned against 1.9148 logged (-1.10%): the parameters are the "
                   "checkpoint's 999,885,952 x 2 B and the two rotary caches 2 x 32,768 x 256 x 2 B; vLLM 0.13.0 held "
                   "22.6 MB more, not found in vllm/model_executor/models/gemma3.py")
def test_weights_gemma3_1b():
    # "Model loading took 1.9148 GiB memory" (vLLM 0.13.0; EOLE)
    planned = w.rank_weights(_spec("google/gemma-3-1b-it"), 1, 1, 2)[0].total_bytes / GiB
    assert abs(planned / 1.9148 - 1) <= 0.01


# (model, tensor parallel, "Available KV cache memory" GiB, max_model_len, "GPU KV cache size" tokens logged,
#  "Maximum concurrency" logged, source). Tokens as V1 before 0.33 printed them: blocks // groups x 16.
FROM_LOGGED_MEMORY = [
    ("qwen2-7b", 1, 5.01, 16_384, 93_872, 5.73, A100_TP1),
    ("qwen2-7b", 2, 31.83, 16_384, 1_192_160, 72.76, A100_TP2),
    (R1_DISTILL_QWEN_14B, 2, 151.25, 4_096, 1_652_080, 403.34, ROCM_RAY),  # MI300X, vLLM 0.9.2
    ("Qwen/Qwen3-8B", 1, 50.32, 40_960, 366_400, 8.95, LMCACHE_FAQ),
    ("Qwen/Qwen3-32B", 2, 33.66, 40_960, 275_760, 6.73, LMCACHE_FAQ),  # H100
    ("llama-3.1-70b", 4, 32.06, 131_072, 420_208, 3.21, LMCACHE_FAQ),  # H100
    (QWEN3_14B, 1, 6.51, 32_768, 42_656, 1.30, "https://github.com/LMCache/LMCache/issues/1739"),
    # 22 sliding + 4 full layers: 7 groups of 4 ("Add 2 padding layers"), vLLM 0.13.0
    ("google/gemma-3-1b-it", 1, 25.39, 2_048, 950_864, 461.21, EOLE),
    # MoE, FP8 weights, TP 4: 1 KV head per rank (+1.1%: vLLM takes the fewest blocks of the 4 workers and the
    # log shows one worker's memory, a likely reason, not checked)
    ("Qwen/Qwen3-235B-A22B-FP8", 4, 8.11, 40_960, 178_880, None, "https://github.com/vllm-project/vllm/issues/21348"),
]


@pytest.mark.parametrize("model, tp, kv_gib, max_len, tokens, concurrency, source", FROM_LOGGED_MEMORY)
def test_kv_tokens_from_the_logged_memory(model, tp, kv_gib, max_len, tokens, concurrency, source):
    spec = _spec(model)
    kinds = list(spec.layer_types) or ["full_attention"] * spec.num_layers
    groups = kv.kv_groups(spec, kinds, kv.page_bytes(spec, tp, 2, 16))
    blocks = kv.num_blocks(groups, int(kv_gib * GiB))
    planned = kv.kv_tokens_by_blocks(groups, blocks, 16)
    assert abs(planned / tokens - 1) <= 0.05, f"{planned:,} planned, {tokens:,} logged ({source})"
    if concurrency is not None:  # the logged memory is rounded to 0.01 GiB: concurrency to 0.5%
        assert abs(kv.max_concurrency(groups, blocks, max_len, 8192, 16) / concurrency - 1) <= 0.005


def test_the_logged_memory_gives_the_logged_tokens_qwen3_14b():
    # "Available KV cache memory: 6.51 GiB" -> 6.51 GiB // (65,536 B x 40 layers) = 2,666 blocks: 42,656 tokens and,
    # in 0.33.0's wording, int(2,666 / 2,048 x 32,768) = 42,656 (https://github.com/LMCache/LMCache/issues/1739)
    spec = _spec(QWEN3_14B)
    groups = kv.kv_groups(spec, list(spec.layer_types), kv.page_bytes(spec, 1, 2, 16))
    assert kv.num_blocks(groups, int(6.51 * GiB)) == 2_666
    assert kv.kv_tokens(groups, 2_666, 32768, 2048, 16) == 42_656


def test_mla_request_kv_bytes_deepseek_v2_lite():
    # "To serve at least one request with the models's max seq len (32768), (0.95 GiB KV cache is needed"
    # (vLLM 0.8.3, https://github.com/vllm-project/vllm/issues/15871): one latent of 512 + 64 per token and layer,
    # 32,768 x 27 x 576 x 2 B = 1,019,215,872 B = 0.949 GiB
    spec = _spec("deepseek-ai/DeepSeek-V2-Lite-Chat")
    groups = kv.kv_groups(spec, ["full_attention"] * spec.num_layers, kv.page_bytes(spec, 1, 2, 16))
    assert [(g.kind, g.num_layers, g.page_bytes) for g in groups] == [("mla", 27, 16 * 576 * 2)]
    assert kv.request_kv_bytes(groups, 32768, 8192, 16) == 1_019_215_872


def _plan(model, gpu, **settings):
    return plan_vllm(_spec(model), gpu, VllmSettings(cudagraph_in_budget=False, **settings))


def _card(total_gib):
    return GpuSpec("case", "logged card", int(total_gib * GiB), (9, 0))


# (model, card, settings of that version, logged KV GiB, logged tokens or None, source)
FULL_BUDGET = [
    # H100 79.18 GiB, util 0.9, max_model_len 16,000, 8,192 tokens / 1,024 sequences, sort sampler (the "sort"
    # constant is measured on these logs: they are not an independent check of it)
    ("llama-3.1-8b", _card(79.18), dict(max_model_len=16000, max_num_batched_tokens=8192, max_num_seqs=1024,
                                        sampler="sort"), 51.38, None, LLM_D),
    ("Qwen/Qwen3-0.6B", _card(79.18), dict(max_model_len=16000, max_num_batched_tokens=8192, max_num_seqs=1024,
                                           sampler="sort"), 64.45, None, LLM_D),
    ("Qwen/Qwen3-32B", _card(79.18), dict(max_model_len=16000, max_num_batched_tokens=8192, max_num_seqs=1024,
                                          sampler="sort"), 4.45, None, LLM_D),
    # TP 2: NCCL in that release's non-torch term (0.55 GiB logged)
    (FP8_70B, _card(79.18), dict(max_model_len=16000, max_num_batched_tokens=8192, max_num_seqs=1024,
                                 sampler="sort", tensor_parallel_size=2, nccl_in_budget=True), 32.0, None, LLM_D),
    # A100 80GB, vLLM 0.10.1.1: FlashInfer's sampler, 2,048 tokens / 256 sequences, NCCL in the non-torch term
    ("qwen2-7b", gpu_from_catalog("a100-80gb"), dict(gpu_memory_utilization=0.25, max_model_len=16384,
                                                     sampler="flashinfer"), 5.01, 93_872, A100_TP1),
    ("qwen2-7b", gpu_from_catalog("a100-80gb"), dict(gpu_memory_utilization=0.5, max_model_len=16384,
                                                     tensor_parallel_size=2, sampler="flashinfer",
                                                     nccl_in_budget=True), 31.83, 1_192_160, A100_TP2),
]


@pytest.mark.parametrize("model, gpu, settings, kv_gib, tokens, source", FULL_BUDGET)
def test_full_budget_within_5_percent(model, gpu, settings, kv_gib, tokens, source):
    p = _plan(model, gpu, **settings)
    assert abs(p.available_kv_bytes / GiB / kv_gib - 1) <= 0.05, f"{p.available_kv_bytes / GiB:.2f} ({source})"
    if tokens:
        assert abs(p.kv_tokens_by_blocks / tokens - 1) <= 0.05, f"{p.kv_tokens_by_blocks:,} planned ({source})"


def test_the_refusal_llama33_70b_fp8_on_one_h100():
    # "Available KV cache memory: -1.44 GiB" then "ValueError: No available memory for the cache blocks" (LLM_D)
    p = _plan(FP8_70B, _card(79.18), max_model_len=16000, max_num_batched_tokens=8192, max_num_seqs=1024,
              sampler="sort")
    assert p.refusal == "No available memory for the cache blocks"
    assert abs(p.available_kv_bytes / GiB + 1.44) <= 0.1  # -1.50 GiB planned


# (model, total GiB the log printed, utilization, max_model_len, GPU blocks logged, source)
V0_TOKENS = [
    # "total_gpu_memory=23.58GiB ... GPU blocks: 1952" and "1478" (V0, RTX 3090)
    ("llama-3.1-8b", 23.58, 0.9, 20_000, 1952, "https://github.com/vllm-project/vllm/issues/10517"),
    ("llama-3.1-8b", 23.58, 0.9, 29_000, 1478, "https://github.com/vllm-project/vllm/issues/10517"),
]


def _v0_plan(model, total_gib, util, max_len):
    # V0 (vLLM 0.6.4): one prefill of max_model_len tokens over 256 sequences, the sort sampler, CUDA graphs outside
    gpu = GpuSpec("case", "logged card", int(total_gib * GiB), (8, 6))
    return plan_vllm(_spec(model), gpu, settings_for_version("0.6.4", gpu_memory_utilization=util,
                                                             max_model_len=max_len))


@pytest.mark.parametrize("model, total_gib, util, max_len, blocks, source", V0_TOKENS)
def test_kv_tokens_within_5_percent(model, total_gib, util, max_len, blocks, source):
    p = _v0_plan(model, total_gib, util, max_len)
    assert abs(p.kv_tokens_by_blocks / (blocks * 16) - 1) <= 0.05, f"{p.kv_tokens_by_blocks:,} planned ({source})"


def test_kv_bytes_llama3_8b_h100_within_5_percent():
    # "total_gpu_memory 79.22GiB, gpu_memory_utilization 0.90 ... available_kv_cache_memory 53.29GiB"
    # (https://github.com/vllm-project/vllm/pull/10511; the tokens were not printed)
    p = _v0_plan("llama-3-8b", 79.22, 0.9, 8192)
    assert abs(p.available_kv_bytes / GiB / 53.29 - 1) <= 0.05


@pytest.mark.parametrize("max_len, logged_gib", [(20_000, 2.07), (29_000, 2.99)])
def test_activation_peak_against_the_logged_torch_peak(max_len, logged_gib):
    # peak_torch_memory 17.06 / 17.98 GiB minus the 14.99 GiB weights
    # (https://github.com/vllm-project/vllm/issues/10517)
    p = _v0_plan("llama-3.1-8b", 23.58, 0.9, max_len)
    assert abs(p.activation_bytes / GiB / logged_gib - 1) <= 0.02
