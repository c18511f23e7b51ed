"""vramguard's decode kernels on the CPU: the NF4 math against bitsandbytes' own quantize/dequantize, the Triton
kernels through Triton's interpreter against float64 references, the routing of bitsandbytes' ``gemm_4bit`` op, and
the graph decoder with the decode-attention kernel against transformers' ``generate`` (greedy, float32)."""

import os

import pytest
from conftest import interpreted_kernels

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():  # before triton decorates the kernels (checked in _kernels below)
    os.environ.setdefault("TRITON_INTERPRET", "1")
BF = pytest.importorskip("bitsandbytes.functional")


def _kernels():
    """The kernel modules with interpreted kernels (reloaded if another test imported them without the variable)."""
    return interpreted_kernels(("nf4", "_matmul_4bit_kernel"), ("decode_attention", "_split_kernel"))


def _quantized(n, k, quant_type="nf4", nested=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    return BF.quantize_4bit(w, blocksize=64, quant_type=quant_type, compress_statistics=nested)


def _scales(st):
    return (st.absmax, st.state2.absmax, st.state2.code, st.offset) if st.nested else (st.absmax,)


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("quant_type,nested", [("nf4", True), ("nf4", False), ("fp4", True)])
def test_reference_dequantize_is_bitsandbytes_dequantize(quant_type, nested):
    from vramguard.run.kernels.nf4 import code_table, reference_dequantize
    q, st = _quantized(48, 320, quant_type, nested)  # 48*320/64 = 240 blocks: one partial absmax2 group of 256
    assert q.dtype == torch.uint8 and q.numel() == 48 * 320 // 2
    ours = reference_dequantize(q, (48, 320), 64, code_table(quant_type, "cpu"), *_scales(st))
    theirs = BF.dequantize_4bit(q, st)
    assert torch.allclose(ours, theirs, rtol=1e-6, atol=0)


def test_nf4_code_table_and_nibble_order():
    """bitsandbytes' NF4 table, and the packing: byte i holds element 2i in its high nibble."""
    from vramguard.run.kernels.nf4 import code_table, reference_dequantize
    code = code_table("nf4", "cpu")
    assert code.shape == (16,) and code[0] == -1.0 and code[7] == 0.0 and code[15] == 1.0
    packed = torch.tensor([0x0F, 0x7F] + [0x77] * 30, dtype=torch.uint8)  # 64 elements, one block, absmax 2
    w = reference_dequantize(packed, (1, 64), 64, code, torch.tensor([2.0]))
    assert w[0, :4].tolist() == [-2.0, 2.0, 0.0, 2.0] and w[0, 4:].abs().sum() == 0


@pytest.mark.parametrize("rows,dtype,tol", [(1, "bfloat16", 1e-2), (2, "float32", 1e-5), (3, "float16", 2e-3)])
def test_matmul_4bit_kernel_matches_float64(rows, dtype, tol):
    nf4, _ = _kernels()
    dt = getattr(torch, dtype)
    for (n, k), nested, qt in (((40, 192), True, "nf4"), ((24, 256), False, "fp4")):  # 192: K/32 = 6 pieces, padded
        q, st = _quantized(n, k, qt, nested, seed=rows)
        x = torch.randn(rows, k).to(dt)
        bias = torch.randn(n).to(dt)
        code = nf4.code_table(qt, "cpu")
        out = nf4.matmul_4bit(x, q, (n, k), 64, code, *_scales(st), bias=bias)
        ref = nf4.reference_matmul(x, q, (n, k), 64, code, *_scales(st), bias=bias, dtype=torch.float64)
        assert out.shape == (rows, n) and out.dtype == dt
        assert _rel(out, ref) < tol
        bnb = x.double() @ BF.dequantize_4bit(q, st).double().T + bias.double()
        assert _rel(out, bnb) < tol


def test_matmul_4bit_refuses_what_it_cannot_take():
    nf4, _ = _kernels()
    q, st = _quantized(16, 128)
    code = nf4.code_table("nf4", "cpu")
    with pytest.raises(ValueError, match="at most 8 per launch"):
        nf4.matmul_4bit(torch.randn(9, 128), q, (16, 128), 64, code, *_scales(st))
    with pytest.raises(ValueError, match="need x"):
        nf4.matmul_4bit(torch.randn(1, 64), q, (16, 128), 64, code, *_scales(st))


def test_gemm_4bit_route_takes_small_calls_and_leaves_the_rest():
    nf4, _ = _kernels()
    q, st = _quantized(32, 256, seed=5)
    op = torch.ops.bitsandbytes.gemm_4bit.default
    kw = dict(bias=None, absmax_8bit=st.absmax, absmax_code=st.state2.code, absmax_offset=st.offset)
    x1, x9 = torch.randn(1, 1, 256).bfloat16(), torch.randn(9, 256).bfloat16()
    want1, want9 = op(x1, q, [32, 256], st.state2.absmax, 64, "nf4", **kw), op(x9, q, [32, 256], st.state2.absmax,
                                                                               64, "nf4", **kw)
    from vramguard.run.kernels.route import gemm_4bit_route
    mode = gemm_4bit_route()
    with mode:
        got1 = op(x1, q, [32, 256], st.state2.absmax, 64, "nf4", **kw)
        got9 = op(x9, q, [32, 256], st.state2.absmax, 64, "nf4", **kw)
    assert mode.counts == {"routed": 1, "declined": 1, "declined_why": "9 rows (more than 8)"}
    assert got1.shape == want1.shape == (1, 1, 32) and _rel(got1, want1) < 1e-2  # both round to bfloat16
    assert torch.equal(got9, want9)  # bitsandbytes' own result


@pytest.mark.parametrize("heads,kv_heads,dim,length,pos,dtype,tol", [
    (8, 2, 32, 300, 0, "float32", 1e-5),  # one key: the output is that value
    (8, 2, 32, 300, 150, "float32", 1e-5),
    (6, 2, 16, 700, 513, "float32", 1e-5),  # several splits, the last partly filled
    (4, 4, 64, 100, 99, "float16", 3e-3),  # no GQA, the cache full
])
def test_decode_attention_matches_a_float64_softmax_over_the_filled_slots(heads, kv_heads, dim, length, pos, dtype,
                                                                          tol):
    _, att = _kernels()
    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(pos)
    q = torch.randn(1, heads, dim, 1, generator=g).transpose(2, 3).to(dt)  # a strided view, as transformers passes
    k = torch.randn(1, kv_heads, length, dim, generator=g).to(dt)
    v = torch.randn(1, kv_heads, length, dim, generator=g).to(dt)
    k[:, :, pos + 1:] = float("nan")  # slots past the filled length must never be read
    v[:, :, pos + 1:] = float("nan")
    out = att.decode_attention(q, k, v, torch.tensor([pos]), dim ** -0.5)
    ref = att.reference_decode_attention(q, k, v, pos, dim ** -0.5)
    assert out.shape == (1, 1, heads, dim) and not out.isnan().any()
    assert _rel(out, ref) < tol


def test_split_plan_covers_the_cache():
    from vramguard.run.kernels.decode_attention import BLOCK_L, split_plan
    splits, iters = split_plan(8319, 8)  # 256 programs / 8 KV heads = 32 chunks wanted: 8319 / (32 * 64) -> 5 steps
    assert (splits, iters) == (26, 5) and splits * iters * BLOCK_L >= 8319 > (splits - 1) * iters * BLOCK_L
    assert split_plan(1, 8) == (1, 1)


def test_graph_decoder_with_the_attention_kernel_gives_transformers_tokens():
    _kernels()
    import transformers

    from vramguard.run import fastdecode as F
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=300, max_position_embeddings=512,
                                   initializer_range=0.2)
    m = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    prompt = list(range(5, 45))
    ids = torch.tensor([prompt])
    want = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                      pad_token_id=0)[0, len(prompt):].tolist()
    r = F.graph_decode(m, prompt, 8, kernels=True, eos_token_id=None)
    assert r.token_ids == want
    assert r.kernels.startswith("decode attention") and m.config._attn_implementation == "sdpa"  # switched back
    # seeded sampling: the kernel's self-test draws from its own generator, so the global RNG sees the same draws
    sampled = []
    for kernels in (True, False):
        torch.manual_seed(7)
        sampled.append(F.graph_decode(m, prompt, 6, kernels=kernels, do_sample=True, eos_token_id=None).token_ids)
    assert sampled[0] == sampled[1]
    with pytest.raises(F.InvalidValue, match="kernels that apply"):
        F.GraphDecoder(transformers.AutoModelForCausalLM.from_config(
            transformers.LlamaConfig(**{**cfg.to_dict(), "head_dim": 24})), 60, kernels=True)
