"""The hand-written family models against the generic replay of transformers' forward, on every measured case of the
H200 matrix (``results/h200_matrix``): the planned peak allocated of both, and of both against the measurement.
Runs on the CPU (no GPU needed); writes one JSON line per case and prints a summary.

    python benchmarks/compare_generic_hand.py --out benchmarks/results/generic_vs_hand/compare.jsonl
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from vramguard.plan.choice import choose
from dataclasses import replace

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from benchmarks.common import emit  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def measured_cases() -> list[dict]:
    """Every completed ``generate`` case of the recorded H200 matrix."""
    rows = []
    for f in sorted(glob.glob(os.path.join(HERE, "results", "h200_matrix", "*", "*.jsonl"))):
        for line in open(f):
            r = json.loads(line)
            if r.get("kind") == "gen" and r.get("ok"):
                rows.append(r)
    return rows


def main() -> None:
    from vramguard.plan import estimate
    from vramguard.resolve import resolve_model
    from vramguard.settings import Settings
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    worst = 0.0
    for r in measured_cases():
        hand = resolve_model(r["model"])
        s = Settings(quant=r["quant"], attn=r["attn"], prompt_tokens=r["prompt"], max_new_tokens=r["new"],
                     batch=r["batch"])
        h = estimate(choose(hand).model, s).peak_allocated_bytes
        g = estimate(choose(replace(hand, generic=True)).model, s).peak_allocated_bytes
        m = r["peak_total"]
        rec = {"model": r["model"], "quant": r["quant"], "attn": r["attn"], "prompt": r["prompt"], "batch": r["batch"],
               "measured": m, "hand": h, "generic": g, "generic_vs_hand_pct": round(100 * (g - h) / h, 3),
               "hand_vs_measured_pct": round(100 * (h - m) / m, 3),
               "generic_vs_measured_pct": round(100 * (g - m) / m, 3)}
        worst = max(worst, abs(rec["generic_vs_hand_pct"]))
        emit(args.out, rec, width=240)
    print(f"largest |generic - hand| / hand: {worst:.3f}%")


if __name__ == "__main__":
    main()
