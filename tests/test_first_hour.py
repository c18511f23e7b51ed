"""What a new user trips on in the first hour: each bad option refused before anything else is printed, naming its
flag, the value, the limit and the fix; text output in 80 columns; no library noise on stderr."""

import errno
import io
import json
import re
from pathlib import Path

import pytest

from conftest import run_cli

pytestmark = pytest.mark.usefixtures("shared_plans")  # the same plans asked for again and again: each computed once


def _only_error(r, flag: str) -> list[str]:
    """The result's stderr lines, after checking that it is a usage error (exit 2) of ``flag`` with nothing on
    stdout and nothing on stderr before the error."""
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert r.stdout == ""
    lines = r.stderr.splitlines()
    assert lines[0].startswith(f"error {flag}: "), r.stderr
    return lines


def test_revision_with_a_catalog_name_asks_for_the_hub_id():
    r = run_cli("plan", "--revision", "main", "llama-3.1-8b", columns="200")
    lines = _only_error(r, "--revision")
    assert lines[0] == ("error --revision: 'main' is not valid; accepted: a branch, tag or commit of a Hub id "
                        "(owner/name); 'llama-3.1-8b' is a catalog name.")
    assert lines[1] == ("fix: pass the Hub id meta-llama/Llama-3.1-8B-Instruct with --revision main, or no revision "
                        "for the catalog's copy of llama-3.1-8b")


def test_revision_with_a_local_folder_is_refused(tmp_path):
    from vramguard.errors import InvalidValue
    from vramguard.resolve import resolve_model
    with pytest.raises(InvalidValue) as e:
        resolve_model(str(tmp_path), revision="v1")
    assert e.value.field == "revision" and "is a local folder" in e.value.accepted
    with pytest.raises(InvalidValue):
        resolve_model("llama-3.1-8b", revision=" ")


def test_tp_help_shows_no_default_the_planner_refuses():
    r = run_cli("plan", "--help", columns="120")
    block = " ".join(r.stdout[r.stdout.index("--tp "):r.stdout.index("--device-map")].split())
    assert "default" not in block and "2 or more" in block and "(unset: 1)" in block


def test_tp_not_dividing_the_kv_heads_is_said_before_the_missing_cards():
    # llama-3.1-8b has 8 KV heads: 3 divides none, 2, 4 and 8 do; no card is named and none is detected
    lines = _only_error(run_cli("plan", "llama-3.1-8b", "--tp", "3", columns="200"), "--tp")
    assert lines == ["error --tp: 3 is not valid; accepted: a divisor of num_key_value_heads=8.",
                     "fix: pick --tp 2, 4 or 8: every rank keeps whole KV heads"]
    # the same before the quantization's refusal (NF4 is the default)
    assert _only_error(run_cli("plan", "llama-3.1-8b", "--tp", "3", "--gpu", "h100"), "--tp")[0].startswith(
        "error --tp: 3 is not valid")


def test_plan_engine_vllm_fits_80_columns_and_its_command_pastes_whole():
    text = run_cli("plan", "llama-3.1-8b", "--engine", "vllm", "--gpu", "h100", "--tp", "2", columns="80")
    assert text.returncode == 0
    lines = text.stdout.splitlines()
    assert max(map(len, lines)) <= 80, [x for x in lines if len(x) > 80]
    command = lines[lines.index("command:") + 1:]
    assert all(x.endswith(" \\") for x in command[:-1]) and not command[-1].endswith("\\")
    joined = " ".join(x.strip().removesuffix(" \\") for x in command)
    js = json.loads(run_cli("plan", "llama-3.1-8b", "--engine", "vllm", "--gpu", "h100", "--tp", "2", "--format",
                            "json").stdout)
    assert joined == js["command"]  # the shell gets the same words as the one-line command


@pytest.mark.parametrize("args", [("--gpus", "2", "--gpu", "rtx-4090"), ("--vram", "24GiB,16GiB"),
                                  ("--tp", "2", "--quant", "bf16", "--gpu", "rtx-4090")])
def test_multi_gpu_plan_fits_80_columns(args):
    r = run_cli("plan", "llama-3.1-8b", *args, columns="80")
    assert r.returncode == 0, r.stderr
    assert max(len(x) for x in r.stdout.splitlines()) <= 80


def test_bad_gpu_memory_utilization_prints_its_error_alone():
    lines = _only_error(run_cli("plan", "llama-3.1-8b", "--engine", "vllm", "--gpu-memory-utilization", "1.5",
                                columns="200"), "--gpu-memory-utilization")
    assert lines == ["error --gpu-memory-utilization: 1.5 is not valid; accepted: a fraction above 0 and at most 1.",
                     "fix: set --gpu-memory-utilization 0.9 (vLLM's default) or another fraction"]


@pytest.mark.parametrize("to", ["kubernetes", "vllm"])
def test_bad_replicas_print_their_error_alone(to):
    lines = _only_error(run_cli("export", "llama-3.1-8b", "--to", to, "--gpu", "h100", "--replicas", "0",
                                columns="200"), "--replicas")
    assert lines == ["error --replicas: 0 is not valid; accepted: an integer from 1 to 10,000.",
                     "fix: set --replicas 1 or more"]


def test_alloc_conf_errors_name_the_flag():
    lines = _only_error(run_cli("plan", "llama-3.1-8b", "--gpu", "h100", "--alloc-conf", "expandable_segments:Maybe",
                                columns="200"), "--alloc-conf")
    assert lines[1] == ("fix: pass options the caching allocator takes (expandable_segments must be True or False, "
                        "not 'Maybe')")
    # an option PyTorch does not know is refused as PyTorch would, not planned as the default allocator
    lines = _only_error(run_cli("plan", "llama-3.1-8b", "--gpu", "h100", "--alloc-conf", "foo", columns="200"),
                        "--alloc-conf")
    assert "'foo' is not an option of PyTorch's allocator" in lines[1]
    from vramguard.cli.common import as_flags
    assert as_flags("or leave alloc_conf out (x)") == "or leave --alloc-conf out (x)"


def test_alloc_conf_parses_pytorch_list_values():
    from vramguard.memory.allocator import AllocatorConfig
    c = AllocatorConfig.parse("roundup_power2_divisions:[64:8,256:4,>:1],expandable_segments:True,"
                              "max_split_size_mb:512")
    assert c.expandable_segments and c.max_split_size == 512 * 2**20
    with pytest.raises(ValueError, match="'expandable_segment' is not an option"):
        AllocatorConfig.parse("expandable_segment:True")


def test_loading_shows_no_progress_bar_and_leaves_the_switch_as_it_was(tmp_path, capfd):
    pytest.importorskip("torch")
    from transformers.utils import logging as hf_logging

    from conftest import save_tiny_llama
    from vramguard import load_model, unload
    folder = save_tiny_llama(tmp_path / "m", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, vocab_size=300)
    capfd.readouterr()
    assert hf_logging.is_progress_bar_enabled()
    loaded = load_model(str(folder), quant="fp32", verify=False)
    err = capfd.readouterr().err
    unload(loaded)
    assert "Loading weights" not in err and "it/s" not in err, err
    assert hf_logging.is_progress_bar_enabled()  # the caller's setting, put back


def test_run_refuses_a_bad_generation_option_before_the_model_is_looked_at():
    # a catalog name has no weights: the option's error comes first, alone (nothing loaded, no prompt line)
    lines = _only_error(run_cli("run", "llama-3.1-8b", "--prompt", "hi", "--max-new-tokens", "0", columns="200"),
                        "--max-new-tokens")
    assert len(lines) == 2
    lines = _only_error(run_cli("run", "llama-3.1-8b", "--prompt", "hi", "--temperature", "0.5", columns="200"),
                        "--temperature")
    assert "--do-sample" in lines[1]


@pytest.mark.parametrize("verb", ["run", "profile", "fit", "serve"])
def test_a_missing_folder_is_named_by_every_verb_that_loads(verb, tmp_path):
    pytest.importorskip("torch")
    extra = {"run": ["--prompt", "hi"], "profile": ["--out", str(tmp_path / "p")], "fit": ["--vary", "prompt"],
             "serve": []}[verb]
    r = run_cli(verb, "./no-such-model", *extra, columns="300")
    assert r.returncode == 3, r.stderr
    # an action first, then the absolute path that was looked for
    assert r.stderr.splitlines()[-1] == ("fix: check the path, or pass the folder that holds config.json (no such "
                                         f"file or folder: {Path('no-such-model').absolute()})")


def test_check_names_a_missing_folder_before_probing_the_machine(monkeypatch):
    import sys

    import vramguard.check  # noqa: F401
    chk = sys.modules["vramguard.check"]  # the package (vramguard.check is also its function's name)

    def probe():
        raise AssertionError("probed before the model was read")
    monkeypatch.setattr(chk, "probe_env", probe)
    r = run_cli("check", "./no-such-model", columns="300")
    assert r.returncode == 3 and r.stdout == "" and r.stderr.splitlines()[-1] == (
        "fix: check the path, or pass the folder that holds config.json (no such file or folder: "
        f"{Path('no-such-model').absolute()})")


def test_export_without_a_card_and_a_bad_vllm_tp_print_their_error_alone():
    lines = _only_error(run_cli("export", "qwen2.5-7b", "--to", "vllm", columns="300"), "--gpu/--vram")
    assert lines[0] == "error --gpu/--vram: 'none given' is not valid; accepted: one card, named or detected."
    assert lines[1].startswith("fix: name the card the deployment runs on, e.g. --gpu h100 or --vram 80GiB (0 GPUs")
    # Qwen2.5-7B has 28 attention heads, 4 KV heads and an MLP of 18,944: of the divisors of 28, vLLM takes 1, 2, 4
    lines = _only_error(run_cli("plan", "qwen2.5-7b", "--engine", "vllm", "--gpu", "h100", "--tp", "3",
                                columns="300"), "--tp")
    assert lines == ["error --tp: 3 is not valid; accepted: a divisor of num_attention_heads (28).",
                     "fix: pass --tp 1, 2 or 4 (the other divisors of the 28 heads: 7, 14: over the 4 KV heads and not "
                     "a multiple of them; 28: not dividing the MLP's 18,944)"]


def test_a_vllm_option_without_engine_vllm_is_refused_not_dropped():
    lines = _only_error(run_cli("plan", "llama-3.1-8b", "--gpu", "h100", "--max-model-len", "4096", columns="300"),
                        "--max-model-len")
    assert lines == ["error --max-model-len: 4096 is not valid; accepted: with --engine vllm only (vLLM's engine "
                     "argument).", "fix: add --engine vllm to plan vLLM with it, or leave --max-model-len out"]


def test_vllm_refusal_fixes_name_the_flags():
    # Llama-3.1-8B at its 131,072-token context does not fit the KV cache left on an RTX 4090
    r = run_cli("plan", "llama-3.1-8b", "--engine", "vllm", "--gpu", "rtx-4090", columns="300")
    fix = next(x for x in r.stdout.splitlines() if x.startswith("fix: "))
    assert re.fullmatch(r"fix: --max-model-len \d+ \(the longest one request that fits\), --tp 2 or more, or "
                        r"--kv-cache-dtype fp8", fix), fix


def test_explain_says_when_its_input_is_empty():
    r = run_cli("explain", "-", input="")
    assert r.returncode == 2 and "MESSAGE: 'empty input' is not valid" in r.stderr


TINY_LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=300)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    pytest.importorskip("torch")
    from conftest import save_tiny_llama
    return save_tiny_llama(tmp_path_factory.mktemp("first_hour") / "tiny", **TINY_LLAMA)


def _findings(r) -> dict[str, dict]:
    return {f["code"]: f for f in json.loads(r.stdout)["findings"]}


@pytest.mark.parametrize("card,cc", [("t4", "7.5"), ("v100-16gb", "7.0")])
def test_check_bf16_on_a_card_without_it_is_a_finding_not_an_internal_error(tiny_llama, card, cc):
    r = run_cli("check", str(tiny_llama), "--dtype", "bf16", "--gpu", card, "--format", "json", "--no-verify")
    assert r.returncode == 0 and "internal error" not in r.stderr, r.stderr
    f = _findings(r)
    assert (f["bf16"]["level"], f["bf16"]["value"]) == ("warn", f"not native on compute capability {cc}")
    assert f["param_dtype"]["value"].startswith("bf16")  # checked as given, not as the fp16 a load would use
    # the compute dtype left unset pairs with the bf16 given (no invented bf16/fp16 mismatch)
    assert f["compute_dtype"]["message"] == "matches the activation dtype, but bfloat16 is not native on this card"


def test_check_docs_example_with_compute_dtype_bf16_on_a_t4():
    r = run_cli("check", "mistral-7b-v0.3", "--attn", "flash_attention_2", "--compute-dtype", "bf16", "--gpu", "t4",
                "--format", "json")
    assert r.returncode == 1 and "internal error" not in r.stderr, r.stderr  # 1: FlashAttention-2 fails on 7.5
    f = _findings(r)
    assert f["bf16"]["level"] == "warn" and f["flash_attention_2"]["level"] == "fail"
    assert f["param_dtype"]["value"].startswith("bf16")  # the unset dtype pairs with the compute dtype given
    assert f["compute_dtype"]["message"] == "matches the activation dtype, but bfloat16 is not native on this card"


def test_choose_dtypes_without_a_report_records_nothing():
    from vramguard.catalog.gpus import GPUS
    from vramguard.runtime.load import choose_dtypes
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no override warning either
        assert choose_dtypes(GPUS["t4"], "nf4", "bf16", None, None, False) == ("fp16", "fp16")


def test_since_refuses_what_no_kernel_log_can_hold():
    from datetime import datetime, timezone

    from vramguard.errors import InvalidValue
    from vramguard.oomlog import parse_since
    now = datetime(2026, 12, 1, tzinfo=timezone.utc)
    # 2026-12-01 is 20,788 days after 1970-01-01 (29,934,720 minutes)
    assert parse_since("20788d", now) == datetime(1970, 1, 1, tzinfo=timezone.utc)
    for text, accepted in (("800000d", "a duration back to 1970-01-01 at most (20,788d from now)"),
                           ("99999999999999999999m", "a duration back to 1970-01-01 at most (29,934,720m from now)"),
                           ("9999-12-31T00:00+00:00", "a time from 1970-01-01 to now (2026-12-01T00:00+00:00)"),
                           ("1969-12-31T00:00+00:00", "a time from 1970-01-01 to now (2026-12-01T00:00+00:00)")):
        with pytest.raises(InvalidValue) as e:
            parse_since(text, now)
        assert (e.value.field, e.value.accepted) == ("since", accepted)
    r = run_cli("oom-log", "--since", "800000d", columns="300")
    lines = _only_error(r, "--since")
    assert lines[1] == "fix: pass a shorter duration such as 30d, or leave it out for every record"
    lines = _only_error(run_cli("oom-log", "--since", "9999-12-31", columns="300"), "--since")
    assert lines[0].startswith("error --since: '9999-12-31' is not valid; accepted: a time from 1970-01-01 to now (")


class _ClosedPipe(io.StringIO):
    """A stdout whose reader went away: every write fails as a closed pipe's does (errno EPIPE)."""

    def write(self, text):
        raise BrokenPipeError(errno.EPIPE, "Broken pipe")


@pytest.mark.parametrize("args", [("plan", "llama-3.1-8b", "--gpu", "t4"),  # the pipe is the subject: the 70B, fast
                                  ("plan", "llama-3.1-70b", "--gpu", "t4", "--exit-code", "--alloc-conf", "formula"),
                                  ("plan", "llama-3.1-8b", "--gpu", "t4", "--format", "json"),
                                  ("explain", "CUDA out of memory. Tried to allocate 2.00 GiB")])
def test_a_closed_pipe_ends_quietly_with_141(args):
    r = run_cli(*args, stdout=_ClosedPipe())
    assert r.returncode == 141  # EXIT_CLOSED_PIPE: 128 + SIGPIPE (13); 1 would say a check failed
    assert "error" not in r.stderr and "pipe" not in r.stderr.lower(), r.stderr


def test_run_into_a_closed_pipe_ends_quietly_with_141(tiny_llama):
    r = run_cli("run", str(tiny_llama), "--prompt", "w1 w2", "--max-new-tokens", "4", stdout=_ClosedPipe())
    assert r.returncode == 141 and "internal error" not in r.stderr and "pipe" not in r.stderr.lower(), r.stderr


def test_a_closed_pipe_in_a_real_process_ends_quietly_with_141():
    import os
    import subprocess
    import sys
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                         os.environ.get("PYTHONPATH", "")])}
    for args in (["--version"], ["plan", "--list-gpus"]):  # click's print, then rich's console
        read, write = os.pipe()
        os.close(read)  # the reader is gone before the first write
        p = subprocess.run([sys.executable, "-m", "vramguard", *args], stdout=write, stderr=subprocess.PIPE,
                           text=True, env=env, timeout=60)
        os.close(write)
        assert (p.returncode, p.stderr) == (141, ""), (args, p.stderr)


def test_explain_knows_cublas_not_initialized():
    from vramguard.explain import explain
    e = explain("RuntimeError: CUDA error: CUBLAS_STATUS_NOT_INITIALIZED when calling `cublasCreate(handle)`")
    assert e.kind == "cublas_alloc" and e.evidence[0].startswith("CUBLAS_STATUS_NOT_INITIALIZED: cublasCreate")


def test_explain_refusal_shows_a_pasted_traceback_on_one_line():
    r = run_cli("explain", "Traceback (most recent call last):\n  File x\nValueError: bad", columns="300")
    assert r.returncode == 2
    assert r.stderr.startswith("error MESSAGE: 'Traceback (most recent call last): File x ValueError: bad' is not "
                               "valid"), r.stderr


def test_explain_reads_an_existing_file_and_says_so(tmp_path, monkeypatch):
    (tmp_path / "oom_tb.txt").write_text(
        "Traceback (most recent call last):\n  ...\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate "
        "20.00 MiB. GPU 0 has a total capacity of 23.65 GiB of which 10.06 MiB is free. Process 12345 has 4.10 GiB "
        "memory in use. Including non-PyTorch memory, this process has 19.48 GiB memory in use. Of the allocated "
        "memory 17.80 GiB is allocated by PyTorch, and 1.20 GiB is reserved by PyTorch but unallocated.\n")
    monkeypatch.chdir(tmp_path)
    r = run_cli("explain", "oom_tb.txt", "--format", "json", columns="300")
    assert r.returncode == 0, r.stderr
    assert r.stderr == "reading the message from the file oom_tb.txt\n"
    e = json.loads(r.stdout)
    # 1.20 GiB reserved but unallocated >= the 20 MiB request: fragmentation; the other process is still named
    assert e["kind"] == "fragmentation"
    assert "other processes hold memory on this card: pid 12345 4.10 GiB (nvidia-smi lists them)" in e["evidence"]
