"""The graph decoder on the CPU: greedy tokens equal transformers' ``generate`` (static and dynamic cache, SDPA and
eager attention, float32 and bfloat16, chunked prefill), EOS and length stops, seeded sampling, the reported mode
and reason, the wiring into ``vramguard.run.generate``; and the capture logic itself through a CPU emulation of a CUDA
graph (the step's Python code runs once, its aten ops are replayed on the same tensors), which fails when the step
keeps Python-side state that a replay would not update. The real capture runs in the ``gpu`` tests."""

import pytest
from conftest import oom_when

from vramguard.run import fastdecode as F
from vramguard.run import generate as G
from vramguard.errors import InvalidValue
from vramguard.plan import estimate
from vramguard.resolve import resolve_model
from vramguard.settings import Settings
from vramguard.units import GiB
from vramguard.plan.choice import choose

# initializer_range 0.2: attention then decides the next token (with the default 0.02 the tokens follow the last
# token's embedding, and a mask or position off by one changes none of them, so identity would prove little)
CFG = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
           vocab_size=300, max_position_embeddings=512, initializer_range=0.2)
PROMPT = list(range(5, 45))
NEW = 20


def _model(attn="sdpa", dtype="float32", **over):
    import torch
    import transformers
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**{**CFG, **over})
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).eval().to(
        getattr(torch, dtype))


@pytest.fixture(scope="module")
def model():
    return _model()


@pytest.fixture(autouse=True)
def _no_overrides():
    yield
    F.GRAPH_OVERRIDE = F.CAPTURE_OVERRIDE = None
    G.OOM_INJECTOR = None


def hf(model, new=NEW, prompt=PROMPT, **kw):
    """transformers' own generate: the reference."""
    import torch
    ids = torch.tensor([prompt], device=next(model.parameters()).device)
    kw.setdefault("do_sample", False)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, pad_token_id=0, **kw)
    return out[0, len(prompt):].tolist()


# -- a CUDA graph, emulated on the CPU -----------------------------------------------------------------------------

class _Recorder:
    """Records the aten ops of one call (as a capture would), then undoes the call's writes to tensors that existed
    before it (a capture runs nothing). Reading a device value on the host during the call raises, as it does in a
    CUDA capture."""

    def __init__(self):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves
        rec = self
        self.ops, self.fresh, self.saved = [], set(), {}

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if func is torch.ops.aten._local_scalar_dense.default:
                    raise RuntimeError("host read of a device value during capture (.item(), int(), bool())")
                for i, a in enumerate(func._schema.arguments):  # an in-place write to an older tensor: keep it
                    t = args[i] if i < len(args) else kwargs.get(a.name)
                    if a.alias_info is not None and a.alias_info.is_write and isinstance(t, torch.Tensor):
                        st = t.untyped_storage()
                        if st.data_ptr() not in rec.fresh and st.data_ptr() not in rec.saved:
                            rec.saved[st.data_ptr()] = (st, st.clone())
                ins = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                       if isinstance(t, torch.Tensor)}
                out = func(*args, **kwargs)
                for t in tree_leaves(out):
                    if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in ins:
                        rec.fresh.add(t.untyped_storage().data_ptr())
                rec.ops.append((func, args, kwargs, out))
                return out

        self.mode = Mode()

    def capture(self, step):
        with self.mode:
            output = step()
        for st, before in self.saved.values():
            st.copy_(before)
        return output

    def replay(self, output):
        from torch.utils._pytree import tree_leaves, tree_map
        env = {}

        def sub(x):
            return env.get(id(x), x)
        for func, args, kwargs, out in self.ops:
            new = func(*tree_map(sub, args), **tree_map(sub, kwargs))
            for o, n in zip(tree_leaves(out), tree_leaves(new)):
                env[id(o)] = n
        output.copy_(env[id(output)])


def emulated_capture(step):
    rec = _Recorder()
    output = rec.capture(step)
    return (lambda: rec.replay(output)), output, "emulated_graph"


def force_graph(emulate=emulated_capture):
    F.GRAPH_OVERRIDE = lambda m: (True, "forced by the test")
    F.CAPTURE_OVERRIDE = emulate


# -- greedy identity -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("attn,dtype,chunk", [("sdpa", "float32", None), ("sdpa", "bfloat16", 16),
                                              ("eager", "float32", 16), ("eager", "bfloat16", None)])
def test_greedy_tokens_equal_generate_on_the_cpu(attn, dtype, chunk):
    m = _model(attn, dtype)
    ref_static = hf(m, min_new_tokens=NEW, cache_implementation="static", prefill_chunk_size=chunk)
    assert len(set(ref_static)) > 5  # not a degenerate repetition: the comparison means something
    r = F.graph_decode(m, PROMPT, NEW, prefill_chunk_tokens=chunk, min_new_tokens=NEW)
    assert r.token_ids == ref_static
    if dtype == "float32":  # and the plain dynamic cache (in bfloat16 a chunked prefill rounds differently)
        assert r.token_ids == hf(m, min_new_tokens=NEW)
    assert (r.mode, r.stop, r.prompt_tokens, r.max_cache_len) == ("eager", "max_new_tokens", 40, 40 + NEW - 1)
    assert r.reason.startswith("no CUDA device (the model is on cpu)") and "eagerly" in r.reason
    assert r.replay_steps == 0 and r.eager_steps == NEW - 1 and r.decode_ms_per_token > 0


@pytest.mark.parametrize("attn,chunk", [("sdpa", None), ("eager", 16)])
def test_emulated_graph_replays_give_the_same_tokens(attn, chunk):
    m = _model(attn)
    force_graph()
    r = F.graph_decode(m, PROMPT, NEW, prefill_chunk_tokens=chunk, min_new_tokens=NEW)
    assert r.token_ids == hf(m, min_new_tokens=NEW, cache_implementation="static", prefill_chunk_size=chunk)
    assert r.mode == "emulated_graph" and "captured after 2 warm-up step(s)" in r.reason
    # 19 decode steps, all replayed: the 2 warm-up steps and the capture ran before the prefill, on a dummy token
    assert (r.eager_steps, r.replay_steps, r.decode_steps, r.warmup_steps) == (0, NEW - 1, NEW - 1, 2)
    assert r.capture_s is not None and r.replay_ms_per_token > 0


def test_a_graph_is_reused_by_the_next_request(model):
    force_graph()
    dec = F.GraphDecoder(model, max_cache_len=100)
    first = dec.generate(PROMPT, NEW, min_new_tokens=NEW)
    other = list(range(60, 90))
    second = dec.generate(other, 12, min_new_tokens=12)
    assert first.token_ids == hf(model, min_new_tokens=NEW)
    assert second.token_ids == hf(model, 12, other, min_new_tokens=12)
    assert (second.eager_steps, second.replay_steps, second.capture_s) == (0, 11, None)
    assert "earlier call" in second.reason
    with pytest.raises(InvalidValue) as e:  # 90 + 12 - 1 = 101 slots > 100
        dec.generate(list(range(90)), 12)
    assert "at most 11" in str(e.value) and "max_cache_len" in str(e.value)


class _StalePosition(F.GraphDecoder):
    """A broken step: its position comes from a Python counter, which a replay does not advance."""

    def _step(self):
        import torch
        self.calls = getattr(self, "calls", 0) + 1
        pos = torch.full((1, 1), self.prompt_len + self.calls - 1)
        return self._forward(self._ids, pos, self._mask(pos.view(1, 1, 1, 1)))


def test_the_emulation_catches_python_state_that_a_replay_would_not_update(model):
    ref = hf(model, min_new_tokens=NEW)
    eager = _StalePosition(model, len(PROMPT) + NEW - 1, use_graph=False)
    eager.prompt_len = len(PROMPT)
    assert eager.generate(PROMPT, NEW, min_new_tokens=NEW).token_ids == ref  # run eagerly, the counter is right
    force_graph()
    graphed = _StalePosition(model, len(PROMPT) + NEW - 1)
    graphed.prompt_len = len(PROMPT)
    r = graphed.generate(PROMPT, NEW, min_new_tokens=NEW)
    # the prefill's token is right; every replayed step repeats the capture's stale position
    assert r.mode == "emulated_graph" and r.token_ids[:1] == ref[:1] and r.token_ids != ref


class _HostRead(F.GraphDecoder):
    def _step(self):
        int(self._pos)  # a host read: a CUDA capture fails on it
        return super()._step()


def test_a_failed_capture_is_reported_and_decoding_continues_eagerly(model):
    force_graph()
    r = _HostRead(model, len(PROMPT) + NEW - 1).generate(PROMPT, NEW, min_new_tokens=NEW)
    assert r.token_ids == hf(model, min_new_tokens=NEW)
    assert r.mode == "eager" and r.replay_steps == 0
    assert r.reason.startswith("graph capture failed, every step ran eagerly: RuntimeError: host read")


def test_a_request_too_short_to_capture_says_so(model):
    force_graph()
    r = F.graph_decode(model, PROMPT, 3)  # 2 decode steps: both are the warm-up
    assert r.mode == "eager" and "ended after 2 decode step(s), before the capture" in r.reason
    one = F.graph_decode(model, PROMPT, 1)
    assert len(one.token_ids) == 1 and one.decode_ms_per_token is None and one.max_cache_len == len(PROMPT)


# -- stops, sampling, streaming ------------------------------------------------------------------------------------

def test_eos_stops_and_is_kept_as_generate_keeps_it(model):
    free = hf(model, min_new_tokens=NEW)
    eos = free[6]
    first = free.index(eos)
    want = hf(model, eos_token_id=eos)
    assert want == free[:first + 1]
    for sync_every in (1, 4):  # 4: steps past the EOS are run, then discarded
        force_graph() if sync_every == 4 else None
        r = F.graph_decode(model, PROMPT, NEW, eos_token_id=eos, sync_every=sync_every)
        assert r.token_ids == want and r.stop == "eos"
    for at_least in (first, first + 1):  # EOS allowed at index `first`, then suppressed there (transformers' rule)
        r = F.graph_decode(model, PROMPT, NEW, eos_token_id=eos, min_new_tokens=at_least)
        assert r.token_ids == hf(model, eos_token_id=eos, min_new_tokens=at_least)
        assert len(r.token_ids) == first + 1 if at_least == first else len(r.token_ids) > first + 1
    held = F.graph_decode(model, PROMPT, NEW, eos_token_id=[eos, 299], min_new_tokens=NEW)
    assert held.token_ids == hf(model, eos_token_id=[eos, 299], min_new_tokens=NEW) and len(held.token_ids) == NEW
    assert held.stop == "max_new_tokens" and held.token_ids != free  # EOS suppressed: another token was chosen


def test_sampling_is_reproducible_and_matches_generate_with_the_same_seed(model):
    import torch
    kw = dict(do_sample=True, temperature=0.8, top_k=40, top_p=0.9)
    torch.manual_seed(11)
    want = hf(model, min_new_tokens=NEW, **kw)
    runs = []
    for graph in (False, True, True):
        if graph:
            force_graph()
        torch.manual_seed(11)
        runs.append(F.graph_decode(model, PROMPT, NEW, min_new_tokens=NEW, **kw).token_ids)
    assert runs == [want, want, want]
    torch.manual_seed(12)
    assert F.graph_decode(model, PROMPT, NEW, min_new_tokens=NEW, **kw).token_ids != want
    assert want != hf(model, min_new_tokens=NEW)  # sampling did change the tokens


def test_tokens_stream_in_order_and_logits_are_the_ones_that_chose_them(model):
    force_graph()
    seen, chosen = [], []
    r = F.graph_decode(model, PROMPT, NEW, min_new_tokens=NEW, on_token=seen.append,
                       on_logits=lambda i, lg: chosen.append((i, int(lg.argmax()))), sync_every=5)
    assert seen == r.token_ids and [i for i, _ in chosen] == list(range(NEW))
    assert [t for _, t in chosen] == r.token_ids


@pytest.mark.parametrize("kw,field", [({"max_cache_len": 0}, "max_cache_len"), ({"warmup_steps": -1}, "warmup_steps"),
                                      ({"prefill_chunk_tokens": 0}, "prefill_chunk_tokens")])
def test_bad_decoder_arguments_are_refused(model, kw, field):
    args = {"max_cache_len": 64, **kw}
    with pytest.raises(InvalidValue) as e:
        F.GraphDecoder(model, **args)
    assert e.value.field == field


def test_models_the_decoder_cannot_run_are_refused_before_any_work(model):
    with pytest.raises(InvalidValue) as e:
        F.graph_decode(model, PROMPT, 4, sync_every=0)
    assert e.value.field == "sync_every"
    model.config._attn_implementation = "flash_attention_2"
    try:
        with pytest.raises(InvalidValue) as e:
            G.generate(model, None, PROMPT, 4, fast_decode=True)
        assert e.value.field == "attn" and "attn='sdpa'" in str(e.value)
    finally:
        model.config._attn_implementation = "sdpa"
    mistral = _model(sliding_window=8, layer_types=["sliding_attention", "full_attention"])
    with pytest.raises(InvalidValue) as e:
        F.GraphDecoder(mistral, 64)
    assert "StaticSlidingWindowLayer" in str(e.value)


def test_graph_support_names_what_prevents_a_graph(model):
    ok, why = F.graph_support(model)
    assert not ok and why == "no CUDA device (the model is on cpu)"
    dyn = _model(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    ok, why = F.graph_support(dyn)
    assert not ok and "'dynamic' recomputes its frequencies on the host" in why


# -- vramguard.run.generate(fast_decode=True) --------------------------------------------------------------------------

def test_generate_fast_decode_gives_the_static_strategy_tokens_and_reports_the_mode(model):
    base = G.generate(model, None, PROMPT, 16)
    r = G.generate(model, None, PROMPT, 16, fast_decode=True)
    assert r.token_ids == base.token_ids and r.strategy == G.GRAPH_STRATEGY.name
    assert r.decode_mode == "eager" and "no CUDA device" in r.decode_reason and "decode: eager" in r.reason
    assert r.attempts[0].decode_mode == "eager" and r.decode_ms_per_token > 0
    assert base.decode_mode is None
    force_graph()
    g = G.generate(model, None, PROMPT, 16, fast_decode=True)
    assert g.token_ids == base.token_ids and g.decode_mode == "emulated_graph"


def test_fast_decode_is_the_default_where_the_graph_can_run(model):
    ok, why = G.fast_decode_choice(model, None)
    assert (ok, why) == (False, "no CUDA device (the model is on cpu)")
    r = G.generate(model, None, PROMPT, 4)
    assert r.strategy == "dynamic" and "fast decode off by default: no CUDA device (the model is on cpu)" in r.reason
    F.GRAPH_OVERRIDE = lambda m: (True, "CUDA device cuda:0 (test)")
    assert G.fast_decode_choice(model, None) == (True, "batch 1 on CUDA device cuda:0 (test)")
    assert G.fast_decode_choice(model, False) == (False, "fast_decode=False was passed")
    eager = _model(attn="eager")
    eager.config._attn_implementation = "flex_attention"  # an attention the decoder does not build masks for
    ok, why = G.fast_decode_choice(eager, None)
    assert not ok and why.startswith("attn is 'flex_attention'; accepted: sdpa or eager for the graph decoder")


def test_generate_fast_decode_recovers_from_oom_with_identical_tokens(model):
    base = G.generate(model, None, PROMPT, 16).token_ids
    G.OOM_INJECTOR = oom_when(lambda phase, attempt, step: attempt == 0 and phase == "decode" and step == 5)
    r = G.generate(model, None, PROMPT, 16, fast_decode=True)
    assert r.token_ids == base
    # the next graph strategy (chunked prefill: planned smaller) continues from the 5 tokens
    assert [(a.strategy, a.phase, a.step) for a in r.attempts] == [(G.GRAPH_STRATEGY.name, "decode", 5),
                                                                    (G.GRAPH_CHUNKED.name, None, None)]
    assert r.decode_mode == "eager" and r.attempts[1].new_tokens == 16 - 5
    G.OOM_INJECTOR = oom_when(lambda phase, attempt, step: attempt < 2 and phase == "decode" and step == 3)
    r = G.generate(model, None, PROMPT, 16, fast_decode=True)
    assert r.token_ids == base and [a.strategy for a in r.attempts][2] == "dynamic"
    assert r.decode_mode is None  # the dynamic strategy finished


def test_preflight_puts_the_graph_first_and_says_when_it_does_not_fit():
    spec = resolve_model("llama-3.1-8b")
    s = Settings(quant="nf4", attn="sdpa", prompt_tokens=4096, max_new_tokens=512)
    order, why = G.preflight(spec, s, 18 * GiB, auto=True, on_cuda=True, weights_loaded=True, fast_decode=True)
    assert [st for st, _ in order[:2]] == [G.GRAPH_STRATEGY, G.GRAPH_CHUNKED] and "fast decode" not in why
    one = estimate(choose(spec).model, s.with_(cache="static"))  # one prefill forward into the static cache
    assert order[0][1] == one.peak_reserved_bytes - one.weights.total_bytes
    static = next(st for st in G.STRATEGIES if st.name.startswith("static cache"))
    est = estimate(choose(spec).model, s.with_(**static.plan))
    assert order[1][1] == est.peak_reserved_bytes - est.weights.total_bytes  # the static strategy's plan exactly
    # then the order without fast decode, unchanged
    plain, _ = G.preflight(spec, s, 18 * GiB, auto=True, on_cuda=True, weights_loaded=True)
    assert order[2:] == plain
    only, _ = G.preflight(spec, s, 18 * GiB, auto=False, on_cuda=True, weights_loaded=True, fast_decode=True)
    assert [st.name for st, _ in only] == [G.GRAPH_STRATEGY.name]
    long = s.with_(prompt_tokens=120_000)
    order, why = G.preflight(spec, long, 18 * GiB, auto=True, on_cuda=True, weights_loaded=True, fast_decode=True)
    assert order[0][0] is not G.GRAPH_STRATEGY and "fast decode not used: its static cache needs" in why


# -- on the GPU ----------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("quant", ["bf16", "nf4"])
def test_cuda_graph_decode_matches_the_static_cache_on_a_gpu(tiny, quant):
    from vramguard.runtime.load import load_model
    folder, _ = tiny("LlamaConfig", **CFG)
    m = load_model(str(folder), quant=quant).model  # default verify: SDPA may be pinned (the pin is lifted)
    eager = F.graph_decode(m, PROMPT, NEW, min_new_tokens=NEW, use_graph=False)
    r = F.graph_decode(m, PROMPT, NEW, min_new_tokens=NEW, kernels=False)  # the same kernels as the eager steps
    assert r.mode == "cuda_graph", r.reason
    assert r.token_ids == eager.token_ids and r.replay_steps == NEW - 1  # warm-up and capture before the prefill
    with F.GraphDecoder(m, 8)._sdpa_unpinned():  # transformers' static cache needs a mask too
        assert r.token_ids == hf(m, min_new_tokens=NEW, cache_implementation="static")
    again = F.graph_decode(m, PROMPT, NEW, min_new_tokens=NEW, kernels=False)
    assert again.token_ids == r.token_ids


@pytest.mark.gpu
def test_the_triton_kernels_give_transformers_tokens_with_float32_compute(tiny):
    """NF4 weights, float32 compute: the graph decoder with its kernels (4-bit matmul, decode attention) picks
    transformers' greedy tokens (float32 throughout, so no rounding tie can split them)."""
    from vramguard.runtime.load import load_model
    folder, _ = tiny("LlamaConfig", **CFG)
    m = load_model(str(folder), quant="nf4", dtype="fp32", compute_dtype="fp32", attn="sdpa", verify=False).model
    r = F.graph_decode(m, PROMPT, NEW, min_new_tokens=NEW)
    assert r.mode == "cuda_graph" and "4-bit matmul (Triton)" in r.kernels and "decode attention" in r.kernels
    assert r.token_ids == hf(m, new=NEW, min_new_tokens=NEW)
