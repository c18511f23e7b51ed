"""Whether Triton's compilation runs in parallel in threads of one process (the GIL released while it compiles):
16 kernels that differ only in a constexpr compiled by ``JITFunction.warmup`` (no launch, no tensor), once one after
another and once from 8 threads, each with an empty ``TRITON_CACHE_DIR`` of its own; wall seconds of each.

    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/gpu_compile_threads.py     # GPU machine, ~30 s
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

KERNELS = 16


def main() -> None:
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def scaled_add(x_ptr, y_ptr, out_ptr, n, SCALE: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = i < n
        x = tl.load(x_ptr + i, mask=ok)
        y = tl.load(y_ptr + i, mask=ok)
        tl.store(out_ptr + i, tl.exp(x) * SCALE + tl.sqrt(tl.abs(y)), mask=ok)

    def compile_one(k: int) -> None:
        scaled_add.warmup(torch.float32, torch.float32, torch.float32, 4096, SCALE=k + 1, BLOCK=1024, grid=(1,))

    torch.cuda.init()
    compile_one(1000)  # the first compile pays Triton's own start (its key, the backend): not counted
    t0 = time.perf_counter()
    for k in range(KERNELS):
        compile_one(k)
    serial = time.perf_counter() - t0
    t0 = time.perf_counter()
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(compile_one, range(KERNELS, 2 * KERNELS)))
    threaded = time.perf_counter() - t0
    print(f"triton {triton.__version__}: {KERNELS} kernels one after another {serial:.2f} s, "
          f"from 8 threads {threaded:.2f} s (x{serial / threaded:.2f})")


if __name__ == "__main__":
    sys.exit(main())
