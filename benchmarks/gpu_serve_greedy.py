"""Identical temperature-0 requests to ``vramguard serve`` at once, on a real model: how many texts come back, and
the throughput with and without ``deterministic`` (one request per step).

For each weight format of ``--quants`` and ``deterministic`` off then on: the server is built in this process on
``--model`` (a local folder: SmolLM2-135M-Instruct as tests/real_model.py saves it), the continuous engine; one
request alone gives the reference text; then, for each of ``--prompts`` chat prompts, ``--concurrency`` identical
requests (temperature 0, ``--max-tokens``) are sent at once. Per burst: distinct texts, how many equal the text
alone, completion tokens and seconds; per server: tokens/s over its bursts. The last line compares the two modes
(the cost of ``deterministic`` in throughput).

    python3 benchmarks/gpu_serve_greedy.py --model ~/.cache/vramguard-tests/smollm2-135m-instruct-fp32 --out OUTDIR
    python3 benchmarks/gpu_serve_greedy.py --model ... --out OUTDIR --quants fp32 --concurrency 4 --max-tokens 12 \
        --prompts 1 --page-size 16 --max-batch-tokens 256 --max-kv-blocks 64      (the CPU figure)

Writes ``OUTDIR/serve_greedy.jsonl`` (one JSON line per burst, per server, and the comparison).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from benchmarks.common import emit  # noqa: E402

PROMPTS = ["Write one sentence about why the sky is blue.", "What is the capital of France? Answer in a sentence.",
           "Give me two tips for sleeping better.", "Explain what a KV cache is in two sentences."]


async def burst(url: str, prompt: str, n: int, max_tokens: int) -> tuple[list[str], int, float]:
    """``n`` identical chat requests at once: (texts, completion tokens, seconds from the first send to the last
    answer)."""
    import httpx
    body = {"model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0}
    limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=n + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as c:
        await asyncio.gather(*[c.get(url + "/health") for _ in range(n)])  # connections open before the clock
        t0 = time.perf_counter()
        rs = await asyncio.gather(*[c.post(url + "/v1/chat/completions", json=body) for _ in range(n)])
        dt = time.perf_counter() - t0
    bad = [r.status_code for r in rs if r.status_code != 200]
    if bad:
        raise SystemExit(f"requests failed with status {bad[:4]}: {rs[0].text[:300]}")
    js = [r.json() for r in rs]
    return [j["choices"][0]["message"]["content"] for j in js], sum(j["usage"]["completion_tokens"] for j in js), dt


def one_server(args, quant: str, deterministic: bool, out: str) -> dict:
    from vramguard.serve.server import build
    t0 = time.perf_counter()
    served = build(args.model, quant=quant, served_name="m", engine_choice="continuous", verify=False,
                   max_running=max(args.concurrency, 16), max_queue=args.concurrency, deterministic=deterministic,
                   max_batch_tokens=args.max_batch_tokens, page_size=args.page_size,
                   max_kv_blocks=args.max_kv_blocks)
    url = served.start_background()
    start_s = time.perf_counter() - t0
    tokens = seconds = 0.0
    distinct = []
    try:
        for i, prompt in enumerate(PROMPTS[:args.prompts]):
            alone, _, _ = asyncio.run(burst(url, prompt, 1, args.max_tokens))
            texts, n_tokens, dt = asyncio.run(burst(url, prompt, args.concurrency, args.max_tokens))
            tokens, seconds = tokens + n_tokens, seconds + dt
            distinct.append(len(set(texts)))
            emit(out, {"quant": quant, "deterministic": deterministic, "prompt": i, "requests": len(texts),
                       "distinct_texts": len(set(texts)), "equal_to_alone": sum(t == alone[0] for t in texts),
                       "completion_tokens": n_tokens, "s": round(dt, 3), "tokens_per_s": round(n_tokens / dt, 1),
                       "texts": sorted(set(texts))[:4]}, width=400)
        rec = {"quant": quant, "deterministic": deterministic, "server_start_s": round(start_s, 1),
               "distinct_texts_per_prompt": distinct, "tokens_per_s": round(tokens / seconds, 1),
               "notes": [n for n in served.engine.notes if "decode" in n or "determin" in n or "attention" in n]}
        emit(out, rec, width=400)
        return rec
    finally:
        served.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="local folder of the model (SmolLM2-135M-Instruct)")
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--quants", default="nf4,bf16", help="weight formats, comma-separated (nf4, bf16, fp32)")
    ap.add_argument("--concurrency", type=int, default=16, help="identical requests sent at once")
    ap.add_argument("--prompts", type=int, default=4, help=f"prompts (at most {len(PROMPTS)})")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--max-batch-tokens", type=int, default=2048)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--max-kv-blocks", type=int, default=None, help="cap the KV pool (serve's --max-kv-blocks; "
                    "the CPU figure: 64)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    out = os.path.join(args.out, "serve_greedy.jsonl")
    for quant in args.quants.split(","):
        base = one_server(args, quant, False, out)
        det = one_server(args, quant, True, out)
        emit(out, {"quant": quant, "distinct_texts_default": base["distinct_texts_per_prompt"],
                   "distinct_texts_deterministic": det["distinct_texts_per_prompt"],
                   "tokens_per_s_default": base["tokens_per_s"], "tokens_per_s_deterministic": det["tokens_per_s"],
                   "deterministic_cost": round(1 - det["tokens_per_s"] / base["tokens_per_s"], 3)})


if __name__ == "__main__":
    main()
