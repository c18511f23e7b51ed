"""The first call of each new (query, key) length pair of a causal SDPA, as the varlen attention's prefills make
them (``vramguard/run/kernels/varlen_attention.py:prefill_attention``), with PyTorch's default backends against the
flash / memory-efficient / math set the varlen attention pins: milliseconds of the first and of a repeated call,
and the backend kernel that ran (Llama-3.1-8B heads: 32 query heads of 128, GQA expanded; bfloat16).

    PYTHONPATH=$PWD python benchmarks/gpu_sdpa_first_use.py --out OUTDIR
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from benchmarks.common import emit  # noqa: E402


def timed(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return round(1000 * (time.perf_counter() - t), 2)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    out = os.path.join(args.out, "sdpa_first_use.jsonl")
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.profiler import ProfilerActivity, profile

    from vramguard.run.kernels.varlen_attention import prefill_attention
    f = torch.nn.functional.scaled_dot_product_attention
    dev = "cuda"
    for name, lengths in (("default", range(301, 309)), ("pinned", range(401, 409))):
        for n in lengths:  # each a length pair this process has not run yet
            q = torch.randn(1, 32, n, 128, device=dev, dtype=torch.bfloat16)
            if name == "default":
                def call():
                    return f(q, q, q, is_causal=True)
            else:
                def call():
                    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
                        return f(q, q, q, is_causal=True)
            first, again = timed(call), timed(call)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                call()
                torch.cuda.synchronize()
            kernels = sorted({e.name[:60] for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})
            emit(out, {"backends": name, "lq": n, "lk": n, "first_ms": first, "again_ms": again, "kernels": kernels})
    # the varlen attention's own prefill path, new lengths (its output against the default backends' output)
    for n in range(501, 505):
        qq = torch.randn(n, 32, 128, device=dev, dtype=torch.bfloat16)
        kk = torch.randn(n, 8, 128, device=dev, dtype=torch.bfloat16)
        o = torch.empty_like(qq)
        from vramguard.run.kernels.varlen_attention import _prefill_backends

        def ours():
            with _prefill_backends(qq):
                prefill_attention(qq, kk, kk, o, 128 ** -0.5)
        first, again = timed(ours), timed(ours)
        ref = torch.empty_like(qq)
        prefill_attention(qq, kk, kk, ref, 128 ** -0.5)
        emit(out, {"path": "varlen prefill_attention, pinned", "lq": n, "first_ms": first, "again_ms": again,
                   "rel_diff_vs_default": float((o.float() - ref.float()).norm() / ref.float().norm())})


if __name__ == "__main__":
    main()
