"""Deployments from a :class:`~vramguard.engines.vllm.VllmPlan`: a ``vllm serve`` command line, a Ray Serve LLM
config, a KServe InferenceService, and a plain Kubernetes Deployment + Service. Pure functions returning plain
data (dicts and lists that serialise to YAML/JSON); knows nothing about a cluster.

Every target runs the same engine arguments (:meth:`VllmPlan.flags`). Shapes follow each target's documentation:

* Ray Serve LLM (Ray 2.52): a Serve config whose one application is ``ray.serve.llm:build_openai_app`` with
  ``args.llm_configs``, each an ``LLMConfig`` (``model_loading_config``, ``engine_kwargs``, ``accelerator_type``,
  ``deployment_config.autoscaling_config``); validated in the tests against the JSON schemas of Ray's own pydantic
  models (``ServeDeploySchema``, ``LLMConfig``).
* KServe ``serving.kserve.io/v1beta1`` InferenceService with a custom predictor container (the vLLM OpenAI image);
  validated against the CRD's ``openAPIV3Schema``.
* Kubernetes ``apps/v1`` Deployment and ``v1`` Service; validated against the Kubernetes 1.33 JSON schemas.

Pods get ``nvidia.com/gpu`` = tensor x pipeline parallel GPUs (one node), host memory for the engine, the whole
checkpoint and the KV offloaded to the CPU (:func:`host_memory_bytes`), a memory-backed ``/dev/shm`` at TP/PP >= 2
(NCCL and vLLM's shared-memory broadcast), a node selector on ``nvidia.com/gpu.product`` (the label GPU Feature
Discovery sets: the NVML product name with spaces replaced by ``-``), and startup/readiness/liveness probes on
vLLM's ``/health``.
"""

from __future__ import annotations

import re

from vramguard.engines.vllm import VllmPlan
from vramguard.engines.vllm_text import serve_command
from vramguard.errors import InvalidValue
from vramguard.units import GiB

TARGETS = ("vllm", "ray-serve", "kserve", "kubernetes")
VLLM_IMAGE = "vllm/vllm-openai:v0.33.0"
PORT = 8000
HOST_MEMORY_BYTES = 16 * GiB  # the API server, the engine core, tokenizers and pinned staging buffers (a default)
SHM_BYTES = 2 * GiB

# catalog card -> the nvidia.com/gpu.product values its variants carry (NVML names, spaces as "-")
GPU_PRODUCTS: dict[str, tuple[str, ...]] = {
    "h200": ("NVIDIA-H200",), "h100-80gb": ("NVIDIA-H100-80GB-HBM3", "NVIDIA-H100-PCIe"),
    "h100-nvl": ("NVIDIA-H100-NVL",),
    "a100-80gb": ("NVIDIA-A100-SXM4-80GB", "NVIDIA-A100-80GB-PCIe"),
    "a100-40gb": ("NVIDIA-A100-SXM4-40GB", "NVIDIA-A100-PCIE-40GB"), "l40s": ("NVIDIA-L40S",), "l4": ("NVIDIA-L4",),
    "a10g": ("NVIDIA-A10G",), "a10": ("NVIDIA-A10",), "t4": ("Tesla-T4",),
    "v100-16gb": ("Tesla-V100-SXM2-16GB", "Tesla-V100-PCIE-16GB"),
    "v100-32gb": ("Tesla-V100-SXM2-32GB", "Tesla-V100-PCIE-32GB"), "rtx-a6000": ("NVIDIA-RTX-A6000",),
    "rtx-6000-ada": ("NVIDIA-RTX-6000-Ada-Generation",), "rtx-4090": ("NVIDIA-GeForce-RTX-4090",),
    "rtx-3090": ("NVIDIA-GeForce-RTX-3090",), "rtx-5090": ("NVIDIA-GeForce-RTX-5090",),
}
# catalog card -> Ray's accelerator_type (ray/util/accelerators/accelerators.py in Ray 2.52)
RAY_ACCELERATORS = {"h200": "H200", "h100-80gb": "H100", "a100-80gb": "A100-80G", "a100-40gb": "A100-40G",
                    "l40s": "L40S", "l4": "L4", "a10g": "A10G", "t4": "T4", "v100-16gb": "V100", "v100-32gb": "V100"}


def resource_name(model_ref: str) -> str:
    """A DNS-1035 label (Kubernetes object names) from a model id: ``Qwen/Qwen2.5-7B-Instruct`` ->
    ``qwen2-5-7b-instruct``."""
    tail = model_ref.rstrip("/").split("/")[-1].lower()
    name = re.sub(r"[^a-z0-9-]+", "-", tail).strip("-")
    name = re.sub(r"^[^a-z]+", "", name)[:52].rstrip("-")
    return name or "llm"


def gpus_per_replica(p: VllmPlan) -> int:
    return p.settings.tensor_parallel_size * p.settings.pipeline_parallel_size


def serve_args(p: VllmPlan, model_ref: str, port: int = PORT) -> list[str]:
    """The arguments after ``vllm serve``: the model, then each flag of the plan, then the port."""
    out = [model_ref]
    for flag, value in p.flags().items():
        out += [f"--{flag}"] if value is True else [f"--{flag}", str(value)]
    return out + ["--port", str(port)]


def host_memory_bytes(p: VllmPlan) -> int:
    """The container's memory (request and limit): the engine's :data:`HOST_MEMORY_BYTES`, plus the whole
    checkpoint, plus the KV offloaded to the CPU. vLLM reads the checkpoint through safetensors' ``safe_open``
    (a memory map: ``vllm/model_executor/model_loader/weight_utils.py::safetensors_weights_iterator``), and the
    page cache of those files is charged to the container's memory cgroup (the kernel's cgroup-v2 documentation,
    Documentation/admin-guide/cgroup-v2.rst: the memory controller accounts file-backed page cache), so a limit
    below engine + checkpoint ends with the pod killed while loading, as in
    https://github.com/vllm-project/vllm/issues/28923 ("Container is killed by Kubernetes when memory crosses the
    defined limit while model is loading"). Llama-3.1-8B in bf16: 16 GiB + 16,060,522,496 B = 33,240,391,680 B.
    """
    return HOST_MEMORY_BYTES + p.checkpoint_bytes + p.settings.kv_offloading_size_bytes


def _host_memory(p: VllmPlan) -> str:
    """:func:`host_memory_bytes` in whole MiB, rounded up (Kubernetes' ``Mi``)."""
    return f"{-(-host_memory_bytes(p) // 2**20)}Mi"


def _node_placement(p: VllmPlan) -> dict:
    values = GPU_PRODUCTS.get(p.gpu.name)
    if not values:
        return {}
    if len(values) == 1:
        return {"nodeSelector": {"nvidia.com/gpu.product": values[0]}}
    term = {"matchExpressions": [{"key": "nvidia.com/gpu.product", "operator": "In", "values": list(values)}]}
    return {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [term]}}}}


def _container(p: VllmPlan, model_ref: str, name: str, port: int) -> dict:
    gpus = str(gpus_per_replica(p))
    probe = {"httpGet": {"path": "/health", "port": port}}
    c = {"name": name, "image": VLLM_IMAGE, "command": ["vllm", "serve"], "args": serve_args(p, model_ref, port),
         "ports": [{"containerPort": port, "name": "http", "protocol": "TCP"}],
         "env": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token",
                                                                      "optional": True}}},
                 *({"name": k, "value": v} for k, v in p.env().items())],
         "resources": {"limits": {"nvidia.com/gpu": gpus, "memory": _host_memory(p)},
                       "requests": {"nvidia.com/gpu": gpus, "memory": _host_memory(p), "cpu": str(2 + 2 * int(gpus))}},
         # the load takes minutes: the startup probe allows 30 of them before liveness applies
         "startupProbe": {**probe, "periodSeconds": 10, "failureThreshold": 180},
         "readinessProbe": {**probe, "periodSeconds": 10, "failureThreshold": 3},
         "livenessProbe": {**probe, "periodSeconds": 20, "failureThreshold": 3}}
    if gpus_per_replica(p) > 1:
        c["volumeMounts"] = [{"name": "dshm", "mountPath": "/dev/shm"}]
    return c


def _pod_spec(p: VllmPlan, model_ref: str, name: str, port: int) -> dict:
    spec: dict = {"containers": [_container(p, model_ref, name, port)], **_node_placement(p)}
    if gpus_per_replica(p) > 1:
        spec["volumes"] = [{"name": "dshm", "emptyDir": {"medium": "Memory",
                                                         "sizeLimit": f"{SHM_BYTES // GiB}Gi"}}]
    return spec


MAX_GPUS_PER_POD = 8  # one node: a Deployment's pod cannot span hosts


def check_replicas(replicas: int) -> None:
    """Raise InvalidValue unless ``replicas`` is an integer from 1 to 10,000."""
    if isinstance(replicas, bool) or not isinstance(replicas, int) or not 1 <= replicas <= 10_000:
        raise InvalidValue("replicas", replicas, "an integer from 1 to 10,000",
                           "set replicas=1 or more")


def _check_one_node(p: VllmPlan) -> None:
    if gpus_per_replica(p) > MAX_GPUS_PER_POD:
        raise InvalidValue("tensor_parallel_size", gpus_per_replica(p), f"at most {MAX_GPUS_PER_POD} GPUs (tensor x "
                           "pipeline parallel) in one pod", "export to ray-serve, which places the workers across "
                           "nodes, or use fewer GPUs per replica")


def kubernetes(p: VllmPlan, model_ref: str, replicas: int = 1, port: int = PORT) -> list[dict]:
    """A ``apps/v1`` Deployment of ``replicas`` vLLM pods (each on one node) and a ``v1`` Service in front of them.

    Raises:
        InvalidValue: ``replicas`` below 1, or more GPUs per replica than one node has.
    """
    check_replicas(replicas)
    _check_one_node(p)
    name = resource_name(model_ref)
    labels = {"app.kubernetes.io/name": name, "app.kubernetes.io/component": "vllm"}
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "labels": labels},
                  "spec": {"replicas": replicas, "selector": {"matchLabels": labels},
                           "template": {"metadata": {"labels": labels},
                                        "spec": _pod_spec(p, model_ref, "vllm", port)}}}
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "labels": labels},
               "spec": {"selector": labels, "ports": [{"name": "http", "port": port, "targetPort": port,
                                                       "protocol": "TCP"}], "type": "ClusterIP"}}
    return [deployment, service]


def kserve(p: VllmPlan, model_ref: str, replicas: int = 1, port: int = PORT) -> dict:
    """A KServe ``v1beta1`` InferenceService whose predictor is the vLLM OpenAI server (a custom container, one
    node per replica; raises as :func:`kubernetes`)."""
    check_replicas(replicas)
    _check_one_node(p)
    name = resource_name(model_ref)
    predictor = {"minReplicas": replicas, "maxReplicas": replicas,
                 **_pod_spec(p, model_ref, "kserve-container", port)}
    return {"apiVersion": "serving.kserve.io/v1beta1", "kind": "InferenceService", "metadata": {"name": name},
            "spec": {"predictor": predictor}}


def ray_serve(p: VllmPlan, model_ref: str, replicas: int = 1) -> dict:
    """A Ray Serve config (``serve run config.yaml``) of one OpenAI-compatible app over one ``LLMConfig``."""
    check_replicas(replicas)
    engine = {flag.replace("-", "_"): value for flag, value in p.flags().items()}
    if "kv_offloading_size" in engine:
        engine["kv_offloading_size"] = float(engine["kv_offloading_size"])
    llm = {"model_loading_config": {"model_id": resource_name(model_ref), "model_source": model_ref},
           "engine_kwargs": engine,
           "deployment_config": {"autoscaling_config": {"min_replicas": replicas, "max_replicas": replicas}}}
    if p.env():
        llm["runtime_env"] = {"env_vars": p.env()}
    if p.gpu.name in RAY_ACCELERATORS:
        llm["accelerator_type"] = RAY_ACCELERATORS[p.gpu.name]
    return {"applications": [{"name": "llm", "route_prefix": "/", "import_path": "ray.serve.llm:build_openai_app",
                              "args": {"llm_configs": [llm]}}]}


def check_model_source(model_ref: str, to: str) -> None:
    """Raise InvalidValue when ``model_ref`` is a folder or file on this machine and ``to`` runs the server
    elsewhere (ray-serve, kserve, kubernetes: a container or a Ray worker, where this path does not exist)."""
    from pathlib import Path
    if to != "vllm" and Path(model_ref).expanduser().exists():
        raise InvalidValue("model", model_ref, f"a Hugging Face Hub id (owner/name) for {to}: the server runs in its "
                           "own container or node, where a path on this machine does not exist",
                           "pass the model's Hub id, or export to vllm for a command to run on this machine")


def export(p: VllmPlan, model_ref: str, to: str, replicas: int = 1):
    """The deployment for ``to`` (one of :data:`TARGETS`): a command string for ``vllm`` (one line, preceded by
    the variables of :meth:`VllmPlan.env`), else data.

    Raises:
        InvalidValue: an unknown target, a replica count below 1, or a local path for a target that runs
            elsewhere (:func:`check_model_source`).
    """
    check_model_source(model_ref, to)
    if to == "vllm":
        check_replicas(replicas)
        return serve_command(p, model_ref, PORT)
    if to == "ray-serve":
        return ray_serve(p, model_ref, replicas)
    if to == "kserve":
        return kserve(p, model_ref, replicas)
    if to == "kubernetes":
        return kubernetes(p, model_ref, replicas)
    raise InvalidValue("to", to, ", ".join(TARGETS), "pick one of them")
