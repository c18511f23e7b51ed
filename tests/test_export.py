"""`vramguard export`: each target validated by its own parser or published schema (vendored in tests/data, see
tests/data/README.md for the source of each file)."""

import argparse
import copy
import json
import shlex
from pathlib import Path

import jsonschema
import pytest
import yaml

from vramguard.engines.vllm import VllmSettings, plan_vllm
from vramguard.errors import InvalidValue
from vramguard.export import (
    export,
    gpus_per_replica,
    kserve,
    kubernetes,
    ray_serve,
    resource_name,
    serve_args,
)
from vramguard.hardware import gpu_from_catalog
from vramguard.resolve import resolve_model
from vramguard.units import GiB

DATA = Path(__file__).parent / "data"
QWEN = resolve_model("qwen2.5-7b")
REF = "Qwen/Qwen2.5-7B-Instruct"


def _plan(card="h100", **kw):
    return plan_vllm(QWEN, gpu_from_catalog(card), VllmSettings(max_model_len=16384, **kw))


def vllm_parser() -> argparse.ArgumentParser:
    """`vllm serve`'s parser rebuilt from its actions as vLLM 0.33.0 defines them (option strings, nargs, choices;
    int/float typed options convert their value)."""
    spec = json.loads((DATA / "vllm_0.33.0_serve_args.json").read_text())
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    types = {"int": int, "float": float, "human_readable_int": int}
    for a in spec["actions"]:
        if not a["options"][0].startswith("-"):
            p.add_argument(a["dest"], nargs=a["nargs"])
            continue
        kw = {"dest": a["dest"]}
        if a["nargs"] == 0 or a["action"] in ("_StoreTrueAction", "_StoreFalseAction", "EnableDisableAction",
                                              "BooleanOptionalAction"):
            kw["action"] = "store_true"
        else:
            kw.update(nargs=a["nargs"], type=types.get(a["type"], str), choices=a["choices"])
        p.add_argument(*a["options"], **kw)
    return p


@pytest.mark.parametrize("settings", [{}, {"tensor_parallel_size": 2, "kv_cache_dtype": "fp8"},
                                      {"pipeline_parallel_size": 2, "enforce_eager": True,
                                       "hybrid_kv_cache_manager": False, "kv_offloading_size_bytes": 16 * GiB}])
def test_vllm_command_parses_with_vllms_arguments(settings):
    p = _plan(**settings)
    line = export(p, REF, "vllm")
    argv = shlex.split(line)
    assert argv[:2] == ["vllm", "serve"]
    ns = vllm_parser().parse_args(argv[2:])
    assert ns.model_tag == REF and ns.port == 8000
    assert ns.tensor_parallel_size == p.settings.tensor_parallel_size
    assert ns.max_model_len == "16384" and ns.gpu_memory_utilization == 0.9 and ns.dtype == "bfloat16"
    assert ns.max_num_seqs == 1024 and ns.max_num_batched_tokens == 8192
    if settings.get("kv_cache_dtype"):
        assert ns.kv_cache_dtype == "fp8"
    if settings.get("kv_offloading_size_bytes"):
        assert ns.kv_offloading_size == "16.0" and ns.enforce_eager and ns.disable_hybrid_kv_cache_manager


def test_an_unknown_flag_is_refused_by_the_rebuilt_parser():
    with pytest.raises((argparse.ArgumentError, SystemExit)):
        vllm_parser().parse_args([REF, "--max-modle-len", "4096"])


def _strict(schema: dict) -> dict:
    """A CRD schema where an object that lists its properties accepts no others (the API server prunes unknown
    fields of structural schemas silently; here a field the export writes and KServe would drop fails)."""
    s = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if "properties" in node and "additionalProperties" not in node \
                    and not node.get("x-kubernetes-preserve-unknown-fields"):
                node["additionalProperties"] = False
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)
    walk(s)
    return s


def test_kserve_inference_service_validates_against_the_crd():
    crd = json.loads((DATA / "kserve_v1beta1_inferenceservice_schema.json").read_text())["schema"]
    doc = kserve(_plan(tensor_parallel_size=2), REF, replicas=3)
    jsonschema.validate(yaml.safe_load(yaml.safe_dump(doc)), _strict(crd))
    pred = doc["spec"]["predictor"]
    assert pred["minReplicas"] == pred["maxReplicas"] == 3
    c = pred["containers"][0]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert pred["volumes"][0]["emptyDir"]["medium"] == "Memory"
    bad = copy.deepcopy(doc)
    bad["spec"]["predictor"]["containers"][0]["gpuCount"] = 2
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, _strict(crd))


def _k8s_validator(kind: str):
    data = json.loads((DATA / "k8s_1.33_deployment_service_schema.json").read_text())
    schema = {**data["roots"][kind], "$defs": data["$defs"]}
    return jsonschema.Draft202012Validator(schema)


def test_kubernetes_deployment_and_service_validate_against_the_kubernetes_schemas():
    p4 = _plan(tensor_parallel_size=4, kv_offloading_size_bytes=32 * GiB)
    dep, svc = kubernetes(p4, REF, replicas=2)
    _k8s_validator("Deployment").validate(dep)
    _k8s_validator("Service").validate(svc)
    pod = dep["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert dep["spec"]["replicas"] == 2
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "4"
    # 16 GiB for the engine + Qwen2.5-7B's bf16 checkpoint 15,231,233,024 B + 32 GiB of offloaded KV
    # = 66,770,840,576 B = 63,677.6 MiB, rounded up
    assert p4.checkpoint_bytes == 15_231_233_024
    assert c["resources"]["requests"]["memory"] == c["resources"]["limits"]["memory"] == "63678Mi"
    assert {v["name"] for v in pod["volumes"]} == {"dshm"} and c["volumeMounts"][0]["mountPath"] == "/dev/shm"
    assert c["readinessProbe"]["httpGet"]["path"] == c["livenessProbe"]["httpGet"]["path"] == "/health"
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms[0]["matchExpressions"][0]["values"] == ["NVIDIA-H100-80GB-HBM3", "NVIDIA-H100-PCIe"]
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    bad = copy.deepcopy(dep)
    bad["spec"]["replicas"] = "two"
    with pytest.raises(jsonschema.ValidationError):
        _k8s_validator("Deployment").validate(bad)


def test_one_gpu_has_no_shm_and_a_node_selector():
    dep, _ = kubernetes(_plan("l40s"), REF)
    pod = dep["spec"]["template"]["spec"]
    assert "volumes" not in pod and pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-L40S"}
    _k8s_validator("Deployment").validate(dep)


def test_ray_serve_config_validates_against_rays_schemas():
    deploy = json.loads((DATA / "ray_2.52.0_serve_deploy_schema.json").read_text())
    llm = json.loads((DATA / "ray_2.52.0_llm_config_schema.json").read_text())
    p = _plan(tensor_parallel_size=2)
    doc = ray_serve(p, REF, replicas=2)
    jsonschema.validate(doc, deploy)
    cfg = doc["applications"][0]["args"]["llm_configs"][0]
    jsonschema.validate(cfg, llm)
    assert doc["applications"][0]["import_path"] == "ray.serve.llm:build_openai_app"
    assert cfg["accelerator_type"] == "H100"
    assert cfg["engine_kwargs"]["tensor_parallel_size"] == 2 and cfg["engine_kwargs"]["max_model_len"] == 16384
    # the engine arguments are vLLM's own: each is a dest of `vllm serve`'s parser
    dests = {a["dest"] for a in json.loads((DATA / "vllm_0.33.0_serve_args.json").read_text())["actions"]}
    assert set(cfg["engine_kwargs"]) <= dests
    assert cfg["deployment_config"]["autoscaling_config"] == {"min_replicas": 2, "max_replicas": 2}
    with pytest.raises(jsonschema.ValidationError):  # LLMConfig forbids fields it does not define
        jsonschema.validate({**cfg, "engine_args": {}}, llm)


def test_names_and_counts():
    assert resource_name("Qwen/Qwen2.5-7B-Instruct") == "qwen2-5-7b-instruct"
    assert resource_name("./models/3b") == "b"
    assert gpus_per_replica(_plan(tensor_parallel_size=2, pipeline_parallel_size=2)) == 4
    assert serve_args(_plan(), REF)[-2:] == ["--port", "8000"]
    with pytest.raises(InvalidValue) as e:
        kubernetes(_plan(), REF, replicas=0)
    assert e.value.field == "replicas"
    # 4 x 4 = 16 GPUs in one pod: more than a node has
    with pytest.raises(InvalidValue) as e:
        kserve(_plan(tensor_parallel_size=4, pipeline_parallel_size=4), REF)
    assert e.value.field == "tensor_parallel_size" and "ray-serve" in e.value.fix


def test_cli_export_yaml_has_no_aliases():
    from conftest import run_cli
    r = run_cli("export", "qwen2.5-7b", "--to", "kubernetes", "--gpu", "h100", "--tp", "2", "--max-model-len", "16384",
                "--replicas", "2")
    assert r.returncode == 0
    out = r.stdout
    assert "&id" not in out and "*id" not in out
    dep, svc = list(yaml.safe_load_all(out))
    _k8s_validator("Deployment").validate(dep)
    assert dep["spec"]["replicas"] == 2 and svc["kind"] == "Service"


def test_cli_export_vllm_json_is_the_argv_and_env():
    from conftest import run_cli
    r = run_cli("export", "qwen2.5-7b", "--to", "vllm", "--gpu", "h100", "--max-model-len", "16384", "--format", "json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)  # JSON, not the shell line
    assert set(data) == {"command", "env"} and data["env"] == {}
    argv = data["command"]
    assert argv[:3] == ["vllm", "serve", REF] and argv[-2:] == ["--port", "8000"]
    ns = vllm_parser().parse_args(argv[2:])
    assert ns.max_model_len == "16384" and ns.gpu_memory_utilization == 0.9
    # the default is still the shell line, pasted as is
    plain = run_cli("export", "qwen2.5-7b", "--to", "vllm", "--gpu", "h100", "--max-model-len", "16384")
    assert shlex.split(plain.stdout.replace("\\\n", " ")) == argv
