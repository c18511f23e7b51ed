"""The fast paths' quality on real weights, on the CPU: ``benchmarks/quality.py``'s teacher-forced comparison with
bitsandbytes' own NF4 forward, run through Triton's interpreter.

The model is the real SmolLM2-135M-Instruct (the ``smollm2`` fixture) cut to its first :data:`LAYERS` decoder
layers (its own embedding, final norm and ``lm_head``) with bitsandbytes NF4 projections (double quant, float32
compute): the interpreter takes tens of seconds per decode step of the whole model, so the CPU measures real
weights on real activations of the text through a shallower network; the GPU benchmark runs the whole model in
bfloat16 (``benchmarks/results/h200_session_1202/README.md``). Float32 compute leaves the kernels' own arithmetic
as the only difference, so the thresholds are the goal's (top-1 agreement >= 99%, perplexity within 0.5%) plus a
log-probability bound that a wrong scale or a misread nibble would break. The register lookup of CUDA (the NF4
table rounded to bfloat16) cannot run here; ``benchmarks/cpu_lut_rounding.py`` measures that rounding on the whole
model in torch (``benchmarks/results/h200_session_1202/README.md``).
"""

import os

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():  # before triton decorates the kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("bitsandbytes")
pytest.importorskip("triton")

from conftest import interpreted_kernels

from benchmarks import quality as Q

LAYERS = 2
TOKENS = 65  # the text's first tokens: 64 scored positions (serve's GEMM: two chunks of 32 rows)
FUSED_FROM = 62  # the fused steps score positions 62 and 63 after a forward over the first 62 tokens


@pytest.fixture(scope="module")
def real(smollm2):
    """(token ids, the NF4 model, bitsandbytes' own NF4 forward's scores over the ids)."""
    interpreted_kernels(("nf4", "_matmul_4bit_kernel"), ("nf4_gemm", "_gemm_4bit_kernel"),
                        ("decode_attention", "_split_kernel"), ("fused", "_glu_kernel"))
    from transformers import AutoTokenizer
    ids = Q.text_ids(AutoTokenizer.from_pretrained(smollm2), TOKENS)
    model, _ = Q.load_models(str(smollm2), "cpu", torch.float32, LAYERS, need_bf16=False)
    return ids, model, Q.forward_scores(model, ids)


def _within_goal(c: dict, logprob_bound: float) -> None:
    print(c)  # the measured figures, for -s runs
    assert c["agreement"] >= Q.GOAL_AGREEMENT, c
    assert abs(c["ppl_ratio"] - 1) <= Q.GOAL_PPL_RATIO, c
    assert c["mean_abs_logprob_diff"] < logprob_bound, c


def test_the_text_is_long_enough_and_scored_against_itself_exactly(real, smollm2):
    from transformers import AutoTokenizer
    ids, _, ref = real
    assert len(Q.text_ids(AutoTokenizer.from_pretrained(smollm2))) >= 2000  # the GPU benchmark's 2048 fit
    assert ids[:4] == AutoTokenizer.from_pretrained(smollm2)("Now it came to pass", add_special_tokens=False)["input_ids"][:4]
    assert ref.top1.shape == (TOKENS - 1,) and torch.isfinite(ref.logprob).all()
    assert Q.compare(ref, ref) == {"agreement": 1.0, "ppl_ratio": 1.0, "mean_abs_logprob_diff": 0.0}
    with pytest.raises(ValueError, match="--tokens: 99999; the text has 3262 tokens"):
        Q.text_ids(AutoTokenizer.from_pretrained(smollm2), 99999)


def test_the_fused_step_agrees_with_bitsandbytes_nf4_on_real_text(real):
    ids, model, ref = real
    fused = Q.fused_scores(model, ids, prefill=FUSED_FROM)
    assert fused.first == FUSED_FROM and "from the unfused step" in fused.note  # the checked step ran
    c = Q.compare(fused, ref)
    _within_goal(c, 1e-3)  # float32 on both sides: the kernels' summation order only
    rows = Q.report({"bnb_nf4": ref, "fused": fused})
    assert rows["fused"]["positions"] == TOKENS - 1 - FUSED_FROM and rows["fused"]["goal_met"] is True
    assert rows["fused"]["vs_bnb_nf4"] == c


def test_the_nf4_gemm_of_serve_agrees_with_bitsandbytes_on_real_text(real):
    ids, model, ref = real
    gemm = Q.run_path("serve_gemm", model, None, ids)
    assert gemm.note.startswith(f"{LAYERS * 7 * 2} 4-bit calls routed, 0 left")  # 7 projections x 2 chunks of 32
    _within_goal(Q.compare(gemm, ref), 1e-3)
