"""GPU tests (marked ``gpu``; skipped without CUDA). Results recorded in benchmarks/results/h200_check."""

import gc

import pytest

pytestmark = pytest.mark.gpu

SMALL = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=2, vocab_size=8000, max_position_embeddings=2048)


def test_kernels_and_loader_on_gpu(tiny):
    import torch

    from vramguard.check.kernels import profile_attention
    from vramguard.load import _pin_sdpa, load_model, unload
    folder, _ = tiny("LlamaConfig", **SMALL)
    loaded = load_model(str(folder))
    k = loaded.report.kernel
    assert k.flash_class and k.kind in ("flash_attn_fa2", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient")
    unload(loaded)
    eager = load_model(str(folder), attn="eager", verify=True)
    assert eager.report.kernel.kind == "eager_softmax"
    unload(eager)
    plain = load_model(str(folder), attn="sdpa", verify=False)
    _pin_sdpa(plain.model, "flash")
    assert profile_attention(plain.model, "sdpa", pinned="flash").kind == "sdpa_flash"
    unload(plain)
    gc.collect()
    torch.cuda.empty_cache()


def test_load_unload_loop_returns_to_baseline(tiny):
    import torch

    from vramguard.load import load_model, unload
    folder, _ = tiny("LlamaConfig", **SMALL)
    gc.collect()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    for _ in range(3):
        loaded = load_model(str(folder), verify=False)
        weights = loaded.report.weights_bytes
        rep = unload(loaded)
        assert rep.residual_bytes is not None and abs(rep.residual_bytes) <= 0.01 * weights, rep
        del loaded
        assert abs(torch.cuda.memory_allocated() - base) <= 0.01 * weights
