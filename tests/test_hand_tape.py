"""The hand family's allocation tape, module tree, load plan and breakpoints (vramguard.memory.hand_tape,
vramguard.introspect.hand) against what transformers gives for the same config: event for event, tensor for tensor,
byte for byte; and a whole plan with them against the plan through transformers."""

from __future__ import annotations

import json

import pytest

from vramguard.catalog.models import MODELS
from vramguard.introspect import alloc_replay, hand
from vramguard.memory import hand_tape
from vramguard.settings import Settings
from vramguard.spec import spec_from_config

GQA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
       "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 256, "max_position_embeddings": 512}
# heads of their own (no grouping), a head_dim of its own, biases, tied embeddings, Llama-3's RoPE
MHA = {**GQA, "hidden_size": 96, "num_key_value_heads": 6, "num_attention_heads": 6, "head_dim": 32,
       "attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True, "num_hidden_layers": 3,
       "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                        "original_max_position_embeddings": 256}}
QWEN2 = {**GQA, "model_type": "qwen2", "sliding_window": 131072, "use_sliding_window": False}  # q, k, v biases
MISTRAL = {**GQA, "model_type": "mistral", "sliding_window": None}
CATALOG = sorted(k for k, v in MODELS.items() if hand.covers(spec_from_config(
    {f: x for f, x in v.items() if f != "source"}, name=k)))


def _spec(cfg: dict):
    return spec_from_config(dict(cfg), name="m")


def _settings(quant: str, attn: str, batch: int, prompt: int, **kw) -> Settings:
    return Settings(quant=quant, attn=attn, batch=batch, prompt_tokens=prompt, **kw)


# prompt 2 at batch 1: 2 rows (bitsandbytes' fused 4-bit kernel), 9 rows and batch 3: the dequantizing kernel; a
# batch of 3 makes eager attention copy its query (a permuted layout) before the matmul
CASES = [(q, a, b, p) for q in ("bf16", "fp32", "nf4", "int8") for a in ("sdpa", "eager") for b, p in ((1, 2), (3, 9))]
CASES += [("fp16", "sdpa", 1, 9), ("fp4", "eager", 2, 5)]


@pytest.mark.parametrize("cfg", [GQA, MHA], ids=["gqa", "mha"])
@pytest.mark.parametrize("quant,attn,batch,prompt", CASES)
def test_llama_hand_tape_is_transformers_replay_event_for_event(cfg, quant, attn, batch, prompt):
    _same_tape(cfg, quant, attn, batch, prompt)


@pytest.mark.parametrize("cfg", [QWEN2, MISTRAL], ids=["qwen2", "mistral"])
@pytest.mark.parametrize("quant,attn,batch,prompt", [("bf16", "eager", 3, 9), ("nf4", "sdpa", 3, 9),
                                                     ("int8", "eager", 1, 2), ("fp32", "sdpa", 1, 2)])
def test_qwen2_and_mistral_hand_tape_is_transformers_replay(cfg, quant, attn, batch, prompt):
    _same_tape(cfg, quant, attn, batch, prompt)


def _same_tape(cfg, quant, attn, batch, prompt):
    """The prefill and two decode steps: every allocation's key and bytes and every free, in order, as the meta-device
    replay of transformers' forward under the storage tracker records them."""
    spec = _spec(cfg)
    s = _settings(quant, attn, batch, prompt)
    assert hand_tape.not_covered(spec, s) is None
    key = s.with_(prompt_tokens=1, max_new_tokens=1)
    ref = alloc_replay._trace(spec.config_json, spec.name, key, prompt, 3, 3)[0]
    assert hand_tape.forwards(spec, key, prompt, 3, 3) == ref


@pytest.mark.parametrize("kw", [dict(quant="nf4", double_quant=False), dict(quant="nf4", compute_dtype="fp16"),
                                dict(quant="fp16", num_beams=2), dict(quant="nf4", dtype="fp32")],
                         ids=["no-double-quant", "fp16-compute", "beams", "fp32-activations"])
def test_hand_tape_other_bitsandbytes_and_generation_settings(kw):
    spec = _spec(GQA)
    s = Settings(prompt_tokens=9, **kw)
    key = s.with_(prompt_tokens=1, max_new_tokens=1)
    assert hand_tape.forwards(spec, key, 9, 3, 3) == alloc_replay._trace(spec.config_json, spec.name, key, 9, 3, 3)[0]


def test_hand_tape_eight_forwards_and_trimmed_layers():
    """Eight forwards (the fallback when decode steps differ), and a 12-layer decoder written for 5 layers and
    expanded: the same as every layer traced."""
    spec = _spec({**GQA, "num_hidden_layers": 12})
    s = Settings(quant="nf4", prompt_tokens=6)
    key = s.with_(prompt_tokens=1, max_new_tokens=1)
    ref = alloc_replay._trace(spec.config_json, spec.name, key, 6, 8, 8)[0]
    assert hand_tape.forwards(spec, key, 6, 8, 8) == ref
    assert hand.forwards(spec, key, 6, 8, 8) == ref


def test_what_the_hand_tape_leaves_to_transformers():
    spec = _spec(GQA)
    for kw in (dict(cache="static"), dict(padded=True), dict(output_attentions=True), dict(logits="all"),
               dict(attn="sdpa", sdpa_kernel="math"), dict(attn="flash_attention_2")):
        assert hand_tape.not_covered(spec, Settings(**kw)) is not None, kw
    assert not hand_tape.covers(_spec({**GQA, "hidden_act": "gelu"}), Settings())
    assert not hand_tape.covers(_spec({**GQA, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}), Settings())
    assert not hand_tape.covers(_spec({**GQA, "model_type": "gemma"}), Settings())
    assert not hand_tape.covers(_spec({**MISTRAL, "sliding_window": 4096}), Settings())
    assert not hand_tape.covers(_spec({**QWEN2, "use_sliding_window": True, "max_window_layers": 1}), Settings())


def _structures(spec, s: Settings):
    from dataclasses import replace

    from vramguard.introspect.generic import structure_of
    return hand.structure(spec, s), structure_of(replace(spec, generic=True), s)


@pytest.mark.parametrize("name,quant", [(n, q) for n in ("gqa", "mha", "qwen2", "mistral")
                                        for q in ("bf16", "fp16", "fp32", "nf4", "int8")]
                         + [(n, q) for n in CATALOG for q in ("bf16", "nf4")])
def test_hand_structure_and_load_plan_are_transformers(name, quant):
    """Every tensor the meta model lists (name, shape, dtype, values, bytes, kind), the converted layers, and the
    load plan (warm-up block, the largest transient, peak reserved) for tiny configs and every catalog model of the
    three families."""
    from vramguard.introspect.generic import load_plan
    from vramguard.resolve import resolve_model
    tiny = {"gqa": GQA, "mha": MHA, "qwen2": QWEN2, "mistral": MISTRAL}
    spec = _spec(tiny[name]) if name in tiny else resolve_model(name)
    s = Settings(quant=quant)
    mine, ref = _structures(spec, s)
    assert mine.tensors == ref.tensors
    assert mine.quantized_modules == ref.quantized_modules
    assert hand.load_plan(spec, s) == load_plan(spec, s)


@pytest.mark.parametrize("cfg", [GQA, {**GQA, "sliding_window": 300, "original_max_position_embeddings": 128},
                                 {**GQA, "attention_chunk_size": 64, "sliding_window": None}, QWEN2, MISTRAL,
                                 {**MISTRAL, "sliding_window": 300, "original_max_position_embeddings": 128}])
def test_hand_breakpoints_are_the_configs(cfg, monkeypatch):
    spec = _spec(cfg)
    mine = alloc_replay._breakpoints(spec.config_json, spec.name)
    monkeypatch.setattr(hand, "ENABLED", False)
    alloc_replay._hand_spec.cache_clear()
    assert alloc_replay._breakpoints(spec.config_json, spec.name) == mine
    alloc_replay._hand_spec.cache_clear()


def _plan_json(model, **kw) -> str:
    from vramguard.cli.render import plan_to_json
    from vramguard.plan.planner import plan
    return json.dumps(plan_to_json(plan(model, **kw)), sort_keys=True)


def test_a_plan_with_the_hand_tape_is_the_plan_through_transformers(tmp_path, monkeypatch):
    """The whole default plan (load, allocator model, solvers, changes) of an 8-layer Llama folder with the hand
    paths and through transformers: the same JSON to the byte."""
    monkeypatch.setenv("VRAMGUARD_PLAN_CACHE", "0")
    monkeypatch.setenv("VRAMGUARD_TAPE_CACHE", "0")
    folder = tmp_path / "llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**GQA, "hidden_size": 256, "intermediate_size": 512,
                                                    "num_hidden_layers": 8, "vocab_size": 1000}))
    from vramguard.settings import Settings as S
    fast = _plan_json(str(folder), settings=S(prompt_tokens=300, max_new_tokens=40), vram="1GiB")
    monkeypatch.setattr(hand, "ENABLED", False)
    alloc_replay._hand_spec.cache_clear()
    alloc_replay._cached_events.cache_clear()
    alloc_replay._stretch_events.cache_clear()
    try:
        assert _plan_json(str(folder), settings=S(prompt_tokens=300, max_new_tokens=40), vram="1GiB") == fast
    finally:
        alloc_replay._hand_spec.cache_clear()
        alloc_replay._cached_events.cache_clear()
        alloc_replay._stretch_events.cache_clear()
