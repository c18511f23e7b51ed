"""The planner against GPU measurements: shared/reference (H200) and this repo's benchmarks/results."""

import glob
import json
import statistics
from pathlib import Path

from conftest import read_jsonl

from vramguard.plan import estimate, plan
from vramguard.resolve import resolve_model
from vramguard.settings import Settings
from vramguard.units import GiB
from vramguard.plan.choice import choose

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "h200_matrix"


def _settings(rec):
    return Settings(quant=rec["quant"], attn=rec["attn"], batch=rec["batch"], prompt_tokens=rec["prompt"],
                    max_new_tokens=rec["new"])


def test_reference_llama2_peaks_within_5_percent(shared_reference):
    recs = [r for r in read_jsonl(shared_reference / "h200_llama2_7b_shape.jsonl") if r["kind"] == "gen"]
    spec = resolve_model("llama-2-7b")
    completed = [r for r in recs if r["ok"]]
    assert len(completed) == 7
    for r in completed:
        pred = estimate(choose(spec).model, _settings(r)).peak_allocated_bytes
        assert abs(pred - r["peak_total"]) / r["peak_total"] < 0.05, (r, pred)


def test_reference_llama2_fit_verdicts_on_24gib(shared_reference):
    """The two eager cases that ran out of memory under the 24 GiB cap do not fit; every completed case does."""
    recs = [r for r in read_jsonl(shared_reference / "h200_llama2_7b_shape.jsonl") if r["kind"] == "gen"]
    spec = resolve_model("llama-2-7b")
    verdicts = {(r["attn"], r["batch"], r["prompt"]): plan(spec, _settings(r), vram="24GiB", solve=False).fits
                for r in recs}
    assert verdicts[("eager", 4, 3968)] is False
    assert verdicts[("eager", 8, 2048)] is False
    for r in recs:
        if r["ok"]:
            assert verdicts[(r["attn"], r["batch"], r["prompt"])] is True, r


def test_committed_h200_matrix_median_and_max_error():
    """benchmarks/results/h200_matrix: 57 completed runs of 4 architectures; the model must stay within the goal
    (median <= 3%, largest <= 8%) and keep every OOM run predicted as not fitting the 24 GiB cap."""
    gens = [json.loads(line) for p in sorted(glob.glob(str(RESULTS / "*" / "matrix.jsonl"))) for line in open(p)]
    gens = [g for g in gens if g["kind"] == "gen"]
    assert len(gens) >= 72
    errs, cap = [], 24 * GiB
    for g in gens:
        est = estimate(choose(resolve_model(g["model"])).model, _settings(g))
        if g["ok"]:
            errs.append(abs(est.peak_allocated_bytes - g["peak_total"]) / g["peak_total"])
            assert est.peak_reserved_bytes <= cap, g
        else:
            assert est.peak_reserved_bytes > cap, g
    assert len(errs) >= 50
    assert statistics.median(errs) <= 0.03
    assert max(errs) <= 0.08
