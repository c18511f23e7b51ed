"""One definition per rule: the memory a card leaves this process, the reading of a quantization config, the server's
settings checked in one place."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vramguard.catalog.gpus import GpuSpec
from vramguard.errors import InvalidValue
from vramguard.runtime.handle import decode_quantization_config, loaded_settings
from vramguard.serve.config import ServeConfig


def test_a_cards_usable_memory_is_its_total_less_other_processes():
    card = GpuSpec("x", "X", total_bytes=24 * 2**30, compute_capability=(8, 9), used_by_others_bytes=2**30)
    assert card.usable_bytes == 23 * 2**30  # 24 GiB - 1 GiB held by another process


def test_a_4bit_config_without_its_type_reads_as_transformers_loads_it():
    """transformers fills a missing bnb_4bit_quant_type / bnb_4bit_use_double_quant with its defaults; the handle
    and the load report read the same."""
    transformers = pytest.importorskip("transformers")
    q = transformers.BitsAndBytesConfig.from_dict({"load_in_4bit": True})
    assert decode_quantization_config({"load_in_4bit": True})[:2] == (q.bnb_4bit_quant_type,
                                                                      q.bnb_4bit_use_double_quant)
    assert decode_quantization_config({"load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
                                       "bnb_4bit_use_double_quant": True})[:2] == ("nf4", True)
    assert decode_quantization_config({"load_in_8bit": True})[:2] == ("int8", False)
    assert decode_quantization_config({"quant_method": "gptq"})[:2] == ("gptq", False)
    model = SimpleNamespace(dtype=None, config=SimpleNamespace(quantization_config={"load_in_4bit": True},
                                                               _attn_implementation="sdpa"))
    assert loaded_settings(model).quant == "fp4" and loaded_settings(model).double_quant is False


def test_the_servers_settings_are_checked_before_anything_is_loaded():
    from vramguard.serve.server import build
    with pytest.raises(InvalidValue) as e:  # a cap of no block: said before the model is looked for
        build("no-such-folder", max_kv_blocks=0)
    assert e.value.field == "max_kv_blocks"
    with pytest.raises(InvalidValue) as e:
        ServeConfig(engine_choice="fast")
    assert e.value.field == "engine"
    with pytest.raises(TypeError):
        build("no-such-folder", ServeConfig(), max_queue=1)  # a config and its fields: one or the other
    assert ServeConfig(allowed_hosts=["a.example"]).allowed_hosts == ("a.example",)
