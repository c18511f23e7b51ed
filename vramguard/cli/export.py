"""``vramguard export``: the deployment of a model on vLLM, from the same plan as ``plan --engine vllm``
(over :func:`vramguard.export.export`)."""

from __future__ import annotations

from enum import Enum
from typing import Optional

import typer

from vramguard.cli import engine as eng
from vramguard.cli.common import run_guarded
from vramguard.cli.options import Dtype

Target = Enum("Target", {t: t for t in ("vllm", "ray-serve", "kserve", "kubernetes")}, type=str)
OutFormat = Enum("OutFormat", {"yaml": "yaml", "json": "json"}, type=str)


def export(
    model: str = typer.Argument(..., metavar="MODEL",
                                help="model folder, config.json, catalog name or cached model id"),
    to: Target = typer.Option(..., "--to", help="vllm (a command line), ray-serve, kserve or kubernetes"),
    replicas: int = typer.Option(1, "--replicas", help="copies of the server (each with tp x pp GPUs)"),
    gpu: Optional[str] = typer.Option(None, help="a catalog card (see vramguard plan --list-gpus) or the name "
                                                 "nvidia-smi prints"),
    vram: Optional[str] = typer.Option(None, help="card memory, e.g. 80GiB"),
    tp: int = eng.tp_option(), pp: int = eng.pp_option(), gpu_memory_utilization: float = eng.util_option(),
    max_model_len: Optional[int] = eng.max_model_len_option(),
    kv_cache_dtype: eng.KvCacheDtype = eng.kv_cache_dtype_option(),
    max_num_seqs: Optional[int] = eng.max_num_seqs_option(),
    max_num_batched_tokens: Optional[int] = eng.max_num_batched_tokens_option(),
    dtype: Optional[Dtype] = typer.Option(None, help="model dtype (default: the checkpoint's, as vLLM's auto)"),
    kv_offload: Optional[str] = typer.Option(None, "--kv-offload", help="host memory for KV offloaded to the CPU, "
                                             "e.g. 16GiB (vLLM --kv-offloading-size; added to the pod's memory)"),
    fmt: Optional[OutFormat] = typer.Option(None, "--format", help="yaml (the default) or json; for vllm, the "
                                            "command as {command: [argv], env: {...}} (default: shell lines)"),
    vllm_version: Optional[str] = eng.vllm_version_option(), enable_lora: bool = eng.enable_lora_option(),
    max_lora_rank: int = eng.max_lora_rank_option(), max_loras: int = eng.max_loras_option(),
    quantization: Optional[eng.VllmQuantization] = eng.quantization_option(),
) -> None:
    """Write a vLLM deployment (command, Ray Serve LLM, KServe or Kubernetes) with the planned flags."""
    a = eng.EngineArgs(tp, pp, gpu_memory_utilization, max_model_len, kv_cache_dtype.value, max_num_seqs,
                       max_num_batched_tokens, dtype.value if dtype else None, kv_offload, vllm_version, enable_lora,
                       max_lora_rank, max_loras, quantization.value if quantization else None)
    from vramguard.cli.vllm import deployment  # vLLM's memory model: loaded when the command runs
    out = run_guarded(deployment, model, gpu, vram, a, to.value, replicas, fmt is not None,
                      as_json=fmt == OutFormat['json'])
    if isinstance(out, list) and to == Target['vllm']:  # the command as shell lines, as plan prints it
        print("\n".join(out))
        return
    import json
    if fmt == OutFormat['json']:
        print(json.dumps(out, indent=2))
    else:
        print(to_yaml(out))


def to_yaml(data) -> str:
    """YAML text of one document or a list of documents (``---`` between them), without anchors or aliases."""
    import yaml

    class _NoAliases(yaml.SafeDumper):
        def ignore_aliases(self, data):  # labels shared by selector and template are written out twice
            return True

    docs = data if isinstance(data, list) else [data]
    return yaml.dump_all(docs, Dumper=_NoAliases, sort_keys=False, width=120).rstrip()
