"""Record `profile` on Llama-2-7B NF4 (against shared/reference) and `fit --vary prompt` on Llama-3.1-8B NF4 with
plain SDPA under a 24 GiB budget, with a fine linear search around the boundary fit found.

    python benchmarks/gpu_profile_fit.py --out OUTDIR
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from benchmarks.common import build_checkpoint, emit  # noqa: E402
from vramguard.catalog.models import MODELS  # noqa: E402

GiB = 2**30






def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget-gib", type=float, default=24.0)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--fine-step", type=int, default=512)
    ap.add_argument("--skip-profile", action="store_true")
    ap.add_argument("--skip-fine", action="store_true", help="no fine linear search after fit")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    log = os.path.join(args.out, "results.jsonl")
    import transformers

    from vramguard.profile.fit import fit
    from vramguard.runtime.load import load_model, unload
    from vramguard.profile.profiler import profile
    from vramguard.profile.measured_run import run_generate
    from vramguard.settings import Settings
    emit(log, {"kind": "versions", "torch": torch.__version__, "transformers": transformers.__version__,
               "gpu": torch.cuda.get_device_name()})

    if not args.skip_profile:
        path = "/dev/shm/vg_profile"
        build_checkpoint("llama-2-7b", path)
        loaded = load_model(path, quant="nf4", attn="sdpa", verify=False)
        s = Settings(quant="nf4", attn="sdpa", prompt_tokens=3968, max_new_tokens=128)
        rep = profile(loaded, s, out_dir=os.path.join(args.out, "profile"))
        emit(log, {"kind": "profile", "rows": [{"name": r.name, "measured": r.measured, "planned": r.planned,
                                                "rel": r.rel} for r in rep.rows],
                   "ttft_s": rep.ttft_s, "decode_ms_per_token": rep.decode_ms_per_token, "files": rep.files,
                   "notes": rep.notes, "weights_bytes": loaded.report.weights_bytes})
        unload(loaded)
        del loaded
        shutil.rmtree(path, ignore_errors=True)

    path = "/dev/shm/vg_fit"
    build_checkpoint("llama-3.1-8b", path)
    loaded = load_model(path, quant="nf4", attn="sdpa", verify=False)
    s = Settings(quant="nf4", attn="sdpa", max_new_tokens=args.new)
    budget = int(args.budget_gib * GiB)
    t0 = time.perf_counter()
    fr = fit(loaded, s, "prompt", budget, out_dir=os.path.join(args.out, "fit"), progress=False)
    emit(log, {"kind": "fit", "boundary": fr.boundary, "smallest_failure": fr.smallest_failure,
               "runs": [r.__dict__ for r in fr.runs], "seeds": [fr.seed_conservative, fr.seed_optimistic],
               "binding": fr.binding_component, "secs": round(time.perf_counter() - t0, 1), "plot": fr.plot})

    if args.skip_fine:
        return
    # fine linear search around the boundary fit found, in steps of --fine-step tokens
    total = torch.cuda.mem_get_info()[1]
    torch.cuda.set_per_process_memory_fraction(budget / total)
    ctx = MODELS["llama-3.1-8b"]["max_position_embeddings"] - args.new
    start = max(512, (fr.boundary or 65536) - 3 * args.fine_step)
    stop = min(ctx, (fr.smallest_failure or fr.boundary or 65536) + 3 * args.fine_step)
    fine = []
    for v in range(start, stop + 1, args.fine_step):
        r = run_generate(loaded.model, s.with_(prompt_tokens=v))
        fine.append({"prompt": v, "ok": r.ok, "peak_allocated": r.peak_allocated, "peak_reserved": r.peak_reserved,
                     "secs": round(r.seconds, 2), "error": (r.error or "")[:240]})
        emit(log, {"kind": "fine", **fine[-1]})
    torch.cuda.set_per_process_memory_fraction(1.0)
    first_fail = next((f["prompt"] for f in fine if not f["ok"]), None)
    linear = max((f["prompt"] for f in fine if f["ok"] and (first_fail is None or f["prompt"] < first_fail)),
                 default=None)
    emit(log, {"kind": "summary", "fit_boundary": fr.boundary, "fit_runs": len(fr.runs),
               "linear_boundary": linear, "linear_first_failure": first_fail,
               "rel_diff": (None if not (linear and fr.boundary) else (fr.boundary - linear) / linear)})


if __name__ == "__main__":
    main()
