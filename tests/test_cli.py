"""The CLI as a user runs it: stdout data, stderr messages, exit codes, no tracebacks. ``vramguard.cli.main`` runs
in this process (:func:`conftest.run_cli`); what only a fresh process shows (a closed pipe, the warnings filters, a
missing package) runs in a subprocess."""

import json
import os
import subprocess
import sys

import pytest
from conftest import run_cli

pytestmark = pytest.mark.usefixtures("shared_plans")  # the same plans asked for again and again: each computed once

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "160"}


def run(*args):
    return run_cli(*args)


def test_default_plan_without_gpu():
    r = run("plan", "llama-2-7b")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    # no card named: transformers' default attention, and the note on stderr says why
    assert "llama-2-7b" in out and "NF4" in out and "attention sdpa" in out
    assert "no card named, so FlashAttention-2 is not assumed" in " ".join(r.stderr.split())
    assert "256 new tokens" in out
    for size in ("8 GiB card     8.00", "12 GiB card   12.00", "16 GiB card   16.00", "24 GiB card   24.00"):
        assert size in out
    assert "Traceback" not in r.stderr


def test_json_carries_integer_bytes():
    r = run("plan", "llama-3.1-8b", "--quant", "nf4", "--attn", "sdpa", "--prompt-tokens", "8192",
            "--max-new-tokens", "512", "--gpu", "rtx-4090", "--format", "json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert isinstance(d["peak_allocated_bytes"], int) and isinstance(d["device_used_bytes"], int)
    assert all(isinstance(v, int) for v in d["components"].values())
    assert sum(d["components"].values()) == d["peak_allocated_bytes"]
    assert d["cards"][0]["gpu"]["name"] == "rtx-4090" and isinstance(d["cards"][0]["max_prompt_tokens"], int)
    assert d["weights"]["total_bytes"] > 5 * 2**30
    assert d["kv_cache"]["bytes_per_token"] == 131_072


@pytest.mark.parametrize("args,code,words", [
    (("plan", "no-such-model"), 3, ["MODEL", "no-such-model", "catalog name"]),
    (("plan", "--gpu", "rtx-9999"), 3, ["--gpu", "rtx-9999", "rtx-4090"]),
    (("plan", "llama-2-7b", "--vram", "24XB"), 2, ["--vram", "24XB", "24GiB"]),
    (("plan", "--batch", "0"), 2, ["--batch", "0", ">= 1", "fix:"]),
    (("plan", "llama-2-7b", "--vram", "24"), 2, ["--vram", "add a unit: 24GiB"]),
    (("plan", "--num-return-sequences", "3"), 2, ["--num-return-sequences", "beam search"]),
    (("plan", "--kv-dtype", "int4", "--cache", "static"), 2, ["--kv-dtype", "--cache dynamic"]),
    (("plan", "--quant", "int8", "--compute-dtype", "fp16"), 2, ["--compute-dtype", "4-bit"]),
    (("plan", "./no/such/config.json"), 3, ["no such file or folder"]),
    (("plan", "llama-2-7b", "--prompt-tokens", "5000"), 2, ["max_position_embeddings=4096"]),
    (("plan", "llama-2-7b", "--gpu", "t4", "--vram", "16GiB"), 2, ["--gpu/--vram", "one of the two"]),
    (("plan", "--quant", "int3"), 2, ["--quant", "int3", "fix:"]),
    (("plan", "--batch", "x"), 2, ["--batch", "an integer", "fix:"]),
    (("plan", "--no-such-option"), 2, ["--no-such-option", "fix:"]),
    (("check", "--quant", "none", "--compute-dtype", "bf16"), 2, ["--compute-dtype", "--quant none"]),
    (("check", "llama-7b", "--prompt-tokens", "5000"), 2, ["max_position_embeddings=2048"]),
    (("check", "--device-map", "weird"), 2, ["--device-map", "weird"]),
    (("explain", ""), 2, ["MESSAGE", "pass -"]),
    (("oom-log", "--year", "0"), 2, ["--year"]),
    (("fit", "x", "--vary", "width"), 2, ["--vary", "width", "fix:"]),
    (("serve", "/no/such/folder", "--max-body-size", "10"), 2, ["--max-body-size", "add a unit: 10MiB or 10MB"]),
])
def test_bad_input_gets_a_clear_error(args, code, words):
    r = run(*args)
    assert r.returncode == code, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr + r.stdout
    for w in words:
        assert w in r.stderr, (w, r.stderr)


def test_binary_file_as_model_is_a_clear_error(tmp_path):
    f = tmp_path / "model.safetensors"
    f.write_bytes(bytes(range(256)) * 4)
    r = run("plan", str(f))
    assert r.returncode == 3 and "not JSON text" in r.stderr and "Traceback" not in r.stderr


def test_json_errors_are_json():
    r = run("plan", "--batch", "0", "--format", "json")
    assert r.returncode == 2
    e = json.loads(r.stdout)["error"]
    assert e["field"] == "--batch" and e["value"] == "0" and e["exit_code"] == 2


def test_context_override_for_rope_scaled_models():
    """C8's Qwen2-7B at 131,072 tokens (YaRN): the config says 32,768, --context allows more."""
    r = run("plan", "qwen2-7b", "--prompt-tokens", "131072", "--max-new-tokens", "0", "--logits", "all",
            "--context", "131072", "--vram", "141GiB", "--format", "json")
    assert r.returncode == 0, r.stderr
    f = next(f for f in json.loads(r.stdout)["findings"] if f["code"] == "logits_all_positions")
    assert "74.250 GiB" in f["message"]


def test_named_card_and_listing():
    r = run("plan", "llama-3.1-70b", "--quant", "nf4", "--gpu", "rtx-4090")
    assert r.returncode == 0 and "no" in r.stdout and "Changes: first those that make it fit" in r.stdout
    r = run("plan", "--list-gpus")
    assert r.returncode == 0 and len(r.stdout.strip().splitlines()) >= 15
    r = run("plan", "--list-models")
    assert r.returncode == 0 and len(r.stdout.strip().splitlines()) >= 12


def test_a_closed_pipe_ends_quietly():
    """``vramguard plan ... | head -1``: the reader goes away after one line and the CLI ends without a
    traceback. The process plans without torch and transformers (the hand model of a catalog family, the same
    numbers), so that it needs no second import of them."""
    code = ("import sys; sys.modules['torch'] = sys.modules['transformers'] = None; from vramguard.cli import main; "
            "sys.argv = ['vramguard', 'plan', 'llama-3.1-70b', '--gpu', 'rtx-4090']; main()")
    r = subprocess.run(f"{sys.executable} -c \"{code}\" | head -1", shell=True, capture_output=True, text=True,
                       env=ENV, timeout=120)
    assert "vramguard plan" in r.stdout and "Traceback" not in r.stderr


def test_exit_code_when_nothing_fits():
    assert run("plan", "llama-3.1-70b", "--gpu", "rtx-4090", "--exit-code").returncode == 1
    assert run("plan", "llama-3.1-8b", "--gpu", "rtx-4090", "--exit-code").returncode == 0
    assert run("plan", "llama-3.1-70b", "--gpu", "rtx-4090").returncode == 0


@pytest.mark.parametrize("command", [["run", "{m}", "--prompt", "hi", "--max-new-tokens", "2"],
                                     ["profile", "{m}"], ["fit", "{m}", "--vary", "prompt"]])
def test_a_missing_optional_package_is_named_with_its_extra(tiny, command, monkeypatch):
    """`pip install .` alone has no torch: commands that need it say which package and which extra (exit 3), not an
    internal error."""
    folder, _ = tiny("LlamaConfig", hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=500)
    code = ("import sys; sys.modules['torch'] = None; from vramguard.cli import main; "
            f"sys.argv = ['vramguard'] + {[c.replace('{m}', str(folder)) for c in command]!r}; main()")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 3, p.stderr
    assert "error torch not installed" in p.stderr and "pip install 'vramguard[gpu]'" in p.stderr
    from vramguard import hardware
    monkeypatch.setattr(hardware, "DETECT_OVERRIDE", None)  # what the subprocess saw: the real NVML answer
    if not hardware.detect_gpus().gpus:  # no GPU here: the CPU build of torch is named first
        assert "pip install torch --index-url https://download.pytorch.org/whl/cpu" in p.stderr
    assert "internal error" not in p.stderr and "Traceback" not in p.stderr


def test_plan_defaults_follow_the_named_card_and_explicit_values_are_kept():
    """On a --gpu card below compute capability 8.0 plan's defaults are what the loader would run there (sdpa,
    fp16), said on stderr; FlashAttention-2 passed explicitly is kept and flagged."""
    d = run("plan", "mistral-7b-v0.3", "--gpu", "t4", "--format", "json")
    assert d.returncode == 0, d.stderr
    data = json.loads(d.stdout)
    assert data["settings"]["attn"] == "sdpa" and data["settings"]["dtype"] == "fp16"
    assert "defaults for the NVIDIA T4 (compute capability 7.5): --attn sdpa" in " ".join(d.stderr.split())
    assert not any(f["level"] == "fail" for f in data["findings"])
    e = run("plan", "mistral-7b-v0.3", "--gpu", "t4", "--attn", "flash_attention_2", "--format", "json")
    codes = {f["code"]: f["level"] for f in json.loads(e.stdout)["findings"]}
    assert codes["fa2_compute_capability"] == "fail" and "--attn sdpa" not in e.stderr
    a = run("plan", "mistral-7b-v0.3", "--gpu", "rtx-4090", "--format", "json")
    assert json.loads(a.stdout)["settings"]["attn"] == "flash_attention_2" and a.stderr == ""


def test_the_torch_install_fix_follows_the_gpu(monkeypatch):
    from vramguard import cli, hardware
    from vramguard.catalog.gpus import GPUS
    assert cli.install_fix("gpu", True).startswith("pip install torch --index-url https://download.pytorch.org/whl/cpu")
    monkeypatch.setattr(hardware, "DETECT_OVERRIDE", lambda: hardware.DetectedGpus((GPUS["t4"],), "1 GPU(s)"))
    assert cli.install_fix("gpu", True) == "pip install 'vramguard[gpu]' (installs the CUDA build of torch)"
    assert cli.install_fix("serve", False) == "pip install 'vramguard[serve]'"


def test_only_the_known_library_noise_is_silenced():
    """One fresh process runs the noisy code twice: without the filters both known warnings show; after
    quiet_known_warnings() they do not, and other warnings (similar words, another category) still do (setting a
    filter resets what Python remembers of warnings already shown)."""
    code = ("import warnings, sys\n"
            "import torch.distributed as dist\n"
            "from torch.profiler import profile, schedule\n"
            "from vramguard.cli import quiet_known_warnings\n"
            "def noisy():\n"
            "    dist.reduce_op.SUM\n"
            "    with profile(schedule=schedule(wait=0, warmup=0, active=1)) as p:\n"
            "        torch_ = __import__('torch'); torch_.ones(2) + 1; p.step()\n"
            "    warnings.warn('Profiler clears events, a different message', UserWarning)\n"
            "    warnings.warn('`torch.distributed.reduce_op` is deprecated', UserWarning)\n"
            "noisy()\n"
            "print('-- filtered --', file=sys.stderr, flush=True)\n"
            "quiet_known_warnings()\n"
            "noisy()\n")
    r = subprocess.run([sys.executable, "-W", "default", "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    bare, filtered = r.stderr.split("-- filtered --\n")
    assert "clears events at the end of each cycle" not in filtered
    assert "FutureWarning" not in filtered
    # other warnings, even with similar words or another category, still show
    assert "a different message" in filtered and "UserWarning: `torch.distributed.reduce_op`" in filtered
    # without the filters both would have shown
    assert "clears events at the end of each cycle" in bare and "FutureWarning" in bare


def _lines(*args, columns="80"):
    r = run_cli(*args, columns=columns)
    assert r.returncode in (0, 1), r.stderr
    return r.stdout.splitlines()


# one case per kind of text: the default cards; a card named as torch prints it; findings with a fail and its fix and
# sliding-window lines (Gemma-2 at 24 GiB: the settings of tests/test_plan_speed.py, whose replays the session's tape
# folder keeps); a model that does not fit, with its changes; check; explain
@pytest.mark.parametrize("args", [("plan", "llama-2-7b"), ("plan", "llama-2-7b", "--gpu", "Tesla T4"),
                                  ("plan", "gemma-2-2b", "--vram", "24GiB"),
                                  ("plan", "llama-3.1-70b", "--gpu", "rtx-6000-ada"),
                                  ("check", "mistral-7b-v0.3", "--no-verify"),
                                  ("explain", "CUDA out of memory. Tried to allocate 2.00 GiB")])
def test_80_columns_no_wrapped_card_rows_and_no_trailing_spaces(args):
    lines = _lines(*args)
    assert all(len(line) <= 80 for line in lines), max(lines, key=len)
    assert not [line for line in lines if line != line.rstrip()]
    if args[0] == "plan":
        head = next(i for i, line in enumerate(lines) if line.split()[:2] == ["card", "memory"])
        rows = lines[head + 2:]
        rows = rows[:next((i for i, line in enumerate(rows) if not line.strip()), len(rows))]
        assert rows and all(len(row.split()) >= 8 for row in rows), rows  # every card on one line


def test_top_level_help_is_not_cut_and_version_is_printed():
    lines = _lines("--help")
    commands = lines[lines.index("Commands:") + 1:]
    assert len([c for c in commands if c.strip()]) == 9  # plan check oom-log explain profile fit run serve export
    assert not any(line.rstrip().endswith("...") for line in commands)
    import vramguard
    assert _lines("--version")[0].startswith(f"vramguard {vramguard.__version__} (torch ")
