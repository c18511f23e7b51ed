"""``vramguard plan --engine vllm`` and ``vramguard export``: the options of vLLM's engine arguments (defined once,
shared by both commands) and the step from them to a :class:`~vramguard.engines.vllm.VllmPlan`."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import typer

from vramguard.cli.common import say
from vramguard.settings import TORCH_DTYPE_NAMES

Engine = Enum("Engine", {"transformers": "transformers", "vllm": "vllm"}, type=str)
KvCacheDtype = Enum("KvCacheDtype", {v: v for v in ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")}, type=str)




def engine_option():
    return typer.Option(Engine['transformers'], help="transformers: this process; vllm: vLLM's own memory model "
                        "(flags, KV cache tokens and concurrency it logs at start)")


def tp_option():
    return typer.Option(1, "--tp", help="vLLM tensor_parallel_size (GPUs per pipeline stage)")


def pp_option():
    return typer.Option(1, "--pp", help="vLLM pipeline_parallel_size (stages)")


def util_option():
    return typer.Option(0.9, "--gpu-memory-utilization", help="vLLM: the fraction of each GPU vLLM may use")


def max_model_len_option():
    return typer.Option(None, "--max-model-len", help="vLLM: tokens per request (default: the model's context)")


def kv_cache_dtype_option():
    return typer.Option(KvCacheDtype['auto'], "--kv-cache-dtype", help="vLLM KV cache type (fp8: one byte)")


def max_num_seqs_option():
    return typer.Option(None, "--max-num-seqs", help="vLLM: requests per step (default: vLLM's for the card)")


def max_num_batched_tokens_option():
    return typer.Option(None, "--max-num-batched-tokens", help="vLLM: tokens per step (default: vLLM's for the "
                        "card)")


def vllm_version_option():
    return typer.Option(None, "--vllm-version", help="vLLM release whose memory rules to plan with (default: the "
                        "installed vLLM, else the newest modelled)")


def enable_lora_option():
    return typer.Option(False, "--enable-lora", help="vLLM: LoRA slots allocated at start (--max-lora-rank, "
                        "--max-loras)")


def max_lora_rank_option():
    return typer.Option(16, "--max-lora-rank", help="vLLM: the largest LoRA rank served (1, 8, 16, 32, 64, 128, 256, "
                        "320, 512)")


def max_loras_option():
    return typer.Option(1, "--max-loras", help="vLLM: LoRAs in one batch (each a slot in every layer)")


def refuse_vllm_options(a: EngineArgs) -> None:
    """Raise InvalidValue for a vLLM-only option set away from its default without ``--engine vllm``: the
    transformers plan would drop it silently (``--tp`` and ``--dtype`` are options of both)."""
    from vramguard.errors import InvalidValue
    for name in ("pp", "gpu_memory_utilization", "max_model_len", "kv_cache_dtype", "max_num_seqs",
                 "max_num_batched_tokens", "vllm_version", "enable_lora", "max_lora_rank", "max_loras"):
        value = getattr(a, name)
        if value != EngineArgs.__dataclass_fields__[name].default:
            flag = "--" + name.replace("_", "-")
            raise InvalidValue(flag, value, "with --engine vllm only (vLLM's engine argument)",
                               f"add --engine vllm to plan vLLM with it, or leave {flag} out")


# options of the transformers plan -> what stands for them in vLLM's plan ("" where nothing does)
TRANSFORMERS_ONLY = {
    "revision": "",
    "double_quant": "", "compute_dtype": "", "attn": "", "kv_dtype": "--kv-cache-dtype", "cache": "", "batch":
    "--max-num-seqs", "num_beams": "", "num_return_sequences": "", "prompt_tokens": "--max-model-len",
    "max_new_tokens": "--max-model-len", "prefill_chunk": "--max-num-batched-tokens", "logits": "",
    "output_attentions": "", "padded": "", "do_sample": "", "context": "--max-model-len", "gpus": "--tp",
    "device_map": "", "max_memory": "", "alloc_conf": "", "freed_before": "",
}


def refuse_transformers_options(given: dict[str, object]) -> None:
    """Raise InvalidValue for the first option of ``given`` (parameter name -> value, the options set on the
    command line) that only the transformers plan reads: vLLM's plan would drop it silently."""
    from vramguard.errors import InvalidValue
    for name, instead in TRANSFORMERS_ONLY.items():
        if name in given:
            value = getattr(given[name], "value", given[name])
            flag = "--" + name.replace("_", "-")
            if isinstance(value, bool):  # a switch: shown as written, not as True or False
                value = f"{flag if value else '--no-' + flag[2:]} with --engine vllm"
            use = f"use {instead} with --engine vllm, or leave {flag} out" if instead else f"leave {flag} out"
            raise InvalidValue(flag, value, "with the transformers engine only (vLLM's plan does not read it)",
                               use + ", or plan with --engine transformers")


def with_quantization(a: EngineArgs, given: dict[str, object]) -> EngineArgs:
    """``a`` with vLLM's ``quantization`` for a ``--quant`` given on the command line: ``nf4`` is vLLM's
    ``--quantization bitsandbytes`` (NF4 applied at load); the 16-bit formats are the model dtype. Raises
    InvalidValue for a format vLLM does not apply at load."""
    from dataclasses import replace

    from vramguard.errors import InvalidValue
    if "quant" not in given:
        return a
    quant = getattr(given["quant"], "value", given["quant"])
    if quant == "nf4":
        return replace(a, quantization="bitsandbytes")
    if quant in ("bf16", "fp16", "fp32"):
        return replace(a, dtype=a.dtype or quant)
    raise InvalidValue("--quant", quant, "nf4 (vLLM's --quantization bitsandbytes) or a 16/32-bit dtype with "
                       "--engine vllm", "use --quant nf4, or a pre-quantized checkpoint (vLLM reads its format)")


@dataclass(frozen=True)
class EngineArgs:
    """The vLLM options as the CLI got them."""

    tp: int = 1
    pp: int = 1
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    kv_cache_dtype: str = "auto"
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    dtype: str | None = None
    kv_offload: str | None = None
    vllm_version: str | None = None
    enable_lora: bool = False
    max_lora_rank: int = 16
    max_loras: int = 1
    quantization: str | None = None


def model_ref(model: str) -> str:
    """What ``vllm serve`` should load: the Hugging Face id of a catalog name, else MODEL as given."""
    from vramguard.catalog.models import MODELS
    from vramguard.resolve import catalog_name
    key = catalog_name(model)
    return str(MODELS[key]["source"]) if key else model


def vllm_settings(a: EngineArgs):
    """The :class:`~vramguard.engines.vllm.VllmSettings` of the options; raises InvalidValue for a bad one (checked
    before the model or the cards are read, so nothing else is printed)."""
    import os

    from vramguard.engines.vllm import settings_for_version
    from vramguard.engines.vllm_versions import default_version
    from vramguard.units import parse_size
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
    from vramguard.engines.vllm import plan_vllm
    from vramguard.engines.vllm_weights import check_tensor_parallel
    from vramguard.errors import ConfigError, InvalidValue
    from vramguard.hardware import resolve_gpus
    from vramguard.resolve import resolve_model
    s = vllm_settings(a)
    spec = resolve_model(model)
    check_tensor_parallel(spec, s.tensor_parallel_size)
    if one_card and gpu is None and vram is None:
        from vramguard.hardware import detect_gpus
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
        from vramguard.engines.vllm import NO_VLLM_MODEL_FIX
        plan = f"`vramguard plan {model}` without --engine vllm"
        raise ConfigError(e.field, e.value, e.accepted, NO_VLLM_MODEL_FIX.format(model_type=spec.model_type,
                                                                                 plan=plan)) from None


def print_plans(plans, model: str, as_json: bool) -> None:
    from vramguard.cli.common import write_json
    from vramguard.engines.vllm_text import plan_lines, plan_to_json
    ref = model_ref(model)
    if as_json:
        data = [plan_to_json(p, ref) for p in plans]
        write_json(data[0] if len(data) == 1 else data)
        return
    from vramguard.cli.common import as_flags
    from vramguard.cli.render import console
    width = console().width
    for i, p in enumerate(plans):
        if i:
            print()
        print("\n".join(plan_lines(p, ref, width, as_flags)))
