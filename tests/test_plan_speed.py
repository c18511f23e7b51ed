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


def _plan_json(model, **kw) -> str:
    """The plan's JSON text, as ``vramguard plan --format json`` writes it."""
    import json

    from vramguard.cli.render import plan_to_json
    from vramguard.plan.planner import plan
    return json.dumps(plan_to_json(plan(model, **kw)), sort_keys=True)


@pytest.mark.parametrize("key", ["gemma-2-2b"])
def test_catalog_plan_without_transformers_is_byte_identical(key, monkeypatch):
    """The whole default plan (allocator model and solvers included) of a catalog name read with the table and
    through AutoConfig: the same JSON to the byte (every catalog entry's spec is compared field by field above, and
    a plan is a function of the spec; Gemma-2: sliding and full layers, soft-capping, tied embeddings by default)."""
    fast = _plan_json(key, vram="24GiB")
    monkeypatch.setattr(spec_module, "READ_FAMILIES_THROUGH_TRANSFORMERS", True)
    assert _plan_json(key, vram="24GiB") == fast


def _config_folder(tmp_path, model_type: str):
    """A folder holding only the config.json of a tiny ``model_type`` (a hand family's or tests/archs.py's)."""
    import json
    folder = tmp_path / model_type
    folder.mkdir()
    if model_type in SUPPORTED_MODEL_TYPES:
        cfg = {"model_type": model_type, **SPARSE, "hidden_size": 256, "intermediate_size": 512,
               "num_hidden_layers": 2, "torch_dtype": "bfloat16"}
    else:
        from archs import ARCHS
        from transformers import AutoConfig
        cfg = AutoConfig.for_model(model_type, **ARCHS[model_type]).to_dict()
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@pytest.mark.parametrize("model_type", ["llama", "deepseek_v2", "gpt_oss"])
def test_plan_read_back_from_disk_is_byte_identical(tmp_path, model_type, monkeypatch):
    """A plan kept on disk and read back (no estimate run) gives the same JSON as the one computed: a hand family,
    and two generic ones whose plans hold the most kinds of parts (MLA; sliding window with MoE and sinks)."""
    from vramguard.plan import planner
    monkeypatch.setenv("VRAMGUARD_PLAN_CACHE", str(tmp_path / "plans"))
    folder = _config_folder(tmp_path, model_type)
    computed = _plan_json(str(folder), vram="24GiB")
    assert len(list((tmp_path / "plans").glob("plan-*.json.gz"))) == 1

    def not_computed(*a, **k):
        raise AssertionError("the plan was computed again")
    monkeypatch.setattr(planner, "_compute", not_computed)
    assert _plan_json(str(folder), vram="24GiB") == computed
    with pytest.raises(AssertionError, match="computed again"):  # another card is another plan
        _plan_json(str(folder), vram="16GiB")


COLUMNS = "100"  # the table's width, in this process and the fresh one alike
# one fresh process plans each argument list in turn: its stdout, then a line of its own, then on stderr the exit
# code and which of torch and transformers the process has imported so far
PROBE = """
import json, runpy, sys
for args in json.loads(sys.argv[1]):
    sys.argv = ["vramguard", "plan", *args]
    try:
        runpy.run_module("vramguard", run_name="__main__")
    except SystemExit as e:
        code = e.code
    print(END, flush=True)
    from vramguard.deferred import ROOTS
    print(json.dumps({"code": code, "heavy": sorted(m for m in ("torch", "transformers") if m in sys.modules),
                      "deferred": sorted(m for m in ROOTS if m in sys.modules)}), file=sys.stderr, flush=True)
"""
END = "-- end of plan --"


def _cli_in_fresh_process(tmp_path, runs: list[tuple[str, ...]]) -> list[tuple[str, dict]]:
    """(stdout, {code, heavy: torch/transformers imported by then, deferred: the packages of vramguard.deferred
    imported by then}) of ``vramguard plan ARGS`` for each ARGS of ``runs``, one after another in one new Python
    process."""
    import json
    import os
    import subprocess
    import sys
    env = {**os.environ, "VRAMGUARD_PLAN_CACHE": str(tmp_path / "plans"), "PYTHONPATH": os.getcwd(),
           "COLUMNS": COLUMNS}
    r = subprocess.run([sys.executable, "-c", f"END = {END!r}" + PROBE, json.dumps(runs)], capture_output=True,
                       text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    outs = r.stdout.split(END + "\n")
    hows = [json.loads(line) for line in r.stderr.splitlines() if line.startswith('{"code"')]
    assert len(outs) == len(hows) + 1 == len(runs) + 1 and outs[-1] == "", r.stderr[-2000:]
    return list(zip(outs, hows))


# (model, format, whether its first plan needs torch and transformers); the ones that do not come first
FRESH = [("qwen2.5-0.5b", "json", False), ("llama", "human", False), ("gemma-2-2b", "json", True),
         ("gpt2", "human", True)]


def test_a_second_plan_in_a_fresh_process_imports_neither_torch_nor_transformers(tmp_path):
    """A catalog name, a hand family's folder and another architecture's folder: the first plans compute (with
    transformers where the load and the allocator tape are its own; a Llama's or a Qwen2's come from the hand paths
    without it), the second ones, in a new process, read what they learned and print the same JSON or table
    without importing torch or transformers. One process makes the four first plans, the hand paths' first
    (nothing imported before them), and one the four second ones: two interpreters instead of eight. No plan
    imports the packages transformers imports and a plan never runs (TorchDynamo, accelerate, SciPy...:
    vramguard.deferred)."""
    runs = [(model if "-" in model else str(_config_folder(tmp_path, model)), "--vram", "24GiB", "--prompt-tokens",
             "256", "--format", fmt) for model, fmt, _ in FRESH]
    first = _cli_in_fresh_process(tmp_path, runs)
    heavy_by_then = False
    for (model, _, heavy), (_, how) in zip(FRESH, first):
        heavy_by_then = heavy_by_then or heavy
        assert how == {"code": 0, "heavy": ["torch", "transformers"] if heavy_by_then else [], "deferred": []}, model
    second = _cli_in_fresh_process(tmp_path, runs)
    for (model, _, _), (out_first, _), (out_second, how) in zip(FRESH, first, second):
        assert how == {"code": 0, "heavy": [], "deferred": []}, model
        assert out_second == out_first and out_first.strip(), model


def test_a_hand_family_is_read_without_transformers_in_a_fresh_process(tmp_path):
    """Reading a catalog name's and a hand-family folder's config (what every plan starts with) imports neither
    torch nor transformers, with nothing kept on disk."""
    import json
    import os
    import subprocess
    import sys
    folder = _config_folder(tmp_path, "qwen3")
    code = ("import json, sys; from vramguard.resolve import resolve_model; "
            f"specs = [resolve_model(m) for m in ('llama-3.1-8b', 'gemma-2-9b', {str(folder)!r})]; "
            "print(json.dumps([[s.num_layers, s.head_dim] for s in specs] + "
            "[m for m in ('torch', 'transformers') if m in sys.modules]))")
    env = {**os.environ, "VRAMGUARD_PLAN_CACHE": "0", "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert json.loads(out) == [[32, 128], [42, 256], [2, 128]]  # qwen3's class head_dim, not 256 // 32


def test_an_entry_is_keyed_by_library_versions_and_code(monkeypatch, tmp_path):
    from vramguard import diskcache
    monkeypatch.setenv("VRAMGUARD_PLAN_CACHE", str(tmp_path))
    diskcache.environment_version.cache_clear()
    before = diskcache.entry_key("plan", "x")
    monkeypatch.setattr(diskcache, "_version", lambda d: "9.9" if d == "transformers" else None)
    diskcache.environment_version.cache_clear()
    newer = diskcache.entry_key("plan", "x")
    monkeypatch.setattr(diskcache, "_PACKAGE", tmp_path)  # other code
    diskcache.environment_version.cache_clear()
    other_code = diskcache.entry_key("plan", "x")
    diskcache.environment_version.cache_clear()
    assert len({before, newer, other_code, diskcache.entry_key("plan", "y")}) == 4
    monkeypatch.setenv("VRAMGUARD_PLAN_CACHE", "off")
    assert diskcache.entry_key("plan", "x") is None


def test_only_vramguard_classes_are_rebuilt(tmp_path):
    import gzip
    import json

    from vramguard import diskcache
    from vramguard.settings import Settings
    s = Settings(quant="bf16", prompt_tokens=7)
    path = tmp_path / "e.json.gz"
    diskcache.write(path, (s, {1: [s]}))
    assert diskcache.read(path) == (s, {1: [s]})
    with gzip.open(path, "wt") as f:
        json.dump({"c": "subprocess:Popen", "f": {}}, f)
    assert diskcache.read(path) is None
    with pytest.raises(TypeError, match="set is not stored"):
        diskcache.encode({1, 2})


def test_a_cache_folder_past_its_limit_drops_the_least_recently_used_entries(tmp_path, monkeypatch):
    """Entries of earlier versions never match again: a folder past its limit keeps the three quarters most
    recently written or read, so a read keeps an old entry and an unread one goes first."""
    import os

    from vramguard import diskcache
    monkeypatch.setattr(diskcache, "MAX_FOLDER_ENTRIES", 8)
    for i in range(8):
        diskcache.write(tmp_path / f"e{i}.json.gz", i)
        os.utime(tmp_path / f"e{i}.json.gz", (1000 + i, 1000 + i))  # written in this order, seconds apart
    assert diskcache.read(tmp_path / "e0.json.gz") == 0  # the oldest, read now: the most recently used
    assert len(list(tmp_path.glob("*.json.gz"))) == 8  # at the limit: nothing removed
    diskcache.write(tmp_path / "e8.json.gz", 8)  # 9 entries: down to 6, the oldest unread first
    left = sorted(p.name for p in tmp_path.glob("*.json.gz"))
    assert left == ["e0.json.gz", "e4.json.gz", "e5.json.gz", "e6.json.gz", "e7.json.gz", "e8.json.gz"]
    # by bytes too: a limit below the folder's size keeps three quarters of it
    sizes = sum(p.stat().st_size for p in tmp_path.glob("*.json.gz"))
    assert diskcache.prune(tmp_path, max_bytes=sizes - 1) >= 2
    assert sum(p.stat().st_size for p in tmp_path.glob("*.json.gz")) <= (sizes - 1) * 3 // 4
