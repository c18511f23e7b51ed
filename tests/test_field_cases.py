"""Field cases of shared/cases/field-cases.md that the planner answers (C1 plan side, C2, C6, C8, C9, C13 are
also covered in test_kv / test_forward / test_weights / test_solve)."""

from vramguard.plan import plan
from vramguard.settings import Settings
from vramguard.memory.weights import parameter_count
from vramguard.resolve import resolve_model


def test_c2_fa2_with_float32_parameters():
    """C2: FA2 requested with parameters that resolve to float32 (Mixtral-8x7B, 46.7 B parameters): plan reports
    that FA2 needs fp16/bf16, and the cost: 46.7e9 x 4 = 186.8 GB against 93.4 GB in bf16."""
    spec = resolve_model("mixtral-8x7b")
    p = plan(spec, Settings(quant="fp32", attn="flash_attention_2", prompt_tokens=512, max_new_tokens=128),
             gpu="h100-80gb", solve=False)
    f = next(f for f in p.findings if f.code == "fa2_needs_half")
    assert f.level == "fail" and "float32" in f.message and "bfloat16" in f.fix
    n = parameter_count(spec)
    assert round(n * 4 / 1e9, 1) == 186.8 and round(n * 2 / 1e9, 1) == 93.4
    assert round(p.estimate.weights.total_bytes / 1e9, 1) == 186.8
    assert round(f.bytes / 1e9, 1) == 93.4  # what the mistake costs
    assert not p.cards[0].fits


def test_c1_plan_flags_fa2_and_bf16_on_turing():
    """C1 (plan side): FA2 asked for on a compute-capability-7.5 card with NF4 + bf16 compute."""
    p = plan("mistral-7b-v0.3", Settings(quant="nf4", attn="flash_attention_2", prompt_tokens=512,
                                         max_new_tokens=1024), gpu="t4", solve=False)
    codes = {f.code: f for f in p.findings}
    assert codes["fa2_compute_capability"].level == "fail"
    assert "8.0" in codes["fa2_compute_capability"].message and "7.5" in codes["fa2_compute_capability"].message
    assert "sdpa" in codes["fa2_compute_capability"].fix
    assert "float16" in codes["bf16_not_native"].fix
