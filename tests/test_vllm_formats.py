"""vLLM's storage of quantized checkpoints, MLA, vision encoders and LoRA slots, and the rules of each release:
exact integers with the arithmetic in a comment (vramguard/engines/vllm_quant.py, vllm_arch.py, vllm_weights.py,
vllm_versions.py)."""

import pytest
from test_vllm_public_logs import spec_of

from vramguard.catalog.gpus import GpuSpec
from vramguard.engines import vllm_weights as w
from vramguard.engines.vllm import VllmSettings, plan_vllm, settings_for_version
from vramguard.engines.vllm_arch import _siglip, vllm_model
from vramguard.engines.vllm_quant import WeightFormat, weight_format
from vramguard.engines.vllm_versions import parse_version, rules_for
from vramguard.errors import ConfigError, InvalidValue
from vramguard.resolve import resolve_model
from vramguard.units import GiB


def test_marlin_gptq_and_awq_linears():
    gptq = weight_format({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128,
                                                  "desc_act": True}})
    # 4,096 x 4,096: weights / 2 = 8,388,608 + 32 groups x 4,096 x 2 B scales = 262,144 + g_idx and its sort
    # indices 2 x 4,096 x 4 B = 32,768 -> 8,683,520
    assert gptq.linear_bytes(4096, 4096, 1, 2) == 8_683_520
    awq = weight_format({"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128}})
    # the same + zero points 32 x 4,096 / 2 = 65,536 B (no g_idx) -> 8,716,288
    assert awq.linear_bytes(4096, 4096, 1, 2) == 8_388_608 + 262_144 + 65_536


def test_bitsandbytes_at_load_and_8bit():
    nf4 = weight_format({}, "bitsandbytes")
    # 4,096 x 4,096 = 16,777,216 weights: 8,388,608 B + 262,144 uint8 absmax + 1,024 fp32 nested absmax (4,096 B)
    # + one shard's code books 272 x 4 = 1,088 B, each rounded to 512 B -> 1,536
    assert nf4.linear_bytes(4096, 4096, 1, 2) == 8_388_608 + 262_144 + 4_096 + 1_536
    eight = weight_format({"quantization_config": {"quant_method": "bitsandbytes", "load_in_8bit": True}})
    assert eight.linear_bytes(4096, 4096, 1, 2) == 16_777_216 + 16_384  # 1 B per weight + fp32 row scales
    with pytest.raises(ConfigError):
        weight_format({}, "awq")


def test_block_fp8_experts():
    fp8 = weight_format({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}})
    # Qwen3-30B-A3B-FP8 at TP 1, one layer: 128 experts x (w13 1,536 x 2,048 + 12 x 16 fp32 scales
    # + w2 2,048 x 768 + 16 x 6 fp32 scales), each tensor rounded to 512 B
    per_expert = 3_145_728 + 1_024 + 1_572_864 + 512
    assert fp8.experts_bytes(128, 768, 2048, 2) == 128 * per_expert


@pytest.mark.parametrize("backend, expected", [
    # Marlin: intermediate 2,880 -> 2,944, hidden -> 3,072: values 32 x 3 x 2,944 x 3,072 / 2 = 434,110,464, scales
    # / 32 = 27,131,904, bf16 biases 32 x (5,888 + 3,072) x 2 = 573,440
    ("marlin", 434_110_464 + 27_131_904 + 573_440),
    # Triton: values padded to hidden 3,072: 424,673,280; scales 32 x 3 x 2,880 x 2,880 / 32 = 24,883,200; fp32
    # biases 32 x 8,640 x 4 = 1,105,920
    ("triton", 424_673_280 + 24_883_200 + 1_105_920),
    # FlashInfer: both to 3,072: 452,984,832 + 28,311,552 + bf16 biases 32 x 9,216 x 2 = 589,824
    ("flashinfer", 452_984_832 + 28_311_552 + 589_824)])
def test_mxfp4_experts_of_gpt_oss_20b_by_kernel(backend, expected):
    assert WeightFormat("mxfp4", linears=False).experts_bytes(32, 2880, 2880, 2, backend, bias=True) == expected


def test_deepseek_v2_lite_mla_weights():
    m = vllm_model(spec_of("deepseek-ai/DeepSeek-V2-Lite-Chat"))
    opts = w.LayerOptions(fmt=m.fmt, mla=m.mla)
    # layer 0 is dense: q_proj 3,072 x 2,048 + kv_a 576 x 2,048 + kv_a norm 512 + kv_b 4,096 x 512 + o 2,048 x 2,048
    # = 13,632,000 + MLP 3 x 10,944 x 2,048 = 67,239,936 + two norms 4,096 -> 80,876,032 x 2 B (tensors rounded)
    assert w.layer_weight_bytes(m.text, 1, 2, opts, 0) == 162_014_208
    # the checkpoint: 15.7B parameters (DeepSeek-V2-Lite's model card), the plan 15,706,484,224 without the rope cache
    r = w.rank_weights(m.text, 1, 1, 2, opts)[0]
    assert (r.total_bytes - r.rope_cache_bytes) // 2 == 15_706_484_224
    # TP 2 x PP 2: the first stage holds 14 layers (one dense) and the embeddings, the last 13 and the LM head
    assert [s.num_layers for s in w.rank_weights(m.text, 2, 2, 2, opts)] == [14, 13]


def test_vision_encoders():
    m = vllm_model(spec_of("mistralai/Mistral-Small-3.2-24B-Instruct-2506"))
    # Pixtral: patch conv 3 x 14 x 14 x 1,024 + ln_pre 1,024 + 24 x (4 x 1,024^2 + 3 x 1,024 x 4,096 + 2 x 1,024)
    # = 403,305,472 (Pixtral's "400M" encoder); projector: norm 1,024 + merger 4,096 x 1,024 + 1,024 x 5,120
    # + 5,120 x 5,120 = 35,652,608
    assert m.vision.params == 403_305_472 + 35_652_608
    assert (m.vision.max_patches, m.vision.tokens_per_image) == (12_100, 3_025)  # 1,540 / 14 = 110 patches a side
    assert m.text.model_type == "mistral" and m.text.num_layers == 40
    # Gemma-3's SigLIP (so400m): 416,866,032 in the encoder + 1,152 + 1,152 x 5,376 in the projector
    siglip = _siglip({"hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27, "image_size": 896,
                      "patch_size": 14}, 5376, 256)
    assert siglip.params == 416_866_032 + 1_152 + 6_193_152


def test_lora_slots():
    qwen = spec_of("qwen2.5-0.5b")  # 896 hidden, 14 / 2 heads of 64, MLP 4,864
    # rank 16, one LoRA: 16 x ((3 x 896 + 1,152) + (896 + 896) + (2 x 896 + 9,728) + (4,864 + 896)) x 2 B
    assert w.lora_layer_bytes(qwen, 1, 2, 16, 1) == 16 * (3840 + 1792 + 11520 + 5760) * 2
    base = plan_vllm(qwen, GpuSpec("c", "card", 24 * GiB, (8, 9)), VllmSettings(max_model_len=4096))
    lora = plan_vllm(qwen, GpuSpec("c", "card", 24 * GiB, (8, 9)),
                     VllmSettings(max_model_len=4096, enable_lora=True, max_lora_rank=16, max_loras=2))
    assert lora.lora_bytes == 24 * w.lora_layer_bytes(qwen, 1, 2, 16, 2)
    assert lora.weights_bytes - base.weights_bytes == lora.lora_bytes
    assert lora.flags()["max-loras"] == 2
    with pytest.raises(InvalidValue):
        VllmSettings(enable_lora=True, max_lora_rank=24)


def test_release_rules():
    assert parse_version("0.9.2.dev7548+gbaba038") == (0, 9, 2)
    v0, old, mid, new = rules_for("0.6.3"), rules_for("0.10.1.1"), rules_for("0.19.0"), rules_for("0.33.0")
    assert (v0.engine, v0.sampler, v0.cudagraph_in_budget) == ("v0", "sort", False)
    assert (old.sampler, old.nccl_in_budget, old.mxfp4_hopper_backend) == ("flashinfer", True, "marlin")
    assert (mid.sampler, mid.cudagraph_in_budget, mid.tokens_by_blocks) == ("triton", False, True)
    assert (new.nccl_in_budget, new.cudagraph_in_budget, new.tokens_by_blocks) == (False, True, False)
    assert rules_for("0.14.0").sampler == "sort"
    s = settings_for_version("0.10.1", sampler="sort", max_model_len=4096)
    assert (s.sampler, s.nccl_in_budget, s.vllm_version) == ("sort", True, "0.10.1")  # an argument overrides a rule
    for bad in ("latest", "0.4.3"):
        with pytest.raises(InvalidValue):
            rules_for(bad)


def test_v0_profiles_one_prefill_of_max_model_len():
    p = plan_vllm(resolve_model("llama-3.1-8b"), GpuSpec("c", "RTX 3090", int(23.58 * GiB), (8, 6)),
                  settings_for_version("0.6.3", max_model_len=20000))
    assert (p.max_num_batched_tokens, p.max_num_seqs, p.kv_tokens) == (20000, 256, p.kv_tokens_by_blocks)


def test_fp8_at_load_keeps_one_scale_per_tensor():
    fp8 = weight_format({}, "fp8")
    assert (fp8.kind, fp8.strategy) == ("int8_fp8", "tensor")
    # Llama-3.1-8B's gate_up 28,672 x 4,096 from two shards: 117,440,512 B of fp8 + one 512 B block of scales
    assert fp8.linear_bytes(28672, 4096, 2, 2) == 117_440_512 + 512
    p = plan_vllm(resolve_model("llama-3.1-8b"), GpuSpec("h", "H100", int(79.19 * GiB), (9, 0)),
                  settings_for_version("0.19.0", quantization="fp8", max_model_len=8192, gpu_memory_utilization=0.95))
    # vLLM 0.19.0 logged "Model loading took 8.49 GiB" (github.com/llm-d-incubation/llm-d-planner, v0.19.0 logs)
    assert abs(p.weights_bytes / GiB - 8.49) < 0.01
    with pytest.raises(InvalidValue):
        VllmSettings(quantization="awq")


def test_granite_is_planned_as_llama():
    granite = spec_of("ibm-granite/granite-3.1-8b-instruct")
    m = vllm_model(granite)
    assert (m.text.model_type, m.text.tie_word_embeddings, m.text.num_layers) == ("llama", True, 40)
    p = plan_vllm(granite, GpuSpec("h", "H100", int(79.19 * GiB), (9, 0)),
                  settings_for_version("0.19.0", max_model_len=8192, gpu_memory_utilization=0.95))
    assert abs(p.weights_bytes / GiB - 15.25) < 0.05  # vLLM 0.19.0 logged 15.25 GiB


def test_tensor_parallel_buffers_by_release():
    # NCCL's 420 MiB before 0.19; 0.19's all-reduce fusion workspace and NCCL at TP >= 2, 1,894 MiB; pipeline
    # parallelism alone keeps 420 MiB; 0.33 keeps them outside the budget
    assert rules_for("0.14.0").tp_comm_bytes == 420 * 2**20
    assert rules_for("0.19.0").tp_comm_bytes == rules_for("0.32.0").tp_comm_bytes == 1894 * 2**20
    h100 = GpuSpec("h", "H100", int(79.19 * GiB), (9, 0))
    llama = resolve_model("llama-3.1-8b")
    tp2 = plan_vllm(llama, h100, settings_for_version("0.19.0", tensor_parallel_size=2, max_model_len=8192))
    pp2 = plan_vllm(llama, h100, settings_for_version("0.19.0", pipeline_parallel_size=2, max_model_len=8192))
    assert (tp2.nccl_bytes, pp2.nccl_bytes) == (1894 * 2**20, 420 * 2**20)


def test_multimodal_rope_is_read_from_the_text_config():
    gemma = vllm_model(spec_of("google/gemma-3-4b-it")).text
    # linear rope x 8: 131,072 x 8 positions x 256 x 2 B = 536,870,912 + the local rope 131,072 x 256 x 2 B
    assert w.rope_cache_bytes(gemma, 2) == 536_870_912 + 67_108_864


def test_a_quantization_against_the_checkpoints_own_is_refused():
    w8a8 = spec_of("RedHatAI/Meta-Llama-3.1-8B-Instruct-quantized.w8a8")
    h100 = GpuSpec("h", "H100", int(79.19 * GiB), (9, 0))
    with pytest.raises(ConfigError, match="compressed-tensors"):  # vLLM 0.19.0 stops on --quantization fp8 here
        plan_vllm(w8a8, h100, settings_for_version("0.19.0", quantization="fp8", max_model_len=8192))
    # the checkpoint's own method given again is accepted
    assert weight_format({"quantization_config": {"quant_method": "bitsandbytes"}}, "bitsandbytes").kind == "bnb4"
