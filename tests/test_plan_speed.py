"""The fast path of ``plan``: a hand family's config read with the class-default table, no torch or transformers
imported for a catalog name or a hand-family folder, and plans learned once kept on disk."""

from __future__ import annotations

import pytest

from vramguard import spec as spec_module
from vramguard.catalog.models import MODELS
from vramguard.spec import SUPPORTED_MODEL_TYPES, spec_from_config

# a config.json per family that leaves the derived fields out (head_dim, num_key_value_heads), so that a default
# derived from the given sizes and a class default that ignores them differ; and one that turns sliding windows on
SPARSE = {"hidden_size": 2560, "num_attention_heads": 32, "num_hidden_layers": 6, "intermediate_size": 6912,
          "vocab_size": 1000, "max_position_embeddings": 4096}
WINDOWED = {**SPARSE, "num_key_value_heads": 4, "sliding_window": 512, "use_sliding_window": True,
            "max_window_layers": 3}


def _both(cfg: dict, monkeypatch) -> tuple:
    """The spec of ``cfg`` read with the class-default table and through ``AutoConfig``."""
    fast = spec_from_config(dict(cfg), name="m")
    monkeypatch.setattr(spec_module, "READ_FAMILIES_THROUGH_TRANSFORMERS", True)
    ref = spec_from_config(dict(cfg), name="m")
    monkeypatch.setattr(spec_module, "READ_FAMILIES_THROUGH_TRANSFORMERS", False)
    assert fast.generic is ref.generic is False
    return fast, ref


def _same(fast, ref) -> None:
    """Every field the planner reads, the config text and the notes included."""
    from dataclasses import fields
    for f in fields(ref):
        assert getattr(fast, f.name) == getattr(ref, f.name), f.name


@pytest.mark.parametrize("key", sorted(MODELS))
def test_catalog_spec_without_transformers_equals_autoconfig(key, monkeypatch):
    cfg = {k: v for k, v in MODELS[key].items() if k != "source"}
    _same(*_both(cfg, monkeypatch))


@pytest.mark.parametrize("model_type", SUPPORTED_MODEL_TYPES)
@pytest.mark.parametrize("given", [{}, SPARSE, WINDOWED], ids=["class-defaults", "sparse", "windowed"])
def test_class_defaults_table_equals_autoconfig(model_type, given, monkeypatch):
    """Each family with only its model_type (every size from the class), with sizes whose derived fields differ
    from the class's, and with sliding windows turned on."""
    fast, ref = _both({"model_type": model_type, **given}, monkeypatch)
    _same(fast, ref)
    if not given:  # the class's own sizes, not a default of vramguard's
        from transformers import AutoConfig
        cls = AutoConfig.for_model(model_type)
        assert (fast.hidden_size, fast.num_layers, fast.vocab_size) == \
            (cls.hidden_size, cls.num_hidden_layers, cls.vocab_size)
