"""Batch-1 decode speed on a GPU, Llama-3.1-8B architecture in NF4: transformers' default ``generate`` against
vramguard's ``generate`` (the guard's own overhead and token identity), a static cache, and a static cache with
the forward compiled in ``reduce-overhead`` mode (CUDA graphs), each timed after a warm-up.

    PYTHONPATH=$PWD python benchmarks/gpu_speed.py --out OUTDIR
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from benchmarks.common import build_checkpoint, emit  # noqa: E402

BANDWIDTH = 4.8e12  # H200 datasheet, bytes/s




class Clock:
    """Streamer recording the time of the first token and of the last."""

    def __init__(self):
        self.n, self.t_first, self.t_last, self.t0 = 0, None, None, None

    def put(self, value):
        self.n += 1
        torch.cuda.synchronize()
        now = time.perf_counter()
        if self.n == 2:
            self.t_first = now
        self.t_last = now

    def end(self):
        pass


def timed(model, ids, new, **kw):
    c = Clock()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                         do_sample=False, pad_token_id=0, streamer=c, **kw)
    torch.cuda.synchronize()
    total = time.perf_counter() - t0
    decode_ms = (c.t_last - c.t_first) * 1000 / (new - 1)
    return out[0, ids.shape[1]:].tolist(), total, decode_ms


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=128)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    log = os.path.join(args.out, "speed.jsonl")
    from vramguard import generate as G
    from vramguard.load import load_model
    build_checkpoint("llama-3.1-8b", "/dev/shm/vg_speed")
    loaded = load_model("/dev/shm/vg_speed", quant="nf4", attn="sdpa", verify=False)
    m = loaded.model
    weights = loaded.report.weights_bytes
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 128000, (1, args.prompt), generator=g).cuda()
    bound_ms = weights / BANDWIDTH * 1000
    rows = {}
    for name, kw in [("default", {}), ("default", {})]:
        toks, total, ms = timed(m, ids, args.new, **kw)
    rows["default"] = (toks, total, ms)
    emit(log, {"kind": "default", "decode_ms_per_token": ms, "total_s": total, "bound_ms": bound_ms})
    # the guard around the same strategy: overhead and identity
    t0 = time.perf_counter()
    r = G.generate(m, None, ids[0].tolist(), args.new)
    torch.cuda.synchronize()
    guard_total = time.perf_counter() - t0
    emit(log, {"kind": "vramguard_generate", "strategy": r.strategy, "total_s": guard_total,
               "overhead_fraction": (guard_total - total) / total, "identical_tokens": r.token_ids == toks,
               "tokens_per_s": r.tokens_per_s})
    toks_s, total_s, ms_s = timed(m, ids, args.new, cache_implementation="static")
    toks_s, total_s, ms_s = timed(m, ids, args.new, cache_implementation="static")
    emit(log, {"kind": "static", "decode_ms_per_token": ms_s, "total_s": total_s,
               "identical_tokens": toks_s == toks})
    try:
        m.forward = torch.compile(m.forward, mode="reduce-overhead", fullgraph=False, dynamic=False)
        t0 = time.perf_counter()
        timed(m, ids, args.new, cache_implementation="static")
        first = time.perf_counter() - t0
        toks_c, total_c, ms_c = timed(m, ids, args.new, cache_implementation="static")
        emit(log, {"kind": "static_compiled", "decode_ms_per_token": ms_c, "total_s": total_c,
                   "first_call_s": first, "identical_tokens": toks_c == toks,
                   "speedup_vs_default": ms / ms_c, "fraction_of_bandwidth_bound": bound_ms / ms_c})
    except Exception as e:  # compile of the 4-bit model may fail: record why
        emit(log, {"kind": "static_compiled", "error": f"{type(e).__name__}: {e}"[:1500]})


if __name__ == "__main__":
    main()
