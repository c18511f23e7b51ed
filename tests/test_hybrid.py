"""A plan follows the path the forward takes: the decode-step shortcut falls back to replaying the steps where it
cannot apply (never an internal error), over random shapes of every architecture in tests/archs.py."""

import inspect

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from archs import ARCHS

from vramguard import plan
from vramguard.errors import VramguardError
from vramguard.introspect import alloc_replay
from vramguard.resolve import resolve_model
from vramguard.settings import Settings


@pytest.fixture(scope="module")
def config_of(tmp_path_factory):
    """The config.json of a tiny model of ``model_type`` (tests/archs.py); a plan needs no weights."""
    from transformers import AutoConfig
    made = {}

    def get(model_type: str) -> str:
        if model_type not in made:
            folder = tmp_path_factory.mktemp(model_type)
            AutoConfig.for_model(model_type, **ARCHS[model_type]).save_pretrained(folder)
            made[model_type] = str(folder / "config.json")
        return made[model_type]
    return get


def _full_trace(spec, s: Settings) -> list:
    """Every forward of ``generate`` replayed (no step extrapolated), as one tape."""
    key = s.with_(prompt_tokens=1, max_new_tokens=1)
    forwards = alloc_replay._cached_events(spec.config_json, spec.name, key, s.prompt_tokens, s.max_new_tokens,
                                           s.max_new_tokens)
    return [e for fw in forwards for e in fw]


def test_decode_steps_of_another_structure_are_replayed_until_two_agree(config_of, monkeypatch):
    # DeepSeek-V2 (MLA + MoE) with eager attention, batch 2 and a one-token prompt: decode step 1 (a cache of 2
    # tokens) allocates 167 tensors, step 2 (3 tokens) 173 (transformers 5.24; 170 and 176 on 5.17), so steps 3..
    # cannot be extrapolated from them; before the fallback this was "internal error ValueError: decode steps 1 and 2
    # differ in structure" (exit 70)
    monkeypatch.setenv("VRAMGUARD_TAPE_CACHE", "0")
    spec = resolve_model(config_of("deepseek_v2"))
    s = Settings(quant="nf4", attn="eager", batch=2, prompt_tokens=1, max_new_tokens=12)
    head, steps, note = alloc_replay._decode_tape(spec, s, rescale=True)
    assert steps is not None and steps.n == 12 - 4  # prefill and steps 1..3 replayed: 8 steps left to extrapolate
    key = s.with_(prompt_tokens=1, max_new_tokens=1)
    _, step1, step2 = alloc_replay._cached_events(spec.config_json, spec.name, key, 1, 3)
    n1, n2 = (sum(1 for _, b in step if b >= 0) for step in (step1, step2))
    assert n1 != n2 and f"decode steps 1 and 2 allocate {n1} and {n2} tensors" in note  # 167, 173 on 5.24
    assert "extrapolated from steps 2 and 3" in note
    # the extrapolated tape is the full replay's, event for event (keys included)
    assert head + [e for j in range(steps.n) for e in steps.events(j)] == _full_trace(spec, s)
    # a generation within FALLBACK_STEPS: every forward replayed, nothing extrapolated
    short = s.with_(max_new_tokens=6)
    head, steps, note = alloc_replay._decode_tape(spec, short, rescale=False)
    assert steps is None and note.endswith("all 6 forwards were replayed in full")
    assert head == _full_trace(spec, short)


def test_the_plan_says_the_decode_steps_were_replayed(config_of):
    p = plan(config_of("deepseek_v2"), Settings(quant="nf4", attn="eager", batch=2, prompt_tokens=1,
                                                max_new_tokens=32), vram="24GiB", solve=False)
    found = [f for f in p.findings if f.code == "decode_replayed"]
    assert len(found) == 1 and "steps 1 to 3 were replayed in full" in found[0].message
    assert p.estimate.allocator is not None and p.estimate.allocator.decode_note == found[0].message


def test_the_deepseek_v2_lite_shape_that_failed_plans(config_of, monkeypatch):
    # the reported command's settings (nf4, eager, batch 2, 8,192 + 32 tokens) on the tiny DeepSeek-V2 with its context
    # raised, on a card the run does not fit (as DeepSeek-V2-Lite's 31 GB of bf16 experts on 24 GiB): the search for
    # the largest prompt that fits goes down to a one-token prompt, where the shortcut does not apply
    from vramguard.plan.planner import with_context
    tapes = []
    decode_tape = alloc_replay._decode_tape

    def recorded(spec, s, rescale):
        out = decode_tape(spec, s, rescale)
        tapes.append((s.prompt_tokens, out[2]))
        return out
    monkeypatch.setattr(alloc_replay, "_decode_tape", recorded)
    spec = with_context(resolve_model(config_of("deepseek_v2")), 16384)
    p = plan(spec, Settings(quant="nf4", attn="eager", batch=2, prompt_tokens=8192, max_new_tokens=32),
             vram="790MiB")
    assert (1, True) in {(prompt, note is not None) for prompt, note in tapes}  # the fallback was taken
    assert not p.cards[0].fits and 0 < p.cards[0].max_prompt_tokens < 8192


hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st


@hsettings(max_examples=20, deadline=None, derandomize=True,
           suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(model_type=st.sampled_from(sorted(ARCHS)), batch=st.integers(1, 3), prompt=st.integers(1, 40),
       new=st.integers(1, 12), quant=st.sampled_from(["bf16", "nf4", "int8"]),
       attn=st.sampled_from(["eager", "sdpa", "flash_attention_2"]))
def test_no_shape_of_any_architecture_is_an_internal_error(config_of, model_type, batch, prompt, new, quant, attn):
    """A plan either answers or raises one of the library's own errors (the CLI maps those to their exit codes);
    any other exception is the CLI's exit 70."""
    s = Settings(quant=quant, attn=attn, batch=batch, prompt_tokens=prompt, max_new_tokens=new)
    try:
        p = plan(config_of(model_type), s, vram="24GiB", solve=False)
    except VramguardError:
        return
    assert p.estimate.peak_allocated_bytes > p.estimate.weights.total_bytes


# ---- the parallel hybrid: attention and Mamba-2 side by side in every layer (Falcon-H1) ---------------------------
FALCON_H1 = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 4096, "mamba_d_ssm": 64,
             "mamba_n_heads": 8, "mamba_d_head": 8, "mamba_d_state": 16, "mamba_chunk_size": 16}


@pytest.fixture(scope="module")
def falcon_h1(tmp_path_factory):
    """A tiny random Falcon-H1 (bf16) saved to a folder, and the model."""
    from transformers import AutoModelForCausalLM, FalconH1Config
    folder = tmp_path_factory.mktemp("falcon_h1")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(FalconH1Config(**FALCON_H1), attn_implementation="eager")
    model = model.to(torch.bfloat16).eval()
    model.save_pretrained(folder)
    return folder, model


class _Allocations(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the storages real (CPU) operators create and free, each rounded to 512 B as the replay rounds them:
    the live bytes' peak."""

    def __init__(self):
        super().__init__()
        self.live, self.now, self.peak = {}, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        import weakref

        from torch.utils._pytree import tree_flatten
        out = func(*args, **(kwargs or {}))
        inputs = {id(a.untyped_storage()) for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and id(st := t.untyped_storage()) not in inputs | self.live.keys():
                self.live[id(st)] = -(-st.nbytes() // 512) * 512
                self.now += self.live[id(st)]
                self.peak = max(self.peak, self.now)
                weakref.finalize(st, self._free, id(st))
        return out

    def _free(self, key):
        self.now -= self.live.pop(key, 0)


def test_the_hybrid_cache_holds_attention_kv_and_mamba_states_as_a_real_generate(falcon_h1):
    from vramguard.introspect.replay import cache_tensors
    from vramguard.memory.common import rounded
    from vramguard.memory.kv import kv_cache_bytes
    folder, model = falcon_h1
    prompt, new = 40, 6
    out = model.generate(torch.randint(3, 200, (1, prompt)), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                         return_dict_in_generate=True)
    real = cache_tensors(out.past_key_values)
    assert {attr for _, attr, _ in real} == {"keys", "values", "conv_states.0", "recurrent_states.0"}
    spec = resolve_model(str(folder))
    planned = kv_cache_bytes(spec, Settings(quant="bf16", prompt_tokens=prompt, max_new_tokens=new), prompt + new - 1)
    # per layer: K and V 2 heads x 45 tokens x 16 x 2 B = 2,880 B each (3,072 B rounded to 512), the conv state
    # 96 channels x 4 x 2 B = 768 B (1,024 B), the SSM state 8 heads x 8 x 16 x 4 B (float32) = 4,096 B: 11,264 B
    assert planned.gpu_bytes == sum(rounded(t.numel() * t.element_size()) for _, _, t in real) == 2 * 11_264
    # a new token grows only the attention half: 2 layers x K and V x 2 KV heads x 16 x 2 B, in the "hybrid" layers
    # transformers' config names (the config.json lists none: not "full-attention layers")
    from vramguard.memory.kv import kv_growth_per_token
    assert kv_growth_per_token(spec, Settings(quant="bf16"), 100) == {"hybrid": 2 * 2 * 2 * 16 * 2}


def test_the_hybrid_prefill_peak_agrees_with_the_allocations_of_a_cpu_forward(falcon_h1):
    """The replayed prefill (eager attention: no kernel substitution) against the storages the real forward creates
    on the CPU, every one of them counted: attention scores, the Mamba-2 chunked scan's float32 intermediates (the
    reference path: no mamba_ssm here), the cache."""
    from transformers import DynamicCache

    from vramguard.introspect import generic
    folder, model = falcon_h1
    tokens = 512
    ids, mask = torch.randint(3, 200, (1, tokens)), torch.ones((1, tokens), dtype=torch.long)
    counted = _Allocations()
    # the cache's keyword as the installed transformers names it ("cache" from 5.24, "past_key_values" before)
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.no_grad(), counted:
        out = model(input_ids=ids, attention_mask=mask, position_ids=torch.arange(tokens)[None],
                    use_cache=True, logits_to_keep=1, **{cache_kw: DynamicCache(config=model.config)})
        out.logits[:, -1, :].to(copy=True, dtype=torch.float32)
    replayed = generic.forward_peak(resolve_model(str(folder)), Settings(quant="bf16", attn="eager",
                                                                         prompt_tokens=tokens, max_new_tokens=1),
                                    0, tokens)
    assert replayed.peak_bytes > 10 << 20  # eager scores of 4 heads x 512 x 512 in float32 dominate: 4 MiB each
    assert abs(replayed.peak_bytes - counted.peak) <= counted.peak // 100, (replayed.peak_bytes, counted.peak)


def test_the_plan_names_the_mixer_path_it_replayed(falcon_h1):
    folder, _ = falcon_h1
    p = plan(str(folder), Settings(quant="bf16", prompt_tokens=256, max_new_tokens=8), vram="24GiB", solve=False)
    [note] = [f.message for f in p.findings if f.code == "mixer_path"]
    assert f"replayed transformers {transformers.__version__}'s reference PyTorch path" in note
    assert "mamba_chunk_scan_combined" in note and "(mamba_ssm, not installed here)" in note
    assert "causal_conv1d_fn" in note and "(causal_conv1d, not installed here)" in note


def test_an_installed_kernel_is_reported_and_the_replay_takes_the_reference_path(falcon_h1, monkeypatch):
    """A package kernel bound by transformers (here a stand-in package whose kernel cannot run on meta tensors) is
    said installed, and the replay swaps the reference function in for it, then back."""
    import sys
    import types

    from transformers.integrations.hub_kernels import (
        use_kernel_func_from_hub_with_fallback,
    )

    from vramguard.introspect import generic
    from vramguard.introspect.mixers import kernel_paths, reference_paths
    modeling = sys.modules[type(falcon_h1[1]).__module__]
    fake = types.ModuleType("fake_mamba_ssm")

    def mamba_chunk_scan_combined(*args, **kwargs):
        raise RuntimeError("a CUDA kernel cannot run on meta tensors")
    fake.mamba_chunk_scan_combined = mamba_chunk_scan_combined
    monkeypatch.setitem(sys.modules, "fake_mamba_ssm", fake)
    reference = modeling.mamba2_chunk_scan.__wrapped__
    bound = use_kernel_func_from_hub_with_fallback("mamba_chunk_scan_combined", "fake_mamba_ssm")(reference)
    monkeypatch.setattr(modeling, "mamba2_chunk_scan", bound)
    paths = {p.kernel: p for p in kernel_paths(falcon_h1[1])}
    assert paths["mamba_chunk_scan_combined"].kernel_installed and paths["mamba_chunk_scan_combined"].package == \
        "fake_mamba_ssm"
    assert not paths["causal_conv1d_fn"].kernel_installed
    with reference_paths(falcon_h1[1]):
        assert modeling.mamba2_chunk_scan is reference
    assert modeling.mamba2_chunk_scan is bound
    generic._replayed.cache_clear()
    r = generic.replayed(resolve_model(str(falcon_h1[0])), Settings(quant="bf16", attn="eager"), 0, 64)
    assert r.peak_bytes > 0


# ---- no bare "fits" on an unverified path --------------------------------------------------------------------------
def test_an_unmeasured_mixer_path_is_unverified_and_never_a_bare_fits(falcon_h1):
    import json

    from vramguard.cli.render import plan_to_json, print_plan
    from vramguard.plan.verified import unverified
    folder, _ = falcon_h1
    p = plan(str(folder), Settings(quant="bf16", prompt_tokens=256, max_new_tokens=8), vram="24GiB", solve=False)
    missing = unverified(p.model, p.settings)
    assert "layer:hybrid" in missing  # the parallel hybrid layer: no measurement on any transformers version
    assert p.cards[0].fits and p.cards[0].unverified and "hybrid layers" in p.cards[0].unverified
    [f] = [f for f in p.findings if f.code == "unverified_path"]
    assert f.level == "warn" and f.message == p.cards[0].unverified
    data = json.loads(json.dumps(plan_to_json(p)))
    assert data["cards"][0]["fits"] is True and data["cards"][0]["unverified"] == f.message
    from io import StringIO

    from rich.console import Console
    buf = StringIO()
    print_plan(p, Console(file=buf, width=80))
    row = next(line for line in buf.getvalue().splitlines() if line.strip().startswith("24 GiB card"))
    assert "unverified" in row.split() and "yes" not in row.split()


def test_a_measured_architecture_keeps_a_plain_fits(config_of):
    from vramguard.plan.verified import unverified
    p = plan(config_of("olmo2"), Settings(quant="bf16", prompt_tokens=64, max_new_tokens=4), vram="24GiB",
             solve=False)  # full attention only, no kernel-backed mixer: measured (deepseek-v2-lite)
    assert unverified(p.model, p.settings) == () and p.cards[0].unverified is None
    assert not [f for f in p.findings if f.code == "unverified_path"]


def test_each_measured_part_is_a_measurement_in_the_results():
    """Every entry of the table names a results file whose records of that architecture have the plan within 1% of
    the measured peak allocated, on the transformers version the entry names."""
    import json
    from pathlib import Path

    from vramguard.plan.verified import MEASURED
    root = Path(__file__).resolve().parent.parent
    for m in MEASURED:
        records = [json.loads(line) for line in (root / m.results).read_text().splitlines() if line.strip()]
        versions = {r["transformers"] for r in records if r.get("kind") == "versions"}
        assert m.transformers is None or m.transformers in versions, m
        runs = [r for r in records if r.get("kind") == "gen" and r.get("model") == m.model and r.get("ok")]
        assert len(runs) >= 2 and len({r["prompt"] for r in runs}) >= 2, m  # two lengths at least
        for r in runs:
            assert abs(r["plan_peak"] - r["peak_total"]) <= r["peak_total"] // 100, (m, r["prompt"], r["quant"])
