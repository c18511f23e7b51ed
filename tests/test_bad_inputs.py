"""Bad inputs on the command line end in exit 2 or 3 naming the file or field and the fix, never an internal error
(exit 70) or a hang: damaged configs, damaged or odd weight files, a binary or FIFO prompt file, sampling values
sampling cannot compute. Each is run through plan, check, run and serve (startup) where it applies."""

import json
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import run_cli, save_tiny_llama

import vramguard
from vramguard.catalog.models import MODELS
from vramguard.errors import ConfigError, InvalidValue, UnknownModel
from vramguard.inputs import (CONFIG_DTYPE_NAMES, CONFIG_INTS, MAX_JSON_DEPTH, MAX_SHARDS, NotAFile, check_config,
                              json_depth, read_json)

REPO = Path(__file__).resolve().parent.parent
LIMIT_S = 5  # a refusal costs at most this many CPU seconds of the process (they take ~0.2 s)
HANG_S = 30  # a command still running this many seconds after its import is waiting on something (a FIFO)
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 300, "max_position_embeddings": 256}
# how each command is started on a model folder: check and run with a shape that fits the tiny model's context
COMMANDS = {"plan": [], "check": ["--prompt-tokens", "64", "--max-new-tokens", "64"],
            "run": ["--prompt", "hi", "--max-new-tokens", "2", "--quant", "fp32"],
            "serve": ["--port", "0", "--quant", "fp32"], "profile": [], "fit": ["--vary", "prompt"]}
LOADERS = ["check", "run", "serve"]  # profile and fit need a GPU first: on a CPU they stop before the weights


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("bad-inputs") / "base", **TINY)


def _copy(base: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(base, folder)
    return folder


def _config(**changes):
    def make(folder: Path) -> None:
        cfg = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**cfg, **changes}))
    return make


def _raw_config(text: str):
    return lambda folder: (folder / "config.json").write_text(text)


def _weights(write):
    def make(folder: Path) -> None:
        good = (folder / "model.safetensors").read_bytes()
        (folder / "model.safetensors").unlink()
        write(folder / "model.safetensors", good)
    return make


def _header(body: dict, data: bytes = b"") -> bytes:
    raw = json.dumps(body).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def _symlink_loop(path: Path, _good: bytes) -> None:
    os.symlink(path.parent / "loop", path)
    os.symlink(path, path.parent / "loop")


def _index_of(n: int):
    def make(folder: Path) -> None:
        weight_map = {f"w{i}": f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(n)}
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return make


# (id, how the folder is broken, what the message names, exit code)
CONFIG_CASES = [
    ("layers-1e12", _config(num_hidden_layers=1e12), "config.json:num_hidden_layers", 3),
    ("layers-10**12", _config(num_hidden_layers=10**12), "config.json:num_hidden_layers", 3),
    ("json-100k-deep", _raw_config("[" * 100_000 + "]" * 100_000), "nested at most 64 levels", 3),
    ("object-100k-deep", _raw_config('{"a":' * 100_000 + "1" + "}" * 100_000), "nested at most 64 levels", 3),
    ("heads-0", _config(num_attention_heads=0), "config.json:num_attention_heads", 3),
    ("kv-heads-not-dividing", _config(num_key_value_heads=3), "a divisor of num_attention_heads (4)", 3),
    ("hidden-str", _config(hidden_size="64"), "write hidden_size: 64 without quotes", 3),
    ("dtype-float128", _config(torch_dtype="float128"), "config.json:torch_dtype", 3),
    ("vocab-1e12", _config(vocab_size=1e12), "config.json:vocab_size", 3),
    ("config-symlink-loop", lambda f: ((f / "config.json").unlink(), _symlink_loop(f / "config.json", b"")),
     "a symlink loop", 3),
]
WEIGHT_CASES = [
    ("empty", _weights(lambda p, good: p.write_bytes(b"")), "it holds 0 bytes", 3),
    ("short", _weights(lambda p, good: p.write_bytes(good[:5])), "it holds 5 bytes", 3),
    ("garbage", _weights(lambda p, good: p.write_bytes(b"\xff" * 4096)), "the file is not safetensors", 3),
    ("truncated", _weights(lambda p, good: p.write_bytes(good[: len(good) // 2])), "truncated or damaged", 3),
    ("header-cut", _weights(lambda p, good: p.write_bytes(good[:20])), "the file is not safetensors, or is cut", 3),
    ("header-not-json", _weights(lambda p, good: p.write_bytes(_header({}).replace(b"{}", b"{x"))),
     "its header is damaged", 3),
    ("offsets-outside", _weights(lambda p, good: p.write_bytes(_header(
        {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 10**12]}}, b"\0" * 16))), "[0, 1000000000000]", 3),
    ("folder", _weights(lambda p, good: p.mkdir()), "is a folder", 3),
    ("symlink-loop", _weights(_symlink_loop), "a symlink loop", 3),
    ("device", _weights(lambda p, good: os.symlink("/dev/zero", p)), "is a character device", 3),
    ("index-10000-shards", _index_of(10_000), f"at most {MAX_SHARDS:,} weight files", 3),
]
# damaged content is noted by plan (which plans from config.json alone); a path that is no file is refused by all
NOT_A_FILE = {"folder", "symlink-loop", "device"}


def _err(r) -> str:
    return " ".join(r.stderr.split())


def _refused(args, names: str, code: int) -> str:
    start = time.process_time()  # CPU time, not wall: the rule (no work before the refusal), whatever else runs
    r = run_cli(*args)
    took = time.process_time() - start
    err = _err(r)
    assert r.returncode == code, (r.returncode, err)
    assert "internal error" not in err and "Traceback" not in err
    assert names in err and "fix:" in err, err
    assert took < LIMIT_S, f"refused after {took:.1f} CPU s"
    return err


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("case,make,names,code", CONFIG_CASES, ids=[c[0] for c in CONFIG_CASES])
def test_a_bad_config_is_refused_naming_its_field(base, tmp_path, command, case, make, names, code):
    folder = _copy(base, tmp_path)
    make(folder)
    assert str(folder / "config.json") in _refused([command, str(folder), *COMMANDS[command]], names, code)


@pytest.mark.parametrize("command", LOADERS)
@pytest.mark.parametrize("case,make,names,code", WEIGHT_CASES, ids=[c[0] for c in WEIGHT_CASES])
def test_a_damaged_weight_file_is_refused_before_loading(base, tmp_path, command, case, make, names, code):
    folder = _copy(base, tmp_path)
    make(folder)
    err = _refused([command, str(folder), *COMMANDS[command]], names, code)
    assert str(folder / ("model.safetensors.index.json" if case.startswith("index") else "model.safetensors")) in err


def test_a_damaged_weight_file_is_refused_before_torch_is_imported(base, tmp_path):
    """The loaders read every safetensors header and the weights index before they import torch (seconds of the
    person's time: 12 to 34 s on a busy 2-core machine before): in one fresh interpreter, check, run and serve on
    an empty, a garbage and a truncated model.safetensors and an index naming 10,000 shards each exit 3 naming the
    file, and torch is never imported."""
    cases = [c for c in WEIGHT_CASES if c[0] in ("empty", "garbage", "truncated", "index-10000-shards")]
    runs = []
    for case, make, names, _code in cases:
        folder = tmp_path / case
        shutil.copytree(base, folder)
        make(folder)
        runs += [(case, names, [command, str(folder), *COMMANDS[command]]) for command in LOADERS]
    program = ("import contextlib, io, json, sys\nfrom vramguard.cli import main\nout = []\n"
               f"for args in {[args for _, _, args in runs]!r}:\n"
               "    sys.argv, err = ['vramguard'] + args, io.StringIO()\n"
               "    with contextlib.redirect_stderr(err):\n"
               "        try:\n            main()\n        except SystemExit as e:\n"
               "            out.append([e.code, ' '.join(err.getvalue().split())])\n"
               "print(json.dumps({'torch': 'torch' in sys.modules, 'runs': out}))")
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "1000"}
    r = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120, env=env,
                       stdin=subprocess.DEVNULL, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.splitlines()[-1])
    assert len(got["runs"]) == 12 and not got["torch"]
    for (case, names, args), (code, err) in zip(runs, got["runs"]):
        assert code == 3 and names in err and "fix:" in err and "internal error" not in err, (case, args[0], err)


@pytest.mark.parametrize("case,make,names,code", [c for c in WEIGHT_CASES if c[0] in NOT_A_FILE],
                         ids=sorted(NOT_A_FILE))
def test_plan_refuses_a_weight_path_that_is_no_file(base, tmp_path, case, make, names, code):
    folder = _copy(base, tmp_path)
    make(folder)
    _refused(["plan", str(folder)], names, code)


def test_plan_notes_a_truncated_weight_file_and_plans_from_the_config(base, tmp_path):
    folder = _copy(base, tmp_path)
    _weights(lambda p, good: p.write_bytes(good[: len(good) // 2]))(folder)
    r = run_cli("plan", str(folder), "--prompt-tokens", "64", "--max-new-tokens", "64", "--format", "json")
    assert r.returncode == 0, _err(r)
    notes = " ".join(json.loads(r.stdout)["model"]["notes"])
    assert "the safetensors headers could not be read (model.safetensors:" in notes
    assert "weights planned from config.json alone" in notes


def _in_subprocess(args: list[str]) -> subprocess.CompletedProcess:
    """The CLI in a fresh interpreter that SIGALRM ends when the command runs over :data:`HANG_S` seconds (counted
    once ``vramguard.cli`` is imported): a command that blocks on a FIFO (forever) dies with -SIGALRM instead of
    passing, and a refusal on a busy machine, seconds of wall time at worst, is not mistaken for one."""
    program = (f"import signal, sys; sys.argv = ['vramguard'] + {args!r}; from vramguard.cli import main; "
               f"signal.alarm({HANG_S})\ntry:\n    main()\nfinally:\n    signal.alarm(0)")
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "1000"}  # one line per message: paths unbroken
    return subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60, env=env,
                          stdin=subprocess.DEVNULL, check=False)


def test_a_fifo_in_the_model_folder_is_refused_without_waiting(base, tmp_path):
    """A FIFO as config.json and as model.safetensors, given to plan, check, run and serve: each of the 8 exits 3
    naming the FIFO, without opening it. The 8 run one after another in one fresh interpreter (as the damaged
    weights above), each under its own :data:`HANG_S` alarm: a command that blocks on the FIFO ends the process with
    -SIGALRM instead of passing."""
    runs = []
    for fifo in ("config.json", "model.safetensors"):
        folder = tmp_path / fifo
        shutil.copytree(base, folder)
        (folder / fifo).unlink()
        os.mkfifo(folder / fifo)
        runs += [(folder / fifo, [command, str(folder), *COMMANDS[command]]) for command in ("plan", *LOADERS)]
    program = ("import contextlib, io, json, signal, sys\nfrom vramguard.cli import main\nout = []\n"
               f"for args in {[args for _, args in runs]!r}:\n"
               "    sys.argv, err = ['vramguard'] + args, io.StringIO()\n"
               "    print('running', args, file=sys.stderr, flush=True)  # the last one named is the one that hung\n"
               f"    signal.alarm({HANG_S})\n"
               "    with contextlib.redirect_stderr(err):\n"
               "        try:\n            main()\n        except SystemExit as e:\n"
               "            out.append([e.code, ' '.join(err.getvalue().split())])\n"
               "    signal.alarm(0)\n"
               "print(json.dumps(out))")
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "1000"}  # one line per message: paths unbroken
    r = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=8 * HANG_S + 60,
                       env=env, stdin=subprocess.DEVNULL, check=False)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    got = json.loads(r.stdout.splitlines()[-1])
    assert len(got) == len(runs) == 8
    for (fifo, args), (code, err) in zip(runs, got):
        assert code == 3, (args[0], fifo, code, err[-400:])
        assert f"{fifo} is a FIFO (named pipe), which vramguard does not read" in err and "fix:" in err, err[-400:]


def test_a_fifo_prompt_file_is_refused_without_waiting(base, tmp_path):
    os.mkfifo(tmp_path / "prompt")
    r = _in_subprocess(["run", str(base), "--prompt-file", str(tmp_path / "prompt")])
    err = " ".join(r.stderr.split())
    assert r.returncode == 2 and "error --prompt-file:" in err and "is a FIFO (named pipe)" in err, err[-400:]
    assert "to stream a prompt, pass --prompt-file - and pipe it in" in err


def test_a_binary_prompt_file_is_refused(base, tmp_path):
    (tmp_path / "prompt.bin").write_bytes(bytes(range(256)))
    err = _refused(["run", str(base), "--prompt-file", str(tmp_path / "prompt.bin")], "--prompt-file", 2)
    assert "it holds NUL bytes (byte 0): it is a binary file" in err
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    r = run_cli("run", str(base), "--prompt-file", str(tmp_path / "latin1.txt"))
    assert r.returncode == 2 and "byte 3 (0xe9) is not UTF-8" in _err(r)


def test_a_context_file_that_is_no_text_file_is_refused(base, tmp_path):
    os.mkfifo(tmp_path / "fifo")
    err = _refused(["run", str(base), "--prompt", "w1", "--context", str(tmp_path / "fifo")], "--context", 2)
    assert "is a FIFO (named pipe)" in err  # before the model loads: the FIFO is never opened
    (tmp_path / "doc.bin").write_bytes(b"w1 w2\0w3")
    r = run_cli("run", str(base), "--prompt", "w1", "--context", str(tmp_path / "doc.bin"), "--max-new-tokens", "2",
                "--quant", "fp32")
    assert r.returncode == 2 and "error --context:" in _err(r) and "it holds NUL bytes (byte 5)" in _err(r)


@pytest.mark.parametrize("value", ["inf", "-inf", "1e-45", "0.00009", "nan"])
def test_a_temperature_sampling_cannot_compute_is_refused(base, value):
    err = _refused(["run", str(base), "--prompt", "hi", "--do-sample", "--temperature", value], "--temperature", 2)
    assert "a finite number >= 0.0001" in err


def test_a_catalog_name_without_weights_gives_the_download_command():
    r = run_cli("run", "llama-3.1-8b", "--prompt", "hi")
    assert r.returncode == 3
    repo = MODELS["llama-3.1-8b"]["source"]
    assert f"\n    hf download {repo}\n" in r.stderr  # a line of code of its own, not wrapped
    assert f"then run {repo} (the catalog's llama-3.1-8b holds shapes only" in _err(r)
    r = run_cli("run", "some-org/not-cached-model", "--prompt", "hi")
    assert r.returncode == 3 and "\n    hf download some-org/not-cached-model\n" in r.stderr


def test_the_python_api_raises_the_same_typed_errors(base, tmp_path):
    folder = _copy(base, tmp_path)
    _config(num_hidden_layers=1e12)(folder)
    for call in (vramguard.plan, vramguard.check, vramguard.resolve_model):
        with pytest.raises(ConfigError) as e:
            call(str(folder))
        assert e.value.field == "config.json:num_hidden_layers" and e.value.value == 1e12
    from vramguard.runtime.load import load_model
    with pytest.raises(ConfigError) as e:
        load_model(str(folder), quant="fp32", verify=False)
    assert e.value.field == "config.json:num_hidden_layers"
    other = tmp_path / "other"
    shutil.copytree(base, other)
    (other / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError) as e:
        load_model(str(other), quant="fp32", verify=False)
    assert e.value.value == str(other / "model.safetensors") and "it holds 0 bytes" in e.value.fix
    with pytest.raises(ConfigError, match="it holds 0 bytes"):
        vramguard.check(str(other), verify=False)
    (other / "model.safetensors").unlink()
    os.mkfifo(other / "model.safetensors")
    with pytest.raises(NotAFile, match="is a FIFO"):
        vramguard.plan(str(other))
    with pytest.raises(UnknownModel) as e:
        load_model("llama-3.1-8b")
    assert e.value.fix.endswith("hf download " + MODELS["llama-3.1-8b"]["source"])
    with pytest.raises(InvalidValue):
        vramguard.generate(None, None, [1], 2, do_sample=True, temperature=float("inf"))


def test_json_depth_and_size_are_bounded(tmp_path):
    assert json_depth({"a": [1, {"b": []}]}) == 4  # object > list > object > list
    assert json_depth(1) == 0
    deep = "[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1)
    (tmp_path / "deep.json").write_text(json.dumps({"a": json.loads(deep)}))
    with pytest.raises(ConfigError, match="nested at most 64 levels"):
        read_json(tmp_path / "deep.json", "MODEL", "config.json")
    (tmp_path / "ok.json").write_text(json.dumps({"a": json.loads("[" * 60 + "]" * 60)}))
    assert json_depth(read_json(tmp_path / "ok.json", "MODEL", "config.json")) == 61  # the object + 60 lists
    (tmp_path / "big.json").write_text("{}")
    with pytest.raises(ConfigError, match="at most 1 bytes"):
        read_json(tmp_path / "big.json", "MODEL", "config.json", max_bytes=1)
    with pytest.raises(NotAFile, match="is a folder"):
        read_json(tmp_path, "MODEL", "config.json")


def test_config_limits_accept_the_catalog_and_refuse_each_field_past_its_limit():
    for key, cfg in MODELS.items():
        check_config(cfg, key)  # every catalog config is within the limits
    for key, (lo, hi) in CONFIG_INTS.items():
        check_config({key: hi}, "c")
        for bad in (lo - 1, hi + 1, True, float(hi), str(lo)):
            with pytest.raises(ConfigError) as e:
                check_config({"text_config": {key: bad}}, "c")
            assert e.value.field == f"config.json:text_config.{key}" and e.value.value == bad
    check_config({"intermediate_size": [128, 256]}, "c")  # one per layer, as some architectures give it
    with pytest.raises(ConfigError) as e:
        check_config({"intermediate_size": [128, 0]}, "c")
    assert e.value.field == "config.json:intermediate_size[1]" and e.value.value == 0


def test_every_accepted_dtype_name_is_a_torch_dtype():
    import torch
    for name in CONFIG_DTYPE_NAMES:
        assert isinstance(getattr(torch, name), torch.dtype) and getattr(torch, name).is_floating_point, name
    assert not hasattr(torch, "float128")
    check_config({"torch_dtype": "torch.bfloat16", "dtype": "auto"}, "c")


def test_every_causal_lm_config_transformers_builds_passes_the_limits():
    """The limits refuse no architecture transformers knows: each causal-LM config class's defaults pass."""
    import warnings

    from huggingface_hub.errors import StrictDataclassError
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    checked = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            try:
                cfg = CONFIG_MAPPING[model_type]().to_dict()
            except (KeyError, ValueError, TypeError, StrictDataclassError):  # no class, or defaults it refuses
                continue
            check_config(cfg, model_type)
            checked += 1
    assert checked > 150  # transformers 5.17 knows about 190 causal-LM architectures


def test_a_sharded_checkpoint_with_its_index_passes(base, tmp_path):
    """The checks refuse nothing a real save writes: transformers' own sharded save (index + shards) is read, and
    an index naming a file outside the folder is refused."""
    from transformers import AutoModelForCausalLM

    from vramguard.hub.headers import check_weights
    from vramguard.probe.checkpoint import read_checkpoint
    folder = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(base).save_pretrained(folder, max_shard_size="200KB")
    shutil.copy(base / "tokenizer.json", folder)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 2
    check_weights(folder)
    assert [name for name, _ in read_checkpoint(folder).shards] == shards
    index["weight_map"]["lm_head.weight"] = "../elsewhere.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ConfigError, match="it names '../elsewhere.safetensors', outside"):
        check_weights(folder)


@pytest.mark.parametrize("field, value, when", [("head_dim", 0, "building the model"),
                                                ("decoder_sparse_step", 0, "building the model"),
                                                ("linear_num_key_heads", 0, "in its forward")])
def test_a_count_below_one_that_transformers_refuses_is_named_never_an_internal_error(tmp_path, field, value, when):
    """transformers raises ZeroDivisionError or a negative-dimension RuntimeError from a model class's __init__ or
    forward on such a config: the plan names the field (exit 3) instead of an internal error (exit 70) or blaming
    the settings."""
    pytest.importorskip("transformers")
    from archs import ARCHS
    from transformers import AutoConfig
    AutoConfig.for_model("qwen3_next", **ARCHS["qwen3_next"]).save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, field: value}))
    r = run_cli("plan", str(tmp_path), "--quant", "bf16", "--format", "json")
    assert r.returncode == 3, r.stderr
    err = json.loads(r.stdout or r.stderr)["error"]
    assert (err["field"], err["value"]) == (f"config.json:{field}", str(value))  # JSON errors give values as text
    assert when in err["fix"] and "published model's value" in err["fix"]
