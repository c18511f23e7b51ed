"""The fused decode step on the CPU, through Triton's interpreter: each fused kernel against its torch reference and
bitsandbytes' own dequantization, and the graph decoder with the fused step against transformers' ``generate``
(greedy, float32) on a tiny Llama whose projections are bitsandbytes NF4 layers, plus the fallback when a check
fails."""

import os

import pytest
from conftest import interpreted_kernels

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():  # before triton decorates the kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")
bnb = pytest.importorskip("bitsandbytes")
BF = pytest.importorskip("bitsandbytes.functional")
transformers = pytest.importorskip("transformers")


def _kernels():
    """The kernel modules with interpreted kernels (reloaded if imported before without the variable)."""
    nf4, _, fused = interpreted_kernels(("nf4", "_matmul_4bit_kernel"), ("decode_attention", "_split_kernel"),
                                        ("fused", "_glu_kernel"))
    return nf4, fused


def _weight(n, k, seed, nested=True):
    g = torch.Generator().manual_seed(seed)
    q, st = BF.quantize_4bit(torch.randn(n, k, generator=g), blocksize=64, quant_type="nf4",
                             compress_statistics=nested)
    w = {"packed": q, "shape": (n, k), "blocksize": 64, "quant_type": "nf4", "absmax": st.absmax}
    if nested:
        w.update(absmax2=st.state2.absmax, code2=st.state2.code, offset=st.offset)
    return w, BF.dequantize_4bit(q, st).double()


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("bfloat16", 3e-2)])  # bf16: Triton's interpreter truncates
def test_fused_projections_match_bitsandbytes_dequantized_weights(dtype, tol):
    nf4, fused = _kernels()
    dt = getattr(torch, dtype)
    code = nf4.code_table("nf4", "cpu")
    (q, wq), (k, wk), (v, wv) = _weight(64, 192, 1), _weight(32, 192, 2), _weight(32, 192, 3)  # 192: 6 pieces, padded
    x = torch.randn(192, generator=torch.Generator().manual_seed(9)).to(dt)
    got = fused.matmul_4bit_segments(x, [q, k, v], code)
    assert got.shape == (128,) and got.dtype == dt
    assert _rel(got, x.double() @ torch.cat([wq, wk, wv]).T) < tol
    gate_ref, up_ref = (x.double() @ wq.T).to(dt), (x.double() @ _weight(64, 192, 4)[1].T).to(dt)
    up, _ = _weight(64, 192, 4)
    glu = fused.matmul_4bit_glu(x, q, up, code)
    assert glu.shape == (64,) and _rel(glu, torch.nn.functional.silu(gate_ref) * up_ref) < tol
    plain, _ = _weight(32, 128, 5, nested=False)  # no double quant: absmax float32
    with pytest.raises(ValueError, match="differ in K, blocksize or double quant"):
        fused.matmul_4bit_segments(x, [q, plain], code)


def test_fused_rms_norm_is_transformers_rms_norm_of_the_sum():
    _, fused = _kernels()
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    norm = LlamaRMSNorm(96, eps=1e-5)
    norm.weight.data = torch.randn(96)
    x, r = torch.randn(96), torch.randn(96)
    out, total = fused.add_rms_norm(x, r, norm.weight.data, 1e-5)
    assert torch.equal(total, r + x)
    assert torch.allclose(out, norm(r + x).detach(), rtol=1e-6, atol=1e-6)
    alone, same = fused.add_rms_norm(x, None, norm.weight.data, 1e-5)
    assert same is x and torch.allclose(alone, norm(x).detach(), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="weight in the activations' dtype"):
        fused.add_rms_norm(x, r, norm.weight.data.bfloat16(), 1e-5)


def test_rotary_and_cache_write_at_the_device_position():
    _, fused = _kernels()
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    heads, kv, d, slots, pos = 4, 2, 16, 10, 7
    qkv = torch.randn((heads + 2 * kv) * d)
    ang = torch.randn(slots, d // 2)
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    keys = torch.full((1, kv, slots, d), float("nan"))
    values, length = keys.clone(), torch.tensor(3)
    q = fused.rope_cache_write(qkv, cos, sin, torch.tensor([pos]), keys, values, heads, kv, length)
    q_want, k_want = apply_rotary_pos_emb(qkv[:heads * d].view(1, heads, 1, d),
                                          qkv[heads * d:(heads + kv) * d].view(1, kv, 1, d), cos[pos:pos + 1][None],
                                          sin[pos:pos + 1][None])
    assert torch.allclose(q, q_want, atol=1e-6) and torch.allclose(keys[:, :, pos:pos + 1], k_want, atol=1e-6)
    assert torch.equal(values[0, :, pos].reshape(-1), qkv[(heads + kv) * d:])
    assert int(length) == pos + 1  # the layer's counter: slots 0..7 filled
    assert keys[:, :, :pos].isnan().all() and values[:, :, pos + 1:].isnan().all()  # nothing else written


def _nf4_llama():
    """A tiny Llama (2 layers, head_dim 16, GQA 2:1) whose seven projections per layer are bitsandbytes NF4 layers
    with double quant and float32 compute, quantized on the CPU."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=256, max_position_embeddings=256,
                                   initializer_range=0.2)
    m = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    for layer in m.model.layers:
        for blk, names in (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
                           ("mlp", ("gate_proj", "up_proj", "down_proj"))):
            for n in names:
                lin = getattr(getattr(layer, blk), n)
                q = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=False, compute_dtype=torch.float32,
                                      compress_statistics=True, quant_type="nf4")
                q.weight = bnb.nn.Params4bit(lin.weight.data.clone(), requires_grad=False, compress_statistics=True,
                                             quant_type="nf4", blocksize=64)._quantize("cpu")
                setattr(getattr(layer, blk), n, q)
    return m


@pytest.fixture(scope="module")
def nf4_model():
    _kernels()
    return _nf4_llama()


PROMPT = list(range(5, 25))


_HF: dict = {}


def _hf(m, new):
    """transformers' greedy tokens after PROMPT (computed once per model and length)."""
    if (id(m), new) in _HF:
        return _HF[(id(m), new)]
    ids = torch.tensor([PROMPT])
    _HF[(id(m), new)] = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                                   do_sample=False, pad_token_id=0)[0, len(PROMPT):].tolist()
    return _HF[(id(m), new)]


def test_the_fused_step_gives_transformers_tokens(nf4_model):
    from vramguard.run import fastdecode as F
    want = _hf(nf4_model, 5)
    dec = F.GraphDecoder(nf4_model, len(PROMPT) + 4, kernels=True)
    r = dec.generate(PROMPT, 5, eos_token_id=None)
    assert r.token_ids == want
    assert r.kernels.startswith("fused step: 4-bit matmul (Triton)") and "from the unfused step" in r.kernels
    assert int(dec.cache.get_seq_length()) == len(PROMPT) + 4  # the fused cache write kept transformers' counter
    again = dec.generate(PROMPT, 3, eos_token_id=None)  # the same cache and step, reset in place
    assert again.token_ids == want[:3]


def test_a_fused_check_that_fails_leaves_the_unfused_step(nf4_model, monkeypatch):
    from vramguard.run import fastdecode as F
    from vramguard.run import fused_step
    monkeypatch.setattr(fused_step, "STEP_TOLERANCE", 0.0)  # no step can agree within 0: the check must fail
    r = F.graph_decode(nf4_model, PROMPT, 3, kernels=True, eos_token_id=None)
    assert "fused step off: RuntimeError: the fused step's logits differ" in r.kernels
    assert r.kernels.startswith("4-bit matmul (Triton) for 14 bitsandbytes gemm_4bit call(s) per step")  # 2 x 7
    assert r.token_ids == _hf(nf4_model, 5)[:3]  # the check step's slot and counters were put back
    plain = F.graph_decode(nf4_model, PROMPT, 2, kernels=True, fused=False, eos_token_id=None)
    assert "fused step not used: fused=False was passed" in plain.kernels


def test_fused_support_names_what_it_cannot_run(nf4_model):
    from transformers import StaticCache

    from vramguard.run.fused_step import fused_support
    cache = StaticCache(config=nf4_model.config, max_cache_len=8)
    ok, why = fused_support(nf4_model, cache)
    assert ok, why
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=64)
    plain = transformers.AutoModelForCausalLM.from_config(cfg)
    assert fused_support(plain, StaticCache(config=cfg, max_cache_len=8)) == (
        False, "layer 0: self_attn.q_proj is not a bitsandbytes 4-bit layer")
    qcfg = transformers.Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=64)
    qwen = transformers.AutoModelForCausalLM.from_config(qcfg)
    assert fused_support(qwen, StaticCache(config=qcfg, max_cache_len=8)) == (
        False, "model_type 'qwen2' (the fused step knows llama, mistral)")


def test_weights_bitsandbytes_repacked_for_its_cpu_kernel_are_refused(nf4_model):
    """On a CPU with AVX512-BF16 bitsandbytes repacks a 4-bit weight into its own layout on the first forward
    (``quant_state.packing_format_for_cpu``): the fused kernels read the standard layout, so they must not run."""
    from transformers import StaticCache

    from vramguard.run.fused_step import fused_support
    qs = nf4_model.model.layers[0].mlp.up_proj.weight.quant_state
    qs.packing_format_for_cpu = True
    try:
        ok, why = fused_support(nf4_model, StaticCache(config=nf4_model.config, max_cache_len=8))
    finally:
        qs.packing_format_for_cpu = False
    assert (ok, why) == (False, "layer 0: mlp.up_proj: bitsandbytes repacked the weight for its CPU kernel "
                                "(another layout)")
