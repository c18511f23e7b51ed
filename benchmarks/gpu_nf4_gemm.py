"""The small-batch 4-bit GEMM (``vramguard/run/kernels/nf4_gemm.py``) against bitsandbytes' ``gemm_4bit`` on
Llama-3.1-8B's four projection shapes (NF4, double quant, bfloat16, random weights quantized by bitsandbytes).

Each call is replayed from a CUDA graph of ``--calls`` calls (as the serving engine's decode steps run it), so the
times are GPU time without Python. Per shape and rows: bitsandbytes, the default config, and with ``--sweep`` the
best (BN, splits, warps, stages) of a small grid
(within ``--sweep-s`` seconds in all); the relative difference from bitsandbytes' own output; and the
bytes each path must move (packed weight + absmax against that plus the bf16 weight written and read back).

    PYTHONPATH=/tmp/site:$PWD python benchmarks/gpu_nf4_gemm.py --out OUTDIR [--sweep]
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from benchmarks.common import emit  # noqa: E402

SHAPES = {"gate_proj/up_proj": (14336, 4096), "down_proj": (4096, 14336), "q_proj/o_proj": (4096, 4096),
          "k_proj/v_proj": (1024, 4096)}  # the largest first (the sweep's time goes to them)


def graph_us(fn, calls: int, reps: int = 20) -> float:
    """Microseconds per call of ``fn``, replayed from one CUDA graph of ``calls`` calls
    (:func:`vramguard.run.kernels.selftest.graph_us`, the engine's own timer, after one eager call)."""
    from vramguard.run.kernels.selftest import graph_us as engine_graph_us
    fn()
    torch.cuda.synchronize()
    return engine_graph_us(fn, calls, reps)


def sweep(nf4_gemm, x, q, shape, code, scales, calls, end, out, name) -> dict:
    """The fastest (BN, splits, warps, stages) of a small grid (stages 3, then 2 and 4 for the best), until
    ``end`` (perf_counter seconds)."""
    n, k = shape
    best = None
    grid = [(bn, sp, w, 3) for bn, sp, w in itertools.product((64, 128, 256), (1, 2, 4, 8, 16), (4, 8))
            if (k // 64) % sp == 0 and (k // 64) // sp >= 4]
    for i, c in enumerate(grid + [None, None]):
        if time.perf_counter() > end:
            break
        if c is None:  # the best config's other stage counts
            c = (*best[1][:3], 2 if i == len(grid) else 4)
        try:
            us = graph_us(lambda: nf4_gemm.gemm_4bit(x, q, shape, 64, code, *scales, config=c), calls, reps=5)
        except Exception as e:  # noqa: BLE001 - a config that does not compile (shared memory)
            emit(out, {"shape": name, "rows": x.shape[0], "config": c, "error": repr(e)[:200]}, width=300)
            continue
        if best is None or us < best[0]:
            best = (us, c)
    return {"best_us": round(best[0], 2), "best_config": best[1]} if best else {}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", default="16,32,64")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--sweep-rows", default="64")
    ap.add_argument("--sweep-s", type=float, default=45, help="seconds for all sweeps together")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    out = os.path.join(args.out, "nf4_gemm.jsonl")
    import bitsandbytes.functional as BF

    from vramguard.run.kernels import nf4_gemm
    from vramguard.run.kernels.nf4 import code_table
    op = torch.ops.bitsandbytes.gemm_4bit.default
    code = code_table("nf4", "cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    sweep_rows = {int(r) for r in args.sweep_rows.split(",")}
    sweep_end = time.perf_counter() + args.sweep_s
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, generator=g, device="cuda", dtype=torch.bfloat16)
        q, st = BF.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
        del w
        scales = (st.absmax, st.state2.absmax, st.state2.code, st.offset)
        nf4_bytes = n * k // 2 + st.absmax.numel()
        for rows in [int(r) for r in args.rows.split(",")]:
            x = torch.randn(rows, k, generator=g, device="cuda", dtype=torch.bfloat16)

            def bnb():
                return op(x, q, [n, k], st.state2.absmax, 64, "nf4", None, st.absmax, st.state2.code, st.offset)

            want = bnb().float()
            rec = {"shape": name, "N": n, "K": k, "rows": rows, "bnb_us": round(graph_us(bnb, args.calls), 2),
                   "nf4_bytes": nf4_bytes, "bnb_bytes": nf4_bytes + 4 * n * k}
            cfg = nf4_gemm.default_config(n, k, 64, rows, "cuda:0")
            got = nf4_gemm.gemm_4bit(x, q, (n, k), 64, code, *scales).float()
            rec.update(default_config=cfg, rel_err=float((got - want).norm() / want.norm()),
                       ours_us=round(graph_us(lambda: nf4_gemm.gemm_4bit(x, q, (n, k), 64, code, *scales),
                                              args.calls), 2))
            lut = nf4_gemm.gemm_4bit(x, q, (n, k), 64, code, *scales, lut=True).float()
            rec.update(lut_rel_err=float((lut - want).norm() / want.norm()),
                       lut_us=round(graph_us(lambda: nf4_gemm.gemm_4bit(x, q, (n, k), 64, code, *scales, lut=True),
                                             args.calls), 2))
            rec["speedup"] = round(rec["bnb_us"] / min(rec["ours_us"], rec["lut_us"]), 2)
            rec["ours_GBps"] = round(nf4_bytes / rec["ours_us"] / 1e3, 1)
            if args.sweep and rows in sweep_rows and time.perf_counter() < sweep_end:
                rec.update(sweep(nf4_gemm, x, q, (n, k), code, scales, args.calls, sweep_end, out, name))
            emit(out, rec)
    # the sum over one Llama-3.1-8B layer (q, k, v, o, gate, up, down) at each row count, from the records
    import json
    recs = [json.loads(line) for line in open(out) if '"bnb_us"' in line]
    per = {"q_proj/o_proj": 2, "k_proj/v_proj": 2, "gate_proj/up_proj": 2, "down_proj": 1}
    for rows in sorted({r["rows"] for r in recs}):
        rs = [r for r in recs if r["rows"] == rows]
        tot = {key: round(32 * sum(per[r["shape"]] * r[key] for r in rs) / 1000, 3)
               for key in ("bnb_us", "ours_us", "best_us") if all(key in r for r in rs)}
        emit(out, {"phase": "per_step_32_layers_ms", "rows": rows, **tot})


if __name__ == "__main__":
    main()
