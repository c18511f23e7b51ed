"""Compare the caching-allocator model (:mod:`vramguard.memory.allocator` over the tape of
:mod:`vramguard.introspect.alloc_replay`) with every recorded H200 measurement of peak reserved memory, and its
edge (the largest prompt that fits) with the measured edges.

Sources: ``results/h200_matrix`` (plain transformers, 24 GiB cap), ``results/h200_profile_fit`` (``profile`` and
``fit``, and the linear search beside it), ``results/h200_edge`` (``gpu_edge.py``: both allocator settings),
``results/h200_reserved_misses`` (the matrix again in the same order, its misses in fresh processes, and ``fit``).
A matrix run made after its process had loaded and freed another model (``freed_model``) is modelled as the plan
of such a process (``vramguard.plan(..., freed_before=True)``): cudaMalloc reuses the freed address range there and
places new segments upwards, so the figure compared is that layout's, and the plan's verdict is the worse of that
layout and the fresh process's; these runs are counted apart as well, and each case outside 3% is shown with what
every matrix process that ran it measured (benchmarks/README.md). ``results/h200_freed_expandable`` ran the matrix
with expandable segments; its runs after the freed model are also compared with the replay of their process's
history (:mod:`history_replay`).

    python benchmarks/compare_reserved.py [--json OUT] [--no-edges]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
from dataclasses import replace

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from vramguard.introspect.alloc_replay import replay_generate  # noqa: E402
from vramguard.memory.allocator import AllocatorConfig  # noqa: E402
from vramguard.resolve import resolve_model  # noqa: E402
from vramguard.settings import Settings  # noqa: E402
from vramguard.plan.choice import choose  # noqa: E402

GiB = 2**30
HERE = os.path.join(os.path.dirname(__file__), "results")
EXP = "expandable_segments:True"


def _jsonl(path: str) -> list[dict]:
    return [json.loads(line) for line in open(path)] if os.path.exists(path) else []


def cases() -> list[dict]:
    """Every recorded generate: model, settings, cap, allocator setting, ok, measured peak reserved (or None)."""
    out = []
    for src, folder, pattern in (("matrix", "h200_matrix", "p*"), ("matrix again", "h200_reserved_misses", "p*"),
                                 ("matrix repeat", "h200_freed_repeat", "call*/r*"),
                                 ("matrix exp", "h200_freed_expandable", "r*"), ("matrix exp", "h200_freed_trace", ".")):
        for path in sorted(glob.glob(os.path.join(HERE, folder, pattern, "matrix.jsonl"))):
            loads, conf = 0, ""
            for r in _jsonl(path):
                loads += r["kind"] == "loaded"
                conf = r.get("alloc_conf", "") if r["kind"] == "versions" else conf
                if r["kind"] == "gen":
                    out.append(dict(src=src, path=os.path.relpath(path, HERE), model=r["model"], quant=r["quant"],
                                    attn=r["attn"], batch=r["batch"],
                                    prompt=r["prompt"], new=r["new"], cap=24 * GiB, conf=conf, ok=r["ok"],
                                    reserved=max(r["prefill_reserved_peak"], r["decode_reserved_peak"])
                                    if r["ok"] else None, freed_model=loads > 1))
    pf = os.path.join(HERE, "h200_profile_fit")
    for r in _jsonl(os.path.join(pf, "results.jsonl")) + _jsonl(os.path.join(pf, "fit_v2", "results.jsonl")):
        base = dict(model="llama-3.1-8b", quant="nf4", attn="sdpa", batch=1, new=64, cap=24 * GiB, conf="")
        if r["kind"] == "profile":
            row = {x["name"]: x["measured"] for x in r["rows"]}
            out.append(base | dict(src="profile", model="llama-2-7b", prompt=3968, new=128, cap=None, ok=True,
                                   reserved=row["peak reserved"]))
        elif r["kind"] == "fit":
            out += [base | dict(src="fit", prompt=x["value"], ok=x["ok"], reserved=x["peak_reserved"])
                    for x in r["runs"]]
        elif r["kind"] == "fine":
            out.append(base | dict(src="fit (linear)", prompt=r["prompt"], ok=r["ok"], reserved=r["peak_reserved"]))
    for path in sorted(glob.glob(os.path.join(HERE, "h200_reserved_misses", "fit", "*.json"))):
        arch, new = os.path.basename(path)[:-5], {"llama-3.1-8b": 64, "llama-3.2-1b": 16}
        out += [dict(src="fit again", model=arch, quant="nf4", attn="sdpa", batch=1, prompt=x["value"],
                     new=new[arch], cap=24 * GiB, conf=EXP, ok=x["ok"], reserved=x["peak_reserved"])
                for x in json.load(open(path))["runs"]]
    out += edge_cases()
    seen, unique = set(), []
    for c in out:  # the same run recorded twice (fit's own record and the linear search) counts once
        c.setdefault("freed_model", False)
        k = (c.get("path"), c["model"], c["quant"], c["attn"], c["batch"], c["prompt"], c["new"],
             c["conf"], c["reserved"])
        if k not in seen:
            seen.add(k)
            unique.append(c)
    return unique


def edge_cases() -> list[dict]:
    """The runs of ``gpu_edge.py`` (``results/h200_edge/edge.jsonl``, then ``run2/edge.jsonl``, whose runs name
    their attention and batch, the fresh processes of ``h200_reserved_misses`` and the Gemma-2 edge of
    ``h200_verify/edge_gemma.jsonl``). A process of the first set that stopped with ``KeyError: 'addr'`` in
    ``trace()`` had just recorded an out-of-memory error (the allocator's ``oom`` trace entry has no address): that run is taken as
    failed at the next bisection point (benchmarks/README.md says which)."""
    out = []
    fresh = sorted(glob.glob(os.path.join(HERE, "h200_reserved_misses", "f*", "edge.jsonl")))
    for path in [os.path.join(HERE, "h200_edge", "edge.jsonl"), os.path.join(HERE, "h200_edge", "run2", "edge.jsonl"),
                 *fresh, os.path.join(HERE, "h200_verify", "edge_gemma.jsonl"),
                 os.path.join(HERE, "h200_default_plan", "edge_default.jsonl"),
                 os.path.join(HERE, "h200_default_plan", "edge_exp.jsonl")]:
        meta = {}
        for r in _jsonl(path):
            if r["kind"] == "versions":
                meta[r["tag"]] = r
            elif r["kind"] == "run":
                m = meta[r["tag"]]
                arch, quant, _ = r["tag"].rsplit("_", 2)
                attn = r["attn"] if "attn" in r else EDGE_ATTN[arch]
                out.append(dict(src="fresh" if "misses" in path else "edge", model=arch, quant=quant, attn=attn,
                                batch=r.get("batch", 1), prompt=r["prompt"], new=r["new"], cap=m["allowed"],
                                conf=m["alloc_conf"], ok=r["ok"], reserved=r["peak_reserved"] if r["ok"] else None))
    for arch, quant, conf, prompt in EDGE_INFERRED_OOM:
        out.append(dict(src="edge (OOM, inferred)", model=arch, quant=quant, attn=EDGE_ATTN[arch], batch=1,
                        prompt=prompt, new=64, cap=EDGE_CAP[arch], conf=conf, ok=False, reserved=None))
    return out


EDGE_ATTN = {"gemma-2-9b": "eager", "qwen2.5-7b": "sdpa", "llama-3.1-8b": "sdpa"}
EDGE_CAP = {"gemma-2-9b": 24 * GiB, "qwen2.5-7b": 20 * GiB, "llama-3.1-8b": 24 * GiB}
# (arch, quant, PYTORCH_CUDA_ALLOC_CONF, prompt): the bisection point each process stopped at (see edge_cases)
EDGE_INFERRED_OOM = [("gemma-2-9b", "bf16", "", 4960), ("gemma-2-9b", "bf16", EXP, 5398),
                     ("qwen2.5-7b", "bf16", "", 28651), ("qwen2.5-7b", "bf16", EXP, 29829),
                     ("llama-3.1-8b", "nf4", EXP, 79260)]


def settings(c: dict) -> Settings:
    return Settings(quant=c["quant"], attn=c["attn"], batch=c["batch"], prompt_tokens=c["prompt"],
                    max_new_tokens=c["new"])


def modelled(c: dict, freed_before: bool | None = None):
    """The replay of case ``c``; in the upward layout where its process had freed a model (``freed_before`` None)."""
    cfg = replace(AllocatorConfig.parse(c["conf"], c["cap"]),
                  freed_before=c["freed_model"] if freed_before is None else freed_before)
    return replay_generate(resolve_model(c["model"]), settings(c), cfg)


def planned_fits(c: dict, base_reserved: int) -> bool | None:
    """The plan's verdict under the case's cap: the replay under the cap less the plan's margin (after a freed
    model: in both layouts)."""
    from vramguard.introspect.alloc_replay import allowed_bytes
    if c["cap"] is None:
        return None
    cfg = AllocatorConfig.parse(c["conf"], allowed_bytes(c["cap"], base_reserved))
    layouts = (False, True) if c["freed_model"] else (False,)
    return all(replay_generate(resolve_model(c["model"]), settings(c), replace(cfg, freed_before=f)).fits
               for f in layouts)


# the measured edges: (source, arch, quant, PYTORCH_CUDA_ALLOC_CONF) -> (largest completed prompt, smallest failed
# prompt). "fit": results/h200_profile_fit (vramguard's own load; fit and the linear search); "edge": h200_edge (plain
# transformers; run2 closed the Qwen brackets and the Gemma default one); "fit again": h200_reserved_misses/fit (fit
# at 24 GiB with expandable segments, 3 runs)
# (source, arch, quant, PYTORCH_CUDA_ALLOC_CONF, new tokens): (largest completed, smallest out of memory)
MEASURED_EDGES = {("fit", "llama-3.1-8b", "nf4", "", 64): (65280, 65536),
                  ("edge", "llama-3.1-8b", "nf4", "", 64): (65536, 65678),
                  ("edge", "llama-3.1-8b", "nf4", EXP, 64): (78509, 79260),
                  ("fit again", "llama-3.1-8b", "nf4", EXP, 64): (78464, 79616),
                  ("edge", "llama-3.1-8b", "nf4", "", 256): (65531, 65595),  # h200_default_plan
                  ("edge", "llama-3.1-8b", "nf4", EXP, 256): (78857, 79009),
                  ("edge", "qwen2.5-7b", "bf16", "", 64): (28248, 28426),
                  ("edge", "qwen2.5-7b", "bf16", EXP, 64): (29352, 29537),
                  ("edge", "gemma-2-9b", "bf16", "", 64): (4613, 4636),  # h200_verify/edge_gemma.jsonl
                  ("edge", "gemma-2-9b", "bf16", EXP, 64): (5252, 5398)}
FORMULA_EDGES = {"llama-3.1-8b": 57428, "qwen2.5-7b": 21581, "gemma-2-9b": 4376}  # the reserve formula's answers


def edges() -> list[dict]:
    """The planned edge (:func:`edge_prompt_tokens` under the measured cap, with the plan's margin) per measured
    architecture and allocator setting, beside the measured bracket."""
    from vramguard.introspect.alloc_replay import allowed_bytes
    from vramguard.plan.allocator import edge_prompt_tokens
    out = []
    for (src, arch, quant, conf, new), (ok, fail) in MEASURED_EDGES.items():
        spec = resolve_model(arch)
        s = Settings(quant=quant, attn=EDGE_ATTN[arch], max_new_tokens=new)
        cfg = AllocatorConfig.parse(conf)
        base = replay_generate(spec, s.with_(prompt_tokens=1), cfg).base_reserved_bytes
        cfg = AllocatorConfig.parse(conf, allowed_bytes(EDGE_CAP[arch], base))
        planned = edge_prompt_tokens(choose(spec).model, s, cfg, FORMULA_EDGES[arch])
        out.append(dict(src=src, model=arch, quant=quant, conf=conf, new=new, cap=EDGE_CAP[arch], measured_ok=ok,
                        measured_fail=fail, planned=planned, formula=FORMULA_EDGES[arch]))
    return out


def print_edges(rows: list[dict]) -> None:
    print(f"\n{'source':9} {'model':14} {'quant':5} {'allocator':10} {'new':>4} {'cap GiB':>7} {'measured ok':>11} "
          f"{'measured OOM':>12} "
          f"{'planned':>8} {'vs ok':>7} {'formula':>8}")
    for r in rows:
        vs = f"{(r['planned'] - r['measured_ok']) / r['measured_ok'] * 100:+.2f}%" if r["measured_ok"] else ""
        ok = f"{r['measured_ok']:,}" if r["measured_ok"] else "-"
        print(f"{r['src']:9} {r['model']:14} {r['quant']:5} {'expandable' if r['conf'] else 'default':10} {r['new']:>4} "
              f"{r['cap'] / GiB:7.0f} "
              f"{ok:>11} {r['measured_fail']:>12,} {r['planned']:>8,} {vs:>7} {r['formula']:>8,}")


def print_twins(rows: list[dict]) -> None:
    """Each case after a freed model outside 3%, with what every matrix process that ran it measured."""
    def key(r):
        return r["model"], r["quant"], r["attn"], r["batch"], r["prompt"], r["new"]
    freed = [r for r in rows if r["freed_model"] and "rel_err" in r]
    for k in dict.fromkeys(key(r) for r in freed if abs(r["rel_err"]) > 0.03):
        same = [r for r in freed if key(r) == k]
        by = {}
        for r in same:
            by.setdefault((r["src"], r["reserved"]), []).append(r)
        print(f"  outside 3% after a freed model: {' '.join(map(str, k))}, modelled {same[0]['modelled']:,} "
              f"(fresh layout {same[0]['modelled_fresh']:,}); measured: "
              + "; ".join(f"{src} x{len(v)} {res:,} ({v[0]['rel_err'] * 100:+.2f}%)" for (src, res), v in by.items()))


def print_history(rows: list[dict]) -> None:
    """The runs after a freed model with expandable segments, against the replay of their process's history
    (:mod:`history_replay`): what the model gives when it knows what the freed model left."""
    from history_replay import peak_reserved
    part = [r for r in rows if r["freed_model"] and r["conf"] and "rel_err" in r]
    if not part:
        return
    err = [(peak_reserved(r["model"], r["conf"], settings(r)) - r["reserved"]) / r["reserved"] for r in part]
    worst = max(range(len(part)), key=lambda i: abs(err[i]))
    w = part[worst]
    print(f"peak reserved after a freed model, expandable segments, {len(part)} runs: the plan (a fresh segment) "
          f"median |error| {statistics.median(abs(r['rel_err']) for r in part) * 100:.2f}%, max "
          f"{max(abs(r['rel_err']) for r in part) * 100:.2f}%; the replay of the process's history (the freed "
          f"model's range unmapped in place) median {statistics.median(map(abs, err)) * 100:.2f}%, max "
          f"{abs(err[worst]) * 100:.2f}% ({w['model']} {w['quant']} {w['attn']} {w['batch']}x{w['prompt']}); "
          f"{sum(abs(x) <= 0.03 for x in err)} within 3%")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-edges", action="store_true")
    args = ap.parse_args()
    rows = []
    print(f"{'source':22} {'model':14} {'quant':5} {'attn':5} {'b':>2} {'prompt':>6} {'alloc conf':10} "
          f"{'measured':>15} {'modelled':>15} {'err':>7}  fits: measured / modelled")
    for c in cases():
        r = modelled(c)
        row = dict(c, modelled=r.peak_reserved_bytes, modelled_fits=r.fits,
                   modelled_fresh=modelled(c, False).peak_reserved_bytes if c["freed_model"] else None,
                   planned_fits=r.fits if not r.fits else planned_fits(c, r.base_reserved_bytes))
        if c["ok"] and c["reserved"]:
            row["rel_err"] = (r.peak_reserved_bytes - c["reserved"]) / c["reserved"]
        rows.append(row)
        meas = f"{c['reserved']:,}" if c["reserved"] else ("OOM" if not c["ok"] else "ok")
        err = f"{row['rel_err'] * 100:+.2f}%" if "rel_err" in row else ""
        print(f"{c['src'] + ('*' if c['freed_model'] else ''):22} {c['model']:14} {c['quant']:5} {c['attn']:5} {c['batch']:>2} {c['prompt']:>6} "
              f"{'expandable' if c['conf'] else 'default':10} {meas:>15} {r.peak_reserved_bytes:>15,} {err:>7}  "
              f"{'ok' if c['ok'] else 'OOM'} / {'ok' if r.fits else 'OOM'}")
    disagree = [r for r in rows if r["ok"] != r["modelled_fits"]]
    capped = [r for r in rows if r["planned_fits"] is not None]
    over = [r for r in capped if r["planned_fits"] and not r["ok"]]
    under = [r for r in capped if r["ok"] and not r["planned_fits"]]
    print(f"plan verdicts (the cap less the plan's margin), {len(capped)} capped runs: "
          f"{len(capped) - len(over) - len(under)} agree; predicted to fit but ran out: "
          + (", ".join(f"{r['model']} {r['quant']} {r['attn']} b{r['batch']} {r['prompt']}" for r in over) or "none")
          + "; ran but predicted not to fit: "
          + (", ".join(f"{r['model']} {r['quant']} {r['attn']} b{r['batch']} {r['prompt']} "
                       f"{'exp' if r['conf'] else 'default'}" for r in under) or "none"))
    print()
    for label, keep in (("all", lambda r: True), ("no model freed before in the process", lambda r: not r["freed_model"]),
                        ("after a freed model", lambda r: r["freed_model"])):
        part = [r for r in rows if "rel_err" in r and keep(r)]
        e = [abs(r["rel_err"]) for r in part]
        s = [r["rel_err"] for r in part]
        print(f"peak reserved, {label}: {len(e)} completed runs, median |error| {statistics.median(e) * 100:.2f}%, "
              f"max {max(e) * 100:.2f}% (signed: min {min(s) * 100:+.2f}%, max {max(s) * 100:+.2f}%), "
              f"{sum(x <= 0.03 for x in e)} within 3%")
    print_twins(rows)
    print_history(rows)
    print(f"fit verdicts: {len(rows) - len(disagree)} of {len(rows)} agree; disagreeing: "
          + ", ".join(f"{r['model']} {r['quant']} {r['prompt']} {'exp' if r['conf'] else 'default'} "
                      f"(measured {'ok' if r['ok'] else 'OOM'})" for r in disagree))
    edge_rows = [] if args.no_edges else edges()
    if edge_rows:
        print_edges(edge_rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": rows, "edges": edge_rows}, f, indent=1)


if __name__ == "__main__":
    main()
