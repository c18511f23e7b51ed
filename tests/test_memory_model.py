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


def _where(root: Path, picks) -> set[str]:
    """``path:function`` (the innermost function around it; ``<module>`` outside any) of every line of the modules
    under ``root`` that ``picks(text)`` returns (line numbers)."""
    found = set()
    for p in sorted(root.rglob("*.py")):
        text = p.read_text()
        lines = picks(text)
        defs = [n for n in ast.walk(ast.parse(text)) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))] \
            if lines else []
        for i in lines:
            inner = [d for d in defs if d.lineno <= i <= (d.end_lineno or d.lineno)]
            found.add(f"{p.relative_to(root)}:{max(inner, key=lambda d: d.lineno).name if inner else '<module>'}")
    return found


def _grep(root: Path, pattern: str) -> set[str]:
    """The functions of the lines ``pattern`` matches, as ``grep -rn`` finds them (comments and docstrings too)."""
    return _where(root, lambda text: [i for i, line in enumerate(text.splitlines(), 1) if re.search(pattern, line)])


def _flag_reads(root: Path) -> set[str]:
    """The functions that read an attribute ``generic`` under any name: ``x.generic``, ``getattr(x, "generic")``."""
    def read(n: ast.AST) -> bool:
        if isinstance(n, ast.Attribute):
            return n.attr == "generic" and isinstance(n.ctx, ast.Load)
        return isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "getattr" and \
            len(n.args) > 1 and isinstance(n.args[1], ast.Constant) and n.args[1].value == "generic"
    return _where(root, lambda text: [n.lineno for n in ast.walk(ast.parse(text)) if read(n)] if "generic" in text
                  else [])


def test_only_the_choosing_function_asks_whether_a_spec_is_generic():
    """``grep -rn "spec.generic" vramguard`` finds the one function that chooses the memory model and nothing else:
    below it the models answer, and the hand fast paths (``introspect/hand.py``, ``memory/hand_tape.py``) ask the
    config's family and the settings, not which model was chosen."""
    assert _grep(PACKAGE, r"spec.generic") == {"plan/choice.py:choose"}
    assert _flag_reads(PACKAGE) == {"plan/choice.py:choose"}


def test_the_guard_finds_a_leaf_that_asks(tmp_path):
    """The guard above can fail: a module that reads the flag is named with its function."""
    (tmp_path / "leaf.py").write_text("def kv(spec):\n    return 0 if spec.generic else 1\n")
    assert _grep(tmp_path, r"spec.generic") == _flag_reads(tmp_path) == {"leaf.py:kv"}
    (tmp_path / "leaf.py").write_text("def kv(m):\n    return getattr(m.spec, 'generic')\n\n\ndef fw(x):\n"
                                      "    return x.generic\n")
    assert _grep(tmp_path, r"spec.generic") == set() and _flag_reads(tmp_path) == {"leaf.py:kv", "leaf.py:fw"}


def test_the_hand_fast_paths_answer_a_config_whichever_model_plans_it(monkeypatch):
    """The allocator replay's load of a hand family's config.json is the hand module tree's for a spec planned by
    transformers too (``generic``), and it is transformers' own (``hand.ENABLED`` off: the meta model): the fast
    path is a fact of the config, the model choice is :func:`choose`'s alone."""
    from dataclasses import replace

    from vramguard.introspect import alloc_replay, hand
    from vramguard.memory import hand_tape
    from vramguard.spec import spec_from_config
    spec = spec_from_config({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                             "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
                             "vocab_size": 256, "max_position_embeddings": 512}, name="m")
    generic = replace(spec, generic=True)
    s = Settings(quant="nf4")
    assert hand.covers(generic) and hand_tape.not_covered(generic, Settings()) is None
    assert not choose(spec).model.needs_transformers and choose(generic).model.needs_transformers
    mine = alloc_replay.load_events(generic, s)
    # 2 layers x 7 nf4 projections, each read in bf16 and quantized with double quant (the default): the 16-bit
    # copy and both float32 absmax freed, 3 frees a projection
    assert s.double_quant and len([e for e in mine[1] if e[1] < 0]) == 2 * 7 * 3
    assert mine == alloc_replay.load_events(spec, s)
    monkeypatch.setattr(hand, "ENABLED", False)  # the meta model's tree: the source the fast path is checked against
    assert alloc_replay.load_events(generic, s) == mine


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
