"""`plan --engine vllm` against public vLLM startup logs that the other vLLM tests do not use
(tests/data/vllm_public_logs.json: each log's source, engine arguments, vLLM version and the numbers it printed).

Each log is planned with its release's rules (:func:`vramguard.engines.vllm.settings_for_version`) on its card (the
total memory the log printed where it printed one). The KV cache must be within 5% of the log: its tokens where
vLLM printed them (V1), else its GiB; a start that failed must be planned as a refusal. The weights, where printed,
within 1%. ``benchmarks/cpu_vllm_public_logs.py`` prints the same comparison as the table in docs/engines.md.
"""

import dataclasses
import json
from pathlib import Path

import pytest

from vramguard.engines import vllm_kv as kv
from vramguard.engines.vllm import plan_vllm, settings_for_version
from vramguard.engines.vllm_arch import vllm_model
from vramguard.errors import ConfigError, InvalidValue
from vramguard.hardware import gpu_from_catalog
from vramguard.resolve import resolve_model
from vramguard.spec import spec_from_config
from vramguard.units import GiB

DATA = Path(__file__).parent / "data"
LOGS = json.loads((DATA / "vllm_public_logs.json").read_text())
CASE_CONFIGS = json.loads((DATA / "vllm_case_configs.json").read_text())


def spec_of(model: str):
    """The spec of a log's model: its vendored config.json, else the catalog."""
    for table in (LOGS["configs"], CASE_CONFIGS):
        if model in table:
            return spec_from_config(table[model]["config"], name=model)
    return resolve_model(model)


def card_of(entry: dict):
    gpu = gpu_from_catalog(entry["gpu"])
    if entry.get("total_gib"):  # the total the log printed ("Free memory on device (78.57/79.18 GiB)")
        gpu = dataclasses.replace(gpu, total_bytes=int(entry["total_gib"] * GiB))
    return gpu


def plan_log(entry: dict):
    """The plan of one log's run, with its release's rules."""
    settings = settings_for_version(entry["vllm_version"], **entry["settings"])
    return plan_vllm(spec_of(entry["model"]), card_of(entry), settings)


def tokens_from_memory(entry: dict) -> int:
    """The KV tokens of the logged KV memory (vLLM's pages and groups; the budget is not planned)."""
    spec = vllm_model(spec_of(entry["model"])).text
    kinds = list(spec.layer_types) or ["full_attention"] * spec.num_layers
    block = entry["settings"].get("block_size", 16)
    groups = kv.kv_groups(spec, kinds, kv.page_bytes(spec, entry["settings"].get("tensor_parallel_size", 1), 2, block))
    return kv.kv_tokens_by_blocks(groups, kv.num_blocks(groups, int(entry["logged"]["kv_gib"] * GiB)), block)


def compare(entry: dict) -> tuple[str, float, float]:
    """``(what, logged, planned)``: KV tokens where logged (V1), else KV GiB; ``refusal`` 1.0 / 1.0 when a failed
    start is planned as a refusal (0.0 planned when it is not)."""
    logged = entry["logged"]
    if entry.get("check") == "from_memory":
        return "tokens from the logged GiB", logged["kv_tokens"], tokens_from_memory(entry)
    if logged.get("refused"):
        try:
            p = plan_log(entry)
        except (InvalidValue, ConfigError):  # settings vLLM stops on (a parallel size it cannot split the model by,
            return "refusal", 1.0, 1.0      # a quantization against the checkpoint's): refused before any planning
        return "refusal", 1.0, 1.0 if p.refused_by else 0.0
    p = plan_log(entry)
    if logged.get("kv_tokens"):
        return "tokens", logged["kv_tokens"], p.kv_tokens
    return "GiB", logged["kv_gib"], p.available_kv_bytes / GiB


# logs the plan misses, with the reason (a strict xfail: fixing one makes the test fail until it is removed here)
KNOWN_MISSES = {
    "llmd-gpt-oss-120b-h100": "the log's own terms exceed its budget: 64.38 GiB weights + 7.38 activation + 0.13 "
                              "non-torch = 71.89 GiB against 0.9 x 79.18 = 71.26 GiB, yet it reports 3.33 GiB of KV "
                              "cache; the plan (64.42 + 7.34 + 0.25) refuses it",
    "llmdp-redhatai-llama-3-3-70b-i-tp1pp1dp1-8192": "+6.5% of a 5.01 GiB cache: vLLM 0.19.0 held 0.33 GiB more "
                                                     "outside the KV cache than the plan (the run's activation and "
                                                     "non-torch terms are not published; the same checkpoint at TP 2 "
                                                     "and 4 is within 0.5%)",
    "dennis-qwen2-7b-tp2-a100-40gb": "+5.3%: two Ray workers on two nodes held 0.56 GiB more outside the KV cache than "
                                     "the plan's NCCL and kernel terms (the same model at TP 2 on one node: -2.9%)",
}


# weights the plan misses by more than 1% (the KV cache of these logs is within 5%)
WEIGHT_MISSES = {
    "llmdp-openai-gpt-oss-20b-tp1pp1dp1-8192": "-1.5%: vLLM 0.19.0's Triton MXFP4 path logs 13.64 GiB kept after a "
                                               "12.92 GiB load peak, 0.17 GiB over the 13.47 GiB vLLM 0.14.0 kept on "
                                               "the same card (planned 13.44); its KV cache is planned within 0.6%",
    "llmdp-openai-gpt-oss-20b-tp2pp1dp1-8192": "-2.4%: the same 0.19.0 MXFP4 excess at TP 2 (7.01 GiB logged, 6.84 "
                                               "planned); KV cache within 5%",
    "llmdp-openai-gpt-oss-20b-tp4pp1dp1-8192": "-2.3%: the same 0.19.0 MXFP4 excess at TP 4 (3.63 GiB logged, 3.55 "
                                               "planned); KV cache within 5%",
    "llmdp-deepseek-ai-deepseek-v2-tp4pp1dp1-8192": "-1.2%: vLLM 0.19.0 holds 0.09-0.12 GiB more than the MLA "
                                                    "parameters at TP 1, 2 and 4 (0.4-0.8% at TP 1 and 2), not found "
                                                    "in deepseek_v2.py; KV cache within 2%",
    "llmdp-w8a8-mistral-small-24b-tp2pp1dp1-8192": "+2.9%: 12.11 GiB logged at TP 2 against 24.07 at TP 1, as if the "
                                                   "0.84 GiB Pixtral encoder were split over the two ranks; the "
                                                   "bfloat16 checkpoint's 22.80 GiB at TP 2 (44.76 at TP 1) keeps it "
                                                   "whole, as planned; KV cache within 0.5%",
}


def _ids():
    return [e["id"] for e in LOGS["logs"]]


@pytest.mark.parametrize("entry", LOGS["logs"], ids=_ids())
def test_kv_cache_within_5_percent_of_the_log(entry):
    if entry["id"] in KNOWN_MISSES:
        pytest.xfail(KNOWN_MISSES[entry["id"]])
    what, logged, planned = compare(entry)
    assert abs(planned / logged - 1) <= 0.05, f"{what}: {planned:,.2f} planned, {logged:,} logged ({entry['source']})"


@pytest.mark.parametrize("entry", [e for e in LOGS["logs"] if e["logged"].get("weights_gib") and e.get("gpu")],
                         ids=[e["id"] for e in LOGS["logs"] if e["logged"].get("weights_gib") and e.get("gpu")])
def test_weights_within_1_percent_of_the_log(entry):
    if entry["id"] in WEIGHT_MISSES:
        pytest.xfail(WEIGHT_MISSES[entry["id"]])
    planned = plan_log(entry).weights_bytes / GiB
    logged = entry["logged"]["weights_gib"]
    assert abs(planned / logged - 1) <= 0.01, f"{planned:.4f} GiB planned, {logged} logged ({entry['source']})"


def test_every_log_has_its_source_and_numbers():
    for e in LOGS["logs"]:
        assert e["source"].startswith("https://"), e["id"]
        assert e["logged"].get("kv_gib") is not None or e["logged"].get("kv_tokens") or e["logged"].get("refused"), \
            e["id"]
        assert e["model"] in LOGS["configs"] or e["model"] in CASE_CONFIGS or resolve_model(e["model"])


def test_gpt_oss_folder_planned_by_the_cli(tmp_path):
    """What a user runs: a folder with gpt-oss-20b's config.json, planned in a new process as the llm-d log ran it."""
    from conftest import run_cli
    (tmp_path / "config.json").write_text(json.dumps(LOGS["configs"]["openai/gpt-oss-20b"]["config"]))
    r = run_cli("plan", str(tmp_path), "--engine", "vllm", "--gpu", "h100", "--max-model-len", "16000",
                "--vllm-version", "0.14.0", "--format", "json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["weight_format"] == "mxfp4" and data["vllm_version"] == "0.14.0"
    # 13.47 GiB logged on H100 (llm-d); the catalog H100 is 79.10 GiB against the log's 79.18
    assert abs(data["per_gpu"]["weights_bytes"] / GiB / 13.47 - 1) < 0.01
    assert [g["kind"] for g in data["kv_cache"]["groups"]] == ["sliding_attention", "full_attention"]
