"""Weight memory: exact integers against hand arithmetic and against real (tiny) models."""

import pytest

from vramguard.memory.weights import parameter_count, quantized_tensor_bytes, rounded, weight_bytes
from vramguard.resolve import resolve_model
from vramguard.settings import Settings

LLAMA2_LINEAR_PARAMS = 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008)  # 6,476,005,376


def test_llama2_7b_parameter_count():
    # 6,476,005,376 linear + 2 x 32,000 x 4,096 embeddings/lm_head + (2 x 32 + 1) x 4,096 norms
    assert parameter_count(resolve_model("llama-2-7b")) == 6_476_005_376 + 262_144_000 + 266_240 == 6_738_415_616


def test_nf4_double_quant_tensor_layout():
    # q_proj 4096 x 4096 = 16,777,216 weights -> 8,388,608 B packed.
    # nblocks = 16,777,216 / 64 = 262,144 -> absmax uint8 262,144 B; second level ceil(262,144 / 256) = 1,024
    # float32 = 4,096 B; code2 256 x 4 = 1,024 B; offset 4 B -> 512 B; NF4 code 16 x 4 = 64 B -> 512 B.
    w, state = quantized_tensor_bytes(4096 * 4096, "nf4", True, 4096)
    assert w == 8_388_608
    assert state == 262_144 + 4_096 + 1_024 + 512 + 512 == 268_288
    # without double quant: float32 absmax 262,144 x 4 = 1,048,576 B, plus the 512 B code
    assert quantized_tensor_bytes(4096 * 4096, "nf4", False, 4096) == (8_388_608, 1_048_576 + 512)
    # int8: one byte a weight, one float32 scale per output row: 4,096 x 4 = 16,384 B
    assert quantized_tensor_bytes(4096 * 4096, "int8", True, 4096) == (16_777_216, 16_384)


def test_c9_llama7b_nf4_breakdown():
    """C9: quantized linears ~3.24 GB, constants ~0.10 GB (DQ) / ~0.40 GB (no DQ), 16-bit embeddings and lm_head
    ~0.52 GB, total ~3.87 GB (3.60 GiB) with double quant and ~4.17 GB without."""
    spec = resolve_model("llama-7b")
    dq = weight_bytes(spec, Settings(quant="nf4", double_quant=True))
    assert dq.quantized_linear_bytes == LLAMA2_LINEAR_PARAMS // 2 == 3_238_002_688
    assert dq.embedding_bytes + dq.lm_head_bytes == 2 * 32_000 * 4_096 * 2 == 524_288_000
    # per layer: 4 attention matrices of 268,288 B state (above) and 3 MLP matrices of 11,008 x 4,096:
    # nblocks 704,512 -> absmax 704,512 B; second level 2,752 x 4 = 11,008 B -> 11,264 B; code2 1,024 B;
    # offset 512 B; code 512 B -> 717,824 B.  32 x (4 x 268,288 + 3 x 717,824) = 103,251,968 B
    assert dq.quant_state_bytes == 32 * (4 * 268_288 + 3 * 717_824) == 103_251_968
    assert round(dq.total_bytes / 1e9, 2) == 3.87
    assert round(dq.total_bytes / 2**30, 2) == 3.60
    no_dq = weight_bytes(spec, Settings(quant="nf4", double_quant=False))
    assert round(no_dq.quant_state_bytes / 1e9, 2) == 0.40
    assert round(no_dq.total_bytes / 1e9, 2) == 4.17


def test_reference_nf4_weights_within_1_percent(shared_reference):
    """Measured after load on an H200 (shared/reference): 3,876,562,944 B."""
    pred = weight_bytes(resolve_model("llama-2-7b"), Settings(quant="nf4")).total_bytes
    assert abs(pred - 3_876_562_944) / 3_876_562_944 < 0.01


def test_reference_bf16_weights():
    # measured 13,476,832,256 B; parameters x 2 = 13,476,831,232 B
    pred = weight_bytes(resolve_model("llama-2-7b"), Settings(quant="bf16")).total_bytes
    assert pred == 13_476_831_232 + 0
    assert abs(pred - 13_476_832_256) <= 1024


def test_tied_embeddings_stored_once():
    spec = resolve_model("qwen2.5-3b")
    w = weight_bytes(spec, Settings(quant="bf16"))
    assert spec.tie_word_embeddings and w.lm_head_bytes == 0
    assert w.embedding_bytes == rounded(151_936 * 2_048 * 2)


def test_mixtral_moe_parameters():
    # C2: Mixtral-8x7B has 46.7 B parameters
    assert round(parameter_count(resolve_model("mixtral-8x7b")) / 1e9, 1) == 46.7


@pytest.mark.parametrize("cfg_name,kw", [
    ("LlamaConfig", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=300, max_position_embeddings=256)),
    ("Qwen2Config", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=300, max_position_embeddings=256,
                         tie_word_embeddings=True)),
    ("Phi3Config", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=4, vocab_size=300, max_position_embeddings=256, pad_token_id=0)),
    ("MistralConfig", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=32, vocab_size=300, max_position_embeddings=256,
                           sliding_window=64)),
    ("Gemma2Config", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, vocab_size=300, max_position_embeddings=256)),
    ("MixtralConfig", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=300, max_position_embeddings=256,
                           num_local_experts=4, num_experts_per_tok=2)),
])
def test_bf16_weights_match_the_real_module_tree(tiny, cfg_name, kw):
    """The planner's module list must be the real one: bf16 bytes equal the sum of every real parameter's bytes,
    each rounded to 512 B like the CUDA allocator, and the parameter count equals num_parameters()."""
    folder, model = tiny(cfg_name, **kw)
    spec = resolve_model(str(folder))
    real_bytes = sum(rounded(p.numel() * 2) for p in model.parameters())
    assert weight_bytes(spec, Settings(quant="bf16")).total_bytes == real_bytes
    assert parameter_count(spec) == model.num_parameters()


def test_nf4_weights_match_bitsandbytes_on_cpu(tiny):
    """Load a tiny Llama in NF4 + double quant through transformers and bitsandbytes (CPU) and compare every
    quantized tensor and its quantization state with the formula."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig
    folder, _ = tiny("LlamaConfig", hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, vocab_size=1000, max_position_embeddings=256)
    for dq in (True, False):
        q = AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.bfloat16, device_map="cpu",
            quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                   bnb_4bit_use_double_quant=dq,
                                                   bnb_4bit_compute_dtype=torch.bfloat16))
        packed = state = 0
        for p in q.parameters():
            qs = getattr(p, "quant_state", None)
            if qs is None:
                continue
            packed += rounded(p.numel() * p.element_size())
            tensors = [qs.absmax, qs.code] + ([qs.offset, qs.state2.absmax, qs.state2.code] if qs.nested else [])
            state += sum(rounded(t.numel() * t.element_size()) for t in tensors)
        w = weight_bytes(resolve_model(str(folder)), Settings(quant="nf4", double_quant=dq))
        assert (w.quantized_linear_bytes, w.quant_state_bytes) == (packed, state)
