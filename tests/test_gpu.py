"""GPU tests (marked ``gpu``; skipped without CUDA). Results recorded in benchmarks/results/h200_check."""

import gc

import pytest
from conftest import oom_when

pytestmark = pytest.mark.gpu

SMALL = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=2, vocab_size=8000, max_position_embeddings=2048)


def test_kernels_and_loader_on_gpu(tiny):
    import torch

    from vramguard.probe.kernels import profile_attention
    from vramguard.runtime.load import _pin_sdpa, load_model, unload
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

    from vramguard.runtime.load import clear_cublas_workspaces, load_model, unload
    folder, _ = tiny("LlamaConfig", **SMALL)
    gc.collect()
    clear_cublas_workspaces()  # load and unload leave them out of the baseline and the residual
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    for _ in range(3):
        loaded = load_model(str(folder), verify=False)
        weights = loaded.report.weights_bytes
        rep = unload(loaded)
        assert rep.residual_bytes is not None and abs(rep.residual_bytes) <= 0.01 * weights, rep
        del loaded
        assert abs(torch.cuda.memory_allocated() - base) <= 0.01 * weights


def test_check_reports_whether_unloading_returned_the_memory(tiny):
    """C17 on the GPU: `check` loads, verifies the kernel, unloads, and reports the residual (memory returned)."""
    from vramguard.check import check
    from vramguard.settings import Settings
    folder, _ = tiny("LlamaConfig", **SMALL)
    r = check(str(folder), Settings(quant="nf4", attn="sdpa"), verify=True)
    f = next(x for x in r.findings if x.code == "unload")
    assert f.level == "ok" and "B above the allocated memory before loading" in f.message, f.message


def test_every_strategy_recovers_on_gpu_including_offloaded_kv(tiny):
    """Issue #4 on the GPU: an OOM injected in each strategy in turn (prefill, then decode) until the last one,
    the offloaded KV cache (CUDA only), completes with the greedy tokens of an uninterrupted run (float32)."""
    from vramguard.run import generate as G
    from vramguard.runtime.load import load_model, unload
    folder, _ = tiny("LlamaConfig", **SMALL)
    loaded = load_model(str(folder), quant="fp32", verify=False)
    m = loaded.model
    prompt = list(range(5, 300))
    base = G.generate(m, None, prompt, 12, fast_decode=False).token_ids
    order = [st for st, _ in G.strategy_order(m, len(prompt), 12)[0]]  # generate's own fallback order
    assert order[-1].name.startswith("offloaded")
    import importlib.util
    if importlib.util.find_spec("hqq") is not None:  # the int8 KV cache runs on hqq's quantizer
        assert "int8 KV cache + chunked prefill 512" in [s.name for s in order]

    G.OOM_INJECTOR = oom_when(lambda phase, attempt, step: attempt < len(order) - 1 and (
        (attempt % 2 == 0 and phase == "prefill") or (attempt % 2 == 1 and step == 3)))
    r = G.generate(m, None, prompt, 12, fast_decode=False)
    assert r.strategy == order[-1].name and len(r.attempts) == len(order)
    assert r.token_ids == base
    unload(loaded)


def test_serve_on_gpu_recovers_an_oom_inside_a_step(tiny):
    """Issue #7 on the GPU: the real engine on CUDA, 8 concurrent greedy requests, an OOM injected in one step:
    every request completes with the tokens of plain ``generate`` (float32), /health stays ok."""

    import httpx
    import torch

    from vramguard.serve.server import build
    from conftest import concurrently, save_word_tokenizer
    folder, _ = tiny("LlamaConfig", **SMALL)
    save_word_tokenizer(folder, SMALL["vocab_size"])
    s = build(str(folder), quant="fp32", page_size=64, max_batch_tokens=512, max_running=8, max_queue=8,
              vram_budget=8 << 30, served_name="m", verify=False)
    url = s.start_background()
    fired = []

    def inject(index, ids):
        if not fired and len(ids) >= 4 and index >= 5:
            fired.append(index)
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
    s.engine.before_step = inject
    prompts = [[1] + list(range(10 + i, 60 + i)) for i in range(8)]
    out = [None] * 8

    def one(i):
        out[i] = httpx.post(url + "/v1/completions", timeout=120, json={
            "model": "m", "prompt": prompts[i], "max_tokens": 16, "temperature": 0, "ignore_eos": True}).json()
    try:
        concurrently(one, 8, 120)
        assert fired and s.engine.oom_recoveries == 1
        assert httpx.get(url + "/health").json()["status"] == "ok"
    finally:
        weights = s.report.weights_bytes
        rep = s.close()  # the KV pool, paged cache, CUDA graphs and the model go back
    assert rep.freed_bytes > weights and rep.returned(weights), rep
    from transformers import AutoModelForCausalLM
    ref = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).cuda().eval()
    for i, p in enumerate(prompts):
        ids = torch.tensor([p], device="cuda")
        want = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, min_new_tokens=16,
                            do_sample=False, pad_token_id=0)[0, len(p):].tolist()
        assert out[i]["usage"]["completion_tokens"] == 16
        assert out[i]["choices"][0]["text"] == " ".join(f"w{t - 3}" for t in want), i


def test_a_real_oom_under_a_cap_recovers_with_the_tokens_of_an_uninterrupted_run(tiny):
    """Issue #4: a real CUDA out-of-memory error, from the caching allocator under the per-process cap (not an
    injected exception). After the preflight, ballast (as another process taking memory would) leaves 3/4 of what
    the uninterrupted dynamic-cache run peaked at, and stays: the unchunked prefill runs out, the next strategy
    (static cache, chunks of 512) fits in what is left, and the request completes with the greedy tokens of the
    uninterrupted run (float32). The caller's own memory cap is put back afterwards."""
    import torch

    from vramguard.run import generate as G
    from vramguard.runtime.load import load_model, unload
    folder, _ = tiny("LlamaConfig", **SMALL)
    gc.collect()
    torch.cuda.empty_cache()
    loaded = load_model(str(folder), quant="fp32", verify=False)
    m = loaded.model
    prompt = list(range(5, 1500))
    held = torch.cuda.memory_allocated()
    plain = G.generate(m, None, prompt, 16, fast_decode=False)
    need = plain.peak_allocated_bytes - held  # what the uninterrupted run took beyond the weights
    budget = held + (1 << 30)  # the preflight sees 1 GiB free: the dynamic cache is planned
    torch.cuda.set_per_process_memory_fraction(0.9)  # a cap of the caller's own, to be put back afterwards
    ballast = []

    def fill(phase, attempt, step):
        if attempt == 0 and phase == "prefill" and not ballast:
            torch.cuda.empty_cache()
            room = budget - torch.cuda.memory_reserved() - need * 3 // 4
            ballast.append(torch.empty(room, dtype=torch.uint8, device="cuda"))
    G.OOM_INJECTOR = fill
    try:
        r = G.generate(m, None, prompt, 16, budget_bytes=budget, fast_decode=False)
    finally:
        G.OOM_INJECTOR = None
        ballast.clear()
        fraction = torch.cuda.get_per_process_memory_fraction()
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert fraction == pytest.approx(0.9)
    first = r.attempts[0]
    assert first.oom and "out of memory" in first.oom and "injected" not in first.oom and first.phase == "prefill"
    assert [a.strategy for a in r.attempts] == ["dynamic", "static cache + chunked prefill 512"], (need, r.attempts)
    assert r.token_ids == plain.token_ids
    unload(loaded)


def test_every_strategy_runs_under_the_flash_pin_of_a_default_load(tiny):
    """load_model's default (verify) pins SDPA to the flash kernel, which takes no mask; chunked prefill (a prompt
    of several chunks) and the static, quantized and offloaded caches pass one. Each strategy, reached by injected
    OOMs, must complete in bf16 and say that the pin was lifted."""
    from vramguard.run import generate as G
    from vramguard.runtime.handle import pin_of
    from vramguard.runtime.load import load_model, unload
    folder, _ = tiny("LlamaConfig", **SMALL)
    loaded = load_model(str(folder), quant="bf16")
    m = loaded.model
    assert pin_of(m) is not None and pin_of(m).backend == "flash"
    prompt = list(range(5, 1300))  # 3 chunks of 512
    order = [st for st, _ in G.strategy_order(m, len(prompt), 8)[0]]
    for k in range(1, len(order)):
        G.OOM_INJECTOR = oom_when(lambda phase, attempt, step, k=k: attempt < k and phase == "prefill")
        r = G.generate(m, None, prompt, 8, fast_decode=False)
        assert r.strategy == order[k].name and len(r.token_ids) == 8
        assert "pin to flash was lifted" in r.reason
    assert pin_of(m).backend == "flash"
    unload(loaded)


def test_4bit_gemm_matches_bitsandbytes_on_gpu():
    """The small-batch 4-bit GEMM compiled on the GPU, both ways of reading the 4-bit values, against bitsandbytes'
    own ``gemm_4bit`` at 16, 40 and 64 rows of Llama-3.1-8B's gate/up shape (NF4, double quant, bfloat16): the
    gathered code is bitsandbytes' dequantized weight (only the summation order differs); the register lookup
    rounds the code to bfloat16 first."""
    import torch
    BF = pytest.importorskip("bitsandbytes.functional")
    from vramguard.run.kernels import nf4_gemm
    from vramguard.run.kernels.nf4 import code_table
    g = torch.Generator(device="cuda").manual_seed(0)
    n, k = 14336, 4096
    w = torch.randn(n, k, generator=g, device="cuda", dtype=torch.bfloat16)
    q, st = BF.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
    scales = (st.absmax, st.state2.absmax, st.state2.code, st.offset)
    op = torch.ops.bitsandbytes.gemm_4bit.default
    for rows in (16, 40, 64):
        x = torch.randn(rows, k, generator=g, device="cuda", dtype=torch.bfloat16)
        want = op(x, q, [n, k], st.state2.absmax, 64, "nf4", None, st.absmax, st.state2.code, st.offset).float()
        for lut, tol in ((False, 2e-3), (True, 1e-2)):
            got = nf4_gemm.gemm_4bit(x, q, (n, k), 64, code_table("nf4", "cuda"), *scales, lut=lut)
            assert got.shape == (rows, n) and got.dtype == torch.bfloat16
            err = float((got.float() - want).norm() / want.norm())
            assert err < tol, (rows, lut, err)
