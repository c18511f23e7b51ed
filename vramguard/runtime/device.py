"""Device memory, the one place vramguard reads and limits it: a snapshot dataclass with ``__sub__`` (allocated,
reserved, peaks, split blocks, memory outside PyTorch), a per-step recorder for ``generate``, the usable-memory
rule (:func:`usable_bytes`), the cap (:func:`memory_cap`, :func:`set_cap`) and what counts as running out of
memory (:func:`is_oom`).

All sizes are bytes from ``torch.cuda.memory_stats`` / ``mem_get_info``. Tests replace :data:`PROBE` with a
fake to run the recorder on the CPU.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field, fields

from vramguard.errors import NoCudaGpu


class CudaProbe:
    """Reads the caching allocator's counters and the device's free memory (one CUDA device)."""

    def __init__(self, device: int = 0):
        self.device = device

    def read(self) -> dict:
        import torch
        st = torch.cuda.memory_stats(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        return {"allocated": st.get("allocated_bytes.all.current", 0),
                "reserved": st.get("reserved_bytes.all.current", 0),
                "peak_allocated": st.get("allocated_bytes.all.peak", 0),
                "peak_reserved": st.get("reserved_bytes.all.peak", 0),
                "inactive_split": st.get("inactive_split_bytes.all.current", 0), "device_used": total - free,
                "total": total}

    def reset_peak(self) -> None:
        import torch
        torch.cuda.reset_peak_memory_stats(self.device)

    def sync(self) -> None:
        import torch
        torch.cuda.synchronize(self.device)


PROBE = None  # set by tests; None means CudaProbe()


@contextlib.contextmanager
def memory_cap(budget_bytes: int | None, device: int | None = None):
    """Cap what PyTorch's caching allocator may reserve on ``device`` at ``budget_bytes`` (bytes) for the block,
    with ``torch.cuda.set_per_process_memory_fraction(budget / total)``, and put back the fraction that was set
    before (a cap the caller chose is kept, not reset to 1.0). Does nothing for ``None`` or without CUDA.

    Yields the fraction applied (or None). Memory outside the allocator (CUDA context, cuBLAS workspaces, NCCL)
    is not counted by this cap: that is PyTorch's rule, not ours.
    """
    import torch
    if budget_bytes is None or not torch.cuda.is_available():
        yield None
        return
    dev = torch.cuda.current_device() if device is None else device
    before = set_cap(budget_bytes, dev)
    try:
        yield min(1.0, budget_bytes / total_bytes(dev))
    finally:
        restore_cap(before, dev)


def probe():
    return PROBE or CudaProbe()


@dataclass(frozen=True)
class MemorySnapshot:
    """One reading (bytes). ``nontorch`` = what the card shows in use minus PyTorch's reserved memory."""

    allocated: int = 0
    reserved: int = 0
    peak_allocated: int = 0
    peak_reserved: int = 0
    inactive_split: int = 0
    device_used: int = 0
    total: int = 0

    @property
    def nontorch(self) -> int:
        return self.device_used - self.reserved

    @property
    def fragmentation(self) -> int:
        """Reserved but not allocated."""
        return self.reserved - self.allocated

    def __sub__(self, other: "MemorySnapshot") -> "MemorySnapshot":
        return MemorySnapshot(**{f.name: getattr(self, f.name) - getattr(other, f.name) for f in fields(self)})

    @classmethod
    def take(cls) -> "MemorySnapshot":
        return cls(**probe().read())


@dataclass
class StepSample:
    """Memory after one generate step: ``step`` 0 is the prefill (first token); ``peak_*`` since the last one."""

    step: int
    t_s: float
    allocated: int
    reserved: int
    peak_allocated: int
    peak_reserved: int
    inactive_split: int


@dataclass
class StepRecorder:
    """A ``generate`` streamer: records memory and time at every new token (the first ``put`` is the prompt)."""

    samples: list[StepSample] = field(default_factory=list)
    t0: float = 0.0
    _calls: int = 0

    def start(self) -> None:
        p = probe()
        p.sync()
        p.reset_peak()
        self.t0 = time.perf_counter()
        self._calls = 0
        self.samples = []

    def put(self, value) -> None:
        self._calls += 1
        if self._calls == 1:
            return
        p = probe()
        p.sync()
        r = p.read()
        self.samples.append(StepSample(len(self.samples), time.perf_counter() - self.t0, r["allocated"],
                                       r["reserved"], r["peak_allocated"], r["peak_reserved"], r["inactive_split"]))
        p.reset_peak()

    def end(self) -> None:
        pass


def usable_bytes(budget_bytes: int | None) -> tuple[int | None, int]:
    """The one usable-memory rule: (bytes this process can still give to a run on the current CUDA device, bytes
    PyTorch has allocated now), or ``(budget_bytes, 0)`` / ``(None, 0)`` without CUDA.

    With a budget: the budget minus what PyTorch has allocated (``torch.cuda.memory_allocated``). Without: what the
    driver reports free (``torch.cuda.mem_get_info``) plus what PyTorch's caching allocator reserves but has not
    allocated (``memory_reserved - memory_allocated``), which PyTorch hands out again before asking the driver.
    """
    import torch
    if not torch.cuda.is_available():
        return (None, 0) if budget_bytes is None else (budget_bytes, 0)
    allocated = torch.cuda.memory_allocated()
    if budget_bytes is not None:
        return budget_bytes - allocated, allocated
    free, _ = torch.cuda.mem_get_info()
    return free + torch.cuda.memory_reserved() - allocated, allocated


def require_cuda(work: str, fix: str) -> None:
    """Raise :class:`~vramguard.errors.NoCudaGpu` naming ``work`` (e.g. ``profile``) when torch has no CUDA device,
    with why (a CPU build of torch, or no device seen by the CUDA build) and ``fix``."""
    import torch
    if torch.cuda.is_available():
        return
    why = ("this torch is a CPU build" if torch.version.cuda is None else
           f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device")
    raise NoCudaGpu(work, "none", why, fix)


def free_bytes(device: int | None = None) -> int:
    """What the driver reports free on ``device``, in bytes (``torch.cuda.mem_get_info(device)[0]``)."""
    import torch
    return torch.cuda.mem_get_info(torch.cuda.current_device() if device is None else device)[0]


def total_bytes(device: int | None = None) -> int:
    """The card's total memory in bytes (``torch.cuda.get_device_properties(device).total_memory``)."""
    import torch
    dev = torch.cuda.current_device() if device is None else device
    return torch.cuda.get_device_properties(dev).total_memory


def set_cap(budget_bytes: int, device: int | None = None) -> float:
    """Cap what PyTorch's caching allocator may reserve on ``device`` at ``budget_bytes``
    (``torch.cuda.set_per_process_memory_fraction(budget / total)``, at most 1.0); returns the fraction that was
    set before, for :func:`restore_cap`."""
    import torch
    dev = torch.cuda.current_device() if device is None else device
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    before = getter(dev) if getter is not None else 1.0
    torch.cuda.set_per_process_memory_fraction(min(1.0, budget_bytes / total_bytes(dev)), dev)
    return before


def restore_cap(fraction: float, device: int | None = None) -> None:
    """Put back a fraction :func:`set_cap` returned."""
    import torch
    dev = torch.cuda.current_device() if device is None else device
    torch.cuda.set_per_process_memory_fraction(fraction, dev)


# What CUDA libraries print when an allocation fails: PyTorch's caching allocator raises torch.OutOfMemoryError
# ("CUDA out of memory"); the driver's cudaErrorMemoryAllocation reads "CUDA error: out of memory"; cuBLAS and
# cuDNN report a failed workspace allocation as CUBLAS_STATUS_ALLOC_FAILED / CUDNN_STATUS_ALLOC_FAILED
# (cublas_api.h, cudnn_graph.h), which PyTorch raises as a plain RuntimeError; NCCL's CUDACHECK macro
# (src/include/checks.h) reports a failed cudaMalloc of its buffers as "Cuda failure 'out of memory'" (newer
# releases print the error number too: "Cuda failure 2 'out of memory'"), raised as torch.distributed's
# DistBackendError, a RuntimeError.
# CUBLAS_STATUS_NOT_INITIALIZED is not one of them, on purpose: cublasCreate returns it whenever the CUDA runtime
# could not set up the handle, a full card or a driver/context fault alike (cuBLAS documentation of cublasCreate), so
# a run does not retry on it as on an allocation failure. vramguard.explain, which a person reads, names it as the
# likely shortage it most often is; this is the one place the two rules differ.
OOM_MARKERS = ("CUDA out of memory", "CUDA error: out of memory", "CUBLAS_STATUS_ALLOC_FAILED",
               "CUDNN_STATUS_ALLOC_FAILED", "Cuda failure 'out of memory'", "Cuda failure 2 'out of memory'")


def is_oom(error: BaseException) -> bool:
    """Whether ``error`` is an allocation failure on the device (see :data:`OOM_MARKERS`): one a run recovers
    from by freeing memory and trying something smaller, unlike a device fault."""
    import torch
    if isinstance(error, torch.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and any(m in str(error) for m in OOM_MARKERS)
