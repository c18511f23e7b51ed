"""A plan follows the path the forward takes: the decode-step shortcut falls back to replaying the steps where it
cannot apply (never an internal error), over random shapes of every architecture in tests/archs.py."""

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
    # tokens) allocates 167 tensors, step 2 (3 tokens) 173, so steps 3.. cannot be extrapolated from them; before
    # the fallback this was "internal error ValueError: decode steps 1 and 2 differ in structure" (exit 70)
    monkeypatch.setenv("VRAMGUARD_TAPE_CACHE", "0")
    spec = resolve_model(config_of("deepseek_v2"))
    s = Settings(quant="nf4", attn="eager", batch=2, prompt_tokens=1, max_new_tokens=12)
    head, steps, note = alloc_replay._decode_tape(spec, s, rescale=True)
    assert steps is not None and steps.n == 12 - 4  # prefill and steps 1..3 replayed: 8 steps left to extrapolate
    assert "decode steps 1 and 2 allocate 167 and 173 tensors" in note
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


def test_the_deepseek_v2_lite_shape_that_failed_plans(config_of):
    # the reported command's settings (nf4, eager, batch 2, 8,192 + 32 tokens, 24 GiB) on the tiny DeepSeek-V2 with
    # its context raised: the solver's edge search replays a one-token prompt, where the shortcut does not apply
    from vramguard.plan.planner import with_context
    spec = with_context(resolve_model(config_of("deepseek_v2")), 16384)
    p = plan(spec, Settings(quant="nf4", attn="eager", batch=2, prompt_tokens=8192, max_new_tokens=32),
             vram="24GiB")
    assert p.cards[0].fits and p.cards[0].max_prompt_tokens is not None


hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st


@hsettings(max_examples=20, deadline=None, derandomize=True,
           suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(model_type=st.sampled_from(sorted(ARCHS)), batch=st.integers(1, 3), prompt=st.integers(1, 40),
       new=st.integers(1, 12), quant=st.sampled_from(["bf16", "nf4", "int8"]), attn=st.sampled_from(["eager", "sdpa"]))
def test_no_shape_of_any_architecture_is_an_internal_error(config_of, model_type, batch, prompt, new, quant, attn):
    """A plan either answers or raises one of the library's own errors (the CLI maps those to their exit codes);
    any other exception is the CLI's exit 70."""
    s = Settings(quant=quant, attn=attn, batch=batch, prompt_tokens=prompt, max_new_tokens=new)
    try:
        p = plan(config_of(model_type), s, vram="24GiB", solve=False)
    except VramguardError:
        return
    assert p.estimate.peak_allocated_bytes > p.estimate.weights.total_bytes
