"""``vramguard export``: the deployment of a model on vLLM, from the same plan as ``plan --engine vllm``
(over :func:`vramguard.export.export`)."""

from __future__ import annotations

from enum import Enum
from typing import Optional

import typer

from vramguard.cli import engine as eng
from vramguard.cli.common import run_guarded, say
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
) -> None:
    """Write a vLLM deployment (command, Ray Serve LLM, KServe or Kubernetes) with the planned flags."""
    a = eng.EngineArgs(tp, pp, gpu_memory_utilization, max_model_len, kv_cache_dtype.value, max_num_seqs,
                       max_num_batched_tokens, dtype.value if dtype else None, kv_offload, vllm_version, enable_lora,
                       max_lora_rank, max_loras)
    out = run_guarded(_build, model, gpu, vram, a, to.value, replicas, fmt is not None,
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


def _refusal_error(p, model: str):
    """The Infeasible error of a plan vLLM would not start with: the field at fault, its limit and the plan's
    fix."""
    from vramguard.engines.vllm_text import _fixes
    from vramguard.errors import Infeasible
    from vramguard.units import GiB
    fix = "; ".join(x.removeprefix("fix: ") for x in _fixes(p))
    why = f"vLLM would stop at start: {p.refusal}"
    if p.refused_by == "max_model_len_limit":
        return Infeasible("max_model_len", p.max_model_len, f"at most {p.model_max_len:,}, the model's "
                          "max_position_embeddings (vLLM refuses more without VLLM_ALLOW_LONG_MAX_MODEL_LEN=1)", fix)
    if p.refused_by == "free_memory":
        return Infeasible("gpu_memory_utilization", p.settings.gpu_memory_utilization,
                          f"at most {p.free_at_start_bytes / p.total_bytes:.2f} (the free memory at start)", fix)
    if p.refused_by in ("weights_load", "weights_budget", "kv_cache"):
        weights = max(p.weights_by_stage)
        return Infeasible("weights", f"{weights / GiB:.2f} GiB per GPU", f"less than the budget on {p.gpu.label}, "
                          f"{p.requested_bytes / GiB:.2f} GiB, with room for the KV cache ({why})", fix)
    return Infeasible("max_model_len", p.max_model_len, f"at most {p.largest_model_len:,} (one request must fit "
                      f"the KV cache; {why})", fix + f"; see `vramguard plan {model} --engine vllm`")


def _build(model, gpu, vram, a, to, replicas, as_data=False):
    """The deployment for ``to``; for vllm, shell lines, or with ``as_data`` the argv and environment as a dict."""
    from vramguard.export import PORT, check_model_source, check_replicas, export as export_fn, serve_args
    check_replicas(replicas)  # before planning: a bad value prints its error alone
    check_model_source(eng.model_ref(model), to)
    p = eng.build_plans(model, gpu, vram, a, one_card=True)[0]
    if p.refusal:
        raise _refusal_error(p, model)
    say(f"planned: GPU KV cache size {p.kv_tokens:,} tokens, maximum concurrency {p.max_concurrency:,.2f}x for "
        f"{p.max_model_len:,} tokens per request")
    for name, value in p.env().items():
        say(f"note: {name}={value} is set in this environment: the deployment sets it too (max_model_len "
            f"{p.max_model_len:,} is above the model's {p.model_max_len:,})")
    if to == "vllm":
        from vramguard.cli.render import console
        from vramguard.engines.vllm_text import command_lines
        check_replicas(replicas)
        if as_data:
            return {"command": ["vllm", "serve", *serve_args(p, eng.model_ref(model), PORT)], "env": p.env()}
        return command_lines(p, eng.model_ref(model), console().width, PORT)
    return export_fn(p, eng.model_ref(model), to, replicas)
