"""Naming the attention path from profiler names: reference kernel names, and real CPU profiles."""

import pytest

from vramguard.probe.kernels import classify, profile_attention

CUDNN = "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128_4x1x1_cga1x1x1_kernel0_0"
EAGER = "void (anonymous namespace)::softmax_warp_forward<float, float, float, 10, false, false>(float*, float const*"


def test_reference_kernel_names_from_the_h200():
    k = classify(["aten::scaled_dot_product_attention", "aten::_scaled_dot_product_cudnn_attention"], [CUDNN],
                 "sdpa")
    assert k.kind == "sdpa_cudnn" and k.flash_class and k.matches_request
    e = classify(["aten::matmul", "aten::softmax", "aten::_softmax"], [EAGER], "eager")
    assert e.kind == "eager_softmax" and not e.flash_class and e.matches_request


def test_pytorch_flash_is_not_flash_attn_package():
    pt = classify(["aten::_scaled_dot_product_flash_attention"],
                  ["void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>"], "sdpa",
                  pinned="flash")
    assert pt.kind == "sdpa_flash" and pt.matches_request
    fa = classify(["flash_attn::_flash_attn_forward"], ["void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<"],
                  "flash_attention_2")
    assert fa.kind == "flash_attn_fa2" and fa.matches_request


def test_differences_from_the_request_are_flagged():
    # pinned to flash but cuDNN ran
    k = classify(["aten::_scaled_dot_product_cudnn_attention"], [CUDNN], "sdpa", pinned="flash")
    assert not k.matches_request and "pinned to flash" in k.reason
    # asked for sdpa, got the math backend (scores materialized)
    m = classify(["aten::_scaled_dot_product_attention_math", "aten::_softmax"], [EAGER], "sdpa")
    assert m.kind == "sdpa_math" and not m.matches_request and "math" in m.reason
    # asked for FA2, eager ran
    x = classify(["aten::_softmax"], [EAGER], "flash_attention_2")
    assert x.kind == "eager_softmax" and not x.matches_request
    assert classify([], [], "sdpa").kind is None


@pytest.mark.parametrize("attn,pin,kind", [("sdpa", None, "sdpa_cpu_flash"), ("eager", None, "eager_softmax"),
                                           ("sdpa", "math", "sdpa_math")])
def test_real_profile_of_a_tiny_model_on_cpu(attn, pin, kind):
    pytest.importorskip("torch")
    import transformers
    from torch.nn.attention import SDPBackend, sdpa_kernel
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
                                   max_position_embeddings=256)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).eval()
    if pin:
        with sdpa_kernel([SDPBackend.MATH]):
            k = profile_attention(model, attn, pinned=pin, seq_len=32)
    else:
        k = profile_attention(model, attn, seq_len=32)
    assert k.kind == kind and k.matches_request, k


def test_the_profilers_own_stderr_lines_are_filtered_and_the_rest_kept(capfd):
    """Kineto prints 'USDT: ... profiler_start/stop' on fd 2 at each profile: filtered; any other line written
    to fd 2 meanwhile comes through, in order."""
    import os

    import torch

    from vramguard.probe.kernels import kineto_lines_filtered
    from torch.profiler import ProfilerActivity, profile
    with kineto_lines_filtered():
        os.write(2, b"before\n")
        with profile(activities=[ProfilerActivity.CPU]):
            torch.ones(3).add_(1)
        os.write(2, b"USDT:2026-11-30 22:21:29 7215:7215 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
        os.write(2, b"after\n")
    err = capfd.readouterr().err
    assert "USDT" not in err and "profiler_start" not in err
    assert err.index("before") < err.index("after")
