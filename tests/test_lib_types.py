"""The Python API refuses a value of the wrong type with InvalidValue naming the field, never a raw Python
exception or a silent default: Settings' switches, plan's arguments, the model, the cards."""

from __future__ import annotations

from pathlib import Path

import pytest

import vramguard
from vramguard.errors import InvalidValue
from vramguard.hardware import gpu_from_catalog
from vramguard.settings import BOOL_FIELDS, Settings

MODEL = "llama-3.2-1b"  # a catalog name: no network
FAST = {"solve": False, "alloc_conf": None}  # no solver, no allocator replay: the checks come before either


def _refused(field: str, call, *args, **kwargs) -> InvalidValue:
    with pytest.raises(InvalidValue) as e:
        call(*args, **kwargs)
    assert e.value.field == field
    assert str(e.value).startswith(f"{field}: ")
    assert e.value.fix
    return e.value


def test_bool_fields_are_every_bool_of_settings():
    import dataclasses
    assert set(BOOL_FIELDS) == {f.name for f in dataclasses.fields(Settings) if f.type in ("bool", bool)}


@pytest.mark.parametrize("field", BOOL_FIELDS)
@pytest.mark.parametrize("value", ["false", "yes", "", None, 0, 1, 1.0, [True]])
def test_settings_switch_needs_a_bool(field, value):
    e = _refused(field, Settings, **{field: value})
    assert "True or False" in str(e)


def test_sampling_as_a_string_is_refused_not_truthy():
    # 'false' is truthy: kept, it let a greedy run plan two return sequences
    _refused("do_sample", Settings, do_sample="false", num_return_sequences=2)
    assert Settings(do_sample=True, num_return_sequences=2).sequences == 2


@pytest.mark.parametrize("field", BOOL_FIELDS)
def test_settings_switch_takes_true_and_false(field):
    for value in (True, False):
        assert getattr(Settings(**{field: value}), field) is value
    _refused(field, Settings().with_, **{field: "True"})


@pytest.mark.parametrize("value", ["no", "", 0, 1, None])
def test_plan_solve_needs_a_bool(value):
    _refused("solve", vramguard.plan, MODEL, solve=value, alloc_conf=None)


@pytest.mark.parametrize("value", [123, ["x"], b"expandable_segments:True", {}, 0.5])
def test_plan_alloc_conf_needs_a_str(value):
    e = _refused("alloc_conf", vramguard.plan, MODEL, alloc_conf=value, solve=False)
    assert "str" in e.accepted


@pytest.mark.parametrize("value", [123, ["h100", "h200"], {}, b"h100", 0, False])
def test_plan_gpu_needs_a_card_name(value):
    e = _refused("gpu", vramguard.plan, MODEL, gpu=value, **FAST)
    assert "card name" in e.accepted


@pytest.mark.parametrize("value", ["", "   "])
def test_plan_empty_gpu_names_no_card(value):
    e = _refused("gpu", vramguard.plan, MODEL, gpu=value, **FAST)
    assert "empty" in e.accepted


@pytest.mark.parametrize("value", ["h100", [1, 2], ["h100"], [], (), 123, {"h100": 1}])
def test_plan_gpus_needs_a_list_of_gpuspec(value):
    e = _refused("gpus", vramguard.plan, MODEL, gpus=value, **FAST)
    assert "GpuSpec" in e.accepted


def test_plan_gpus_with_gpu_or_vram_is_refused_not_dropped():
    h100 = gpu_from_catalog("h100")
    _refused("gpus", vramguard.plan, MODEL, gpus=[h100], gpu="h200", **FAST)
    _refused("gpus", vramguard.plan, MODEL, gpus=[h100], vram="24GiB", **FAST)
    assert [c.gpu.name for c in vramguard.plan(MODEL, gpus=[h100], **FAST).cards] == [h100.name]
    assert [c.gpu.name for c in vramguard.plan(MODEL, gpus=(h100,), **FAST).cards] == [h100.name]


@pytest.mark.parametrize("value", [None, 123, b"llama-3.2-1b", ["llama-3.2-1b"], {}])
def test_plan_model_needs_a_str(value):
    e = _refused("model", vramguard.plan, value, **FAST)
    assert "str" in e.accepted


def test_resolve_model_takes_a_path(tmp_path):
    from vramguard.errors import UnknownModel
    _refused("model", vramguard.resolve_model, 123)
    with pytest.raises(UnknownModel):
        vramguard.resolve_model(Path(tmp_path) / "missing")


@pytest.mark.parametrize("value", [{"batch": 2}, "batch=2", 2])
def test_plan_settings_needs_a_settings(value):
    _refused("settings", vramguard.plan, MODEL, value, **FAST)


@pytest.mark.parametrize("value", [[], {}, 24, 0, "", "24"])
def test_plan_vram_of_a_wrong_type_is_refused(value):
    _refused("vram", vramguard.plan, MODEL, vram=value, **FAST)


@pytest.mark.parametrize("value", ["4096", 4096.0, True, [], 0])
def test_plan_context_needs_an_int(value):
    _refused("context", vramguard.plan, MODEL, context=value, **FAST)


def test_plan_gpus_of_plan_gpus_needs_gpuspecs():
    from vramguard.plan.multigpu import plan_gpus
    _refused("gpus", plan_gpus, MODEL, gpus="h100")
    _refused("gpus", plan_gpus, MODEL, gpus=[1, 2])


def test_right_types_still_plan():
    p = vramguard.plan(MODEL, Settings(do_sample=True, num_return_sequences=2, padded=True), gpu="h100", **FAST)
    h100 = gpu_from_catalog("h100")
    assert [c.gpu.name for c in p.cards] == [h100.name]
    assert len(vramguard.plan(MODEL, vram="24GiB", context=8192, **FAST).cards) == 1


@pytest.mark.parametrize("kwargs", [{"gpu": 123}, {"gpu": ""}, {"gpu": ["h100"]}, {"verify": "no"},
                                    {"unquantized": 1}, {"loader_defaults": None}, {"settings": {"batch": 2}},
                                    {"device_map": 0}])
def test_check_arguments_of_a_wrong_type(kwargs):
    from vramguard.probe.env import probe_env
    field = next(iter(kwargs))
    _refused(field, vramguard.check, MODEL, env=probe_env(), **kwargs)


@pytest.mark.parametrize("value", [123, {}, [], b"llama-3.2-1b"])
def test_check_model_needs_a_str(value):
    _refused("model", vramguard.check, value)
