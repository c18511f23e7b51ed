"""The vLLM steps of ``vramguard plan --engine vllm`` and ``vramguard export``: from the options to one
:class:`~vramguard.engines.vllm.VllmPlan` per card, its printing, and the deployment; loaded when one of those commands
runs (vLLM's memory model is not imported at the CLI's start)."""

from __future__ import annotations

import os

from vramguard.catalog.models import MODELS
from vramguard.cli.common import as_flags, say, write_json
from vramguard.cli.engine import EngineArgs
from vramguard.cli.render import console
from vramguard.engines.vllm import NO_VLLM_MODEL_FIX, plan_vllm, settings_for_version
from vramguard.engines.vllm_text import _fixes, command_lines, plan_lines, plan_to_json
from vramguard.engines.vllm_versions import default_version
from vramguard.engines.vllm_weights import check_tensor_parallel
from vramguard.errors import ConfigError, Infeasible, InvalidValue
from vramguard.export import PORT, check_model_source, check_replicas, export as export_fn, serve_args
from vramguard.hardware import detect_gpus, resolve_gpus
from vramguard.resolve import catalog_name, resolve_model
from vramguard.settings import TORCH_DTYPE_NAMES
from vramguard.units import GiB, parse_size


def model_ref(model: str) -> str:
    """What ``vllm serve`` should load: the Hugging Face id of a catalog name, else MODEL as given."""
    key = catalog_name(model)
    return str(MODELS[key]["source"]) if key else model


def vllm_settings(a: EngineArgs):
    """The :class:`~vramguard.engines.vllm.VllmSettings` of the options; raises InvalidValue for a bad one (checked
    before the model or the cards are read, so nothing else is printed)."""
    # vllm/envs.py reads the variable as "1" or "true", case-insensitive
    allow_long = os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "0").strip().lower() in ("1", "true")
    offload = parse_size(a.kv_offload, "kv_offloading_size_bytes", "16GiB") if a.kv_offload else 0
    return settings_for_version(
        a.vllm_version or default_version(), tensor_parallel_size=a.tp, pipeline_parallel_size=a.pp,
        gpu_memory_utilization=a.gpu_memory_utilization, max_model_len=a.max_model_len,
        kv_cache_dtype=a.kv_cache_dtype, max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
        dtype=TORCH_DTYPE_NAMES.get(a.dtype, "auto") if a.dtype else "auto", kv_offloading_size_bytes=offload,
        allow_long_max_model_len=allow_long, quantization=a.quantization, enable_lora=a.enable_lora,
        max_lora_rank=a.max_lora_rank, max_loras=a.max_loras)


def build_plans(model: str, gpu: str | None, vram: str | None, a: EngineArgs, one_card: bool = False):
    """One vLLM plan per card (``--gpu``, ``--vram``, the detected GPU, or the default sizes); with ``one_card``,
    exactly one card, named or detected. The options and the model's limits are checked before the cards are
    looked for, so a refusal is printed alone.

    Raises:
        InvalidValue: a bad option; a ``--tp`` the model's shapes refuse; with ``one_card``, no card named or
            detected.
    """
    s = vllm_settings(a)
    spec = resolve_model(model)
    check_tensor_parallel(spec, s.tensor_parallel_size)
    if one_card and gpu is None and vram is None:
        det = detect_gpus()
        if len(det.gpus) != 1:
            raise InvalidValue("--gpu/--vram", "none given", "one card, named or detected",
                               "name the card the deployment runs on, e.g. --gpu h100 or --vram 80GiB "
                               f"({len(det.gpus)} GPUs detected" + (f": {det.reason})" if det.reason else ")"))
    cards, why = resolve_gpus(gpu, vram)
    say(f"cards: {why}")
    try:
        return [plan_vllm(spec, card, s) for card in cards]
    except ConfigError as e:
        if e.field != "config.json:model_type":
            raise
        plan = f"`vramguard plan {model}` without --engine vllm"
        raise ConfigError(e.field, e.value, e.accepted, NO_VLLM_MODEL_FIX.format(model_type=spec.model_type,
                                                                                 plan=plan)) from None


def print_plans(plans, model: str, as_json: bool) -> None:
    """Print the plans on stdout: JSON (one object, or a list for several cards), or each plan's lines."""
    ref = model_ref(model)
    if as_json:
        data = [plan_to_json(p, ref) for p in plans]
        write_json(data[0] if len(data) == 1 else data)
        return
    width = console().width
    for i, p in enumerate(plans):
        if i:
            print()
        print("\n".join(plan_lines(p, ref, width, as_flags)))


def refusal_error(p, model: str):
    """The Infeasible error of a plan vLLM would not start with: the field at fault, its limit and the plan's
    fix."""
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


def deployment(model: str, gpu: str | None, vram: str | None, a: EngineArgs, to: str, replicas: int,
               as_data: bool = False):
    """The deployment for ``to``; for vllm, shell lines, or with ``as_data`` the argv and environment as a dict."""
    check_replicas(replicas)  # before planning: a bad value prints its error alone
    check_model_source(model_ref(model), to)
    p = build_plans(model, gpu, vram, a, one_card=True)[0]
    if p.refusal:
        raise refusal_error(p, model)
    say(f"planned: GPU KV cache size {p.kv_tokens:,} tokens, maximum concurrency {p.max_concurrency:,.2f}x for "
        f"{p.max_model_len:,} tokens per request")
    for name, value in p.env().items():
        say(f"note: {name}={value} is set in this environment: the deployment sets it too (max_model_len "
            f"{p.max_model_len:,} is above the model's {p.model_max_len:,})")
    if to == "vllm":
        check_replicas(replicas)
        if as_data:
            return {"command": ["vllm", "serve", *serve_args(p, model_ref(model), PORT)], "env": p.env()}
        return command_lines(p, model_ref(model), console().width, PORT)
    return export_fn(p, model_ref(model), to, replicas)
