"""A plan follows the path the forward takes: the decode-step shortcut falls back to replaying the steps where it
cannot apply (never an internal error), over random shapes of every architecture in tests/archs.py."""

import inspect

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from archs import ARCHS

from vramguard import plan
from vramguard.runtime.first_prefill import cpu_allocations
from vramguard.introspect import alloc_replay
from vramguard.resolve import resolve_model
from vramguard.settings import Settings
from vramguard.plan.choice import choose


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


def _dsv2_lite(folder, layers: int) -> str:
    """DeepSeek-V2-Lite's config.json (benchmarks/cpu_plan_time.py: its published dimensions) with ``layers``
    layers, in ``folder``."""
    import json
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from benchmarks.cpu_plan_time import DSV2_LITE
    (folder / "config.json").write_text(json.dumps(dict(DSV2_LITE, num_hidden_layers=layers)))
    return str(folder)


def test_the_deepseek_v2_lite_command_that_failed_plans(tmp_path, monkeypatch):
    # the reported command (nf4, eager, batch 2, 8,192 + 32 tokens) on DeepSeek-V2-Lite's dimensions trimmed to 2
    # layers (the dense first layer and one MoE layer), on a card the run does not fit: the search for the largest
    # prompt goes down to a one-token prompt, where decode steps 1 and 2 allocate 167 and 173 tensors and the
    # shortcut refuses (before the fallback: "internal error ValueError: decode steps 1 and 2 differ in structure",
    # exit 70). The full 27 layers on 24 GiB plan too (exit 0; the weights alone exceed the card, so no search):
    # 57 s of CPU time on this 2-core machine, measured by hand (benchmarks/results/h200_hybrid2/README.md).
    from typer.testing import CliRunner

    from vramguard.cli import app
    tapes = []
    decode_tape = alloc_replay._decode_tape

    def recorded(spec, s, rescale, *later_steps):
        out = decode_tape(spec, s, rescale, *later_steps)
        tapes.append((s.prompt_tokens, out[2] is not None))
        return out
    monkeypatch.setattr(alloc_replay, "_decode_tape", recorded)
    r = CliRunner().invoke(app, ["plan", _dsv2_lite(tmp_path, 2), "--quant", "nf4", "--attn", "eager", "--batch", "2",
                                 "--prompt-tokens", "8192", "--max-new-tokens", "32", "--vram", "3GiB",
                                 "--format", "json"])
    assert r.exit_code == 0, r.output
    assert (1, True) in tapes  # the shortcut refused at a one-token prompt and the fallback replayed the steps
    import json
    card = json.loads(r.stdout)["cards"][0]
    assert card["fits"] is False and card["max_prompt_tokens"] is None


hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st


@hsettings(max_examples=4, deadline=None, derandomize=True,
           suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(model_type=st.sampled_from(sorted(ARCHS)), batch=st.integers(1, 3), prompt=st.integers(1, 40),
       new=st.integers(1, 12), quant=st.sampled_from(["bf16", "nf4"]), attn=st.sampled_from(["eager", "sdpa"]),
       vram=st.sampled_from(["1GiB", "24GiB"]))
def test_no_shape_of_any_architecture_is_an_internal_error(config_of, model_type, batch, prompt, new, quant, attn,
                                                           vram):
    """``vramguard plan`` (the solver's search included: a 1 GiB card sends it through short prompts and small
    batches) either answers or ends with one of the library's own errors' exit codes, never the internal error's
    70 (an exception vramguard did not expect)."""
    from typer.testing import CliRunner

    from vramguard.cli import app
    from vramguard.errors import EXIT_INTERNAL
    r = CliRunner().invoke(app, ["plan", config_of(model_type), "--quant", quant, "--attn", attn, "--batch",
                                 str(batch), "--prompt-tokens", str(prompt), "--max-new-tokens", str(new),
                                 "--vram", vram, "--format", "json"])
    assert r.exit_code != EXIT_INTERNAL, r.output
    # an exception past the CLI's guard would be Python's traceback; the library's errors end with their codes
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert r.exit_code in (0, 2, 3, 4), r.output


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


def test_the_hybrid_cache_holds_attention_kv_and_mamba_states_as_a_real_generate(falcon_h1):
    from vramguard.introspect.replay import cache_tensors
    from vramguard.memory.weights import rounded
    folder, model = falcon_h1
    prompt, new = 40, 6
    out = model.generate(torch.randint(3, 200, (1, prompt)), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                         return_dict_in_generate=True)
    real = cache_tensors(out.past_key_values)
    assert {attr for _, attr, _ in real} == {"keys", "values", "conv_states.0", "recurrent_states.0"}
    spec = resolve_model(str(folder))
    planned = choose(spec).model.kv_cache_bytes(Settings(quant="bf16", prompt_tokens=prompt, max_new_tokens=new), prompt + new - 1)
    # per layer: K and V 2 heads x 45 tokens x 16 x 2 B = 2,880 B each (3,072 B rounded to 512), the conv state
    # 96 channels x 4 x 2 B = 768 B (1,024 B), the SSM state 8 heads x 8 x 16 x 4 B (float32) = 4,096 B: 11,264 B
    assert planned.gpu_bytes == sum(rounded(t.numel() * t.element_size()) for _, _, t in real) == 2 * 11_264
    # a new token grows only the attention half: 2 layers x K and V x 2 KV heads x 16 x 2 B, in the "hybrid" layers
    # transformers' config names (the config.json lists none: not "full-attention layers")
    assert choose(spec).model.kv_growth_per_token(Settings(quant="bf16"), 100) == {"hybrid": 2 * 2 * 2 * 16 * 2}


def test_the_hybrid_prefill_peak_agrees_with_the_allocations_of_a_cpu_forward(falcon_h1):
    """The replayed prefill (eager attention: no kernel substitution) against the storages the real forward creates
    on the CPU, every one of them counted: attention scores, the Mamba-2 chunked scan's float32 intermediates (the
    reference path: no mamba_ssm here), the cache."""
    from transformers import DynamicCache

    from vramguard.introspect import generic
    folder, model = falcon_h1
    tokens = 512
    ids, mask = torch.randint(3, 200, (1, tokens)), torch.ones((1, tokens), dtype=torch.long)
    counted = cpu_allocations()
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
    p = plan(str(folder), Settings(quant="bf16", prompt_tokens=256, max_new_tokens=8, kernels="torch"), vram="24GiB",
             solve=False)
    [note] = [f.message for f in p.findings if f.code == "mixer_path"]
    assert note.startswith(f"replayed transformers {transformers.__version__}'s reference PyTorch path of ")
    assert "mamba_chunk_scan_combined" in note and "causal_conv1d_fn (causal_conv1d)" in note
    assert note.endswith("kernels='torch' was asked (causal_conv1d, mamba_ssm: none of them installed here)")
    assert p.kernel_path.replayed == "torch" and p.kernel_path.why in note


def test_the_kernel_path_follows_the_choice_and_both_are_planned_where_it_cannot_be_known(falcon_h1, monkeypatch):
    """kernels='fast' replays the package kernels' memory model (less than the reference scan's); with no choice,
    a plan for this machine's GPU follows what is installed here, and a plan for another card plans both paths and
    keeps the larger, saying so in the text and the JSON."""
    import json

    from vramguard import hardware
    from vramguard.catalog.gpus import GPUS
    from vramguard.cli.render import plan_to_json
    folder = str(falcon_h1[0])
    s = Settings(quant="bf16", prompt_tokens=256, max_new_tokens=8)
    fast = plan(folder, s.with_(kernels="fast"), vram="24GiB", solve=False)
    torch_path = plan(folder, s.with_(kernels="torch"), vram="24GiB", solve=False)
    assert fast.estimate.prefill.peak_bytes < torch_path.estimate.prefill.peak_bytes
    [note] = [f.message for f in fast.findings if f.code == "mixer_path"]
    assert note.startswith("replayed the package kernels ") and "modelled on meta tensors" in note
    assert "mamba_ssm's CUDA kernels" in fast.cards[0].unverified  # no measurement covers the kernel path

    both = plan(folder, s, vram="24GiB", solve=False)  # no GPU here (the suite's default): another machine's card
    assert both.kernel_path.replayed == "torch" and both.kernel_path.asked is None
    assert both.kernel_path.other == ("fast", fast.estimate.device_used_bytes)
    assert both.estimate.peak_allocated_bytes == torch_path.estimate.peak_allocated_bytes
    assert "both paths were planned and the larger kept" in both.kernel_path.why
    data = json.loads(json.dumps(plan_to_json(both)))
    assert data["kernel_path"]["replayed"] == "torch" and data["kernel_path"]["other"] == ["fast", \
        fast.estimate.device_used_bytes]

    h200 = GPUS["h200"]
    monkeypatch.setattr(hardware, "DETECT_OVERRIDE", lambda: hardware.DetectedGpus((h200,), "forced by the test"))
    here = plan(folder, s, gpu="h200", solve=False)  # the catalog card this machine's GPU is
    assert here.kernel_path.replayed == "installed" and here.kernel_path.other is None
    assert "this machine's GPU" in here.kernel_path.why
    assert here.estimate.peak_allocated_bytes == torch_path.estimate.peak_allocated_bytes  # no kernel installed here


def test_the_kernel_model_allocates_what_mamba_ssm_allocates():
    from vramguard.introspect.mixer_paths import _mamba_chunk_scan_combined
    from vramguard.introspect.tracker import StorageTracker
    meta = torch.device("meta")
    x = torch.empty((2, 300, 8, 16), dtype=torch.bfloat16, device=meta)  # batch 2, 300 tokens, 8 heads of 16
    b = torch.empty((2, 300, 1, 32), dtype=torch.bfloat16, device=meta)  # one group, d_state 32
    tracker = StorageTracker()
    with tracker:
        y, final = _mamba_chunk_scan_combined({"hidden_states": x, "B": b, "C": b, "chunk_size": 128}, (x, None))
    assert y.shape == x.shape and y.dtype == torch.bfloat16 and final.shape == (2, 8, 16, 32)
    # 3 chunks of 128: dA_cumsum and dt 2x8x3x128 float32 (24,576 B each); chunk states 2x3x8x16x32 float32
    # (98,304 B); passed states in bf16 (49,152 B); final states 2x8x16x32 float32 (32,768 B); the chunk states
    # dropped; CB 2x3x1x128x128 float32 (393,216 B); the output 2x300x8x16 bf16 (153,600 B)
    assert tracker.peak.bytes == 24576 * 2 + 49152 + 32768 + 393216 + 153600
    assert tracker.live_bytes == 32768 + 153600  # what is returned


def test_the_kernel_choice_is_a_setting_the_cli_renders_as_its_option():
    from vramguard.cli.flags import as_flags
    from vramguard.errors import InvalidValue
    assert as_flags("plan with kernels='fast'") == "plan with --kernels fast"
    with pytest.raises(InvalidValue, match="installed | fast | torch"):
        Settings(kernels="cuda")


def test_an_installed_kernel_is_reported_and_the_replay_models_it_without_calling_it(falcon_h1, monkeypatch):
    """A package kernel bound by transformers (here a stand-in package whose kernel cannot run on meta tensors) is
    said installed; the replay swaps the reference function (kernels='torch') or the kernel's memory model
    (kernels='installed') in for it, then back, and never calls it."""
    import sys
    import types

    from transformers.integrations.hub_kernels import (
        use_kernel_func_from_hub_with_fallback,
    )

    from vramguard.introspect import generic
    from vramguard.introspect.mixer_paths import reference_paths
    from vramguard.introspect.mixers import kernel_paths
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
    spec = resolve_model(str(falcon_h1[0]))
    installed = generic.replayed(spec, Settings(quant="bf16", attn="eager", kernels="installed"), 0, 64)
    reference = generic.replayed(spec, Settings(quant="bf16", attn="eager", kernels="torch"), 0, 64)
    assert 0 < installed.peak_bytes < reference.peak_bytes
    assert modeling.mamba2_chunk_scan is bound


# ---- no bare "fits" on an unverified path --------------------------------------------------------------------------
def test_an_unmeasured_mixer_path_is_unverified_and_never_a_bare_fits(falcon_h1):
    import json

    from vramguard.cli.render import plan_to_json, print_plan
    from vramguard.plan.verified import unverified
    folder, _ = falcon_h1
    p = plan(str(folder), Settings(quant="bf16", prompt_tokens=256, max_new_tokens=8), vram="24GiB", solve=False)
    missing = unverified(choose(p.model).model, p.settings)
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
    assert unverified(choose(p.model).model, p.settings) == () and p.cards[0].unverified is None
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


def test_a_kernel_choice_for_a_model_without_kernel_backed_layers_is_said_not_dropped():
    """``kernels='fast'`` on a Llama changes nothing: the plan says so (a user's setting is never dropped silently)
    and its figures are those without the setting."""
    spec = resolve_model("llama-3.1-8b")
    asked = plan(spec, Settings(kernels="fast"), vram="24GiB", solve=False)
    plain = plan(spec, Settings(), vram="24GiB", solve=False)
    note = [f for f in asked.findings if f.code == "kernels_ignored"]
    assert len(note) == 1 and "kernels='fast' changes nothing for llama" in note[0].message
    assert asked.estimate.peak_allocated_bytes == plain.estimate.peak_allocated_bytes
    assert not [f for f in plain.findings if f.code == "kernels_ignored"]


def test_the_cache_goes_in_and_out_under_the_name_the_forward_takes():
    """Mamba-2's forward in transformers 5.17 takes and returns its cache as ``cache_params`` (generate passes it so);
    the replay passes it under that name where the signature has it, else as ``past_key_values``."""
    from vramguard.introspect.replay import cache_keyword

    class Mamba2Style(torch.nn.Module):
        def forward(self, input_ids=None, cache_params=None, use_cache=None, **kwargs):
            return input_ids

    class Attention(torch.nn.Module):
        def forward(self, input_ids=None, past_key_values=None, cache_params=None, **kwargs):
            return input_ids

    assert cache_keyword(Mamba2Style()) == "cache_params"
    assert cache_keyword(Attention()) == "past_key_values"
    assert cache_keyword(transformers.LlamaForCausalLM(transformers.LlamaConfig(**ARCHS["olmo2"]))) \
        == "past_key_values"


def test_eager_attention_is_not_said_to_cost_scores_in_a_model_without_attention(tmp_path, config_of):
    """A pure Mamba-2 model has no score matrix: eager attention adds no finding about one (an attention model
    planned the same way does get it)."""
    cfg = transformers.AutoConfig.for_model("mamba2", hidden_size=64, num_hidden_layers=2, state_size=16, head_dim=16,
                                            num_heads=8, expand=2, n_groups=1, chunk_size=16, vocab_size=256)
    cfg.save_pretrained(tmp_path)
    s = Settings(attn="eager", prompt_tokens=32, max_new_tokens=4)
    mamba = plan(str(tmp_path), s, vram="24GiB", solve=False)
    assert set(mamba.layer_kinds) == {"linear_attention"}
    assert not [f for f in mamba.findings if f.code == "eager_scores"]
    attention = plan(config_of("olmo2"), s, vram="24GiB", solve=False)
    assert [f for f in attention.findings if f.code == "eager_scores"]


def test_of_the_two_mixer_paths_only_the_larger_is_solved_and_the_plan_is_that_of_both_solved(falcon_h1, monkeypatch):
    """A plan for another machine's card compares the two paths' estimates (side by side where a forked child pays)
    and solves only the larger; the plan is the one solving both and keeping the larger gave."""
    from vramguard.plan import kernels
    monkeypatch.setenv("VRAMGUARD_PLAN_CACHE", "0")
    folder = str(falcon_h1[0])
    s = Settings(quant="bf16", prompt_tokens=256, max_new_tokens=8)
    larger, solved = kernels._larger, []

    def counted(s_, compute, estimates):
        return larger(s_, lambda ps: solved.append(ps.kernels) or compute(ps), estimates)
    monkeypatch.setattr(kernels, "_larger", counted)
    p = plan(folder, s, vram="24GiB", alloc_conf="")
    assert solved == ["torch"] and p.cards[0].max_prompt_tokens  # solved, on the larger path only
    monkeypatch.setattr(kernels, "_larger", lambda s_, compute, _estimates: counted(s_, compute, None))
    both = plan(folder, s, vram="24GiB", alloc_conf="")  # both paths solved, as before
    assert solved == ["torch", "fast", "torch"] and p == both


def test_the_cli_plans_a_hybrid_as_the_library_does_in_a_fresh_process(falcon_h1, tmp_path):
    """``vramguard plan`` in a new process (its deferred imports and paused collector: TorchDynamo is imported in the
    middle of the first prefill, by the cache's ``mark_static_address``) gives the figures the library gives here,
    where TorchDynamo was imported before. The deferred import once kept that prefill's frames alive, and a tiny
    Falcon-H1's activations at 512 tokens were planned 4,247,040 B for 3,251,200 B."""
    import json
    import os
    import subprocess
    import sys
    folder, _ = falcon_h1
    args = ["--prompt-tokens", "512", "--max-new-tokens", "8", "--kernels", "torch", "--vram", "24GiB"]
    env = {**os.environ, "VRAMGUARD_PLAN_CACHE": "0", "VRAMGUARD_TAPE_CACHE": str(tmp_path), "PYTHONPATH": os.getcwd()}
    env.pop("VRAMGUARD_DEFER_IMPORTS", None)
    r = subprocess.run([sys.executable, "-m", "vramguard", "plan", str(folder), *args, "--format", "json"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    cli = json.loads(r.stdout)
    p = plan(str(folder), Settings(prompt_tokens=512, max_new_tokens=8, kernels="torch"), vram="24GiB")
    assert cli["prefill"]["components"]["activations"] == p.estimate.prefill.components["activations"] > 0
    assert (cli["peak_allocated_bytes"], cli["device_used_bytes"]) == (p.estimate.peak_allocated_bytes,
                                                                       p.estimate.device_used_bytes)


def test_a_moe_plan_says_which_experts_path_it_replayed(config_of):
    """The experts implementation transformers resolved on the model it built (grouped_mm for a class that
    dispatches, the default), said in the plan; a dense model says nothing of it."""
    from vramguard.introspect.generic import experts_path
    s = Settings(quant="bf16", prompt_tokens=64, max_new_tokens=4)
    p = plan(config_of("olmoe"), s, vram="24GiB", solve=False)
    [f] = [f for f in p.findings if f.code == "experts_path"]
    assert f.level == "info" and "experts_implementation='grouped_mm'" in f.message
    assert experts_path(p.model, s) == "grouped_mm"
    dense = plan(config_of("olmo2"), s, vram="24GiB", solve=False)
    assert not [f for f in dense.findings if f.code == "experts_path"] and experts_path(dense.model, s) is None
