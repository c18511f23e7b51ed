"""Where a serving step's time goes: ``vramguard serve`` built in this process (same model, budget and pool as
``benchmarks/gpu_serve.py``), driven over loopback with ``--concurrency`` requests of ``--prompt`` + ``--new`` tokens,
once per attention variant ("stock": transformers' paged SDPA without the start-up warm-up, as before;
"varlen": vramguard's varlen attention with the warm-up).

Per run: tokens/s and the engine's steps (from its step hook): how many, and their mean wall time, split into steps
with a prefill and decode-only steps. On the second run, ``--profile-steps`` decode-only steps under
``torch.profiler`` (CPU and CUDA): the top operators by CUDA time and by CPU time, and the totals per step.

    PYTHONPATH=/tmp/site:$PWD python benchmarks/gpu_serve_profile.py --out OUTDIR
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from benchmarks.common import add_serving_args, emit, load_nf4_under_budget  # noqa: E402
from benchmarks.gpu_serve import body, fire, prompts  # noqa: E402

GiB = 2**30


class StepLog:
    """The engine's steps (time, requests, query tokens), and a profiler over a few decode-only steps on demand."""

    def __init__(self, engine, out_dir: str):
        self.engine, self.out_dir = engine, out_dir
        self.rows: list[tuple[float, int, int]] = []
        self.profile_from: int | None = None
        self.profile_steps = 0
        self.prof = None
        self.profiled = 0
        self.tag = ""
        inner = engine._on_step

        def hook(index, request_ids, bp=None):
            io = getattr(bp, "inputs_and_outputs", None)
            q = int(getattr(io, "num_q_tokens", 0) or 0)
            self.rows.append((time.perf_counter(), len(request_ids), q))
            self._profile(len(request_ids), q)
            inner(index, request_ids, bp)

        engine._on_step = hook

    def _profile(self, n: int, q: int) -> None:
        if self.prof is not None:
            self.profiled += 1  # steps completed under the profiler (the hook runs before each step)
            if self.profiled >= self.profile_steps:
                torch.cuda.synchronize()
                self.prof.stop()
                self._write()
                self.prof, self.profile_from = None, None
            return
        if self.profile_from is not None and len(self.rows) >= self.profile_from and n == q and n > 1:
            from torch.profiler import ProfilerActivity, profile
            torch.cuda.synchronize()
            self.prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            self.prof.start()
            self.profiled = 0

    def _write(self) -> None:
        ka = self.prof.key_averages()
        path = os.path.join(self.out_dir, f"profile_{self.tag}.txt")
        with open(path, "w") as f:
            f.write(f"{self.profile_steps} decode-only steps at {self.rows[-2][1]} requests\n")
            f.write(ka.table(sort_by="cuda_time_total", row_limit=30))
            f.write("\n")
            f.write(ka.table(sort_by="self_cpu_time_total", row_limit=30))
        kernels = sum(e.self_device_time_total for e in ka if e.device_type == torch.autograd.DeviceType.CUDA)
        self.summary = {"profiled_steps": self.profile_steps,
                        "cuda_kernel_ms_per_step": round(kernels / 1000 / self.profile_steps, 2)}

    def stats(self, since: int) -> dict:
        rows = self.rows[since:]
        durs = [(rows[i + 1][0] - rows[i][0], rows[i][1], rows[i][2]) for i in range(len(rows) - 1)]
        dec = [d for d, n, q in durs if n == q]
        mix = [d for d, n, q in durs if n != q]
        ms = lambda xs: round(1000 * statistics.mean(xs), 2) if xs else None  # noqa: E731
        return {"steps": len(rows), "decode_steps": len(dec), "decode_ms_mean": ms(dec),
                "decode_ms_median": round(1000 * statistics.median(dec), 2) if dec else None,
                "prefill_steps": len(mix), "prefill_ms_mean": ms(mix),
                "decode_s_total": round(sum(dec), 2), "prefill_s_total": round(sum(mix), 2),
                "max_requests_in_step": max((n for _, n, _ in rows), default=0)}


def main():
    ap = argparse.ArgumentParser()
    add_serving_args(ap, new_tokens=128)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--profile-steps", type=int, default=3)
    ap.add_argument("--variants", default="stock,varlen")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    out = os.path.join(args.out, "profile.jsonl")
    import transformers

    from vramguard.serve import attention
    from vramguard.serve.server import build
    transformers.utils.logging.disable_progress_bar()
    budget = int(args.budget * GiB)
    t0 = time.perf_counter()
    loaded = load_nf4_under_budget(args.arch, args.ckpt, budget)
    emit(out, {"phase": "checkpoint_and_load", "s": round(time.perf_counter() - t0, 1),
               "transformers": transformers.__version__,
               "torch": torch.__version__})
    m = loaded.model
    P = prompts(args.concurrency + 8, args.prompt, m.config.vocab_size)
    for variant in args.variants.split(","):
        attention.ENABLED = variant != "stock"
        m.set_attn_implementation("sdpa")
        t0 = time.perf_counter()
        served = build(args.ckpt, vram_budget=budget, loaded=loaded, max_running=args.concurrency,
                       max_queue=args.concurrency, served_name="m", verify=False, warm_up=variant != "stock")
        log = StepLog(served.engine, args.out)
        log.tag, log.profile_steps = variant, args.profile_steps
        url = served.start_background()
        emit(out, {"phase": f"{variant}_start", "s": round(time.perf_counter() - t0, 1), "notes": served.engine.notes,
                   "attn": m.config._attn_implementation})
        try:
            asyncio.run(fire(url, [body(P[i], 16) for i in range(8)]))
            for run in range(args.runs):
                if run == args.runs - 1:
                    log.profile_from = len(log.rows) + 40
                since = len(log.rows)
                t = time.perf_counter()
                rs = asyncio.run(fire(url, [body(P[i], args.new) for i in range(args.concurrency)]))
                dt = time.perf_counter() - t
                toks = sum(r["tokens"] or 0 for r in rs)
                rec = {"phase": f"{variant}_run", "run": run, "ok": sum(r["status"] == 200 for r in rs),
                       "tokens": toks, "s": round(dt, 2), "tokens_per_s": round(toks / dt, 1), **log.stats(since)}
                if run == args.runs - 1:
                    rec.update(getattr(log, "summary", {}))
                emit(out, rec)
        finally:
            served.close(unload_model=False)
    emit(out, {"phase": "done"})


if __name__ == "__main__":
    main()
