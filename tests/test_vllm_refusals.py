"""`plan --engine vllm` and `export`: the plans vLLM would not start with (a max_model_len above the model's, weights
that do not fit), the options only the transformers plan reads, the wrapped command, and local folders for targets
that run elsewhere."""

import json
import shlex
import shutil
import subprocess

import pytest
from conftest import run_cli

from vramguard.catalog.gpus import GPUS
from vramguard.engines.vllm import VllmSettings, plan_vllm
from vramguard.engines.vllm_text import plan_lines
from vramguard.export import export, kubernetes, ray_serve
from vramguard.hardware import gpu_from_catalog
from vramguard.resolve import resolve_model

QWEN = resolve_model("qwen2.5-7b")  # max_position_embeddings 32,768; 14.19 GiB of bf16 weights in vLLM
REF = "Qwen/Qwen2.5-7B-Instruct"
LONG = "VLLM_ALLOW_LONG_MAX_MODEL_LEN"


def test_max_model_len_above_the_model_is_refused_unless_allowed():
    p = plan_vllm(QWEN, gpu_from_catalog("h100"), VllmSettings(max_model_len=1_000_000))
    assert p.refused_by == "max_model_len_limit" and not p.starts and p.env() == {}
    assert "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1" in p.refusal
    ok = plan_vllm(QWEN, gpu_from_catalog("h100"), VllmSettings(max_model_len=1_000_000,
                                                                  allow_long_max_model_len=True))
    assert ok.starts and ok.env() == {LONG: "1"}
    assert export(ok, REF, "vllm").startswith(f"{LONG}=1 vllm serve {REF} ")
    container = kubernetes(ok, REF)[0]["spec"]["template"]["spec"]["containers"][0]
    assert {"name": LONG, "value": "1"} in container["env"]
    assert ray_serve(ok, REF)["applications"][0]["args"]["llm_configs"][0]["runtime_env"] == {
        "env_vars": {LONG: "1"}}
    # at the model's own length nothing is needed, allowed or not
    assert plan_vllm(QWEN, gpu_from_catalog("h100"), VllmSettings(allow_long_max_model_len=True)).env() == {}


def test_cli_export_refuses_a_long_max_model_len_and_sets_the_variable_when_the_user_did(monkeypatch):
    args = ("export", "qwen2.5-7b", "--to", "vllm", "--gpu", "h100", "--max-model-len", "1000000")
    monkeypatch.delenv(LONG, raising=False)
    r = run_cli(*args)
    assert r.returncode == 4 and r.stdout == ""
    assert "error --max-model-len: 1000000" in r.stderr and "at most 32,768" in r.stderr
    monkeypatch.setenv(LONG, "1")
    r = run_cli(*args)
    assert r.returncode == 0 and r.stdout.startswith(f"{LONG}=1 vllm serve {REF}")
    assert f"note: {LONG}=1 is set in this environment" in r.stderr


def test_weights_above_the_card_fail_at_load_with_fixes_that_fit():
    p = plan_vllm(QWEN, gpu_from_catalog("rtx-3060-12gb"))  # 11.74 GiB card: 14.19 GiB of weights do not load
    assert p.refused_by == "weights_load" and p.refusal.startswith("CUDA out of memory while loading the weights")
    # TP 2 (4 KV heads, 28 query heads: 2 divides both) halves the layers: 7.36 GiB per GPU under 10.57 GiB
    assert p.fit_tp.settings.tensor_parallel_size == 2 and p.fit_tp.starts
    # budgets at 0.9 of the cards above 11.74 GiB: rtx-3080-ti 10.59, t4 13.28, rtx-5080 13.92, rtx-4060-ti-16gb 13.99,
    # rtx-4070-ti-super 14.04, rtx-4080 14.11, v100-16gb 14.18 GiB, all under 14.19 GiB of weights; a10 (21.99 GiB)
    # gives 19.79 GiB
    assert p.fit_card.gpu.name == "a10" and p.fit_card.starts
    smaller = [g for g in GPUS.values() if p.total_bytes < g.total_bytes < p.fit_card.total_bytes]
    assert [g.name for g in sorted(smaller, key=lambda g: g.total_bytes)] == [
        "rtx-3080-ti", "t4", "rtx-5080", "rtx-4060-ti-16gb", "rtx-4070-ti-super", "rtx-4080", "v100-16gb"]
    assert all(plan_vllm(QWEN, g).refused_by in ("weights_load", "weights_budget") for g in smaller)
    fix = [x for x in plan_lines(p, REF) if x.startswith("fix:")]
    assert len(fix) == 1 and "tensor_parallel_size=2 (" in fix[0] and "catalog's a10" in fix[0]
    assert "quantized checkpoint" in fix[0] and "max_num_batched_tokens" not in fix[0]


def test_weights_above_the_budget_but_not_the_card_suggest_no_batched_tokens():
    p = plan_vllm(QWEN, gpu_from_catalog("v100-16gb"))  # 14.19 GiB of weights, budget 0.9 x 15.75 = 14.18 GiB
    assert p.refused_by == "weights_budget" and p.refusal == "No available memory for the cache blocks"
    assert "max_num_batched_tokens" not in " ".join(plan_lines(p, REF))


def test_cli_70b_on_a_4090_names_the_weights_and_the_tp_that_fits():
    r = run_cli("plan", "llama-3.1-70b", "--engine", "vllm", "--gpu", "rtx-4090")
    out = " ".join(r.stdout.split())  # the lines are folded to the width
    assert r.returncode == 0
    assert "vLLM will refuse to start: CUDA out of memory while loading the weights (131.45 GiB per GPU" in out
    # TP 4: 33 GiB per GPU, over the 21.14 GiB budget; TP 8 (8 KV heads): 16.46 GiB; no catalog card at TP 1
    assert "--tp 8 (16.46 GiB of weights per GPU" in out and "no catalog card holds it" in out
    assert "--max-num-batched-tokens 1024" not in out
    r = run_cli("export", "llama-3.1-70b", "--to", "vllm", "--gpu", "rtx-4090")
    assert r.returncode == 4 and r.stdout == ""
    assert "error weights: '131.45 GiB per GPU'" in r.stderr and "--tp 8" in r.stderr
    assert "error --max-model-len" not in r.stderr


@pytest.mark.parametrize("option, instead", [
    (["--kv-dtype", "int4"], "--kv-cache-dtype"),
    (["--prompt-tokens", "4096"], "--max-model-len"), (["--batch", "8"], "--max-num-seqs"),
    (["--attn", "eager"], "leave --attn out"), (["--alloc-conf", "expandable_segments:True"], "leave --alloc-conf"),
    (["--freed-before"], "leave --freed-before")])
def test_transformers_options_are_refused_with_engine_vllm(option, instead):
    r = run_cli("plan", "qwen2.5-7b", "--engine", "vllm", "--gpu", "h100", *option)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith(f"error {option[0]}: ") and "transformers engine only" in r.stderr
    assert instead in " ".join(r.stderr.split())


def test_the_transformers_plan_still_takes_its_options():
    assert run_cli("plan", "qwen2.5-7b", "--gpu", "h100", "--quant", "nf4", "--batch", "8").returncode == 0


def test_cli_export_command_is_wrapped_and_joins_back_in_a_shell():
    r = run_cli("export", "qwen2.5-7b", "--to", "vllm", "--gpu", "h100", "--tp", "2", "--max-model-len", "16384",
                columns="80")
    assert r.returncode == 0
    lines = r.stdout.rstrip("\n").split("\n")
    assert len(lines) > 1 and all(len(x) <= 80 for x in lines)
    assert all(x.endswith(" \\") for x in lines[:-1]) and not lines[-1].endswith("\\")
    p = plan_vllm(QWEN, gpu_from_catalog("h100"), VllmSettings(tensor_parallel_size=2, max_model_len=16384))
    expected = shlex.split(export(p, REF, "vllm"))
    bash = shutil.which("bash")
    if bash:  # the shell joins the continuations: the same words as the one-line command
        script = 'vllm() { printf "%s\\n" vllm "$@"; }\n' + r.stdout
        assert subprocess.run([bash, "-c", script], capture_output=True, text=True,
                              check=True).stdout.splitlines() == expected
    assert shlex.split(r.stdout.replace("\\\n", " ")) == expected


def test_local_folder_is_refused_for_targets_that_run_elsewhere(tmp_path, monkeypatch):
    from transformers import LlamaConfig
    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=256, max_position_embeddings=512).save_pretrained(tmp_path / "tiny")
    monkeypatch.chdir(tmp_path)
    for to in ("kubernetes", "kserve", "ray-serve"):
        r = run_cli("export", "./tiny", "--to", to, "--gpu", "h100")
        assert r.returncode == 2 and r.stdout == "", to
        assert r.stderr.startswith("error MODEL: './tiny'") and "Hub id" in r.stderr
    r = run_cli("export", "./tiny", "--to", "vllm", "--gpu", "h100")  # a command for this machine: the path is right
    assert r.returncode == 0 and r.stdout.startswith("vllm serve ./tiny ")


def test_a_refused_plan_labels_its_command_and_a_load_failure_logs_no_kv_cache():
    """Llama-3.1-70B on one RTX 4090: vLLM stops while loading 131.45 GiB of weights, so it never logs a KV cache
    size; the command printed is the one planned, labelled as refused (it starts only after a fix)."""
    from conftest import run_cli
    r = run_cli("plan", "llama-3.1-70b", "--engine", "vllm", "--gpu", "rtx-4090", columns="80")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "vLLM will refuse to start: CUDA out of memory while loading the weights" in r.stdout
    assert "GPU KV cache size" not in r.stdout
    assert "command as planned (vLLM refuses it: apply a fix above first):" in r.stdout.splitlines()
    ok = run_cli("plan", "llama-3.1-8b", "--engine", "vllm", "--gpu", "h100", columns="80")
    assert "command:" in ok.stdout.splitlines() and "GPU KV cache size" in ok.stdout


def test_quant_nf4_is_vllms_bitsandbytes_at_load_and_other_quants_are_refused():
    r = run_cli("plan", "qwen2.5-7b", "--engine", "vllm", "--gpu", "h100", "--quant", "nf4", "--format", "json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["flags"]["quantization"] == "bitsandbytes" and "--quantization bitsandbytes" in data["command"]
    bf16 = json.loads(run_cli("plan", "qwen2.5-7b", "--engine", "vllm", "--gpu", "h100", "--format", "json").stdout)
    # NF4: about a quarter of the bf16 linears (0.5 B + absmax per weight), bf16 embeddings and LM head
    assert data["per_gpu"]["weights_bytes"] < 0.45 * bf16["per_gpu"]["weights_bytes"]
    r = run_cli("plan", "qwen2.5-7b", "--engine", "vllm", "--gpu", "h100", "--quant", "int8")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith("error --quant: 'int8'") and "--quant nf4" in r.stderr


def test_quantization_fp8_plans_fp8_at_load_and_goes_into_the_command():
    """``--quantization fp8`` is vLLM's own option: FP8 weights at load (about half the bf16 linears), in the plan's
    command and the export; it needs --engine vllm and is not given beside a different --quant."""
    r = run_cli("plan", "qwen2.5-7b", "--engine", "vllm", "--gpu", "h100", "--quantization", "fp8", "--format",
                "json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["flags"]["quantization"] == "fp8" and "--quantization fp8" in data["command"]
    bf16 = json.loads(run_cli("plan", "qwen2.5-7b", "--engine", "vllm", "--gpu", "h100", "--format", "json").stdout)
    assert 0.5 * bf16["per_gpu"]["weights_bytes"] < data["per_gpu"]["weights_bytes"] \
        < 0.75 * bf16["per_gpu"]["weights_bytes"]
    out = run_cli("export", "qwen2.5-7b", "--to", "vllm", "--gpu", "h100", "--quantization", "fp8")
    assert out.returncode == 0 and "--quantization fp8" in out.stdout
    alone = run_cli("plan", "qwen2.5-7b", "--quantization", "fp8")
    assert alone.returncode == 2 and alone.stderr.startswith("error --quantization: 'fp8'")
    assert "--engine vllm" in alone.stderr
    both = run_cli("plan", "qwen2.5-7b", "--engine", "vllm", "--gpu", "h100", "--quant", "nf4", "--quantization",
                   "fp8")
    assert both.returncode == 2 and both.stderr.startswith("error --quant: 'nf4'")


def test_vllm_version_selects_the_release_rules():
    old = json.loads(run_cli("plan", "qwen2.5-7b", "--engine", "vllm", "--gpu", "h100", "--tp", "2",
                             "--vllm-version", "0.19.0", "--format", "json").stdout)
    new = json.loads(run_cli("plan", "qwen2.5-7b", "--engine", "vllm", "--gpu", "h100", "--tp", "2",
                             "--vllm-version", "0.33.0", "--format", "json").stdout)
    # 0.19: NCCL in the budget, CUDA graphs outside it (estimate off by default), Triton sampler; 0.33: the reverse
    assert old["per_gpu"]["nccl_in_budget"] and not old["per_gpu"]["cudagraph_in_budget"]
    assert not new["per_gpu"]["nccl_in_budget"] and new["per_gpu"]["cudagraph_in_budget"]
    r = run_cli("plan", "qwen2.5-7b", "--engine", "vllm", "--gpu", "h100", "--vllm-version", "latest")
    assert r.returncode == 2 and r.stderr.startswith("error --vllm-version: 'latest'")


def test_a_family_without_a_vllm_model_points_to_the_transformers_plan(tmp_path):
    from archs import ARCHS
    from transformers import AutoConfig
    AutoConfig.for_model("gpt2", **ARCHS["gpt2"]).save_pretrained(tmp_path)  # config.json only: plan reads no weights
    for cmd in (("plan", str(tmp_path), "--engine", "vllm"), ("export", str(tmp_path), "--to", "vllm")):
        r = run_cli(*cmd, "--gpu", "h100", columns="400")
        assert r.returncode == 3, r.stderr  # ConfigError
        assert "config.json:model_type: 'gpt2' is not valid" in r.stderr
        assert f"plan it for transformers, the default engine (`vramguard plan {tmp_path}` without --engine vllm)" \
            in r.stderr
        assert "vLLM itself may serve gpt2" in r.stderr and "plan one of those" not in r.stderr
    # the transformers plan of the same folder works
    assert run_cli("plan", str(tmp_path), "--gpu", "h100").returncode == 0
