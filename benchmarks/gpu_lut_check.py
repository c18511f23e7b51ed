"""The register table's two 16-bit types against the float32 table on a GPU: ``nf4.matmul_4bit`` and
``nf4_gemm.gemm_4bit`` of bitsandbytes NF4 weights (double quant, Llama-3.1-8B shapes) by bfloat16 rows, with the
values looked up from a float16 table, a bfloat16 table, or gathered from the float32 table, each against the
float64 reference (:func:`vramguard.run.kernels.nf4.reference_matmul`): relative error of the output (max abs
difference over max abs reference) and microseconds a call (CUDA events, median of 200).

    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/gpu_lut_check.py > OUT/lut_check.txt      # H200, ~20 s
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import bitsandbytes.functional as BF  # noqa: E402

from vramguard.run.kernels import nf4, nf4_gemm  # noqa: E402

SHAPES = ((4096, 4096), (14336, 4096), (4096, 14336), (1024, 4096))


def timed_us(fn) -> float:
    times = []
    for _ in range(200):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1000)
    return sorted(times)[len(times) // 2]


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}")
    print("kernel | N x K | rows | table | rel err vs float64 | us")
    for n, k in SHAPES:
        w = torch.randn(n, k, generator=g, device="cuda") * 0.02
        q, st = BF.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
        args = (q, (n, k), 64, st.code, st.absmax, st.state2.absmax, st.state2.code, st.offset)
        for rows in (1, 16):
            x = torch.randn(rows, k, generator=g, device="cuda").to(torch.bfloat16)
            ref = nf4.reference_matmul(x, *args, dtype=torch.float64)
            for name, lut, table in (("float16", True, "float16"), ("bfloat16", True, "bfloat16"),
                                     ("float32 gather", False, "float16")):
                nf4.LUT_TABLE = table
                if rows == 1:
                    fn = lambda: nf4.matmul_4bit(x, *args, lut=lut)  # noqa: E731
                    kernel = "matmul_4bit"
                else:
                    fn = lambda: nf4_gemm.gemm_4bit(x, *args, lut=lut)  # noqa: E731
                    kernel = "gemm_4bit"
                out = fn().double()
                err = float((out - ref).abs().max() / ref.abs().max())
                print(f"{kernel} | {n} x {k} | {rows} | {name} | {err:.2e} | {timed_us(fn):.1f}", flush=True)
    nf4.LUT_TABLE = "float16"


if __name__ == "__main__":
    main()
