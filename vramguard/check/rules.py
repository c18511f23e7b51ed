"""The findings of ``check``: pure functions of the probed environment, the checkpoint and the load settings.

Each finding (the shared :class:`~vramguard.finding.Finding`) has a level (ok / info / warn / fail), the value
found, the reason and the fix. No probing happens here, so tests build an :class:`~vramguard.probe.env.Env` by
hand to reach every branch.
"""

from __future__ import annotations

from vramguard.catalog.gpus import GpuSpec
from vramguard.finding import Finding
from vramguard.probe.checkpoint import CheckpointInfo
from vramguard.probe.env import Env
from vramguard.plan.choice import choose
from vramguard.plan.rules import attention_map_bytes, dequantized_weight_bytes
from vramguard.settings import DTYPE_BYTES, TORCH_DTYPE_NAMES, Settings
from vramguard.spec import ModelSpec
from vramguard.units import fmt_bytes, fmt_gib

FLASH_ATTN_MAX_HEAD_DIM = 256  # flash_attn 2.x supports head dimensions up to 256
RAM_WARN_FRACTION = 0.8


def finding_line(code: str, level: str, value: str, message: str, fix: str | None = None,
                 bytes: int | None = None) -> Finding:
    """One line of ``check`` as the shared :class:`~vramguard.finding.Finding`, in the order it prints: the level
    (ok, warn, fail or info), the rule, the value found, then the reason and the fix."""
    return Finding(code, level, message, fix, bytes, value)


def _cc(g: GpuSpec | None) -> str:
    return ".".join(map(str, g.compute_capability)) if g and g.compute_capability else "unknown"


def environment_findings(env: Env, gpu: GpuSpec | None, gpu_source: str) -> list[Finding]:
    """torch, CUDA, driver, the GPU and its memory, other processes, allocator settings."""
    f: list[Finding] = []
    if env.torch_version is None:
        f.append(finding_line("torch", "fail", "not installed", env.torch_reason, "pip install torch"))
    else:
        f.append(finding_line("torch", "ok", env.torch_version, f"CUDA runtime {env.cuda_runtime or 'none'}"))
    if env.cuda_available:
        f.append(finding_line("cuda", "ok", f"runtime {env.cuda_runtime}, driver {env.driver_version or '?'}",
                              env.cuda_reason))
    else:
        why = "; ".join(r for r in (env.cuda_reason, env.gpu_reason) if r)
        f.append(finding_line("cuda", "warn", "no CUDA GPU on this machine",
                              (f"{why}. " if why else "") + "Checking what can be checked without one"
                              + (f"; settings are checked against {gpu.label}" if gpu else ""),
                              None if gpu else "name the card you will run on with gpu=NAME"))
    if gpu is not None:
        used = gpu.used_by_others_bytes
        # free memory is measured on a detected card only; a catalog card or a --vram size has its total alone
        free = (f", {fmt_gib(gpu.usable_bytes)} free" if gpu.source == "detected" else
                f" ({'catalog card' if gpu.source == 'catalog' else 'a size given'}, not measured)")
        f.append(finding_line("gpu", "ok", f"{gpu.label}, compute capability {_cc(gpu)}, "
                              f"{fmt_gib(gpu.total_bytes)} total{free}", gpu_source))
        if used > gpu.total_bytes // 10:
            f.append(finding_line("other_processes", "warn", f"{fmt_gib(used)} held by other processes",
                                  "memory in use before this process starts (other programs, a display, an "
                                  "earlier Python session)", "close them, or plan with the memory that is left"))
    return f


def runtime_findings(env: Env, gpu: GpuSpec | None, s: Settings, spec: ModelSpec | None,
                     param_dtype: str, param_dtype_reason: str) -> list[Finding]:
    """bf16, bitsandbytes, flash_attn / FA2 feasibility, SDPA backends, allocator config."""
    f: list[Finding] = []
    cc = gpu.compute_capability if gpu else None
    if cc is not None:
        if gpu.supports_bf16:
            f.append(finding_line("bf16", "ok", f"supported (compute capability {_cc(gpu)})", "native since 8.0"))
        elif "bf16" in (param_dtype, s.resolved_compute_dtype if s.is_4bit else param_dtype):
            f.append(finding_line("bf16", "warn", f"not native on compute capability {_cc(gpu)}",
                                  "bfloat16 needs compute capability >= 8.0; below that it is emulated or fails",
                                  "use float16: dtype=torch.float16 and bnb_4bit_compute_dtype=torch.float16"))
    if s.is_bnb:
        if env.bnb_version is None:
            f.append(finding_line("bitsandbytes", "fail", "not installed", env.bnb_reason,
                                  "pip install bitsandbytes"))
        elif env.cuda_available and env.bnb_native_ok is False:
            f.append(finding_line("bitsandbytes", "fail", f"{env.bnb_version}, CUDA library not loadable",
                                  env.bnb_reason, "reinstall bitsandbytes for this CUDA version"))
        else:
            f.append(finding_line("bitsandbytes", "ok", f"{env.bnb_version} ({env.bnb_backend or '?'} backend)",
                                  env.bnb_reason))
    f += _flash_attn_findings(env, gpu, s, spec, param_dtype, param_dtype_reason)
    if s.effective_attn == "sdpa" and env.sdpa_backends and env.cuda_available:
        fused = [k for k in ("flash", "cudnn", "efficient") if env.sdpa_backends.get(k)]
        on = ", ".join(k for k, v in env.sdpa_backends.items() if v)
        f.append(finding_line("sdpa_backends", "ok" if fused else "warn", on or "none",
                              "torch.backends.cuda.*_sdp_enabled()",
                              None if fused else "re-enable a fused SDPA backend (flash, cuDNN or efficient)"))
    if env.alloc_conf and "expandable_segments:True" in env.alloc_conf:
        f.append(finding_line("PYTORCH_CUDA_ALLOC_CONF", "ok", env.alloc_conf, "expandable segments limit "
                              "fragmentation"))
    else:
        f.append(finding_line("PYTORCH_CUDA_ALLOC_CONF", "info", env.alloc_conf or "unset",
                              "without expandable segments, reserved-but-unused blocks can fragment the pool; "
                              "vramguard run, profile, fit and serve turn them on for their own process when it "
                              "is unset (vramguard.allocconf)",
                              "for your own scripts only: export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
                              if not env.alloc_conf else "for your own scripts: add expandable_segments:True to "
                              "the setting (vramguard keeps a setting you made as it is)"))
    return f


def _flash_attn_findings(env: Env, gpu: GpuSpec | None, s: Settings, spec: ModelSpec | None, param_dtype: str,
                         param_dtype_reason: str) -> list[Finding]:
    if s.attn != "flash_attention_2":
        value = env.flash_attn_version or "not installed"
        return [finding_line("flash_attn", "info", value, "not requested (attn_implementation="
                             f"{s.attn})")]
    f: list[Finding] = []
    if env.flash_attn_version is None:
        f.append(finding_line("flash_attention_2", "fail", "flash_attn package not installed",
                              "transformers raises ImportError at load: 'the package for FlashAttention2 doesn't "
                              f"seem to be installed' ({env.flash_attn_reason})",
                              "use attn_implementation='sdpa' (a flash-class kernel), or pip install flash-attn"))
    if gpu is not None and gpu.supports_flash_attn2 is False:
        f.append(finding_line("flash_attention_2", "fail", f"compute capability {_cc(gpu)}",
                              f"FlashAttention-2 needs compute capability >= 8.0; {gpu.label} has {_cc(gpu)}: "
                              "the load succeeds and the first generate fails inside the kernel",
                              "use attn_implementation='sdpa'"))
    if param_dtype == "fp32":
        f.append(finding_line("flash_attention_2", "fail", "dtype float32",
                              f"FlashAttention-2 runs only in float16/bfloat16; {param_dtype_reason}",
                              "pass dtype=torch.bfloat16 (torch.float16 below compute capability 8.0)"))
    if spec is not None and spec.head_dim > FLASH_ATTN_MAX_HEAD_DIM:
        f.append(finding_line("flash_attention_2", "fail", f"head_dim {spec.head_dim}",
                              f"flash_attn supports head_dim <= {FLASH_ATTN_MAX_HEAD_DIM}",
                              "use attn_implementation='sdpa'"))
    if not f:
        f.append(finding_line("flash_attention_2", "ok", f"flash_attn {env.flash_attn_version}",
                              f"compute capability {_cc(gpu)}, dtype {param_dtype}"
                              + (f", head_dim {spec.head_dim}" if spec else "")))
    return f


def checkpoint_findings(ckpt: CheckpointInfo | None, env: Env) -> list[Finding]:
    """Free RAM against the largest shard (a shard is read whole while loading), pickle weights, remote code."""
    f: list[Finding] = []
    if ckpt is not None and ckpt.largest_shard:
        name, size = ckpt.largest_shard
        avail = env.ram_available_bytes
        if avail is None:
            f.append(finding_line("ram_vs_shard", "info", f"largest shard {name}: {fmt_bytes(size)}",
                                  "free RAM unknown (psutil missing)"))
        elif size > avail:
            f.append(finding_line("ram_vs_shard", "fail",
                                  f"largest shard {name} is {fmt_bytes(size)} > {fmt_bytes(avail)} free RAM",
                                  "a shard is read whole into RAM while loading: the kernel's OOM killer will "
                                  "likely end the process ('Killed')",
                                  "re-shard the checkpoint with smaller shards (save_pretrained(..., "
                                  "max_shard_size='2GB')), or free RAM / add swap"))
        elif size > avail * RAM_WARN_FRACTION:
            f.append(finding_line("ram_vs_shard", "warn",
                                  f"largest shard {name} is {fmt_bytes(size)} of {fmt_bytes(avail)} free RAM",
                                  "little RAM left while the shard is loaded", "re-shard with a smaller shard size"))
        else:
            f.append(finding_line("ram_vs_shard", "ok",
                                  f"largest shard {name} is {fmt_bytes(size)}, {fmt_bytes(avail)} free RAM",
                                  "the shard fits in free RAM"))
    if ckpt is not None and ckpt.format == "pickle":
        f.append(finding_line("checkpoint_format", "warn", "pickle (.bin) weights only",
                              "loading pickle files can run arbitrary code; vramguard loads safetensors only",
                              "convert the checkpoint to safetensors, or opt in with allow_pickle=True"))
    if ckpt is not None and ckpt.remote_code:
        f.append(finding_line("remote_code", "warn", "config.json has auto_map (custom modelling code)",
                              "remote code is not run unless you opt in", "pass trust_remote_code=True if you "
                              "trust the repository"))
    return f


def _param_dtype_line(param_dtype: str, stored: str | None, reason: str) -> Finding:
    """The dtype the weights load in against the checkpoint's (float32 widening is :func:`model_findings`' warning):
    ok where they are the same (or the checkpoint's is unknown); a bfloat16 checkpoint loaded in float16 a warning
    (float16's largest value is 65,504 where bfloat16's is float32's: activations of a model trained in bfloat16 can
    overflow to inf and NaN); any other narrowing (float32 or float16 to bfloat16, float32 to float16) info: the
    weights are rounded to fewer mantissa bits as they load, half the memory of float32."""
    value = param_dtype + (f" (checkpoint: {stored})" if stored else "")
    if stored is None or stored == param_dtype or param_dtype == "fp32" or stored not in ("bf16", "fp16", "fp32"):
        return finding_line("param_dtype", "ok", value, reason)
    names = TORCH_DTYPE_NAMES
    change = f"the {names[stored]} checkpoint is loaded in {names[param_dtype]}, not its own dtype"
    if (stored, param_dtype) == ("bf16", "fp16"):
        return finding_line("param_dtype", "warn", value, f"{reason}; {change}: float16 overflows above 65,504, "
                            "where bfloat16 does not, so activations of a model trained in bfloat16 can become inf "
                            "or NaN", "pass dtype=torch.bfloat16 on a card of compute capability 8.0 or more; "
                            "below it, dtype=torch.float32 if the output turns to nonsense")
    return finding_line("param_dtype", "info", value, f"{reason}; {change}: its weights are rounded to fewer "
                        "mantissa bits as they load")


def model_findings(spec: ModelSpec | None, ckpt: CheckpointInfo | None, s: Settings, env: Env, param_dtype: str,
                   param_dtype_reason: str, gpu: GpuSpec | None = None,
                   dtype_passed: bool = False, default_fp32: bool = False) -> list[Finding]:
    """RAM against the largest shard, parameter and compute dtypes, options that force eager attention.
    Parameters in float32 are a warning (twice the memory, with the cost in bytes) unless the user passed that
    dtype for a float32 checkpoint; ``default_fp32``: float32 is the format vramguard itself loads without a CUDA
    device (none given), said as ``info`` with the same cost."""
    f: list[Finding] = checkpoint_findings(ckpt, env)
    stored = (ckpt.config_dtype or ckpt.stored_dtype) if ckpt else (spec.checkpoint_dtype if spec else None)
    if spec is None and ckpt is None:
        pass  # no model named: nothing to say about its dtype
    elif param_dtype == "fp32" and (stored in ("bf16", "fp16") or (stored == "fp32" and not dtype_passed)):
        cost = ""
        if spec is not None:
            weight_bytes = choose(spec, s).model.weight_bytes
            q = s.quant if s.is_bnb else "fp32"
            f32 = weight_bytes(s.with_(quant=q, dtype="fp32", compute_dtype=None)).total_bytes
            b16 = weight_bytes(s.with_(quant=q if s.is_bnb else "bf16", dtype="bf16", compute_dtype=None)).total_bytes
            cost = (f" (weights {f32 / 1e9:.1f} GB in float32 against {b16 / 1e9:.1f} GB in bfloat16)" if b16 >= 1e8
                    else f" (weights {f32:,} B in float32 against {b16:,} B in bfloat16)")
        own = "; the format vramguard loads without a CUDA device when none is given (exact)" if default_fp32 else ""
        f.append(finding_line("param_dtype", "info" if default_fp32 else "warn",
                              f"float32 (checkpoint stores {stored})",
                              f"{param_dtype_reason}: every unquantized weight takes twice the memory of 16-bit "
                              f"weights{cost}{own}", "pass quant=bf16 (quant=fp16 below compute capability 8.0)"
                              if param_dtype_reason.startswith("quant=fp32") else
                              "pass dtype=torch.bfloat16 (float16 below compute capability 8.0)"))
    else:
        f.append(_param_dtype_line(param_dtype, stored, param_dtype_reason))
    pre_ampere = gpu is not None and gpu.supports_bf16 is False
    half_name = "float16" if pre_ampere or param_dtype == "fp16" else "bfloat16"
    if s.is_4bit and spec is not None:
        compute = s.resolved_compute_dtype
        if compute == "fp32" and param_dtype == "fp32":
            f.append(finding_line("compute_dtype", "warn", "bnb_4bit_compute_dtype fp32, activations fp32",
                                  "4-bit layers dequantize to float32 and every activation is float32: twice the "
                                  "activation memory and a slow path",
                                  f"load with dtype=torch.{half_name} and bnb_4bit_compute_dtype=torch.{half_name}"))
        elif compute != param_dtype:
            big, wide, narrow = dequantized_weight_bytes(choose(spec, s).model, compute, param_dtype)
            cost = (f"largest dequantized weight {big.out_features} x {big.in_features}: {fmt_bytes(wide)} "
                    f"against {fmt_bytes(narrow)}" if wide != narrow else "a cast copy of every input and output")
            f.append(finding_line("compute_dtype", "warn", f"bnb_4bit_compute_dtype {compute}, activations "
                                  f"{param_dtype}",
                                  "each 4-bit linear casts its input and dequantizes to the compute dtype: a slow "
                                  f"path and more memory ({cost})",
                                  f"set bnb_4bit_compute_dtype=torch.{half_name}"
                                  + (f" and dtype=torch.{half_name}" if half_name != TORCH_DTYPE_NAMES.get(param_dtype)
                                     else "")))
        elif pre_ampere and compute == "bf16":  # the bf16 finding above says it is not native here
            f.append(finding_line("compute_dtype", "warn", compute, "matches the activation dtype, but bfloat16 is "
                                  "not native on this card", "set bnb_4bit_compute_dtype=torch.float16 and "
                                  "dtype=torch.float16"))
        else:
            f.append(finding_line("compute_dtype", "ok", compute, "matches the activation dtype"))
    if s.output_attentions:
        extra = ""
        if spec is not None:
            per_layer = attention_map_bytes(spec, s, param_dtype)
            extra = (f": attention maps of {fmt_bytes(per_layer)} per layer, "
                     f"{fmt_gib(per_layer * spec.num_layers)} over {spec.num_layers} layers at "
                     f"{s.prompt_tokens:,} tokens, plus a float32 softmax buffer of "
                     f"{fmt_bytes(per_layer * 4 // DTYPE_BYTES[param_dtype])} per layer while it runs")
        f.append(finding_line("eager_forced", "warn", "output_attentions=True",
                              "attention maps need eager attention: the fused kernels cannot return them" + extra,
                              "request attention maps only where needed"))
    return f
