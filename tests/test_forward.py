"""Forward-pass peaks: attention workspace per implementation, activations, logits, chunked prefill."""

from vramguard.memory.forward import (decode_peak, eager_bytes_per_score, forward_peak, logits_bytes,
                                      prefill_peak)
from vramguard.plan import estimate, plan
from vramguard.resolve import resolve_model
from vramguard.settings import Settings
from vramguard.units import GiB, MiB
from vramguard.plan.choice import choose


def test_eager_bytes_per_score_by_dtype():
    # bf16: scores (2) + float32 copy made by softmax(dtype=float32) (4) + float32 result (4)
    assert eager_bytes_per_score("bf16") == 10
    assert eager_bytes_per_score("fp16") == 8  # fused half-to-float softmax: 2 + 4 + 2
    assert eager_bytes_per_score("fp32") == 8


def test_eager_prefill_holds_the_score_matrix():
    spec = resolve_model("llama-2-7b")
    s = Settings(quant="nf4", attn="eager", prompt_tokens=3968, max_new_tokens=128)
    pf = prefill_peak(spec, s)
    scores = 32 * 3968 * 3968  # 503,840,768 scores in the last layer
    assert pf.at == "softmax_fp32"
    assert pf.components["attention"] >= 10 * scores
    sdpa = prefill_peak(spec, s.with_(attn="sdpa"))
    assert sdpa.components.get("attention", 0) < 32 * 3968 * 4 * 2  # a log-sum-exp, no score matrix
    assert pf.peak_bytes - sdpa.peak_bytes > 4 * GiB


def test_sdpa_math_materializes_float32_scores():
    spec = resolve_model("llama-3-8b")
    s = Settings(quant="nf4", attn="sdpa", prompt_tokens=4096, max_new_tokens=1)
    math = prefill_peak(spec, s.with_(sdpa_kernel="math")).peak_bytes
    flash = prefill_peak(spec, s).peak_bytes
    assert math - flash >= 32 * 4096 * 4096 * 8 - 512 * MiB


def test_c8_logits_all_positions():
    spec = resolve_model("llama-3-8b")
    native, fp32 = logits_bytes(spec, 1, 8192, "bf16")
    assert native == 8192 * 128_256 * 2 == 2_101_346_304
    assert round(native / GiB, 3) == 1.957 and round(fp32 / GiB, 3) == 3.914
    _, last = logits_bytes(spec, 1, 1, "bf16")
    assert round(last / MiB, 2) == 0.49  # 128,256 x 4 B = 513,024 B
    # Qwen2-7B at 131,072 tokens: 131,072 x 152,064 x 4 B = 79,725,330,432 B = 74.25 GiB of float32 logits
    _, qwen = logits_bytes(resolve_model("qwen2-7b"), 1, 131_072, "bf16")
    assert qwen / GiB == 74.25


def test_c8_plan_says_which_logits_case_applies():
    gen = plan("llama-3-8b", Settings(prompt_tokens=8191, max_new_tokens=1), vram="80GiB", solve=False)
    assert "last position" in gen.logits_case
    full = plan("llama-3-8b", Settings(prompt_tokens=8191, max_new_tokens=1, logits="all"), vram="80GiB",
                solve=False)
    assert "all positions" in full.logits_case
    f = next(f for f in full.findings if f.code == "logits_all_positions")
    assert "1.957 GiB" in f.message and "3.914 GiB" in f.message
    assert full.estimate.components["logits"] - gen.estimate.components.get("logits", 0) > 5 * GiB


def test_c13_output_attentions_retains_every_map():
    """C13: Llama-3-70B, bf16, prompt 2048, attention maps requested: 64 x 2048 x 2048 x 2 B = 512 MiB per layer,
    40 GiB over 80 layers, plus a transient float32 softmax buffer of 1 GiB per layer."""
    spec = resolve_model("llama-3-70b")
    s = Settings(quant="bf16", attn="sdpa", prompt_tokens=2048, max_new_tokens=1, output_attentions=True)
    assert s.effective_attn == "eager"
    p = plan(spec, s, vram="192GiB", solve=False)
    f = next(f for f in p.findings if f.code == "output_attentions_eager")
    assert "512.00 MiB per layer" in f.message and "40.00 GiB over 80 layers" in f.message
    assert "1.00 GiB per layer" in f.message
    assert f.bytes == 80 * 64 * 2048 * 2048 * 2 == 40 * GiB
    without = prefill_peak(spec, s.with_(output_attentions=False, attn="eager")).peak_bytes
    assert prefill_peak(spec, s).peak_bytes - without >= 79 * 512 * MiB


def test_chunked_prefill_lowers_the_activation_peak():
    spec = resolve_model("llama-3.1-8b")
    s = Settings(quant="nf4", attn="sdpa", prompt_tokens=65_536, max_new_tokens=64)
    whole = prefill_peak(spec, s)
    chunked = prefill_peak(spec, s.with_(prefill_chunk=2048))
    assert chunked.chunk_tokens == 2048 and chunked.past_tokens == 63_488
    # MLP activations scale with the chunk: 3 x 65,536 x 14,336 x 2 B = 5.25 GiB without chunks
    assert whole.components["activations"] > 5 * GiB > chunked.components["activations"]
    assert whole.peak_bytes - chunked.peak_bytes > 6 * GiB


def test_decode_peak_is_the_last_step():
    spec = resolve_model("llama-3-8b")
    s = Settings(quant="nf4", prompt_tokens=1000, max_new_tokens=24)
    d = decode_peak(spec, s)
    assert (d.past_tokens, d.chunk_tokens) == (1022, 1)
    assert decode_peak(spec, s.with_(max_new_tokens=1)) is None
    # batch-1 NF4 decode uses bitsandbytes' gemv: no dequantized weight; batch 2 dequantizes
    assert "dequant" not in d.components or d.components["dequant"] < MiB
    d2 = forward_peak(spec, s.with_(batch=2), 1022, 1, "decode")
    assert d2.largest_alloc >= 14336 * 4096 * 2 or d2.peak_bytes > d.peak_bytes


def test_compute_dtype_float32_costs_memory():
    """C3: 4-bit compute dtype float32 with bf16 activations: dequantized 14336 x 4096 weight is 224 MiB in
    float32 against 112 MiB in half precision."""
    spec = resolve_model("mistral-7b-v0.3")
    s = Settings(quant="nf4", batch=32, prompt_tokens=512, max_new_tokens=512)
    fp32 = s.with_(compute_dtype="fp32")
    assert estimate(choose(spec).model, fp32).prefill.peak_bytes > estimate(choose(spec).model, s).prefill.peak_bytes
    p = plan(spec, fp32, gpu="rtx-4090", solve=False)
    f = next(f for f in p.findings if f.code == "compute_dtype_mismatch")
    assert "224.00 MiB" in f.message and "112.00 MiB" in f.message
