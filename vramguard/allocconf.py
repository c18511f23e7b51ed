"""The caching allocator's setting for vramguard's own GPU process: expandable segments, unless the user chose.

PyTorch reads ``PYTORCH_CUDA_ALLOC_CONF`` (or ``PYTORCH_ALLOC_CONF``) when its CUDA allocator starts;
``torch.cuda.memory._set_allocator_settings`` changes ``expandable_segments`` afterwards too (Note [Expandable
Segments] in ``c10/cuda/CUDACachingAllocator.cpp``: it can be switched at any time and applies to new segments).
Measured on an H200 (benchmarks/README.md, "Reserved memory and the edge"), expandable segments moved the largest
prompt of every architecture measured: Llama-3.1-8B NF4 under a 24 GiB cap from 65,280 to at least 78,509 tokens;
Qwen2.5-7B bf16 under 20 GiB ran out of memory at 28,651 tokens with the default allocator and completed them with
expandable segments; Gemma-2-9B bf16 (eager) under 24 GiB ran out at 4,960 and completed 5,252.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

EXPANDABLE = "expandable_segments:True"
ENV_NAMES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def env_alloc_conf(environ: MutableMapping[str, str] | None = None) -> str:
    """The allocator options this process's environment gives PyTorch (``PYTORCH_CUDA_ALLOC_CONF``, else
    ``PYTORCH_ALLOC_CONF``), ``""`` when neither is set."""
    env = os.environ if environ is None else environ
    return next((env[name] for name in ENV_NAMES if env.get(name)), "")


def prefer_expandable_segments(environ: MutableMapping[str, str] | None = None,
                               cuda_available: bool | None = None) -> str | None:
    """Set ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` for this process when neither allocator variable
    is set and a CUDA device is present; returns the sentence saying so, or None when nothing was changed (the
    user's own setting is kept as it is). ``environ`` / ``cuda_available``: overrides for tests."""
    env = os.environ if environ is None else environ
    if any(name in env for name in ENV_NAMES):
        return None
    if cuda_available is None:
        try:
            import torch
            cuda_available = torch.cuda.is_available()
        except ImportError:
            cuda_available = False
    if not cuda_available:
        return None
    env["PYTORCH_CUDA_ALLOC_CONF"] = EXPANDABLE
    torch = sys.modules.get("torch") if environ is None else None
    if torch is not None and torch.cuda.is_initialized():
        _apply_now(torch)
    return ("note: set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True for this process (less fragmentation: "
            "measured on an H200, Llama-3.1-8B NF4 fits a 78,509-token prompt in 24 GiB instead of 65,280); set "
            "PYTORCH_CUDA_ALLOC_CONF yourself to choose otherwise")


def _apply_now(torch) -> None:
    """Switch an allocator that has read its settings already (CUDA initialised before the variable was set):
    torch >= 2.10's ``torch._C._accelerator_setAllocatorSettings``, else ``torch.cuda.memory._set_allocator_settings``
    (deprecated there with a FutureWarning, which is kept off the user's stderr)."""
    import warnings
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    try:
        if setter is not None:
            setter(EXPANDABLE)
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                torch.cuda.memory._set_allocator_settings(EXPANDABLE)
    except (AttributeError, RuntimeError):
        pass  # an allocator that cannot switch keeps its setting; new processes read the variable
