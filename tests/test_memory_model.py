"""One memory model per model, chosen once (:func:`vramguard.plan.choice.choose`), and a planner core that imports
nothing above it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from vramguard.errors import InvalidValue
from vramguard.memory.model import HandModel
from vramguard.plan.choice import choose
from vramguard.resolve import resolve_model
from vramguard.settings import Settings

PACKAGE = Path(__file__).resolve().parent.parent / "vramguard"


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at its top or inside a function."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
    return out


def test_only_the_choosing_function_asks_whether_a_spec_is_generic():
    """``grep -rn "spec.generic" vramguard`` finds the one function that chooses the memory model, and the hand
    allocator tape's coverage checks below it (``introspect/hand.py``, ``memory/hand_tape.py``: whether the
    torch-free tape covers the spec, which ``choose`` asks)."""
    found = [f"{p.relative_to(PACKAGE)}:{i}" for p in sorted(PACKAGE.rglob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"spec.generic", line)]
    assert all(f.startswith(("plan/choice.py:", "introspect/hand.py:", "memory/hand_tape.py:")) for f in found), found
    assert len([f for f in found if f.startswith("plan/choice.py:")]) == 1, found


def test_the_memory_package_imports_nothing_above_it_and_no_torch():
    bad = {f"{p.name}: {m}" for p in (PACKAGE / "memory").glob("*.py") for m in _imports(p)
           if m.startswith(("vramguard.introspect", "vramguard.hub", "vramguard.plan", "torch", "transformers"))}
    assert bad == set()


def test_a_hand_family_is_its_hand_model_and_another_architecture_transformers():
    hand = choose(resolve_model("llama-3.1-8b"), Settings())
    assert isinstance(hand.model, HandModel) and not hand.model.needs_transformers
    assert hand.model.sources["kv_cache"] == "the hand-written llama model"
    assert "hand-written family" in hand.reason and hand.reserve.alloc_conf is None and hand.finding is None
    from dataclasses import replace
    generic = choose(replace(resolve_model("llama-3.1-8b"), generic=True))
    assert generic.model.needs_transformers and "meta device" in generic.model.sources["forward"]
    assert "not a hand-written family" in generic.reason


def test_the_reserve_is_chosen_with_its_reason():
    spec = resolve_model("llama-3.2-1b")
    asked = choose(spec, Settings(), "expandable_segments:True").reserve
    assert asked.replay and asked.asked and asked.config.expandable_segments
    int8 = choose(spec, Settings(kv_dtype="int8"), "auto")
    assert not int8.reserve.replay and int8.finding.code == "reserve_formula" and "int8" in int8.finding.message
    with pytest.raises(InvalidValue, match="alloc_conf"):
        choose(spec, Settings(), "expandable_segments:maybe")


def test_one_reading_of_quantization_config_with_transformers_defaults():
    """A config.json's quantization_config without bnb_4bit_quant_type is FP4 without double quant and with
    float32 compute, as transformers' BitsAndBytesConfig reads it; the handle's settings say the same."""
    from types import SimpleNamespace

    from transformers import BitsAndBytesConfig

    from vramguard.runtime.handle import decode_quantization_config, loaded_settings
    bare = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    real = BitsAndBytesConfig(load_in_4bit=True)
    assert decode_quantization_config(bare) == decode_quantization_config(real) == ("fp4", False, "fp32")
    assert decode_quantization_config({"load_in_8bit": True})[0] == "int8"
    assert decode_quantization_config({"quant_method": "gptq"})[0] == "gptq"
    assert decode_quantization_config(None)[0] is None
    model = SimpleNamespace(dtype="torch.bfloat16", config=SimpleNamespace(quantization_config=bare,
                                                                           _attn_implementation="sdpa"))
    s = loaded_settings(model)
    assert (s.quant, s.double_quant, s.compute_dtype, s.dtype) == ("fp4", False, "fp32", "bf16")
