"""The small-batch 4-bit GEMM on the CPU, through Triton's interpreter: against bitsandbytes' own dequantize and
matmul (NF4 and FP4, with and without double quant, split K, a bias, rows that do not fill a tile), and the
``gemm_4bit`` route sending 9 to 64 rows to it while larger calls stay with bitsandbytes."""

import os

import pytest
from conftest import interpreted_kernels

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():  # before triton decorates the kernels (checked in _gemm below)
    os.environ.setdefault("TRITON_INTERPRET", "1")
BF = pytest.importorskip("bitsandbytes.functional")


def _gemm():
    """nf4 and nf4_gemm with interpreted kernels (reloaded if imported before without the variable)."""
    nf4_gemm, nf4 = interpreted_kernels(("nf4_gemm", "_gemm_4bit_kernel"), ("nf4", "_matmul_4bit_kernel"))
    return nf4, nf4_gemm


def _quantized(n, k, quant_type="nf4", nested=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    return BF.quantize_4bit(torch.randn(n, k, generator=g), blocksize=64, quant_type=quant_type,
                            compress_statistics=nested)


def _scales(st):
    return (st.absmax, st.state2.absmax, st.state2.code, st.offset) if st.nested else (st.absmax,)


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("rows,n,k,qt,nested,config", [
    (9, 40, 192, "nf4", True, None),  # 40 features: one tile of 64, masked; 3 blocks of K
    (33, 72, 256, "nf4", False, (16, 2, 4, 1)),  # 33 rows in a tile of 64; 5 tiles of 16 features, K split in 2
    (16, 24, 512, "fp4", True, (16, 4, 4, 1)),  # 4 splits of 2 blocks each
])
def test_gemm_4bit_matches_bitsandbytes_float32(rows, n, k, qt, nested, config):
    """float32 compute (exact products): the kernel equals bitsandbytes' dequantized weight times x, to float32
    summation order (1e-5 relative), with and without a bias."""
    nf4, gemm = _gemm()
    q, st = _quantized(n, k, qt, nested, seed=rows)
    g = torch.Generator().manual_seed(rows + 1)
    x, bias = torch.randn(rows, k, generator=g), torch.randn(n, generator=g)
    w = BF.dequantize_4bit(q, st)  # bitsandbytes' own float32 weight
    code = nf4.code_table(qt, "cpu")
    got = gemm.gemm_4bit(x, q, (n, k), 64, code, *_scales(st), bias=bias, config=config)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    assert _rel(got, x.double() @ w.double().T + bias.double()) < 1e-5
    plain = gemm.gemm_4bit(x.view(1, rows, k), q, (n, k), 64, code, *_scales(st), config=config)
    assert plain.shape == (1, rows, n) and _rel(plain[0], x.double() @ w.double().T) < 1e-5
    ref = gemm.reference_gemm(x, q, (n, k), 64, code, *_scales(st), bias=bias)
    assert torch.allclose(ref, x @ w.T + bias, rtol=1e-5, atol=1e-5)  # the reference is bitsandbytes' arithmetic


def test_gemm_4bit_bfloat16_and_refusals():
    nf4, gemm = _gemm()
    q, st = _quantized(64, 128, seed=3)
    x = torch.randn(20, 128, generator=torch.Generator().manual_seed(4)).bfloat16()
    code = nf4.code_table("nf4", "cpu")
    got = gemm.gemm_4bit(x, q, (64, 128), 64, code, *_scales(st))
    want = x.double() @ BF.dequantize_4bit(q, st).double().T
    assert got.dtype == torch.bfloat16 and _rel(got, want) < 1e-2  # bf16 weights and output (the interpreter
    # truncates to bfloat16 where CUDA rounds: 6e-3 here)
    with pytest.raises(ValueError, match="65 rows, at most 64"):
        gemm.gemm_4bit(torch.randn(65, 128), q, (64, 128), 64, code, *_scales(st))
    with pytest.raises(ValueError, match="need x"):
        gemm.gemm_4bit(torch.randn(9, 64), q, (64, 128), 64, code, *_scales(st))
    with pytest.raises(ValueError, match="3 splits of K 128 do not divide its 2 blocks"):
        gemm.gemm_4bit(torch.randn(9, 128), q, (64, 128), 64, code, *_scales(st), config=(16, 3, 4, 1))


def test_default_config_splits_k_to_fill_the_device(monkeypatch):
    """Llama-3.1-8B's shapes on 132 SMs: K is halved while the programs stay within 2 x 132 = 264 and each split
    keeps at least 8 blocks of 64."""
    _, gemm = _gemm()
    monkeypatch.setattr(gemm, "_sm_count", lambda _device: 132)
    gemm.default_config.cache_clear()
    try:
        assert gemm.default_config(1024, 4096, 64, 64, "cuda:0") == (128, 8, 4, 3)  # 8 x 8; 16 splits: 4 blocks
        assert gemm.default_config(4096, 4096, 64, 64, "cuda:0") == (128, 8, 4, 3)  # 32 x 8 = 256; x 16 = 512 > 264
        assert gemm.default_config(14336, 4096, 64, 64, "cuda:0") == (128, 2, 4, 3)  # 112 x 2 = 224; x 4 = 448
        assert gemm.default_config(4096, 14336, 64, 64, "cuda:0") == (128, 8, 4, 3)  # 32 x 8 = 256, 28 blocks each
        assert gemm.default_config(14336, 4096, 64, 64, "cuda:0", 256) == (256, 4, 8, 3)  # 56 x 4 = 224
        assert gemm.default_config(40, 192, 64, 9, "cpu") == (64, 1, 4, 1)  # the interpreter: one split
        assert gemm.default_config(1536, 576, 64, 32, "cpu") == (256, 1, 4, 1)  # at most 256 features a program
    finally:
        gemm.default_config.cache_clear()


def test_route_sends_9_to_64_rows_to_the_gemm():
    nf4, _ = _gemm()
    q, st = _quantized(32, 256, seed=5)
    op = torch.ops.bitsandbytes.gemm_4bit.default
    kw = dict(bias=None, absmax_8bit=st.absmax, absmax_code=st.state2.code, absmax_offset=st.offset)
    xs = [torch.randn(r, 256, generator=torch.Generator().manual_seed(r)) for r in (2, 40, 65)]
    want = [op(x, q, [32, 256], st.state2.absmax, 64, "nf4", **kw) for x in xs]
    from vramguard.run.kernels.route import gemm_4bit_route
    mode = gemm_4bit_route(max_rows=64)
    with mode:
        got = [op(x, q, [32, 256], st.state2.absmax, 64, "nf4", **kw) for x in xs]
    assert mode.counts == {"routed": 2, "declined": 1, "declined_why": "65 rows (more than 64)"}
    assert _rel(got[0], want[0]) < 1e-5 and _rel(got[1], want[1]) < 1e-5  # GEMV (2 rows), GEMM (40 rows)
    assert torch.equal(got[2], want[2])  # bitsandbytes' own result
    with pytest.raises(ValueError, match="max_rows: 65"):
        gemm_4bit_route(max_rows=65)


def test_decode_graphs_take_the_checked_route_and_fall_back_when_it_disagrees(monkeypatch):
    """choose_gemm on a tiny NF4 Llama (float32 compute; on the CPU nothing is timed, so every shape is routed):
    its factory routes a 40-row call of each projection to the GEMM with bitsandbytes' result; a GEMM that
    disagrees (zeros) leaves bitsandbytes in place with the reason; switched off, it says so."""
    _, gemm = _gemm()
    from test_fused_step import _nf4_llama

    from vramguard.run.kernels import route
    from vramguard.serve import decode_graphs
    model = _nf4_llama()
    factory, note = decode_graphs.choose_gemm(model)
    assert factory is not None and "checked against bitsandbytes on every projection shape at 2, 4, 8, 16, 32, " \
                                   "64 rows" in note
    proj = model.model.layers[0].mlp.gate_proj  # 128 x 64, NF4 with double quant
    x = torch.randn(1, 40, 64, generator=torch.Generator().manual_seed(7))
    with torch.inference_mode():
        want = proj(x)
        mode = factory()
        with mode:
            got = proj(x)
    assert mode.counts == {"routed": 1} and _rel(got, want) < 1e-5
    monkeypatch.setattr(route.nf4_gemm, "gemm_4bit", lambda x, *a, **k: torch.zeros(*x.shape[:-1], a[1][0]))
    factory, note = decode_graphs.choose_gemm(model)
    assert factory is None and note.startswith("decode steps: bitsandbytes' 4-bit matmul (vramguard's failed its "
                                               "check: RuntimeError: it differs from bitsandbytes by 1 (relative)")
    monkeypatch.setattr(decode_graphs, "GEMM", False)
    assert decode_graphs.choose_gemm(model) == (None, "decode steps: bitsandbytes' 4-bit matmul (vramguard's "
                                                      "switched off)")
    plain = torch.nn.Sequential(torch.nn.Linear(4, 4))
    assert decode_graphs.choose_gemm(plain) == (None, None)  # no 4-bit layer: nothing to say


@pytest.mark.parametrize("table,worst", [("float16", 3.3e-4), ("bfloat16", 3.2e-3)])
def test_register_table_holds_the_code_in_its_16_bit_type(table, worst):
    """The byte tables of ``lut_asm``'s PTX (8 words: low bytes of entries 0-7 and 8-15, then high bytes) put back
    together give bitsandbytes' NF4 values rounded to ``table``; float16 is within 3.3e-4 of every value (relative),
    bfloat16 3.1e-3 (its worst value is -0.525)."""
    import re

    nf4, _ = _gemm()
    code = BF.get_4bit_type("nf4", device="cpu").float()
    words = [int(w, 16) for w in re.findall(r"mov\.b32 t\d, (0x[0-9a-f]+);", nf4.lut_asm(code, table))]
    assert len(words) == 8
    lo = [(words[i // 4] >> (8 * (i % 4))) & 0xFF for i in range(16)]
    hi = [(words[4 + i // 4] >> (8 * (i % 4))) & 0xFF for i in range(16)]
    bits = torch.tensor([(h << 8) | b for h, b in zip(hi, lo)], dtype=torch.int32).to(torch.int16)
    values = bits.view(getattr(torch, table)).float()
    assert torch.equal(values, code.to(getattr(torch, table)).float())
    rel = ((values - code).abs() / code.abs().clamp_min(1e-12))[code != 0]
    assert float(rel.max()) < worst
    with pytest.raises(ValueError, match="table 'float32'"):
        nf4.lut_asm(code, "float32")
