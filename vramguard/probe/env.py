"""Probes of the software and hardware environment, each with the value found and the reason.

Nothing here raises: a missing package or driver is a value (``None``) with the exception text as the reason.
Tests replace the whole probe through :data:`ENV_OVERRIDE`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vramguard.allocconf import env_alloc_conf
from vramguard.catalog.gpus import GpuSpec
from vramguard.extras import import_bitsandbytes
from vramguard.hardware import detect_gpus

ENV_OVERRIDE = None  # a callable returning an Env, set by tests


@dataclass(frozen=True)
class Env:
    """What the machine has. Sizes are bytes; versions are strings; ``*_reason`` say why a value is missing."""

    torch_version: str | None = None
    torch_reason: str = ""
    cuda_available: bool = False
    cuda_runtime: str | None = None
    cuda_reason: str = ""
    driver_version: str | None = None
    gpus: tuple[GpuSpec, ...] = ()
    gpu_reason: str = ""
    transformers_version: str | None = None
    accelerate_version: str | None = None
    bnb_version: str | None = None
    bnb_backend: str | None = None
    bnb_native_ok: bool | None = None
    bnb_reason: str = ""
    flash_attn_version: str | None = None
    flash_attn_reason: str = ""
    sdpa_backends: dict[str, bool] = field(default_factory=dict)
    alloc_conf: str | None = None
    ram_available_bytes: int | None = None
    ram_total_bytes: int | None = None


def _version(module: str) -> tuple[str | None, str]:
    try:
        mod = __import__(module)
        return str(getattr(mod, "__version__", "unknown")), "installed"
    except Exception as e:  # ImportError, or a broken install raising anything at import
        return None, f"{type(e).__name__}: {e}"


def _torch() -> dict:
    out: dict = {}
    out["torch_version"], out["torch_reason"] = _version("torch")
    if out["torch_version"] is None:
        out["cuda_reason"] = "torch is not installed"
        return out
    import torch
    out["cuda_runtime"] = torch.version.cuda
    try:
        out["cuda_available"] = bool(torch.cuda.is_available())
        out["cuda_reason"] = "CUDA device visible to torch" if out["cuda_available"] else (
            "torch was built without CUDA" if torch.version.cuda is None else "no CUDA device visible to torch")
    except Exception as e:  # a broken driver makes is_available() raise on some versions
        out["cuda_available"], out["cuda_reason"] = False, f"{type(e).__name__}: {e}"
    b = torch.backends.cuda
    out["sdpa_backends"] = {"flash": b.flash_sdp_enabled(), "efficient": b.mem_efficient_sdp_enabled(),
                            "math": b.math_sdp_enabled(),
                            "cudnn": b.cudnn_sdp_enabled() if hasattr(b, "cudnn_sdp_enabled") else False}
    return out


def _bnb(cuda_available: bool) -> dict:
    import logging
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # its CPU-kernel notice is noise for a check
    version, reason = _version("bitsandbytes")
    out = {"bnb_version": version, "bnb_reason": reason}
    if version is None:
        return out
    try:
        import_bitsandbytes()
        from bitsandbytes import cextension as c
        out["bnb_backend"] = getattr(c, "BNB_BACKEND", None)
        lib = getattr(c, "lib", None)
        kind = type(lib).__name__
        if "ErrorHandler" in kind:
            out["bnb_native_ok"] = False
            out["bnb_reason"] = str(getattr(lib, "formatted_error", "") or getattr(lib, "error_msg", "")
                                    or "the native library failed to load")
        else:
            out["bnb_native_ok"] = (kind == "CudaBNBNativeLibrary") if cuda_available else True
            out["bnb_reason"] = f"native library: {kind}"
    except Exception as e:
        out["bnb_native_ok"], out["bnb_reason"] = False, f"{type(e).__name__}: {e}"
    return out


def _driver() -> str | None:
    try:
        import pynvml
        pynvml.nvmlInit()
        try:
            v = pynvml.nvmlSystemGetDriverVersion()
            return v.decode() if isinstance(v, bytes) else str(v)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no driver: the GPU probe already carries the reason
        return None


def _ram() -> tuple[int | None, int | None]:
    try:
        import psutil
        vm = psutil.virtual_memory()
        return int(vm.available), int(vm.total)
    except Exception:
        return None, None


def probe_env(bnb: bool = True) -> Env:
    """Probe everything :mod:`vramguard.check` needs. Never raises. ``bnb=False`` leaves bitsandbytes out (its
    fields None, the reason saying so): importing it costs seconds, and a 16/32-bit load does not use it."""
    if ENV_OVERRIDE is not None:
        return ENV_OVERRIDE()
    t = _torch()
    det = detect_gpus()
    fa_version, fa_reason = _version("flash_attn")
    ram_avail, ram_total = _ram()
    return Env(
        **t, driver_version=_driver(), gpus=det.gpus, gpu_reason=det.reason,
        transformers_version=_version("transformers")[0], accelerate_version=_version("accelerate")[0],
        **(_bnb(t.get("cuda_available", False)) if bnb else {"bnb_reason": "not probed (bnb=False)"}),
        flash_attn_version=fa_version, flash_attn_reason=fa_reason,
        alloc_conf=env_alloc_conf() or None,
        ram_available_bytes=ram_avail, ram_total_bytes=ram_total)
