"""What a failed engine step was: out of memory (:func:`vramguard.runtime.device.is_oom`), a fault of the device
(:func:`device_fault`), or neither (a fault of the request); and how many failures each kind is allowed."""

from __future__ import annotations

from vramguard.runtime.device import is_oom

MAX_OOM_RETRIES = 3
MAX_STEP_FAILURES = 3  # failed steps a request may be part of before it fails, companions or not
MAX_FAILURES_IN_A_ROW = 16  # failed iterations with no request in the step, in a row: the engine is broken (fatal);
# as many failures in a row charged to requests queue a known-good probe request (serve/recovery.py add_probe)
# Text of the errors PyTorch raises for a faulty or lost device (CUDA runtime, cuBLAS, cuDNN, NCCL, ROCm); an
# out-of-memory error is not one of them (see is_oom).
DEVICE_FAULT_MARKERS = ("CUDA error", "CUBLAS_STATUS", "CUDNN_STATUS", "cuDNN error", "NCCL error", "HIP error",
                        "illegal memory access", "device-side assert", "unspecified launch failure",
                        "an illegal instruction", "uncorrectable ECC error", "misaligned address")


def device_fault(error: BaseException) -> str | None:
    """Why ``error`` is a fault of the device (the text it matched, or ``torch.AcceleratorError``), else None.
    Out-of-memory errors are not device faults."""
    import torch
    if is_oom(error):
        return None
    accel = getattr(torch, "AcceleratorError", None)
    if accel is not None and isinstance(error, accel):
        return f"torch.AcceleratorError: {str(error).splitlines()[0][:120] if str(error) else ''}"
    text = str(error)
    return next((m for m in DEVICE_FAULT_MARKERS if m in text), None)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0][:200] if text else '(no message)'}"
