"""One definition per rule: the memory a card leaves this process, the reading of a quantization config, the server's
settings checked in one place."""

from __future__ import annotations

import ast
import functools
from pathlib import Path
from types import SimpleNamespace

import pytest

from vramguard import dtypes
from vramguard.catalog.gpus import GpuSpec
from vramguard.errors import InvalidValue
from vramguard.runtime.handle import decode_quantization_config, loaded_settings
from vramguard.serve.config import ServeConfig

PACKAGE = Path(__file__).resolve().parent.parent / "vramguard"


@functools.cache
def _modules() -> tuple[tuple[str, ast.Module], ...]:
    """(path below vramguard/, parsed source) of every module, parsed once per test process (0.7 s of CPU; seven
    tests read them all, none changes a tree)."""
    return tuple((str(p.relative_to(PACKAGE)), ast.parse(p.read_text())) for p in sorted(PACKAGE.rglob("*.py")))


def test_each_row_of_the_dtype_table_is_torchs_element_size():
    torch = pytest.importorskip("torch")
    for d in dtypes.TABLE:
        assert getattr(torch, d.torch_name).itemsize == d.bytes, d
    assert len({d.name for d in dtypes.TABLE}) == len({d.safetensors for d in dtypes.TABLE}) == len(dtypes.TABLE)


def _names_a_dtype_table(node: ast.Dict) -> bool:
    """A dict literal keyed by two or more dtype names (any spelling) whose values are their element sizes or
    other names of a dtype: a second dtype table."""
    size = dtypes.BYTES | dtypes.TORCH_BYTES | dtypes.SAFETENSORS_BYTES
    names = set(size)
    pairs = [(k.value, v.value) for k, v in zip(node.keys, node.values)
             if isinstance(k, ast.Constant) and k.value in names and isinstance(v, ast.Constant)]
    return len([1 for k, v in pairs if v == size[k] or v in names]) >= 2


def test_there_is_one_dtype_table():
    """Element sizes and dtype names come from vramguard.dtypes: no other module spells a table of them."""
    found = [f"{name}:{node.lineno}" for name, tree in _modules() if name != "dtypes.py"
             for node in ast.walk(tree) if isinstance(node, ast.Dict) and _names_a_dtype_table(node)]
    assert found == []
    assert "torch" not in {a.name for n in ast.walk(ast.parse((PACKAGE / "dtypes.py").read_text()))
                           if isinstance(n, ast.Import) for a in n.names}


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


def test_no_module_but_the_cards_own_subtracts_other_processes_memory():
    """``GpuSpec.usable_bytes`` is the one usable-memory rule of a plan: no other module spells
    ``total_bytes - used_by_others_bytes``."""
    found = [f"{name}:{node.lineno}" for name, tree in _modules() if name != "catalog/gpus.py"
             for node in ast.walk(tree) if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Sub)
             and any(isinstance(n, ast.Attribute) and n.attr == "used_by_others_bytes" for n in ast.walk(node))]
    assert found == []


def test_every_out_of_memory_check_is_is_oom():
    """``vramguard.runtime.device.is_oom`` is the one predicate: no other module tests an error's type against
    ``torch.OutOfMemoryError`` (which would miss cuBLAS, cuDNN and NCCL allocation failures) or catches it."""
    found = []
    for name, tree in _modules():
        if name == "runtime/device.py":
            continue
        raised = {id(n) for r in ast.walk(tree) if isinstance(r, ast.Raise) for n in ast.walk(r)}
        found += [f"{name}:{n.lineno}" for n in ast.walk(tree) if id(n) not in raised
                  and isinstance(n, (ast.Attribute, ast.Name)) and "OutOfMemoryError" in (getattr(n, "attr", None),
                                                                                            getattr(n, "id", None))]
    assert found == []


def test_a_loaded_model_is_carried_as_its_handle_not_found_again_in_a_table():
    """Verbs take the LoadedModel load_model returns (runtime.handle.handle_of describes a model vramguard did not
    load); no module keeps a table from model objects to what loading knew (the SDPA pin's is the one weak table)."""
    from vramguard.runtime import handle
    assert not hasattr(handle, "as_loaded") and not hasattr(handle, "register")
    tables = [f"{name}:{n.lineno}" for name, tree in _modules() for n in ast.walk(tree)
              if isinstance(n, ast.Attribute) and n.attr in ("WeakKeyDictionary", "WeakValueDictionary")]
    assert len(set(tables)) == 1 and tables[0].startswith("runtime/handle.py:"), tables  # _PINS alone


def test_only_the_handle_reads_a_bitsandbytes_quantization_config():
    """runtime.handle.decode_quantization_config is the one reading of load_in_4bit / load_in_8bit /
    bnb_4bit_quant_type / bnb_4bit_use_double_quant / bnb_4bit_compute_dtype in a config."""
    keys = {"load_in_4bit", "load_in_8bit", "bnb_4bit_quant_type", "bnb_4bit_use_double_quant",
            "bnb_4bit_compute_dtype"}
    found = [f"{name}:{n.lineno}" for name, tree in _modules() if name != "runtime/handle.py" for n in ast.walk(tree)
             if isinstance(n, ast.Constant) and n.value in keys]
    assert found == []


def _parameters(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    a = fn.args
    return [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg not in ("self", "cls")]


def test_below_a_command_the_options_travel_as_one_object():
    """Typer needs one parameter per option in a command's function; below it the options are one object (the
    plan's PlanRequest, run's RunRequest, serve's ServeConfig): no function but a command or a Triton kernel takes
    more than 15 parameters, and the plan and run commands' bodies read their options through the request alone."""
    from vramguard.cli import COMMANDS
    from vramguard.cli.plan import PlanRequest
    from vramguard.cli.run import RunRequest
    commands = {(fn.__module__, fn.__name__) for _, fn, _ in COMMANDS}
    wide = []
    for name, tree in _modules():
        module = "vramguard." + name.removesuffix(".py").replace("/", ".").removesuffix(".__init__")
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or (module, fn.name) in commands:
                continue
            if any("jit" in ast.unparse(d) or "autotune" in ast.unparse(d) for d in fn.decorator_list):
                continue  # a Triton kernel takes each pointer, stride and block size as its own parameter
            if len(_parameters(fn)) > 15:
                wide.append(f"{name}:{fn.lineno} {fn.name} ({len(_parameters(fn))})")
    assert wide == []
    for name, request in (("plan", PlanRequest), ("run", RunRequest)):
        tree = ast.parse((PACKAGE / f"cli/{name}.py").read_text())
        command = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name)
        options = set(_parameters(command)) - {"ctx"}
        assert options == {f for f in request.__dataclass_fields__} - {"given"}
        read = {n.id for stmt in command.body for n in ast.walk(stmt) if isinstance(n, ast.Name)}
        assert read & options == set(), name
