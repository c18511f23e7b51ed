"""``vramguard plan --engine vllm`` and ``vramguard export``: the options of vLLM's engine arguments (defined once,
shared by both commands) and their refusals; the step from them to a :class:`~vramguard.engines.vllm.VllmPlan` is
:mod:`vramguard.cli.vllm`."""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum

import typer

from vramguard.engines.vllm_quant import AT_LOAD
from vramguard.errors import InvalidValue

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


VllmQuantization = Enum("VllmQuantization", {v: v for v in AT_LOAD}, type=str)


def quantization_option():
    return typer.Option(None, "--quantization", help="vLLM: quantize a 16-bit checkpoint at load: fp8 (FP8 weights, "
                        "per-tensor scales) or bitsandbytes (NF4, as --quant nf4); a checkpoint saved in GPTQ, AWQ... "
                        "needs none: its format is read from its config.json")


def max_loras_option():
    return typer.Option(1, "--max-loras", help="vLLM: LoRAs in one batch (each a slot in every layer)")


def refuse_vllm_options(a: EngineArgs) -> None:
    """Raise InvalidValue for a vLLM-only option set away from its default without ``--engine vllm``: the
    transformers plan would drop it silently (``--tp`` and ``--dtype`` are options of both)."""
    for name in ("pp", "gpu_memory_utilization", "max_model_len", "kv_cache_dtype", "max_num_seqs",
                 "max_num_batched_tokens", "vllm_version", "enable_lora", "max_lora_rank", "max_loras",
                 "quantization"):
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
    if "quant" not in given:
        return a
    quant = getattr(given["quant"], "value", given["quant"])
    if a.quantization is not None and not (quant == "nf4" and a.quantization == "bitsandbytes"):
        raise InvalidValue("--quant", quant, f"no --quant beside --quantization {a.quantization} (vLLM applies one "
                           "format at load)", f"leave --quant out to plan --quantization {a.quantization}")
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
