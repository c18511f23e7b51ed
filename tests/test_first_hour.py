"""What a new user trips on in the first hour: each bad option refused before anything else is printed, naming its
flag, the value, the limit and the fix; text output in 80 columns; no library noise on stderr."""

import errno
import io
import json
import re
from pathlib import Path

import pytest

from conftest import run_cli


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
    assert lines[1] == "fix: expandable_segments must be True or False, not 'Maybe'"
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
    assert r.stderr.splitlines()[-1] == f"fix: no such file or folder: {Path('no-such-model').absolute()}"


def test_check_names_a_missing_folder_before_probing_the_machine(monkeypatch):
    import sys

    import vramguard.check  # noqa: F401
    chk = sys.modules["vramguard.check"]  # the package (vramguard.check is also its function's name)

    def probe():
        raise AssertionError("probed before the model was read")
    monkeypatch.setattr(chk, "probe_env", probe)
    r = run_cli("check", "./no-such-model", columns="300")
    assert r.returncode == 3 and r.stdout == "" and r.stderr.splitlines()[-1] == (
        f"fix: no such file or folder: {Path('no-such-model').absolute()}")


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


@pytest.mark.parametrize("args", [("plan", "llama-3.1-8b", "--gpu", "t4"),
                                  ("plan", "llama-3.1-70b", "--gpu", "t4", "--exit-code"),  # would exit 1
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


def test_tp_with_nf4_is_a_usage_error_naming_both_options():
    # no card named and none detected: the two options that do not go together are said first, as exit 2
    lines = _only_error(run_cli("plan", "llama-3.1-8b", "--tp", "2", columns="300"), "--quant + --tp")
    assert lines == ["error --quant + --tp: 'nf4 with --tp 2' is not valid; accepted: bf16, fp16 or fp32 weights "
                     "with tensor parallelism (transformers' tp_plan='auto').",
                     "fix: pass --quant bf16 with --tp 2, or split the nf4 model's layers over the cards instead "
                     "(--gpus 2 in place of --tp 2)"]
    assert _only_error(run_cli("plan", "llama-3.1-8b", "--tp", "2", "--gpu", "h100"), "--quant + --tp")
    from vramguard.errors import InvalidValue
    from vramguard.plan.multigpu.tensorparallel import check_tp_quant
    from vramguard.settings import Settings
    check_tp_quant(Settings(quant="bf16"), 2)  # 16-bit weights and no tp with nf4 pass
    check_tp_quant(Settings(quant="nf4"), None)
    with pytest.raises(InvalidValue) as e:
        check_tp_quant(Settings(quant="int8"), 4)
    assert (e.value.field, e.value.value, e.value.exit_code) == ("quant + tp", "int8 with tp=4", 2)


def test_plan_without_a_model_asks_for_one_with_examples():
    lines = _only_error(run_cli("plan", columns="300"), "MODEL")
    assert lines == ["error MODEL: 'none given' is not valid; accepted: a model folder, its config.json, a catalog "
                     "name or a Hub id.",
                     "fix: name the model to plan, e.g. vramguard plan meta-llama/Llama-3.1-8B-Instruct, vramguard "
                     "plan ./my-model or vramguard plan llama-3.1-8b (vramguard plan --list-models lists the "
                     "catalog)"]
    assert _only_error(run_cli("plan", "--engine", "vllm", "--gpu", "h100", columns="300"), "MODEL")
    assert run_cli("plan", "--list-gpus").returncode == 0  # the listings need no model


@pytest.mark.parametrize("args,flag,text,value", [
    (("--vram", "24TB"), "--vram", "24TB", 24 * 10**12),
    (("--vram", "24GiB,30TB"), "--vram", "30TB", 30 * 10**12),
    (("--gpus", "2", "--gpu", "h100", "--max-memory", "300GiB"), "--max-memory", "300GiB", 300 * 2**30),
])
def test_a_size_above_any_card_is_refused_before_any_note(args, flag, text, value):
    lines = _only_error(run_cli("plan", "llama-3.1-8b", *args, columns="300"), flag)
    # 288 GB = 288 x 10**9 B = 268.22 GiB: NVIDIA's B300, the largest memory of one GPU
    assert lines == [f"error {flag}: {text!r} is not valid; accepted: at most 288 GB (268.22 GiB) per card, the "
                     "memory of the largest GPU sold (NVIDIA B300).",
                     f"fix: {text} is {value:,} B: give the memory of one card, such as "
                     f"{'30GiB' if flag == '--max-memory' else '24GiB'}"]


def test_card_size_bound_is_inclusive_and_applies_to_budgets():
    from vramguard.errors import InvalidValue
    from vramguard.units import MAX_CARD_BYTES, parse_card_size
    assert parse_card_size("288GB") == MAX_CARD_BYTES == 288_000_000_000
    with pytest.raises(InvalidValue):
        parse_card_size("288000000001B")
    lines = _only_error(run_cli("serve", "/no/such/folder", "--vram-budget", "1TB", columns="300"),
                        "--vram-budget")
    assert lines[1] == "fix: 1TB is 1,000,000,000,000 B: give the memory of one card, such as 24GiB"


class _TemplateTokenizer:
    """A tokenizer whose chat template would turn even an empty text into a prompt of several ids."""

    chat_template = "{{ messages }}"

    def apply_chat_template(self, messages, **kwargs):
        return "<|user|>" + messages[0]["content"] + "<|assistant|>"

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": list(range(len(text)))}


@pytest.mark.parametrize("text", ["", "  \n"])
def test_an_empty_prompt_is_refused_by_the_library_and_the_cli(text, tiny_llama, tmp_path):
    from vramguard.errors import InvalidValue
    from vramguard.run.prompt import prepare_prompt
    assert len(prepare_prompt(_TemplateTokenizer(), "hi").ids) == 23  # <|user|> 8 + hi 2 + <|assistant|> 13
    with pytest.raises(InvalidValue) as e:
        prepare_prompt(_TemplateTokenizer(), text)  # the template alone would have been 21 ids of no prompt
    assert (e.value.field, e.value.value) == ("prompt", text)
    lines = _only_error(run_cli("run", str(tiny_llama), "--prompt", text, columns="300"), "--prompt")
    assert lines == [f"error --prompt: {text!r} is not valid; accepted: text with at least one character other "
                     "than white space.", "fix: pass the text to answer, e.g. --prompt 'Hello'"]
    (tmp_path / "p.txt").write_text(text)
    lines = _only_error(run_cli("run", str(tiny_llama), "--prompt-file", str(tmp_path / "p.txt"), columns="300"),
                        "--prompt-file")
    assert lines[1] == "fix: write the prompt into the file, or pass --prompt TEXT"


@pytest.fixture(scope="module")
def no_tokenizer(tiny_llama, tmp_path_factory):
    """The tiny Llama's config and weights, without its tokenizer files."""
    import shutil
    folder = tmp_path_factory.mktemp("first_hour") / "no_tokenizer"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_llama / name, folder / name)
    return folder


def test_run_without_a_tokenizer_says_what_is_missing_and_the_fix(no_tokenizer):
    r = run_cli("run", str(no_tokenizer), "--prompt", "hi", columns="400")
    assert r.returncode == 3 and r.stdout == "", r.stderr
    assert r.stderr.splitlines() == [
        f"error MODEL: {str(no_tokenizer)!r} is not valid; accepted: a model folder with tokenizer files.",
        "fix: the folder has no tokenizer files (no tokenizer.json, tokenizer_config.json or vocabulary file): save "
        "the tokenizer of the checkpoint these weights come from into the folder "
        "(AutoTokenizer.from_pretrained(ID).save_pretrained(folder)); vramguard.generate takes token ids without one"]


def test_a_tokenizer_transformers_cannot_read_keeps_its_whole_error_on_one_line(tmp_path):
    from vramguard.runtime.tokenizer import ERROR_CHARS, load_failure
    (tmp_path / "tokenizer.json").write_text("{")
    long = ValueError("Couldn't instantiate the backend tokenizer from one of:\n(1) a `tokenizers` library "
                      "serialization file,\n(2) a slow tokenizer instance to convert" + " or more" * 60)
    why = load_failure(tmp_path, long)
    assert why.startswith("transformers could not load the tokenizer files it has (ValueError: Couldn't "
                          "instantiate the backend tokenizer from one of: (1) a `tokenizers` library serialization "
                          "file, (2) a slow")
    assert "\n" not in why and why.endswith(" ...)") and len(why) <= ERROR_CHARS + 80


def test_check_names_a_missing_tokenizer_as_a_finding(no_tokenizer, tiny_llama):
    f = _findings(run_cli("check", str(no_tokenizer), "--no-verify", "--format", "json"))["tokenizer"]
    assert (f["level"], f["value"]) == ("warn", "none in the folder")
    assert f["message"].startswith("the folder has no tokenizer files") and "save_pretrained(folder)" in f["fix"]
    f = _findings(run_cli("check", str(tiny_llama), "--no-verify", "--format", "json"))["tokenizer"]
    assert (f["level"], f["message"]) == ("ok", "no chat template (raw prompts)")
    assert f["value"].endswith(", 300 tokens")  # the word-level tokenizer of vocab_size=300


def test_a_misspelt_field_is_an_unknown_parameter_not_a_missing_one():
    pytest.importorskip("fastapi")
    from vramguard.serve.apierrors import ApiError
    from vramguard.serve.schemas import ChatRequest, CompletionRequest
    from vramguard.serve.validate import to_request
    with pytest.raises(ApiError) as e:  # "promt" is unknown and "prompt" missing: the unknown name is the fix
        to_request({"model": "tiny", "promt": "hi"}, CompletionRequest)
    body = e.value.body()["error"]
    assert (e.value.status, body["code"], body["param"]) == (400, "unknown_parameter", "promt")
    assert body["message"].startswith('"promt": unknown parameter (did you mean "prompt"?); accepted: model, ')
    with pytest.raises(ApiError) as e:
        to_request({"model": "tiny", "mesages": [{"role": "user", "content": "hi"}]}, ChatRequest)
    assert e.value.message.startswith('"mesages": unknown parameter (did you mean "messages"?); accepted: ')
    with pytest.raises(ApiError) as e:  # nothing close: no guess
        to_request({"model": "tiny", "prompt": "hi", "zzz": 1}, CompletionRequest)
    assert e.value.message.startswith('"zzz": unknown parameter; accepted: model, ')
    with pytest.raises(ApiError) as e:  # a field really missing is still said as missing
        to_request({"model": "tiny"}, CompletionRequest)
    assert (e.value.param, e.value.code) == ("prompt", "invalid_value") and "Field required" in e.value.message


def test_serve_log_lines_wrap_at_120_columns_under_their_time():
    import logging

    from vramguard.serve.access import LOG_COLUMNS, WrappedFormatter
    words = ", ".join(f"field_{i}" for i in range(40))  # 40 names: 398 characters
    record = logging.LogRecord("vramguard.serve", logging.WARNING, __file__, 1, "refused (400 x): %s", (words,), None)
    lines = WrappedFormatter().format(record).splitlines()
    assert LOG_COLUMNS == 120 and len(lines) == 4 and all(len(x) <= 120 for x in lines)
    assert re.fullmatch(r"\d\d:\d\d:\d\d refused \(400 x\): field_0, .*", lines[0])
    assert all(x.startswith(" " * 11) and x[11] != " " for x in lines[1:])  # "HH:MM:SS " + 2: under the text
    assert " ".join(x.strip() for x in lines).split(" ", 1)[1] == "refused (400 x): " + words
    record.args = ("short",)
    assert len(WrappedFormatter().format(record).splitlines()) == 1
    path = "/very/long/" + "x" * 150  # a word longer than the line is kept whole, on its own line
    record.args = (path,)
    assert path in WrappedFormatter().format(record).splitlines()[1]


def test_oom_log_continuation_lines_are_indented_under_their_item():
    r = run_cli("oom-log", "--file", "tests/data/oomlog/cgroup_6.5_dmesg_T.log", "--year", "2024", columns="80")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert max(map(len, lines)) <= 80
    at = lines.index("  memory at death: RSS 15.93 GiB, anon 15.91 GiB, file 24.00 MiB, shmem 0 B,")
    assert lines[at + 1] == "    virtual 37.68 GiB, page tables 32.54 MiB"
    # every line of a kill is its heading, an item at 2 spaces, or an item's continuation at 4: none at column 0
    body = lines[2:]
    assert all(x.startswith("  ") for x in body), [x for x in body if not x.startswith("  ")]
    assert [x for x in body if x.startswith("    ")] == [lines[at + 1], "    16.00 GiB; python held 15.93 GiB",
                                                          "    resources.limits.memory), or load with less RAM: "
                                                          "shards smaller than the",
                                                          "    limit, device_map={'': 0} so weights go straight to "
                                                          "the GPU"]


def test_oom_log_since_counts_the_lines_of_its_window(tmp_path):
    log = tmp_path / "kern.log"
    log.write_text("".join(f"{t} host kernel: line {i}\n" for i, t in enumerate(
        ["2026-11-29T22:41:07+0000"] * 3 + ["2026-11-30T10:00:00+0000"] * 2)) + "[   12.5] raw dmesg line\n")
    r = run_cli("oom-log", "--file", str(log), "--since", "2026-11-30T00:00+00:00", columns="300")
    assert r.returncode == 0, r.stderr
    # 6 lines read: 3 on the 29th (before the window), 2 on the 30th (in it), 1 with seconds since boot only
    assert r.stdout.splitlines() == [f"no OOM-killer record in {log} since 2026-11-30T00:00+00:00 (2 lines since "
                                     "then, of 6 read; 1 line without a date)"]
    r = run_cli("oom-log", "--file", str(log), columns="300")
    assert r.stdout.splitlines() == [f"no OOM-killer record in {log} (6 lines)"]


def test_vllm_tensor_parallel_sizes_are_every_divisor_that_meets_its_rules():
    from dataclasses import replace

    from vramguard.engines.vllm_weights import check_tensor_parallel, tensor_parallel_sizes
    from vramguard.errors import InvalidValue
    from vramguard.resolve import resolve_model
    qwen = resolve_model("qwen2.5-7b")
    # 28 heads: 7 and 14 are over the 4 KV heads and no multiples of 4; 28 is, but 18,944 = 2**9 x 37 is not
    # divisible by 7
    assert tensor_parallel_sizes(qwen) == [1, 2, 4]
    # 32 heads, 8 KV heads, MLP 14,336 = 2**11 x 7, vocabulary 128,256 = 2**8 x 501: every power of two to 32
    assert tensor_parallel_sizes(resolve_model("llama-3.1-8b")) == [1, 2, 4, 8, 16, 32]
    # GPT-2's shape: 12 heads (no GQA), MLP 3,072 = 2**10 x 3, vocabulary 50,257 padded to 50,304 = 2**7 x 3 x 131:
    # 3, 6 and 12 divide all of them
    gpt2 = replace(qwen, num_heads=12, num_kv_heads=12, intermediate_size=3072, vocab_size=50257)
    assert tensor_parallel_sizes(gpt2) == [1, 2, 3, 4, 6, 12]
    for tp in tensor_parallel_sizes(gpt2):
        check_tensor_parallel(gpt2, tp)
    with pytest.raises(InvalidValue) as e:
        check_tensor_parallel(gpt2, 5)
    assert e.value.fix == "pass tensor_parallel_size=1, 2, 3, 4, 6 or 12"  # every divisor of 12 works


@pytest.mark.parametrize("args,lines", [
    (("plan", "llama-3.1-8b", "--prompt-tokens", "abc"),
     ["error --prompt-tokens: 'abc' is not valid; accepted: an integer.",
      "fix: pass --prompt-tokens with an integer (`vramguard plan --help`)"]),
    (("plan", "llama-3.1-8b", "--gpu-memory-utilization=x"),
     ["error --gpu-memory-utilization: 'x' is not valid; accepted: a number.",
      "fix: pass --gpu-memory-utilization with a number (`vramguard plan --help`)"]),
    (("plan", "llama-3.1-8b", "--quant", "int3"),
     ["error --quant: 'int3' is not valid; accepted: nf4, fp4, int8, bf16, fp16, fp32.",
      "fix: pass one of them, e.g. --quant nf4"]),
    (("plan", "llama-3.1-8b", "--no-exit-code"),
     ["error OPTION: '--no-exit-code' is not valid; accepted: an option of vramguard plan (`vramguard plan --help` "
      "lists them).", "fix: did you mean --exit-code?"]),
    (("plan", "llama-3.1-8b", "--prompt-tokens"),
     ["error --prompt-tokens: 'none given' is not valid; accepted: a value after the option.",
      "fix: pass --prompt-tokens VALUE (`vramguard plan --help` says which values)"]),
    (("run",), ["error MODEL: 'none given' is not valid; accepted: a MODEL (`vramguard run --help` says which).",
                "fix: pass it: vramguard run MODEL ..."]),
    (("plan", "llama-3.1-8b", "24", "GB"),
     ["error ARGUMENT: '24 GB' is not valid; accepted: the arguments of vramguard plan (`vramguard plan --help`).",
      "fix: quote a value that holds spaces, and give each option its name"]),
    (("nosuch",), ["error COMMAND: 'nosuch' is not valid; accepted: plan, check, oom-log, explain, profile, fit, run, "
                   "serve, export.", "fix: see `vramguard --help` for what each does"]),
])
def test_click_usage_errors_read_as_vramguard_errors(args, lines):
    r = run_cli(*args, columns="300")
    assert (r.returncode, r.stdout) == (2, ""), r.stderr
    assert r.stderr.splitlines() == lines


def test_plan_attention_default_follows_the_card_and_says_when_none_is_named():
    from vramguard.hardware import card_defaults
    attn, dtype, notes = card_defaults(None, None, None, False)
    assert (attn, dtype) == ("sdpa", None) and len(notes) == 1 and "FlashAttention-2 is not assumed" in notes[0]
    assert card_defaults(None, "flash_attention_2", None, False) == ("flash_attention_2", None, [])  # given: kept
    assert card_defaults("rtx-4090", None, None, False) == ("flash_attention_2", None, [])  # 8.9: the loader's FA2
    assert card_defaults("t4", None, None, False)[:2] == ("sdpa", "fp16")  # 7.5: no FA2, no native bf16
    r = run_cli("plan", "llama-3.1-8b", columns="300")
    assert r.returncode == 0 and "attention sdpa," in r.stdout
    assert r.stderr.splitlines() == ["note: attention sdpa (transformers' default): no card named, so "
                                     "FlashAttention-2 is not assumed; --gpu NAME plans the card's default, --attn "
                                     "flash_attention_2 plans it"]


def test_export_concurrency_has_thousands_separators():
    args = ("llama-3.2-1b", "--gpu", "h200", "--max-model-len", "1024")
    kv = json.loads(run_cli("plan", *args, "--engine", "vllm", "--format", "json").stdout)["kv_cache"]
    # 248,583 blocks of 16 tokens for 16 layers: 3,977,328 tokens, over 1,024 tokens per request 3,884.11 requests
    assert (kv["num_blocks"] * 16, kv["kv_tokens"]) == (kv["kv_tokens"], int(kv["max_concurrency"] * 1024))
    assert kv["max_concurrency"] >= 1000  # a figure with a thousands separator to print
    r = run_cli("export", *args, "--to", "vllm", columns="300")
    assert r.returncode == 0, r.stderr
    assert (f"planned: GPU KV cache size {kv['kv_tokens']:,} tokens, maximum concurrency {kv['max_concurrency']:,.2f}x "
            "for 1,024 tokens per request") in r.stderr
    assert f"{kv['max_concurrency']:,.2f}".count(",") == 1


def test_kubernetes_memory_limit_holds_the_checkpoint_while_loading():
    from vramguard.engines.vllm import VllmSettings, plan_vllm
    from vramguard.export import HOST_MEMORY_BYTES, host_memory_bytes, kubernetes
    from vramguard.hardware import gpu_from_catalog
    from vramguard.resolve import resolve_model
    p = plan_vllm(resolve_model("llama-3.1-8b"), gpu_from_catalog("h100"), VllmSettings(max_model_len=8192))
    # Llama-3.1-8B in bf16: 32 layers x 436,224,000 B + embeddings and LM head 2 x 128,256 x 4,096 x 2 B + final norm
    # 8,192 B = 16,060,522,496 B (its safetensors), then the engine's 16 GiB: 33,240,391,680 B = 31,700.5 MiB
    assert p.checkpoint_bytes == 32 * 436_224_000 + 2 * 128_256 * 4_096 * 2 + 8_192 == 16_060_522_496
    assert host_memory_bytes(p) == HOST_MEMORY_BYTES + 16_060_522_496 == 33_240_391_680
    dep, _ = kubernetes(p, "meta-llama/Llama-3.1-8B-Instruct")
    assert dep["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["memory"] == "31701Mi"


@pytest.mark.parametrize("name,says", [
    ("llama-3.1-8b", "catalog: the config of meta-llama/Llama-3.1-8B-Instruct, an instruction-tuned checkpoint"),
    ("gemma-2-9b", "catalog: the config of google/gemma-2-9b-it, an instruction-tuned checkpoint"),
    ("mistral-7b-v0.1", "catalog: the config of mistralai/Mistral-7B-v0.1, a base checkpoint"),
])
def test_a_catalog_name_says_which_checkpoint_it_plans(name, says):
    r = run_cli("plan", name, "--gpu", "h100", columns="300")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == f"vramguard plan - {name}  ({says}; pass a Hub id for another)"
    r = run_cli("plan", name, "--gpus", "2", "--gpu", "h100", columns="300")
    assert r.stdout.splitlines()[1] == f"({says}; pass a Hub id for another)"


def test_cublas_not_initialized_is_explained_as_a_shortage_but_not_retried():
    pytest.importorskip("torch")
    from vramguard.explain import explain
    from vramguard.runtime.device import OOM_MARKERS, is_oom
    text = "RuntimeError: CUDA error: CUBLAS_STATUS_NOT_INITIALIZED when calling `cublasCreate(handle)`"
    assert explain(text).kind == "cublas_alloc"  # a person is told the likely shortage
    assert not is_oom(RuntimeError(text))  # a run does not retry on it: it can be a driver or context fault
    assert is_oom(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"))
    assert "CUBLAS_STATUS_NOT_INITIALIZED" not in " ".join(OOM_MARKERS)


def test_check_says_the_verbs_set_expandable_segments_themselves(monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    r = run_cli("check", "--format", "json", columns="300")
    f = _findings(r)["PYTORCH_CUDA_ALLOC_CONF"]
    assert (f["level"], f["value"]) == ("info", "unset")
    assert "vramguard run, profile, fit and serve turn them on for their own process" in f["message"]
    assert f["fix"] == "for your own scripts only: export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
