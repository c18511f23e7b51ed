"""The serving engine's varlen paged attention on the CPU: the per-request math against a float64 reference, the
Triton decode kernel through Triton's interpreter (packed keys, the paged cache's read index, padding requests),
its split plan, and the engine with it switched on against the engine without it (greedy, float32)."""

import asyncio
import os

import pytest
from conftest import interpreted_kernels

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():  # before triton decorates the kernels (checked in _kernel below)
    os.environ.setdefault("TRITON_INTERPRET", "1")

LQ, LK = [5, 3, 1, 1, 1], [5, 9, 70, 130, 1]  # a fresh prefill, a prefill chunk, three decodes (one of one key)
H, HKV, D = 8, 2, 16


def _packed(seed=0):
    g = torch.Generator().manual_seed(seed)
    cu_q, cu_k = [0], [0]
    for a, b in zip(LQ, LK):
        cu_q.append(cu_q[-1] + a)
        cu_k.append(cu_k[-1] + b)
    q = torch.randn(cu_q[-1], H, D, generator=g)
    k = torch.randn(cu_k[-1], HKV, D, generator=g)
    v = torch.randn(cu_k[-1], HKV, D, generator=g)
    return q, k, v, cu_q, cu_k


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def _kernel():
    return interpreted_kernels(("varlen_attention", "_varlen_split_kernel"))[0]


def test_reference_is_causal_bottom_right():
    """Request 1 (3 queries over 9 keys): its first query sees keys 0..6, so key 7 and 8 do not move it."""
    from vramguard.run.kernels.varlen_attention import reference_varlen_attention
    q, k, v, cu_q, cu_k = _packed()
    out = reference_varlen_attention(q, k, v, cu_q, cu_k, D ** -0.5)
    k2, v2 = k.clone(), v.clone()
    k2[cu_k[1] + 7:cu_k[2]] += 5.0
    v2[cu_k[1] + 7:cu_k[2]] += 5.0
    out2 = reference_varlen_attention(q, k2, v2, cu_q, cu_k, D ** -0.5)
    assert torch.equal(out[cu_q[1]], out2[cu_q[1]])  # the first query of the chunk
    assert not torch.equal(out[cu_q[1] + 2], out2[cu_q[1] + 2])  # the last one sees them


def test_sdpa_path_matches_the_reference():
    from vramguard.run.kernels.varlen_attention import reference_varlen_attention, varlen_attention
    q, k, v, cu_q, cu_k = _packed()
    want = reference_varlen_attention(q, k, v, cu_q, cu_k, D ** -0.5)
    got = varlen_attention(q, k, v, torch.tensor(cu_q), torch.tensor(cu_k), 5, 130, D ** -0.5, use_triton=False)
    assert _rel(got, want) < 1e-5
    perm = torch.randperm(cu_k[-1] + 7, generator=torch.Generator().manual_seed(1))[:cu_k[-1]]
    kc, vc = torch.zeros(cu_k[-1] + 7, HKV, D), torch.zeros(cu_k[-1] + 7, HKV, D)
    kc[perm], vc[perm] = k, v  # the same keys scattered over a paged cache, read through its read index
    got = varlen_attention(q, kc, vc, torch.tensor(cu_q), torch.tensor(cu_k), 5, 130, D ** -0.5, use_triton=False,
                           read_index=perm)
    assert _rel(got, want) < 1e-5


def test_split_plan():
    from vramguard.run.kernels.varlen_attention import split_plan
    assert split_plan(64, 8, 640) == (1, 640)  # 512 programs already: one split of 10 blocks of 64 keys
    assert split_plan(1, 8, 8192) == (64, 128)  # 8 programs: 64 splits of 2 blocks
    assert split_plan(4, 8, 100) == (2, 64)  # ceil(512 / 32) = 16 wanted, 2 blocks of keys exist


def test_triton_kernel_mixed_indexed_and_padded():
    V = _kernel()
    q, k, v, cu_q, cu_k = _packed()
    want = V.reference_varlen_attention(q, k, v, cu_q, cu_k, D ** -0.5)
    got = V.varlen_attention(q, k, v, torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32),
                             5, 130, D ** -0.5)
    assert _rel(got, want) < 1e-5
    perm = torch.randperm(cu_k[-1] + 7, generator=torch.Generator().manual_seed(1))[:cu_k[-1]]
    kc, vc = torch.zeros(cu_k[-1] + 7, HKV, D), torch.zeros(cu_k[-1] + 7, HKV, D)
    kc[perm], vc[perm] = k, v
    s = 2  # the decodes alone, padded with 3 requests without queries (offsets that plateau), 256 keys planned
    cq = torch.tensor(cu_q[s:] + [cu_q[-1]] * 3, dtype=torch.int32) - cu_q[s]
    ck = torch.tensor(cu_k[s:] + [cu_k[-1]] * 3, dtype=torch.int32) - cu_k[s]
    qp = torch.cat([q[cu_q[s]:], torch.full((3, H, D), 7.0)])
    got = V.varlen_attention(qp, kc, vc, cq, ck, 1, 256, D ** -0.5, read_index=perm[cu_k[s]:])
    assert _rel(got[:3], want[cu_q[s]:]) < 1e-5
    assert torch.equal(got[3:], torch.zeros(3, H, D))  # padding rows are never written


def test_choose_keeps_transformers_attention_off_cuda(tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig

    from vramguard.serve.attention import choose
    m = AutoModelForCausalLM.from_config(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                     num_attention_heads=2, num_key_value_heads=1, vocab_size=64))
    before = m.config._attn_implementation
    assert choose(m) == (None, "attention: transformers' paged attention (the model is not on a CUDA device)")
    assert m.config._attn_implementation == before


def _tokens(served, prompts, n):
    from vramguard.serve.engine import Sampling

    async def go():
        hs = [served.engine.submit(p, n, Sampling(temperature=0)) for p in prompts]
        out = []
        for h in hs:
            while True:
                o = await asyncio.wait_for(h.queue.get(), 60)
                if o.status.name in ("FINISHED", "FAILED"):
                    out.append(list(o.generated_tokens))
                    break
        return out

    return asyncio.run(go())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Llama folder, its prompts (5..100 tokens against 64-token steps: chunked prefills and decodes) and
    their greedy tokens from the engine with transformers' attention."""
    from conftest import save_tiny
    folder, _ = save_tiny(tmp_path_factory.mktemp("attn"), "LlamaConfig", hidden_size=64, intermediate_size=128,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
                          max_position_embeddings=1024)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (5, 40, 100, 7, 63, 2)]
    s = _build_tiny(folder)
    try:
        return folder, prompts, _tokens(s, prompts, 10)
    finally:
        s.close()


def _build_tiny(folder):
    from vramguard.serve.server import build
    return build(str(folder), quant="fp32", max_batch_tokens=64, page_size=16, greedy=True, verify=False)


def test_engine_with_varlen_attention_equals_without(tiny, monkeypatch):
    """The engine with the varlen attention forced on (its SDPA path on the CPU) gives the tokens of the engine
    without it; where this transformers' continuous batching takes no custom attention, the engine says so and
    serves with transformers' own."""
    from vramguard.serve import attention
    folder, prompts, want = tiny
    monkeypatch.setattr(attention, "eligible", lambda m: None)
    s = _build_tiny(folder)
    try:
        assert _tokens(s, prompts, 10) == want and all(len(t) == 10 for t in want)
        note = next(n for n in s.engine.notes if n.startswith("attention:"))
        assert ("vramguard's varlen" in note and s.engine.attn_implementation == attention.ATTN_NAME) or \
            "refused ours" in note
    finally:
        s.close()


def test_engine_falls_back_to_transformers_attention_when_ours_fails(tiny, monkeypatch):
    """Our attention raising on the first request: the continuous engine is started again with transformers' own
    (not the one-request-at-a-time generate engine), says why, and serves the tokens of transformers' attention."""
    from vramguard.serve import attention
    folder, prompts, want = tiny

    def broken(*a, **k):
        raise RuntimeError("kernel broke")

    monkeypatch.setattr(attention, "eligible", lambda m: None)
    monkeypatch.setattr(attention, "paged_varlen_attention", broken)
    s = _build_tiny(folder)
    try:
        assert s.engine.name == "continuous" and s.engine.attn_implementation != attention.ATTN_NAME
        assert _tokens(s, prompts, 10) == want
        notes = " ".join(s.engine.notes)
        assert "failed this model's first request" in notes and "kernel broke" in notes or "refused ours" in notes
    finally:
        s.close()


def _decode_step(n: int, keys: list[int]):
    """A decode-only step of ``n`` requests laid out as transformers 5.17's ContinuousBatchingIOs holds it (static
    int32 bulk rows, int64 index storage) and the kwargs its get_model_kwargs returns."""
    from types import SimpleNamespace
    bulk = torch.full((10, 65), 99, dtype=torch.int32)  # 99: stale values of earlier steps
    wstore = torch.full((1, 64), 555, dtype=torch.int64)
    rstore = torch.full((1, 4096), 555, dtype=torch.int64)
    cu_k = [0]
    for x in keys:
        cu_k.append(cu_k[-1] + x)
    bulk[2, :n + 1] = torch.arange(n + 1)
    bulk[3, :n] = torch.arange(n)  # each request's one token is its logits row
    bulk[4, :n + 1] = torch.tensor(cu_k)
    bulk[7:, :n] = torch.arange(3 * n, dtype=torch.int32).view(3, n)  # three processors' per-request arguments
    wstore[0, :n] = torch.arange(100, 100 + n)
    io = SimpleNamespace(input_ids=bulk[0, :64], position_ids=bulk[1, :64], cumulative_seqlens_q=bulk[2],
                         cumulative_seqlens_k={"full_attention": bulk[4]}, logits_indices=bulk[3, :64],
                         write_index_storage=wstore, read_index_storage=rstore, total_seqlen_k={"full_attention":
                                                                                              cu_k[-1]},
                         num_q_tokens=n, num_request_in_batch=n, _write_trash_index=7)
    kw = {"input_ids": bulk[0, :n].unsqueeze(0), "position_ids": bulk[1, :n].unsqueeze(0),
          "cu_seq_lens_q": bulk[2, :n + 1], "cu_seq_lens_k": bulk[4, :n + 1], "max_seqlen_q": 1,
          "max_seqlen_k": max(keys), "logits_indices": bulk[3, :n], "logits_processor_args": bulk[7:, :n],
          "write_index": [wstore[0, :n]], "read_index": [rstore[0, :cu_k[-1]]], "attention_mask": None}
    return io, kw


def test_decode_graph_inputs_pad_with_requests_that_read_and_write_nothing():
    """5 requests padded to 8: the offsets plateau (the padding requests have no query and no key), their keys go to
    the trash row (7), their sampling arguments are the first request's, and the read index is the whole storage
    (the same tensor at every replay)."""
    from types import SimpleNamespace

    from vramguard.serve import decode_graphs as DG
    io, kw = _decode_step(5, [3, 70, 1, 9, 2])
    bp = SimpleNamespace(inputs_and_outputs=io)
    g = DG.DecodeGraphs(bp, max_requests=64)
    assert g.size_max == 64 and DG._bucket(70, DG.MIN_KEYS) == 1024 and DG._bucket(1500, DG.MIN_KEYS) == 2048
    g._fill(io, kw, 5, 8)
    runner = SimpleNamespace(supports_logits_to_keep=lambda m: True)
    data = g._batch(io, kw, 8, 1024, runner, None)
    assert data["cu_seq_lens_q"].tolist() == [0, 1, 2, 3, 4, 5, 5, 5, 5]
    assert data["cu_seq_lens_k"].tolist() == [0, 3, 73, 74, 83, 85, 85, 85, 85]  # 85 = 3 + 70 + 1 + 9 + 2
    assert data["write_index"][0].tolist() == [100, 101, 102, 103, 104, 7, 7, 7]
    assert data["logits_indices"].tolist() == [0, 1, 2, 3, 4, 0, 0, 0]  # padding rows read row 0's logits
    assert data["logits_processor_args"].tolist() == [[0, 1, 2, 3, 4, 0, 0, 0], [5, 6, 7, 8, 9, 5, 5, 5],
                                                      [10, 11, 12, 13, 14, 10, 10, 10]]
    assert data["read_index"][0].data_ptr() == io.read_index_storage.data_ptr() and data["read_index"][0].numel() \
        == 4096
    assert data["max_seqlen_q"] == 1 and data["max_seqlen_k"] == 1024 and data["logits_to_keep"] is \
        data["logits_indices"]
    io2, kw2 = _decode_step(3, [5, 5, 5])  # a later, smaller step reuses the same buffers
    g._fill(io2, kw2, 3, 4)
    assert g._batch(io2, kw2, 4, 1024, runner, None)["cu_seq_lens_q"].data_ptr() == data["cu_seq_lens_q"].data_ptr()
    assert g.cu_k[:5].tolist() == [0, 5, 10, 15, 15]
    assert DG.unsupported(SimpleNamespace(inputs_and_outputs=SimpleNamespace())).startswith(
        "this transformers' batch layout lacks input_ids")

