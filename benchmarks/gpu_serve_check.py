"""Greedy tokens of the serving engine's three decode paths, same model and requests, in one process:

* "graphs": vramguard's varlen attention with decode steps replayed from CUDA graphs (the default on a GPU);
* "eager": the same attention, every step run eagerly (``vramguard.serve.engine.GRAPHS = False``);
* "stock": transformers' paged SDPA (``vramguard.serve.attention.ENABLED = False``), as before.

"graphs" also runs the 4-bit projections of decode steps through vramguard's kernels where the engine's start-up
timing chose them (``vramguard.serve.decode_graphs.choose_gemm``; the register lookup rounds the NF4 code to
bfloat16), so like "stock" (another attention kernel) it may round differently from "eager": the record gives the
shared prefix of each request for both (on random weights any two paths diverge after a few greedy tokens). Requests: ``--requests`` prompts of
``--prompt`` random token ids, with max_tokens alternating ``--new`` and ``--new // 2`` so the batch shrinks mid-way
(graphs of two sizes, with padding rows).

    PYTHONPATH=/tmp/site:$PWD python benchmarks/gpu_serve_check.py --out OUTDIR
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from benchmarks.common import add_serving_args, emit, load_nf4_under_budget  # noqa: E402
from benchmarks.gpu_serve import prompts  # noqa: E402

GiB = 2**30


def run_engine(engine, P, news) -> list[list[int]]:
    from vramguard.serve.engine import Sampling

    async def go():
        hs = [engine.submit(p, n, Sampling(temperature=0)) for p, n in zip(P, news)]
        res = []
        for h in hs:
            while True:
                out = await asyncio.wait_for(h.queue.get(), 300)
                if out.error or out.status.name in ("FINISHED", "FAILED"):
                    res.append(list(out.generated_tokens))
                    engine.finish(h.request_id)
                    break
        return res

    return asyncio.run(go())


def prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def main():
    ap = argparse.ArgumentParser()
    add_serving_args(ap, new_tokens=48)
    ap.add_argument("--requests", type=int, default=6)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    out = os.path.join(args.out, "check.jsonl")
    import transformers

    from vramguard.serve import attention, engine
    from vramguard.serve.server import build
    transformers.utils.logging.disable_progress_bar()
    budget = int(args.budget * GiB)
    loaded = load_nf4_under_budget(args.arch, args.ckpt, budget)
    m = loaded.model
    P = prompts(args.requests, args.prompt, m.config.vocab_size, seed=1)
    news = [args.new if i % 2 == 0 else args.new // 2 for i in range(args.requests)]
    tokens = {}
    for name, varlen, graphs in (("graphs", True, True), ("eager", True, False), ("stock", False, False)):
        attention.ENABLED, engine.GRAPHS = varlen, graphs
        m.set_attn_implementation("sdpa")
        served = build(args.ckpt, vram_budget=budget, loaded=loaded, max_running=64, max_queue=64,
                       served_name="m", verify=False, warm_up=False)
        try:
            t = time.perf_counter()
            tokens[name] = run_engine(served.engine, P, news)
            dt = time.perf_counter() - t
            emit(out, {"phase": name, "s": round(dt, 2), "tokens": sum(map(len, tokens[name])),
                       "lengths": [len(x) for x in tokens[name]], "notes": served.engine.notes,
                       "decode_graphs": served.engine.stats()["decode_graphs"]})
        finally:
            served.close(unload_model=False)
    attention.ENABLED, engine.GRAPHS = True, True
    emit(out, {"phase": "agreement", "graphs_equal_eager": tokens["graphs"] == tokens["eager"],
               "graphs_vs_eager_prefix": [prefix(a, b) for a, b in zip(tokens["graphs"], tokens["eager"])],
               "eager_vs_stock_prefix": [prefix(a, b) for a, b in zip(tokens["eager"], tokens["stock"])],
               "new_tokens": news})


if __name__ == "__main__":
    main()
