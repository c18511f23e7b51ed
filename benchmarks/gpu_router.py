"""``vramguard serve --gpus 0,1`` (one worker per GPU behind the router) against one GPU, on a 2-GPU machine.

Llama-3.1-8B architecture (random weights), NF4, 24 GiB budget per GPU, prompts of 512 token ids, 128 new tokens
(greedy, ``ignore_eos``). One GPU (``--gpus 0``): 64 and 128 concurrent requests, then a burst of 300 with a queue
of 64 (client-side rejection latency and the server's own ``vramguard_overload_rejection_seconds``). Two GPUs:
128 and 64 concurrent requests through the router, with the worker that served each request.

    PYTHONPATH=/tmp/site:$PWD python benchmarks/gpu_router.py --out OUTDIR
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from benchmarks.common import build_checkpoint, emit  # noqa: E402
from benchmarks.gpu_serve import (body, fire, fire_raw, httpx_get, metric, prompts, spawn_server,  # noqa: E402
                                  stop_server)


def run_load(out, url, name, P, n, new):
    t = time.perf_counter()
    rs = asyncio.run(fire(url, [body(P[i % len(P)], new) for i in range(n)]))
    dt = time.perf_counter() - t
    toks = sum(r["tokens"] or 0 for r in rs)
    emit(out, {"phase": name, "requests": n, "ok": sum(r["status"] == 200 for r in rs),
               "exact_tokens": sum(r["tokens"] == new for r in rs), "tokens": toks, "s": round(dt, 2),
               "tokens_per_s": round(toks / dt, 1), "statuses": sorted({r["status"] for r in rs}),
               "workers": dict(collections.Counter(r.get("worker") for r in rs))})
    return rs


def histogram(url, name):
    import httpx
    rows = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(name + "_bucket"):
            le = line.split('le="')[1].split('"')[0]
            rows[le] = float(line.split()[-1])
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--arch", default="llama-3.1-8b")
    ap.add_argument("--ckpt", default="/tmp/ckpt-llama3-8b")
    ap.add_argument("--budget", default="24")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--short", action="store_true", help="skip the 64-request runs")
    ap.add_argument("--burst-front", action="store_true",
                    help="only: --gpus 0 (front process + one worker), warm-up, then the 300-request burst")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    out = os.path.join(args.out, "results.jsonl")
    t = time.perf_counter()
    if not os.path.exists(os.path.join(args.ckpt, "config.json")):
        build_checkpoint(args.arch, args.ckpt)
    emit(out, {"phase": "checkpoint", "s": round(time.perf_counter() - t, 1)})
    P = prompts(300, 512, 128256)
    flags = ["--vram-budget", f"{args.budget}GiB", "--max-queue", "64", "--max-running", "64",
             "--served-model-name", "m"]
    cases = (("front_one_gpu", "0"),) if args.burst_front else (("one_gpu", "0"), ("two_gpus", "0,1"))
    for name, gpus in cases:
        t = time.perf_counter()
        proc, url = spawn_server(args.ckpt, flags + ["--gpus", gpus], os.path.join(args.out, f"{name}.log"))
        try:
            emit(out, {"phase": f"{name}_start", "s": round(time.perf_counter() - t, 1),
                       "health": {k: v for k, v in httpx_get(url + "/health").items() if k != "pool"}})
            asyncio.run(fire(url, [body(P[i], 16) for i in range(16)]))  # warm-up (both workers)
            if not args.burst_front:
                run_load(out, url, f"{name}_128", P, 128, args.new)
            if not args.short:
                run_load(out, url, f"{name}_64", P, 64, args.new)
            if name in ("one_gpu", "front_one_gpu"):
                t = time.perf_counter()
                rs = asyncio.run(fire_raw(url, [body(P[i], args.new) for i in range(300)]))
                dt = time.perf_counter() - t
                ok = [r for r in rs if r["status"] == 200]
                rej = [r for r in rs if r["status"] in (429, 503)]
                emit(out, {"phase": "burst", "requests": 300, "queue": 64, "accepted": len(ok),
                           "exact_tokens": sum(r["tokens"] == args.new for r in ok), "rejected": len(rej),
                           "rejected_median_ms": round(1000 * statistics.median([r["s"] for r in rej]), 1)
                           if rej else None,
                           "rejected_p90_ms": round(1000 * sorted(r["s"] for r in rej)[int(0.9 * len(rej))], 1)
                           if rej else None,
                           "server_rejection_seconds_buckets": histogram(url, "vramguard_overload_rejection_seconds"),
                           "router_rejected": metric(url, "vramguard_router_rejected_total"),
                           "5xx": sum(r["status"] >= 500 for r in rs), "s": round(dt, 2),
                           "oom_recoveries": httpx_get(url + "/health").get("oom_recoveries"),
                           "peak_bytes": metric(url, "vramguard_vram_peak_allocated_bytes")})
            else:
                emit(out, {"phase": "two_gpus_health", "health": httpx_get(url + "/health")})
        finally:
            emit(out, {"phase": f"{name}_stop", "exit_code": stop_server(proc)})


if __name__ == "__main__":
    main()
