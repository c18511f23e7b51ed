"""Memory outside the model's tensors: cuBLAS workspace, CUDA context, and the caching allocator's reserve.

* ``CUBLAS_WORKSPACE_BYTES``: PyTorch allocates the cuBLAS/cuBLASLt workspace through its caching allocator at
  the first matmul and keeps it, so it counts in ``memory_allocated``. Measured on an H200 (torch 2.11): the
  allocated bytes rose by 33,554,944 B over a warm-up ``generate`` that left nothing else alive.
* ``CUDA_CONTEXT_BYTES``: memory the card shows in use that PyTorch does not allocate: the CUDA context, loaded
  kernels (cuBLAS, cuDNN, bitsandbytes) and their handles (``total - free - memory_reserved``). Measured 701 to
  751 MiB across 57 runs on an H200 with torch 2.11 / CUDA 13.0; smaller cards and older CUDA usually need less,
  so the plan errs on the safe side there.
* Allocator reserve (``memory_reserved - memory_allocated`` at the peak): the caching allocator keeps whole
  segments, and a freed block split for a smaller tensor cannot serve the next large request. Modelled as the
  largest single allocation of the peak phase (the block that gets stranded), plus 3/10 of the rest of the
  memory above the weights (blocks freed and re-requested at other sizes, layer after layer and decode step
  after decode step), plus one 20 MiB segment (the allocator's segment size for mid-size requests,
  c10/cuda/CUDACachingAllocator.cpp). Over the 57 measured runs the reserve was at most the largest allocation
  plus 0.30 x the rest; these coefficients cover all of them.

Source of the measurements: benchmarks/results/h200_matrix (benchmarks/README.md has the command).
"""

from __future__ import annotations

from vramguard.units import MiB

CUBLAS_WORKSPACE_BYTES = 32 * MiB
CUDA_CONTEXT_BYTES = 750 * MiB
RESERVE_SEGMENT_BYTES = 20 * MiB
RESERVE_REST_NUM, RESERVE_REST_DEN = 3, 10


def allocator_reserve_bytes(dynamic_peak_bytes: int, largest_alloc_bytes: int) -> int:
    """Reserved minus allocated at the peak, in bytes:
    ``largest + (dynamic_peak - largest) x 3 / 10 + 20 MiB`` (see the module docstring for the measurements)."""
    rest = max(dynamic_peak_bytes - largest_alloc_bytes, 0)
    return largest_alloc_bytes + rest * RESERVE_REST_NUM // RESERVE_REST_DEN + RESERVE_SEGMENT_BYTES
