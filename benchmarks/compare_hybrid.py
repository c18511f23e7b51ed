"""The plan's error against the measurements of ``benchmarks/gpu_hybrid.py``: peak allocated, peak reserved and
weights, for the plan recorded beside each measurement (made in the measuring process) and, with ``--replan``, for a
plan made here from the same config (this machine's transformers: where its version differs from the GPU
machine's, a reference PyTorch path may differ, and the error shows it). Runs on the CPU.

    python3 benchmarks/compare_hybrid.py benchmarks/results/h200_hybrid/gpu_hybrid.jsonl --replan \\
        --out benchmarks/results/h200_hybrid/compare.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def pct(planned: int | None, measured: int | None) -> float | None:
    """``(planned - measured) / measured`` in percent, 3 decimals; None where either is missing."""
    if planned is None or not measured:
        return None
    return round(100 * (planned - measured) / measured, 3)


def measured_reserved(r: dict) -> int | None:
    """The reserved peak of the whole ``generate`` call (its out-of-memory point for a failed one)."""
    return r.get("decode_reserved_peak") if r.get("ok") else r.get("reserved_peak")


def replanned(arch: str, r: dict, folder: str) -> dict:
    """The plan made here of record ``r`` (a config.json of ``arch`` written to ``folder``)."""
    from transformers import AutoConfig

    from benchmarks.gpu_hybrid import CONFIGS, config_fields, planned
    path = os.path.join(folder, arch)
    if not os.path.isdir(path):
        AutoConfig.for_model(CONFIGS[arch]["model_type"], **config_fields(arch, False)).save_pretrained(path)
    return planned(path, r["quant"], r["prompt"], r["new"], r["cap"], r.get("attn", "sdpa"), r.get("process_freed"))


def compare(records: list[dict], replan: bool) -> list[dict]:
    """One row per ``gen`` record: measured figures, the recorded plan's errors and (``replan``) this machine's."""
    import transformers
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for r in records:
            if r.get("kind") != "gen":
                continue
            m_peak, m_res = r.get("peak_total"), measured_reserved(r)
            row = {"model": r["model"], "quant": r["quant"], "prompt": r["prompt"], "new": r["new"],
                   "ok": r.get("ok"), "measured_peak": m_peak, "measured_reserved": m_res,
                   "measured_weights": r.get("weights"),
                   "peak_err_pct": pct(r.get("plan_peak"), m_peak),
                   "reserved_err_pct": pct(r.get("plan_reserved"), m_res) if r.get("ok") else None,
                   "weights_err_pct": pct(r.get("plan_weights"), r.get("weights")),
                   "unverified": r.get("plan_unverified")}
            if replan:
                here = replanned(r["model"], r, folder)
                row.update(here_transformers=transformers.__version__, here_secs=here["plan_secs"],
                           here_peak_err_pct=pct(here["plan_peak"], m_peak),
                           here_reserved_err_pct=pct(here["plan_reserved"], m_res) if r.get("ok") else None,
                           here_weights_err_pct=pct(here["plan_weights"], r.get("weights")))
            rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", help="gpu_hybrid.jsonl")
    ap.add_argument("--replan", action="store_true", help="also plan each case here")
    ap.add_argument("--out", help="write the rows as JSON lines here too")
    args = ap.parse_args()
    with open(args.results) as f:
        records = [json.loads(line) for line in f if line.strip()]
    rows = compare(records, args.replan)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
    for row in rows:
        print(f"{row['model']:<22} {row['quant']:<5} {row['prompt']:>6,}+{row['new']:<3} measured "
              f"{(row['measured_peak'] or 0) / 1e9:7.2f} GB  peak {row['peak_err_pct']}%  reserved "
              f"{row['reserved_err_pct']}%  weights {row['weights_err_pct']}%"
              + (f"  here: peak {row['here_peak_err_pct']}%" if args.replan else ""))
    errs = [abs(r["peak_err_pct"]) for r in rows if r["peak_err_pct"] is not None and r["ok"]]
    if errs:
        print(f"largest |peak error| of the recorded plans: {max(errs):.3f}% over {len(errs)} runs")


if __name__ == "__main__":
    main()
