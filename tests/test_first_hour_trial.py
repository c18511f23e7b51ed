"""The second new-user trial's items, each refused or said as a new user expects: options that do not go together,
a plan without a model, sizes above any card, an empty prompt, a folder without a tokenizer, the server's field
errors and log lines, oom-log's wrapping and window, vLLM's tensor-parallel sizes, click's own usage errors, the
plan's attention and source, the pod's memory, and where ``is_oom`` and ``explain`` differ; then the next trial's:
a second card as the two-card plan splits it, card tables whole at 80 columns, a batch above the search's cap, the
choices of a missing option, the seed's range, a GGUF command on one line, a tiny model's KV warning, check's dtype
reason and wrapped lines, and a mistyped option's one suggestion."""

import json
import re

import pytest

from conftest import run_cli
from test_first_hour import _findings, _only_error, tiny_llama  # noqa: F401 (tiny_llama: a fixture)

pytestmark = pytest.mark.usefixtures("shared_plans")  # the same plans asked for again and again: each computed once


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
    # one swap from --vram, far from --format (which click also finds close): only --vram is suggested
    (("plan", "llama-3.1-8b", "--vrma", "24GiB"),
     ["error OPTION: '--vrma' is not valid; accepted: an option of vramguard plan (`vramguard plan --help` lists "
      "them).", "fix: did you mean --vram?"]),
    # a required option of choices lists them (typer's parameter carries no click type: read from the command)
    (("fit", "llama-3.2-1b"), ["error --vary: 'none given' is not valid; accepted: prompt, new-tokens, batch.",
                               "fix: pass one of them, e.g. vramguard fit ... --vary prompt"]),
    (("export", "llama-3.2-1b"), ["error --to: 'none given' is not valid; accepted: vllm, ray-serve, kserve, "
                                  "kubernetes.", "fix: pass one of them, e.g. vramguard export ... --to vllm"]),
    # the seed's range, from the library's own check, whether the value is out of it or no integer at all
    (("run", "no-such-folder", "--prompt", "hi", "--seed", "-1"),
     ["error --seed: -1 is not valid; accepted: an integer from 0 to 9,223,372,036,854,775,807 (2**63 - 1).",
      "fix: pass a seed from 0 to 2**63 - 1, e.g. --seed 0"]),
    (("run", "no-such-folder", "--seed", "abc"),
     ["error --seed: 'abc' is not valid; accepted: an integer from 0 to 9,223,372,036,854,775,807 (2**63 - 1).",
      "fix: pass a whole number in that range, e.g. --seed 0"]),
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
    r = run_cli("plan", name, "--gpu", "h100", "--alloc-conf", "formula", columns="300")  # the header is the subject
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


def test_batch_at_the_solvers_cap_is_said_as_a_bound(tiny_llama):
    from vramguard.plan.solve import MAX_BATCH_SEARCH
    assert MAX_BATCH_SEARCH == 65_536  # 1 << 16
    r = run_cli("plan", str(tiny_llama), "--vram", "48GiB", "--format", "json")
    assert r.returncode == 0, r.stderr
    card = json.loads(r.stdout)["cards"][0]
    # a 0.78 GiB need on 48 GiB: the search stops at its cap, and the JSON says so
    assert (card["max_batch"], card["max_batch_search_cap"], card["max_batch_at_cap"]) == (65_536, 65_536, True)
    text = run_cli("plan", str(tiny_llama), "--vram", "48GiB", columns="200").stdout
    assert re.search(r"48 GiB card .* yes .* ≥65,536\n", text), text
    assert "batch: ≥65,536 is the search's cap; a larger batch may fit too (plan it with --batch N)" in text
    # a batch asked above the cap that fits is searched up to: the table says that batch, not the cap below it
    r = run_cli("plan", str(tiny_llama), "--vram", "48GiB", "--batch", "100000", "--format", "json")
    card = json.loads(r.stdout)["cards"][0]
    assert (card["max_batch"], card["max_batch_search_cap"], card["max_batch_at_cap"]) == (100_000, 100_000, True)
    text = run_cli("plan", str(tiny_llama), "--vram", "48GiB", "--batch", "100000", columns="200").stdout
    assert re.search(r"48 GiB card .* yes .* ≥100,000\n", text) and "65,536" not in text, text
    assert "batch: ≥100,000 is the batch asked; a larger batch may fit too (plan it with --batch N)" in text
    small = json.loads(run_cli("plan", str(tiny_llama), "--vram", "1GiB", "--format", "json").stdout)["cards"][0]
    assert small["max_batch_at_cap"] is False and 1 <= small["max_batch"] < 65_536


@pytest.fixture(scope="module")
def gpt2_256(tmp_path_factory):
    pytest.importorskip("torch")
    from conftest import save_tiny
    folder, _ = save_tiny(tmp_path_factory.mktemp("gpt2_256"), "GPT2Config", n_embd=64, n_layer=2, n_head=4,
                          vocab_size=256, n_positions=256)
    return folder


def test_default_lengths_are_fitted_into_a_short_context_and_said(gpt2_256):
    r = run_cli("plan", str(gpt2_256), "--max-new-tokens", "64", "--format", "json")
    assert r.returncode == 0, r.stderr  # a length given: the defaults are not touched (128 + 64 fits 256)
    assert "default --prompt-tokens" not in r.stderr
    r = run_cli("plan", str(gpt2_256), "--format", "json", columns="300")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)["settings"]
    # 128 + 256 = 384 > 256: prompt 256 // 3 = 85, new 2 x 85 = 170 (85 + 170 = 255 <= 256)
    assert (s["prompt_tokens"], s["max_new_tokens"]) == (85, 170)
    assert ("note: the default --prompt-tokens 128 + --max-new-tokens 256 exceed the model's context of 256 tokens; "
            "planned with 85 + 170 (a third and two thirds of it); pass --prompt-tokens and --max-new-tokens to "
            "choose") in r.stderr.splitlines()
    lines = _only_error(run_cli("plan", str(gpt2_256), "--prompt-tokens", "128", columns="300"),
                        "--prompt-tokens + --max-new-tokens")
    assert lines[0].startswith("error --prompt-tokens + --max-new-tokens: '128 + 256 = 384' is not valid")


def test_generic_peak_is_named_by_the_module_not_the_operator(gpt2_256):
    r = run_cli("plan", str(gpt2_256), "--max-new-tokens", "64", columns="200")
    assert r.returncode == 0, r.stderr
    assert "aten." not in r.stdout
    # GPT-2's prefill peaks in its MLP (the GELU's products); the replay's label of that allocation is activations
    assert "Memory at the peak of generate: prefill, in the MLP / hidden states" in r.stdout
    from vramguard.cli.render import _where
    assert (_where("in_attention"), _where("in_logits"), _where("prod")) == (
        "in attention", "in lm_head / logits", "MLP (activation x up projection)")


def test_plan_refuses_zero_new_tokens_as_run_does(tiny_llama):
    lines = _only_error(run_cli("plan", str(tiny_llama), "--max-new-tokens", "0", columns="300"), "--max-new-tokens")
    assert lines == ["error --max-new-tokens: 0 is not valid; accepted: an integer >= 1.",
                     "fix: pass a whole number of at least 1 (or --logits all for a forward without generating)"]
    # a forward over every position generates nothing: 0 new tokens stays accepted there
    r = run_cli("plan", str(tiny_llama), "--max-new-tokens", "0", "--logits", "all", "--format", "json")
    assert r.returncode == 0 and json.loads(r.stdout)["settings"]["max_new_tokens"] == 0, r.stderr


def test_changes_that_fit_come_first_then_by_saving():
    r = run_cli("plan", "llama-3.1-8b", "--context", "1000000", "--prompt-tokens", "500000", "--vram", "24GiB",
                "--format", "json")
    assert r.returncode == 0, r.stderr
    changes = json.loads(r.stdout)["changes"]
    keep = [c for c in changes if not c["reduces_request"]]
    fitting = [c for c in keep if c["fits_on"]]
    assert changes[:len(fitting)] == fitting  # those that fit as asked lead
    rest = keep[len(fitting):]
    assert [c["saved_bytes"] for c in rest] == sorted((c["saved_bytes"] for c in rest), reverse=True)
    names = [c["description"].split(":")[0] for c in changes]
    second = names.index("a second 24 GiB card")
    # the second card fits no card (each would still hold half of a 500,000-token KV cache), and saves less
    # than offloading the KV cache, which now comes first
    assert changes[second]["fits_on"] == []
    assert changes[0]["description"].startswith("KV cache offloaded to CPU RAM (OffloadedCache: up to ")
    assert changes[0]["description"].endswith(" GiB of CPU RAM)")  # 500,000 tokens of Llama-3.1-8B's KV cache
    assert changes[0]["saved_bytes"] > changes[second]["saved_bytes"]
    assert changes[-1]["reduces_request"] and changes[-1]["fits_on"] == ["24-gib-card"]


def test_vllm_plan_says_no_kv_cache_instead_of_a_negative_size():
    r = run_cli("plan", "llama-3.1-70b", "--engine", "vllm", "--gpu", "rtx-4090", columns="300")
    out = r.stdout + r.stderr
    # budget 21.14 GiB - weights 131.45 - activation 0.52 (the sampler, with the Triton kernel's buffer of 128 SMs x
    # 128,256 x 4 B) - non-torch 0.25 - CUDA graphs 0.20 = -111.29 GiB
    assert ("= KV cache    none: the terms above exceed the budget by 111.29 GiB ('Available KV cache memory' "
            "below zero)") in out
    assert "-111.29" not in out


def test_a_second_card_fits_only_when_the_two_card_plan_fits():
    """Llama-3.1-70B NF4 on an RTX 4090: device_map='auto' puts layers 0-35 and the input embeddings on card 0,
    36-79 and lm_head on card 1, so card 1 holds more than half. At a 4,072-token prompt half of the model on each
    card would fit (the old suggestion), but the two-card plan's card 1 is short: the suggestion must say no."""
    from vramguard.plan import plan
    from vramguard.plan.multigpu import plan_gpus
    from vramguard.settings import Settings
    for prompt, fits in ((4071, True), (4072, False)):  # 4,071: the two-card plan's largest prompt
        p = plan("llama-3.1-70b", Settings(prompt_tokens=prompt), gpu="rtx-4090",
                 alloc_conf=None)  # the formula, as the changes
        card, est = p.cards[0], p.estimate
        second = next(c for c in p.changes if c.settings == {"gpus": 2})
        two = plan_gpus(p.model, p.settings, gpus=[card.gpu, card.gpu], solve=False)
        needs = [c.need_bytes for c in two.cards]
        assert two.fits is fits and second.fits_on == (("rtx-4090",) if fits else ())
        assert second.need_bytes == max(needs) == needs[1] and second.saved_bytes == est.device_used_bytes - needs[1]
        assert f"{needs[0] / 2**30:.2f} GiB on card 0 and {needs[1] / 2**30:.2f} GiB on card 1" in second.description
        even = est.device_used_bytes - (est.weights.total_bytes + est.kv_full.gpu_bytes) // 2
        assert even <= card.usable_bytes  # an even split would have said "fits" both times


@pytest.mark.parametrize("args", [
    # two 80 GiB cards, 120,000 tokens: needs of 130.01 GiB cut "fits" to "fi…" at 80 columns before
    ("llama-3.1-70b", "--quant", "bf16", "--vram", "80GiB,80GiB", "--prompt-tokens", "120000", "--context", "131072"),
    # 1,000,000 tokens x 64: needs of 33,944 GiB per card, five digits before the point
    ("llama-3.1-70b", "--quant", "bf16", "--vram", "80GiB,80GiB", "--prompt-tokens", "1000000", "--context",
     "1048576", "--batch", "64"),
    ("llama-3.1-70b", "--quant", "bf16", "--gpu", "rtx-6000-ada", "--prompt-tokens", "1000000", "--context",
     "1048576", "--batch", "64"),
])
def test_no_header_or_cell_of_the_card_tables_is_cut_at_80_columns(args):
    r = run_cli("plan", *args, columns="80")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "…" not in r.stdout and all(len(line) <= 80 for line in lines), max(lines, key=len)
    head = next(i for i, line in enumerate(lines) if line.split()[:1] == ["card"])
    assert lines[head].split()[-1] == ("fits" if "," in args[4] else "batch"), lines[head]
    from vramguard.cli.render import gib_cell
    # the first card's row holds its need whole, as the JSON has it
    card = json.loads(run_cli("plan", *args, "--format", "json").stdout)["cards"][0]
    row = lines[head + 2].split()
    assert row[-1 if "," in args[4] else -5] in ("yes", "no") and gib_cell(card["need_bytes"]) in row, row
    # 33,944.05 GiB: whole GiB with separators; below 1,000 GiB two decimals
    assert (gib_cell(int(33944.05 * 2**30)), gib_cell(int(999.99 * 2**30)), gib_cell(-int(1500 * 2**30))) == (
        "33,944", "999.99", "-1,500")


def test_missing_choices_come_from_a_click_choice_type_too():
    """The click package's options carry their Choice type (``type.choices``); typer's vendored one has none, and
    the choices come from the annotation of the command's function."""
    import enum
    from types import SimpleNamespace

    from vramguard.cli.usage import _choices

    class Color(enum.Enum):
        red = "red"
        blue = "blue"

    def command(color: Color) -> None: ...
    ctx = SimpleNamespace(command=SimpleNamespace(callback=command))
    assert _choices(SimpleNamespace(name="color", type=SimpleNamespace(choices=("a", "b"))), None) == ["a", "b"]
    assert _choices(SimpleNamespace(name="color"), ctx) == ["red", "blue"]
    assert _choices(SimpleNamespace(name="other"), ctx) == [] and _choices(SimpleNamespace(name="x"), None) == []


def test_a_line_of_code_in_a_library_text_stays_as_written():
    from vramguard.cli.flags import as_flags
    # the prose takes the CLI's words; the indented line of code keeps the library's keyword arguments
    assert as_flags("pass seed=0, e.g.:\n    generate(m, seed=0)") == "pass --seed 0, e.g.:\n    generate(m, seed=0)"


def test_the_kv_as_large_as_the_weights_warning_shows_a_tiny_models_real_sizes(tiny_llama):
    from vramguard.plan import plan
    from vramguard.settings import Settings
    p = plan(str(tiny_llama), Settings(prompt_tokens=768), vram="24GiB")
    # KV: 2 (K, V) x 2 layers x 2 KV heads x head_dim 16 x 2 B (bf16) x 1,024 tokens = 262,144 B = 256.00 KiB;
    # the weights are 159,232 B (155.50 KiB): both were "0.00 GiB"
    assert p.estimate.kv_full.gpu_bytes == 262_144 and p.estimate.weights.total_bytes == 159_232
    f = next(f for f in p.findings if f.code == "kv_as_large_as_weights")
    assert f.message == "the KV cache at 1,024 tokens (256.00 KiB) is as large as the weights (155.50 KiB)"
    # far above the weights, the ratio is said: 8,192 tokens are 2,097,152 B, 13.2 times 159,232 B
    big = plan(str(tiny_llama), Settings(prompt_tokens=7936), vram="24GiB", context=8192)
    f = next(f for f in big.findings if f.code == "kv_as_large_as_weights")
    assert f.message == "the KV cache at 8,192 tokens (2.00 MiB) is 13.2 times the weights (155.50 KiB)"


def test_check_says_why_a_dtype_nobody_passed_is_checked(tiny_llama):
    r = run_cli("check", str(tiny_llama), "--gpu", "t4", "--no-verify", "--format", "json")
    f = _findings(r)["param_dtype"]
    # the tiny model's checkpoint is float32: loaded narrower, said as info (tests/test_first_hour_findings.py)
    narrower = "; the float32 checkpoint is loaded in {}, not its own dtype: its weights are rounded to fewer"
    assert f["value"].startswith("fp16") and f["level"] == "info" and f["message"].startswith(
        "none given: vramguard run and serve pass fp16 to from_pretrained; bfloat16 is not native on compute "
        "capability 7.5 (t4); float16 is" + narrower.format("float16"))
    f = _findings(run_cli("check", str(tiny_llama), "--gpu", "a100-80gb", "--no-verify", "--format", "json"))
    assert f["param_dtype"]["message"].startswith("none given: vramguard run and serve pass bf16 to from_pretrained "
                                                  "(bfloat16 where the card supports it, else float16)"
                                                  + narrower.format("bfloat16"))
    # a dtype the user passes is said as passed
    f = _findings(run_cli("check", str(tiny_llama), "--gpu", "t4", "--dtype", "fp16", "--no-verify", "--format",
                          "json"))
    assert f["param_dtype"]["message"].startswith("--dtype fp16 passed to from_pretrained" + narrower.format("float16"))


def test_check_lines_that_wrap_stay_under_their_item(tiny_llama):
    r = run_cli("check", str(tiny_llama), "--gpu", "t4", "--no-verify", columns="80")
    lines = r.stdout.splitlines()
    body = lines[1:-1]  # between the title and the count of failures and warnings
    starts = ("OK   ", "WARN ", "FAIL ", "INFO ", "     ")
    assert body and all(line.startswith(starts) for line in body), [x for x in body if not x.startswith(starts)]
    # the card's line is longer than 80 columns: its continuation is indented under the check's name
    gpu = next(i for i, line in enumerate(lines) if line.startswith("OK   gpu: NVIDIA T4"))
    assert lines[gpu + 1].startswith("     ") and "measured)" in lines[gpu + 1]


def test_edit_distance_counts_a_swap_as_one_edit():
    from vramguard.cli.usage import _nearest, edit_distance
    # --vrma -> --vram: one swap (m, a); -> --format: 3 (v by f, insert o, insert t)
    assert (edit_distance("--vrma", "--vram"), edit_distance("abc", "abc"), edit_distance("", "ab")) == (1, 0, 2)
    assert edit_distance("--vrma", "--format") == 3 and edit_distance("kitten", "sitting") == 3
    assert _nearest("--vrma", ["--vram", "--format"]) == ["--vram"] and _nearest("--x", []) == []
