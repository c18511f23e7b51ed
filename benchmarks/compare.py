"""Compare the planner with the measured GPU matrix (benchmarks/results/h200_matrix/*/matrix.jsonl).

For every completed case: predicted PyTorch peak (``estimate().peak_allocated_bytes``, weights and cuBLAS
workspace included) against the measured ``peak_total`` (``max_memory_allocated`` over ``generate``, measured
after a warm-up so the workspace already exists). For every case that ran out of memory under the cap: whether
the planner says it does not fit (predicted reserved peak above the cap; the cap limits PyTorch's reserved memory).

    python benchmarks/compare.py [--results DIR] [--json OUT]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from vramguard.plan import estimate  # noqa: E402
from vramguard.resolve import resolve_model  # noqa: E402
from vramguard.settings import Settings  # noqa: E402
from vramguard.plan.choice import choose  # noqa: E402

GiB = 2**30


def load(results_dir: str) -> tuple[list[dict], dict]:
    gens, meta = [], {}
    for path in sorted(glob.glob(os.path.join(results_dir, "*", "matrix.jsonl"))):
        for line in open(path):
            rec = json.loads(line)
            if rec["kind"] == "gen":
                gens.append(rec)
            elif rec["kind"] == "versions":
                meta = rec
    return gens, meta


def compare(gens: list[dict], cap_bytes: int) -> list[dict]:
    rows = []
    for g in gens:
        s = Settings(quant=g["quant"], attn=g["attn"], batch=g["batch"], prompt_tokens=g["prompt"],
                     max_new_tokens=g["new"])
        est = estimate(choose(resolve_model(g["model"])).model, s)
        pred = est.peak_allocated_bytes
        row = {k: g[k] for k in ("model", "quant", "attn", "batch", "prompt", "new", "ok")}
        row.update(predicted_peak=pred, predicted_reserved=est.peak_reserved_bytes,
                   predicted_fits=est.peak_reserved_bytes <= cap_bytes, peak_phase=est.peak_phase)
        if g["ok"]:
            meas = g["peak_total"] - (g["base_allocated"] - g["weights"] - 33554944)  # ids/mask of the case
            row.update(measured_peak=g["peak_total"], measured_prefill=g["prefill_peak"],
                       measured_decode=g["decode_peak"], measured_reserved=max(g["prefill_reserved_peak"],
                                                                                g["decode_reserved_peak"]),
                       rel_err=(pred - g["peak_total"]) / g["peak_total"])
            _ = meas
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    here = os.path.dirname(__file__)
    ap.add_argument("--results", default=os.path.join(here, "results", "h200_matrix"))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    gens, meta = load(args.results)
    cap = int(meta.get("cap_gib", 24) * GiB)
    rows = compare(gens, cap)
    print(f"{'model':16} {'quant':5} {'attn':6} {'b':>2} {'prompt':>6} {'measured':>15} {'predicted':>15} "
          f"{'err':>7}  fits(pred)")
    for r in rows:
        meas = f"{r['measured_peak']:,}" if r["ok"] else "OOM"
        err = f"{r['rel_err'] * 100:+.2f}%" if r["ok"] else ""
        print(f"{r['model']:16} {r['quant']:5} {r['attn']:6} {r['batch']:>2} {r['prompt']:>6} {meas:>15} "
              f"{r['predicted_peak']:>15,} {err:>7}  {'yes' if r['predicted_fits'] else 'no'}")
    errs = [abs(r["rel_err"]) for r in rows if r["ok"]]
    oom = [r for r in rows if not r["ok"]]
    wrong_oom = [r for r in oom if r["predicted_fits"]]
    wrong_ok = [r for r in rows if r["ok"] and not r["predicted_fits"]]
    summary = {"completed": len(errs), "oom": len(oom), "median_abs_rel_err": statistics.median(errs),
               "max_abs_rel_err": max(errs), "oom_predicted_fitting": len(wrong_oom),
               "completed_predicted_not_fitting": len(wrong_ok), "cap_bytes": cap,
               "measured_with": {k: meta.get(k) for k in ("torch", "transformers", "gpu")}}
    print(json.dumps(summary, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
