"""How much of a burst's measured rejection time is the client's own: the same 120-request burst against a CPU
server (a 4-layer random Llama, ``--max-running 16 --max-queue 16``, 256-token prompts, 32 new tokens), sent with
httpx from one asyncio client (as in the first GPU runs) and with pre-serialized requests on pre-opened
connections (``fire_raw``), twice each. One JSON line per burst on stdout and in OUTDIR/results.jsonl.

    python benchmarks/cpu_burst_clients.py OUTDIR [--requests 300 --running 64 --queue 64 --prompt 512 --raw-only]

(the bracketed form is the GPU burst's shape: 300 requests against 64 running + 64 queued)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchmarks.common import emit  # noqa: E402
from benchmarks.gpu_serve import body, fire, fire_raw, spawn_server  # noqa: E402


def main():
    import torch
    import transformers
    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="?", default="/tmp/burst")
    ap.add_argument("--requests", type=int, default=120)
    ap.add_argument("--running", type=int, default=16)
    ap.add_argument("--queue", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--raw-only", action="store_true")
    args = ap.parse_args()
    out = args.out
    os.makedirs(out, exist_ok=True)
    ckpt = os.path.join(out, "ckpt")
    if not os.path.exists(os.path.join(ckpt, "config.json")):
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=3000,
                                       max_position_embeddings=4096)
        transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(ckpt)
    proc, url = spawn_server(ckpt, ["--quant", "fp32", "--max-queue", str(args.queue), "--max-running",
                                    str(args.running), "--page-size",
                                    "64", "--served-model-name", "m"], os.path.join(out, "serve.log"))
    try:
        prompts = [[5 + (i * 13 + j) % 2900 for j in range(args.prompt)] for i in range(args.requests)]
        clients = ((("raw", fire_raw),) * 2 if args.raw_only
                   else (("httpx", fire), ("raw", fire_raw), ("httpx", fire), ("raw", fire_raw)))
        for client, send in clients:
            t = time.perf_counter()
            rs = asyncio.run(send(url, [body(p, 32) for p in prompts]))
            rej = sorted(r["s"] for r in rs if r["status"] == 429)
            ok = [r for r in rs if r["status"] == 200]
            emit(os.path.join(out, "results.jsonl"), {
                "client": client, "requests": args.requests, "accepted": len(ok), "exact_tokens": sum(r["tokens"] == 32 for r in ok),
                "rejected": len(rej), "rejected_median_ms": round(1000 * statistics.median(rej), 1) if rej else None,
                "rejected_p90_ms": round(1000 * rej[int(0.9 * len(rej))], 1) if rej else None,
                "other": sorted({r["status"] for r in rs} - {200, 429}), "s": round(time.perf_counter() - t, 1)})
    finally:
        proc.send_signal(signal.SIGINT)
        emit(os.path.join(out, "results.jsonl"), {"server_exit_code": proc.wait(60)})


if __name__ == "__main__":
    main()
