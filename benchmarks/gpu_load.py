"""Measure what loading takes on the GPU: ``from_pretrained``'s peak allocated and reserved memory above the final
weights, transformers' caching-allocator warm-up (its one large allocation, from the allocator's history), and
whether a load under a per-process cap just above the weights succeeds; each beside vramguard's load plan
(:func:`vramguard.introspect.generic.load_plan`).

    python benchmarks/gpu_load.py --archs llama-3.1-8b olmoe-1b-7b --out load.jsonl
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from benchmarks.common import build_checkpoint, emit  # noqa: E402
from benchmarks.gpu_generic import CONFIGS, build  # noqa: E402

GiB = 2**30


def _load(path: str, quant: str):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig
    kw = {}
    if quant == "nf4":
        kw["quantization_config"] = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                       bnb_4bit_use_double_quant=True,
                                                       bnb_4bit_compute_dtype=torch.bfloat16)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="cuda:0", **kw)


def _largest_alloc(snapshot) -> int:
    sizes = [e["size"] for trace in snapshot.get("device_traces", []) for e in trace if e.get("action") == "alloc"]
    return max(sizes, default=0)


def measure(path: str, arch: str, quant: str, out: str) -> None:
    from vramguard import Settings
    from vramguard.introspect.generic import load_plan
    from vramguard.resolve import resolve_model
    total = torch.cuda.mem_get_info()[1]
    lp = load_plan(resolve_model(path), Settings(quant=quant))
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=200000)
    model = _load(path, quant)
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    weights = torch.cuda.memory_allocated() - base
    rec = {"kind": "load", "model": arch, "quant": quant, "weights": weights,
           "peak_allocated": torch.cuda.max_memory_allocated() - base, "peak_reserved": torch.cuda.max_memory_reserved(),
           "largest_alloc": _largest_alloc(snap), "plan_weights": lp.weights_bytes, "plan_warmup": lp.warmup_bytes,
           "plan_peak": lp.peak_reserved_bytes, "plan_largest_transient": lp.largest_transient_bytes,
           "plan_converted": len(lp.converted)}
    del model, snap
    gc.collect()
    torch.cuda.empty_cache()
    margins = sorted({GiB, 256 * 2**20, lp.largest_transient_bytes + 256 * 2**20}, reverse=True)
    for margin in margins:
        torch.cuda.set_per_process_memory_fraction((weights + margin) / total)
        try:
            model = _load(path, quant)
            rec[f"capped_{margin >> 20}MiB"] = "ok"
            del model
        except (torch.OutOfMemoryError, RuntimeError) as e:  # transformers wraps an OOM inside a conversion
            rec[f"capped_{margin >> 20}MiB"] = str(e).split(". GPU")[0][:200]
        torch.cuda.set_per_process_memory_fraction(1.0)
        gc.collect()
        torch.cuda.empty_cache()
    emit(out, rec)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--archs", nargs="+", required=True)
    ap.add_argument("--quants", nargs="+", default=["bf16", "nf4"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--ckpt-dir", default="/dev/shm/vg_load")
    args = ap.parse_args()
    for arch in args.archs:
        path = os.path.join(args.ckpt_dir, arch)
        try:
            build(arch, path) if arch in CONFIGS else build_checkpoint(arch, path)
            for quant in args.quants:
                measure(path, arch, quant, args.out)
        except Exception as e:  # keep measuring the others; the record says what failed
            emit(args.out, {"kind": "arch_error", "model": arch, "err": repr(e)[:800]})
        shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    main()
