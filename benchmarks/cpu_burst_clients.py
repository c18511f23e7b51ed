"""How much of a burst's measured rejection time is the client's own: the same 120-request burst against a CPU
server (a 4-layer random Llama, ``--max-running 16 --max-queue 16``, 256-token prompts, 32 new tokens), sent with
httpx from one asyncio client (as in the first GPU runs) and with pre-serialized requests on pre-opened
connections (``fire_raw``), twice each. One JSON line per burst on stdout and in OUTDIR/results.jsonl.

    python benchmarks/cpu_burst_clients.py OUTDIR
"""

from __future__ import annotations

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
    out = sys.argv[1] if len(sys.argv) > 1 else "/tmp/burst"
    os.makedirs(out, exist_ok=True)
    ckpt = os.path.join(out, "ckpt")
    if not os.path.exists(os.path.join(ckpt, "config.json")):
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=3000,
                                       max_position_embeddings=4096)
        transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(ckpt)
    proc, url = spawn_server(ckpt, ["--quant", "fp32", "--max-queue", "16", "--max-running", "16", "--page-size",
                                    "64", "--served-model-name", "m"], os.path.join(out, "serve.log"))
    try:
        prompts = [[5 + (i * 13 + j) % 2900 for j in range(256)] for i in range(120)]
        for client, send in (("httpx", fire), ("raw", fire_raw), ("httpx", fire), ("raw", fire_raw)):
            t = time.perf_counter()
            rs = asyncio.run(send(url, [body(p, 32) for p in prompts]))
            rej = sorted(r["s"] for r in rs if r["status"] == 429)
            ok = [r for r in rs if r["status"] == 200]
            emit(os.path.join(out, "results.jsonl"), {
                "client": client, "accepted": len(ok), "exact_tokens": sum(r["tokens"] == 32 for r in ok),
                "rejected": len(rej), "rejected_median_ms": round(1000 * statistics.median(rej), 1) if rej else None,
                "rejected_p90_ms": round(1000 * rej[int(0.9 * len(rej))], 1) if rej else None,
                "other": sorted({r["status"] for r in rs} - {200, 429}), "s": round(time.perf_counter() - t, 1)})
    finally:
        proc.send_signal(signal.SIGINT)
        emit(os.path.join(out, "results.jsonl"), {"server_exit_code": proc.wait(60)})


if __name__ == "__main__":
    main()
