"""Record guarded generation on a GPU (Llama-3.1-8B architecture, NF4, plain SDPA):

* recovery: a real out-of-memory error (plain dynamic cache at a 70,000-token prompt under a 24 GiB cap, the
  preflight told to allow it) recovered by the next strategy;
* capacity under 12 GiB: plain ``generate``'s longest prompt (searched with ``fit``), then vramguard's at 2.5x;
* capacity under 24 GiB: the full 131,072-token context (131,008 prompt + 64 new tokens), 16-bit KV.

    python benchmarks/gpu_run.py --out OUTDIR
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from benchmarks.common import build_checkpoint, emit  # noqa: E402

GiB = 2**30




def ids_of(n, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (n,), generator=g).tolist()


def guarded(loaded, log, case, prompt_len, new, budget, **kw):
    from vramguard.run import generate as G
    t0 = time.perf_counter()
    try:
        r = G.generate(loaded, None, ids_of(prompt_len, loaded.model.config.vocab_size), new, budget_bytes=budget,
                       ignore_eos=True, **kw)
        emit(log, {"kind": case, "ok": True, "prompt": prompt_len, "new": new, "budget": budget,
                   "strategy": r.strategy, "reason": r.reason, "tokens": len(r.token_ids),
                   "attempts": [a.__dict__ for a in r.attempts], "peak_allocated": r.peak_allocated_bytes,
                   "ttft_s": r.ttft_s, "tokens_per_s": r.tokens_per_s, "secs": round(time.perf_counter() - t0, 1),
                   "planned_need": r.planned_need_bytes, "usable": r.usable_bytes})
        return r
    except Exception as e:  # the record says what failed; the other cases still run
        emit(log, {"kind": case, "ok": False, "prompt": prompt_len, "error": f"{type(e).__name__}: {e}"[:1200],
                   "secs": round(time.perf_counter() - t0, 1)})
        torch.cuda.set_per_process_memory_fraction(1.0)
        return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--skip-131k", action="store_true")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    log = os.path.join(args.out, "run.jsonl")
    import transformers

    from vramguard.run import generate as G
    from vramguard.profile.fit import fit
    from vramguard.runtime.load import load_model
    from vramguard.settings import Settings
    emit(log, {"kind": "versions", "torch": torch.__version__, "transformers": transformers.__version__,
               "gpu": torch.cuda.get_device_name()})
    path = "/dev/shm/vg_run"
    build_checkpoint("llama-3.1-8b", path)
    loaded = load_model(path, quant="nf4", attn="sdpa", verify=False)

    # recovery from a real OOM: let the preflight allow the plain dynamic cache, which cannot fit
    real_preflight = G.preflight
    G.preflight = lambda spec, s, usable, auto, on_cuda, weights_loaded: real_preflight(
        spec, s, 10**15, auto, on_cuda, weights_loaded)
    guarded(loaded, log, "recovery_real_oom", 70_000, 32, 24 * GiB)
    G.preflight = real_preflight

    # capacity under 12 GiB: plain generate's longest prompt, then vramguard at 2.5x
    s = Settings(quant="nf4", attn="sdpa", max_new_tokens=64)
    fr = fit(loaded, s, "prompt", 12 * GiB, progress=False)
    emit(log, {"kind": "plain_12gib", "boundary": fr.boundary, "smallest_failure": fr.smallest_failure,
               "runs": [(r.value, r.ok) for r in fr.runs]})
    if fr.boundary:
        guarded(loaded, log, "guarded_12gib", int(fr.boundary * 2.5), 64, 12 * GiB)

    if not args.skip_131k:
        guarded(loaded, log, "guarded_24gib_131k", 131_072 - 64, 64, 24 * GiB)


if __name__ == "__main__":
    main()
