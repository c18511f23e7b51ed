"""``load_model`` / ``unload``: the seed recipe done right, with a report of requested against active settings.

Defaults (each can be set; an explicit setting is kept, or, when it cannot run, replaced and the replacement
reported in ``LoadReport.overrides``; ``strict=True`` raises instead):

* NF4 with double quant; compute dtype bf16 where the card supports it (compute capability >= 8.0), else fp16;
  the model dtype equal to the compute dtype. A checkpoint already quantized in another format (config.json's
  ``quantization_config``: GPTQ, AWQ, GGUF, FP8, ...) loads in its own format, the bitsandbytes setting replaced
  by the compute dtype and reported: transformers refuses a BitsAndBytesConfig beside another quantization.
* attention: flash_attention_2 when the flash_attn package is installed and the card, dtype and head_dim allow it,
  else SDPA pinned to a flash-class backend (PyTorch's flash kernel, then cuDNN, then memory-efficient), verified
  by profiling one short forward (:func:`vramguard.probe.kernels.profile_attention`).
* one GPU (``device_map={"": 0}``) unless the weights do not fit it, then an explicit ``max_memory`` split over
  the visible GPUs; safetensors only and no remote code unless the caller opts in.
"""

from __future__ import annotations

import gc
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from vramguard.extras import extra_of, import_bitsandbytes
from vramguard.introspect.build import attention_support, cached_config
from vramguard.memory.runtime import CUDA_CONTEXT_BYTES
from vramguard.plan.choice import choose
from vramguard.probe.checkpoint import read_checkpoint, resolve_param_dtype
from vramguard.probe.env import probe_env
from vramguard.probe.kernels import AttentionKernel, profile_attention
from vramguard.errors import ConfigError, InvalidValue, UnknownModel
from vramguard.resolve import local_model_folder, resolve_model
from vramguard.runtime.device import MemorySnapshot, free_bytes
from vramguard.runtime.handle import LoadedModel, decode_quantization_config, loaded_settings
from vramguard.runtime.handle import pin_sdpa as _pin_sdpa
from vramguard.runtime.handle import unpin_sdpa as _unpin_sdpa
from vramguard.runtime.tokenizer import folder_tokenizer
from vramguard.settings import TORCH_DTYPE_NAMES, Settings

SDPA_PIN_ORDER = ("flash", "cudnn", "efficient")


@dataclass
class LoadReport:
    """Requested against active settings of a load, every override with its reason, and memory in bytes."""

    model: str
    requested: dict
    active: dict = field(default_factory=dict)
    overrides: list[str] = field(default_factory=list)
    kernel: AttentionKernel | None = None
    weights_bytes: int | None = None
    baseline_allocated_bytes: int | None = None
    notes: list[str] = field(default_factory=list)


def _override(report: LoadReport | None, strict: bool, field_: str, value, accepted: str, new: str, why: str) -> str:
    """``new`` in place of ``value``, recorded in ``report.overrides`` and warned; ``strict`` raises InvalidValue
    instead; ``report`` None records and warns nothing (a caller asking only what a load would choose)."""
    if strict:
        raise InvalidValue(field_, value, accepted, why)
    if report is None:
        return new
    msg = f"{field_}: {value} -> {new} ({why})"
    report.overrides.append(msg)
    warnings.warn("vramguard: " + msg, stacklevel=3)
    return new


def _not_native(gpu) -> str:
    major, minor = gpu.compute_capability
    return f"bfloat16 is not native on compute capability {major}.{minor} ({gpu.name}); float16 is"


def older_card_quant(gpu, quant: str, report: LoadReport, strict: bool) -> str:
    """``quant`` as loaded on ``gpu``: ``bf16`` weights become ``fp16`` below compute capability 8.0, reported
    in ``report.overrides`` (or raised as InvalidValue with ``strict``); anything else as given."""
    if quant == "bf16" and (gpu is not None and gpu.supports_bf16 is False):
        return _override(report, strict, "quant", quant, "fp16, fp32 or a quantization below compute capability "
                         "8.0", "fp16", _not_native(gpu))
    return quant


CPU_DEFAULT_QUANT = "fp32"


def default_quant(on_cuda: bool) -> tuple[str, str]:
    """The weight format ``vramguard run`` loads when the user names none, and why (said in its summary).

    On a CUDA device NF4 (4-bit weights with double quant: about a quarter of bf16's bytes). Without one, float32
    weights: exact (a bf16 or fp16 checkpoint widens to float32 without rounding; NF4 rounds every weight). Not
    always the fastest: on a 2-core AVX2 CPU without bf16 instructions SmolLM2-135M decoded 3x faster in float32 than
    in bf16, which PyTorch emulates there (benchmarks/README.md, "`vramguard run` as a user runs it"); on a 2-core
    CPU with AVX512-BF16, NF4 decoded 32.8 ms/token and bf16 42.9 against float32's 58.8 (128 tokens)."""
    if on_cuda:
        return "nf4", "the default on a CUDA device (4-bit weights, about a quarter of bf16's bytes)"
    return CPU_DEFAULT_QUANT, ("no CUDA device: full-precision float32 weights, exact (bf16 and NF4 compute in "
                               "lower precision and change the text); quant='bf16' or quant='nf4' loads smaller "
                               "weights, faster on a CPU with bf16 instructions, slower on one without")


def choose_dtypes(gpu, quant: str, compute_dtype: str | None, dtype: str | None, report: LoadReport | None,
                  strict: bool) -> tuple[str, str]:
    """(compute dtype, model dtype): bf16 where the card supports it (compute capability >= 8.0, or no CUDA
    card), else fp16; whichever of the two is not given equals the other, so a 4-bit layer never computes in a
    dtype other than its activations' unless both are set apart explicitly (the mismatch costs a
    cast per layer). A bf16 request on an older card becomes fp16, reported (or raised with ``strict``); so does
    ``quant="bf16"`` (weights in bf16), which :func:`load_model` overrides with :func:`older_card_quant`.
    ``report`` None: nothing recorded or warned (``vramguard check`` reports the bf16 request as its own finding)."""
    old = gpu is not None and gpu.supports_bf16 is False
    if old:
        for name, val in (("compute_dtype", compute_dtype), ("dtype", dtype)):
            if val == "bf16":
                _override(report, strict, name, val, "fp16 or fp32 below compute capability 8.0", "fp16",
                          _not_native(gpu))
        compute_dtype = "fp16" if compute_dtype == "bf16" else compute_dtype
        dtype = "fp16" if dtype == "bf16" else dtype
    cd = compute_dtype or (dtype if dtype in ("bf16", "fp16", "fp32") else ("fp16" if old else "bf16"))
    return cd, dtype or (quant if quant in ("bf16", "fp16", "fp32") else cd)


def choose_attn(attn: str, env, gpu, dtype: str, head_dim: int, report: LoadReport, strict: bool,
                supports: dict[str, bool] | None = None) -> str:
    """The attention implementation to load: flash_attention_2 when the package, card, dtype and head_dim allow
    it, else sdpa (``auto``); an explicit request that cannot run is replaced by sdpa and reported. ``supports``:
    what the model class accepts (:func:`vramguard.introspect.build.attention_support`); where it accepts neither
    flash_attention_2 nor sdpa, eager is loaded and the replacement reported (strict raises)."""
    supports = supports or {"sdpa": True, "flash_attention_2": True}
    if not supports.get("sdpa", True) and attn in ("auto", "sdpa") or \
            attn == "flash_attention_2" and not supports.get("flash_attention_2", True) and \
            not supports.get("sdpa", True):
        why = "transformers' class for this model accepts neither sdpa nor flash_attention_2 here"
        if attn == "auto":
            report.notes.append(f"attention: eager ({why})")
            return "eager"
        return _override(report, strict, "attn", attn, "an implementation the model class accepts", "eager", why)
    fa2_ok, why = True, ""
    if env.flash_attn_version is None:
        fa2_ok, why = False, "the flash_attn package is not installed"
    elif gpu is None or not gpu.supports_flash_attn2:
        fa2_ok, why = False, "FlashAttention-2 needs a CUDA GPU of compute capability >= 8.0"
    elif dtype == "fp32":
        fa2_ok, why = False, "FlashAttention-2 needs float16/bfloat16"
    elif head_dim > 256:
        fa2_ok, why = False, f"flash_attn supports head_dim <= 256, the model has {head_dim}"
    if attn == "auto":
        report.notes.append("attention: flash_attention_2" if fa2_ok else f"attention: sdpa ({why})")
        return "flash_attention_2" if fa2_ok else "sdpa"
    if attn == "flash_attention_2" and not fa2_ok:
        return _override(report, strict, "attn", attn, "an implementation that can run here", "sdpa", why)
    return attn


def _verify_sdpa_pin(model, report: LoadReport, on_cuda: bool) -> None:
    """Pin SDPA to the first flash-class backend that runs for this model, verified by a profiled forward."""
    if not on_cuda:
        try:
            report.kernel = profile_attention(model, "sdpa", seq_len=64)
        except (RuntimeError, AssertionError) as e:  # e.g. bitsandbytes' CPU kernels refuse some shapes
            report.notes.append(f"attention not verified on the CPU: {type(e).__name__}: {str(e)[:160]}")
        return
    errors = []
    for backend in SDPA_PIN_ORDER:
        _pin_sdpa(model, backend)
        try:
            k = profile_attention(model, "sdpa", pinned=backend)
        except RuntimeError as e:  # "No available kernel": this backend cannot take these shapes
            errors.append(f"{backend}: {str(e).splitlines()[0][:160]}")
            _unpin_sdpa(model)
            continue
        if k.matches_request:
            report.kernel = k
            report.active["sdpa_backend"] = backend
            report.notes += [f"sdpa backend tried and failed: {e}" for e in errors]
            return
        _unpin_sdpa(model)
    report.kernel = profile_attention(model, "sdpa")
    report.notes.append("no flash-class SDPA backend ran (" + "; ".join(errors) + "); SDPA left unpinned")


def load_model(model: str, *, quant: str = "nf4", double_quant: bool = True, compute_dtype: str | None = None,
               dtype: str | None = None, attn: str = "auto", device_map: str | dict | None = None,
               trust_remote_code: bool = False, allow_pickle: bool = False, verify: bool = True,
               strict: bool = False, tokenizer=None) -> LoadedModel:
    """Load ``model`` (a local folder or a model id in the local HF cache) for inference, and report what runs.

    Args:
        quant: nf4 | fp4 | int8 (bitsandbytes) | bf16 | fp16 | fp32.
        compute_dtype, dtype: bf16 | fp16 | fp32; ``None`` = bf16 on compute capability >= 8.0, else fp16.
        attn: auto | flash_attention_2 | sdpa | eager.
        device_map: ``None`` = one GPU, or a split by ``max_memory`` when the weights need several; else passed on.
        trust_remote_code, allow_pickle: opt-ins (off: no custom code, safetensors only).
        verify: profile one short forward and name the attention kernel that ran.
        strict: raise instead of replacing a setting that cannot run here.
        tokenizer: the tokenizer the caller already read from this folder (``vramguard run`` reads it to check the
            prompt before loading); None reads it here.

    Returns:
        The :class:`~vramguard.runtime.handle.LoadedModel` every runtime verb takes: the model, its tokenizer, the
        report, the spec it was resolved to, the settings as loaded and the pre-load snapshot (iterable as
        ``model, tokenizer, report``).

    Raises:
        UnknownModel: no local weights for ``model``. InvalidValue: a bad setting (or one that cannot run, with
        ``strict``). ImportError: torch/transformers missing.
    """
    import torch
    import transformers

    Settings(quant=quant, double_quant=double_quant, compute_dtype=compute_dtype, dtype=dtype)  # validates
    if attn not in ("auto", "flash_attention_2", "sdpa", "eager"):
        raise InvalidValue("attn", attn, "auto | flash_attention_2 | sdpa | eager")
    folder, ckpt = _weights_folder(model, allow_pickle)
    spec = resolve_model(str(folder))
    env = probe_env(bnb=quant in ("nf4", "fp4", "int8"))  # a 16/32-bit load never imports bitsandbytes
    on_cuda = env.cuda_available and torch.cuda.is_available()
    gpu = env.gpus[0] if on_cuda and env.gpus else None
    report = LoadReport(str(model), {"quant": quant, "double_quant": double_quant, "compute_dtype": compute_dtype,
                                     "dtype": dtype, "attn": attn, "device_map": device_map})
    quant = older_card_quant(gpu, quant, report, strict)
    cd, dt = choose_dtypes(gpu, quant, compute_dtype, dtype, report, strict)
    if quant in ("nf4", "fp4", "int8") and spec.prequantized and spec.prequantized != "bitsandbytes":
        quant = _override(report, strict, "quant", quant, "a 16-bit or 32-bit dtype for a checkpoint already "
                          f"quantized ({spec.prequantized})", dt if dt in ("bf16", "fp16", "fp32") else cd,
                          f"the checkpoint is already quantized ({spec.prequantized}; config.json's "
                          "quantization_config): transformers loads it in its own format, bitsandbytes does not "
                          "apply to it")
    param_dtype, _ = resolve_param_dtype(dt, ckpt, transformers.__version__, quant)
    chosen_attn = choose_attn(attn, env, gpu, param_dtype, spec.head_dim, report, strict, _attention_support(spec))
    kwargs: dict = {"dtype": getattr(torch, TORCH_DTYPE_NAMES[param_dtype]), "attn_implementation": chosen_attn,
                    "use_safetensors": not allow_pickle, "trust_remote_code": trust_remote_code,
                    "local_files_only": True}
    if quant in ("nf4", "fp4", "int8"):
        _require_bitsandbytes(quant)
        kwargs["quantization_config"] = _bnb_config(quant, double_quant, cd)
    kwargs["device_map"] = device_map if device_map is not None else _default_device_map(spec, quant, on_cuda,
                                                                                       report, kwargs)
    baseline: int | None = None
    workspace = 0
    snapshot = None
    if on_cuda:  # baseline and residual (unload) both leave cuBLAS workspaces out: dropped here and there
        clear_cublas_workspaces()
        snapshot = MemorySnapshot.take()
        baseline = snapshot.allocated
        a = torch.ones(8, 8, device="cuda", dtype=torch.bfloat16)  # the workspace the first matmul takes and
        (a @ a).sum().item()  # keeps, now rather than inside loading, where it would count as weights
        del a
        workspace = torch.cuda.memory_allocated() - baseline
    m = _from_pretrained(folder, spec, kwargs)
    report.baseline_allocated_bytes = baseline
    report.weights_bytes = torch.cuda.memory_allocated() - baseline - workspace if baseline is not None else None
    tok, no_tokenizer = (tokenizer, "") if tokenizer is not None else folder_tokenizer(folder, trust_remote_code)
    if tok is None:  # a folder with weights but no tokenizer files
        report.notes.append(f"no tokenizer loaded: {no_tokenizer}")
    if chosen_attn == "sdpa" and attn in ("auto", "sdpa", "flash_attention_2") and verify:
        _verify_sdpa_pin(m, report, on_cuda)
    elif verify:
        report.kernel = profile_attention(m, chosen_attn, seq_len=64 if not on_cuda else 256)
    report.active = {**_active(m), **report.active}
    return LoadedModel(m, tok, report, spec, loaded_settings(m), snapshot)


def _weights_folder(model: str, allow_pickle: bool):
    """(the folder holding ``model``'s weights, its checkpoint info); refuses what cannot be loaded as asked."""
    folder = local_model_folder(model)
    if not any(Path(folder).glob("*.safetensors")) and not any(Path(folder).glob("*.bin")):
        raise UnknownModel("MODEL", model, "a local model folder or a cached model id with weights",
                           f"{folder} holds no weights (*.safetensors or *.bin): save or download them there")
    ckpt = read_checkpoint(folder)
    if ckpt.format == "pickle" and not allow_pickle:
        raise InvalidValue("allow_pickle", False, "True to load pickle (.bin) weights",
                           "convert the checkpoint to safetensors, or pass allow_pickle=True if you trust it")
    return folder, ckpt


def _require_bitsandbytes(quant: str) -> None:
    """Refuses a bitsandbytes ``quant`` when bitsandbytes is not installed, before transformers' loader would fail
    on it with an ImportError (its quantizer's ``validate_environment``); imports it otherwise, before transformers'
    quantizer does, without its own TorchDynamo and Inductor imports (:func:`vramguard.extras.import_bitsandbytes`).

    Raises:
        ConfigError: ``quant`` is nf4/fp4/int8 and ``importlib.util.find_spec("bitsandbytes")`` finds nothing.
    """
    import importlib.util
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ConfigError("quant", quant, "a 16-bit or 32-bit dtype when bitsandbytes is not installed "
                          f"({quant} weights are quantized by bitsandbytes)",
                          f"pip install 'vramguard[{extra_of('bitsandbytes')}]' (it installs bitsandbytes), or load "
                          "with quant='bf16' (twice the weight bytes of nf4)")
    import_bitsandbytes()


def _bnb_config(quant: str, double_quant: bool, compute_dtype: str):
    import torch
    import transformers
    if quant == "int8":
        return transformers.BitsAndBytesConfig(load_in_8bit=True)
    return transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant,
                                           bnb_4bit_use_double_quant=double_quant,
                                           bnb_4bit_compute_dtype=getattr(torch, TORCH_DTYPE_NAMES[compute_dtype]))


@contextmanager
def _no_progress_bar():
    """transformers' "Loading weights" progress bar off while vramguard loads (its public switch,
    ``transformers.utils.logging.disable_progress_bar``), and back as the caller had it afterwards."""
    from transformers.utils import logging as hf_logging
    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def _from_pretrained(folder, spec, kwargs: dict):
    """``AutoModelForCausalLM.from_pretrained`` in eval mode; a config with no causal-LM class is a ConfigError."""
    import transformers
    try:
        with _no_progress_bar():
            m = transformers.AutoModelForCausalLM.from_pretrained(str(folder), **kwargs)
    except ValueError as e:
        if "Unrecognized configuration class" not in str(e):
            raise
        raise ConfigError("MODEL", spec.model_type, "a model AutoModelForCausalLM loads",
                          f"transformers {transformers.__version__} has no causal-LM class for {spec.model_type} "
                          "(its model may need another Auto class or a newer transformers)") from None
    m.eval()
    return m


def _attention_support(spec) -> dict[str, bool]:
    return attention_support(cached_config(spec.config_json, spec.name)) if spec.config_json else {}


def _default_device_map(spec, quant, on_cuda, report, kwargs) -> dict | str:
    if not on_cuda:
        return {"": "cpu"}
    import torch
    need = choose(spec).model.weight_bytes(Settings(quant=quant)).total_bytes + CUDA_CONTEXT_BYTES
    free = [free_bytes(i) for i in range(torch.cuda.device_count())]
    if need <= free[0] or len(free) == 1:
        return {"": 0}
    kwargs["max_memory"] = {i: int(f * 0.9) for i, f in enumerate(free)}
    report.notes.append(f"weights ({need:,} B) exceed GPU 0's free memory ({free[0]:,} B): split with max_memory "
                        f"{kwargs['max_memory']}")
    return "auto"


def _active(m) -> dict:
    import torch
    q = getattr(m.config, "quantization_config", None)
    method, double, _ = decode_quantization_config(q)
    quant = method or "none"
    compute = None
    for mod in m.modules():
        if hasattr(mod, "compute_dtype") and getattr(mod, "compute_dtype", None) is not None:
            compute = str(mod.compute_dtype).replace("torch.", "")
            break
    emb = m.get_input_embeddings().weight
    dmap = getattr(m, "hf_device_map", None) or {"": str(emb.device)}
    on_gpu = any(str(v) not in ("cpu", "disk") for v in dmap.values())
    offloaded = sorted(k for k, v in dmap.items() if str(v) in ("cpu", "disk")) if on_gpu else []
    return {"quant": quant, "double_quant": double if method in ("nf4", "fp4") else None,
            "compute_dtype": compute, "dtype": str(emb.dtype).replace("torch.", ""),
            "attn": m.config._attn_implementation, "device_map": {k: str(v) for k, v in dmap.items()},
            "offloaded_modules": offloaded, "device": str(emb.device),
            "parameters_dtype_float32": any(p.dtype == torch.float32 for p in m.parameters())}


@dataclass(frozen=True)
class UnloadReport:
    """Bytes freed, the residual above the pre-load baseline (CUDA only) and what still holds it."""

    freed_bytes: int | None
    residual_bytes: int | None
    holders: tuple[str, ...]
    workspace_bytes: int = 0  # cuBLAS workspaces dropped with the model (left out of baseline and residual)

    RESIDUAL_TOLERANCE = 0.01  # of the weights: allocator rounding and a few small cached tensors

    def returned(self, weights_bytes: int | None) -> bool | None:
        """Whether memory went back to the pre-load baseline, within 1% of ``weights_bytes`` (None: not measured,
        i.e. no CUDA device or no baseline)."""
        if self.residual_bytes is None:
            return None
        return self.residual_bytes <= self.RESIDUAL_TOLERANCE * (weights_bytes or 0) + (1 << 20)

    def describe(self, weights_bytes: int | None) -> str:
        """One line for reports: the residual against the baseline and, when memory was not returned, what holds
        it (the largest CUDA tensors still alive)."""
        if self.residual_bytes is None:
            return "not measured (no CUDA device)"
        if self.residual_bytes < 0:
            return f"all returned: {-self.residual_bytes:,} B below the allocated memory before loading"
        text = f"{self.residual_bytes:,} B above the allocated memory before loading"
        if weights_bytes:
            text += f" ({100 * self.residual_bytes / weights_bytes:.2f}% of the {weights_bytes:,} B of weights)"
        if not self.returned(weights_bytes) and self.holders:
            text += "; still held by: " + ", ".join(self.holders)
        return text


def clear_cublas_workspaces() -> int:
    """Drop cuBLAS's workspaces; returns the bytes freed (0 without CUDA or where PyTorch lacks the call).

    cuBLAS keeps one workspace per (thread, stream) in PyTorch's caching allocator (32 MiB on sm90), taken by the
    first matmul and never given back, e.g. one for a server's engine thread. PyTorch's own CUDA memory-leak check
    drops them the same way (torch.testing._internal.common_utils: gc.collect, _cuda_clearCublasWorkspaces,
    empty_cache). The next matmul takes a new one. Call it only when no kernel of this process is running.
    """
    import torch
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is None or not torch.cuda.is_available():
        return 0
    held = torch.cuda.memory_allocated()
    clear()
    return held - torch.cuda.memory_allocated()


def unload(model) -> UnloadReport:
    """Free a model loaded by :func:`load_model` (its :class:`LoadedModel`, whose baseline snapshot the residual is
    measured from; or any ``nn.Module``): drop every parameter and buffer, break reference cycles (``gc.collect()``:
    bitsandbytes' quantized modules hold cycles that plain ``del`` does not free), drop cuBLAS workspaces, and return
    the cached blocks (``torch.cuda.empty_cache()``).

    The module object is left empty; use it no more.
    """
    import torch
    handle = model if isinstance(model, LoadedModel) else None
    model = handle.model if handle is not None else model
    on_cuda = torch.cuda.is_available()
    before = torch.cuda.memory_allocated() if on_cuda else 0
    baseline = handle.baseline.allocated if handle is not None and handle.baseline is not None else None
    _unpin_sdpa(model)
    for mod in model.modules():
        for name in list(mod._parameters):
            p = mod._parameters[name]
            if p is not None and hasattr(p, "quant_state"):
                p.quant_state = None
            mod._parameters[name] = None
        for name in list(mod._buffers):
            mod._buffers[name] = None
        for name, v in list(vars(mod).items()):  # tensors and bitsandbytes QuantState kept as plain attributes
            if torch.is_tensor(v) or type(v).__name__ == "QuantState":
                setattr(mod, name, None)
    gc.collect()
    if not on_cuda:
        return UnloadReport(None, None, ())
    workspaces = clear_cublas_workspaces()
    torch.cuda.empty_cache()
    after = torch.cuda.memory_allocated()
    residual = after - baseline if baseline is not None else None
    holders: list[str] = []
    if residual and residual > 0:
        tensors = [o for o in gc.get_objects() if torch.is_tensor(o) and o.is_cuda]
        tensors.sort(key=lambda t: -t.untyped_storage().nbytes())
        holders = [f"{tuple(t.shape)} {t.dtype} {t.untyped_storage().nbytes():,} B" for t in tensors[:5]]
    return UnloadReport(before - after, residual, tuple(holders), workspaces)
