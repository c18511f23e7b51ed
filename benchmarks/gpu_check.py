"""Record `check` and `load_model` on a GPU: the attention kernel that runs per setting, the loader's choice,
and the memory of a load/unload loop (field case C17).

A random-weight Llama-3-8B-architecture checkpoint is written first (memory and kernels do not depend on weight
values). Run on the GPU machine (see benchmarks/README.md)::

    python benchmarks/gpu_check.py --out OUTDIR
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from benchmarks.common import build_checkpoint, emit  # noqa: E402




def cli(out_dir, name, *args):
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "vramguard", *args], capture_output=True, text=True)
    with open(os.path.join(out_dir, f"{name}.txt"), "w") as f:
        f.write(f"$ vramguard {' '.join(args)}\n(exit {r.returncode}, {time.perf_counter() - t0:.1f} s)\n")
        f.write(r.stdout + "\n--- stderr ---\n" + r.stderr[-3000:])
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--arch", default="llama-3-8b")
    ap.add_argument("--ckpt", default="/dev/shm/vg_check")
    ap.add_argument("--loops", type=int, default=3)
    ap.add_argument("--skip-checks", action="store_true", help="only the load/unload loop and the naive del")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    log = os.path.join(args.out, "check.jsonl")
    import transformers
    build_checkpoint(args.arch, args.ckpt)
    emit(log, {"kind": "versions", "torch": torch.__version__, "transformers": transformers.__version__,
               "gpu": torch.cuda.get_device_name(), "arch": args.arch})

    cases = [] if args.skip_checks else [("check_sdpa", ["--attn", "sdpa"]),
                        ("check_sdpa_pinned_flash", ["--attn", "sdpa", "--sdpa-kernel", "flash"]),
                        ("check_eager", ["--attn", "eager"]),
                        ("check_fa2", ["--attn", "flash_attention_2"])]
    if not args.skip_checks:
        cli(args.out, "plan_detected", "plan", args.arch, "--attn", "sdpa", "--prompt-tokens", "4096")
        cli(args.out, "check_env", "check")
    for name, extra in cases:
        r = cli(args.out, name, "check", args.ckpt, "--quant", "nf4", "--compute-dtype", "bf16", "--dtype", "bf16",
                "--format", "json", *extra)
        try:
            d = json.loads(r.stdout)
            kern = next((f for f in d["findings"] if f["name"] == "attention_kernel"), None)
            emit(log, {"kind": "check", "case": name, "exit": r.returncode, "attention_kernel": kern,
                       "kernel": d.get("attention_kernel"),
                       "fails": [f for f in d["findings"] if f["status"] == "fail"]})
        except (json.JSONDecodeError, KeyError) as e:
            emit(log, {"kind": "check", "case": name, "exit": r.returncode, "parse_error": repr(e),
                       "stderr": r.stderr[-1500:]})

    from vramguard.runtime.load import load_model, unload
    gc.collect()
    torch.cuda.empty_cache()
    baseline = torch.cuda.memory_allocated()
    rows = []
    for i in range(args.loops):
        t0 = time.perf_counter()
        loaded = load_model(args.ckpt)
        rep = loaded.report
        if i == 0:
            emit(log, {"kind": "load_model", "active": rep.active, "overrides": rep.overrides, "notes": rep.notes,
                       "kernel": rep.kernel.__dict__ if rep.kernel else None, "weights_bytes": rep.weights_bytes,
                       "load_s": round(time.perf_counter() - t0, 1)})
        loaded_alloc = torch.cuda.memory_allocated()
        u = unload(loaded)
        del loaded
        after = torch.cuda.memory_allocated()
        rows.append({"loop": i, "loaded_allocated": loaded_alloc, "after_unload": after, "baseline": baseline,
                     "residual": after - baseline, "unload_report": u.__dict__,
                     "report_baseline": rep.baseline_allocated_bytes})
    emit(log, {"kind": "load_unload_loop", "rows": rows,
               "max_residual_fraction_of_weights": max(r["residual"] for r in rows) /
               max(1, rows[0]["loaded_allocated"] - baseline)})

    # the naive path for comparison (C17): del + empty_cache without gc.collect()
    gc.collect()
    torch.cuda.empty_cache()
    base2 = torch.cuda.memory_allocated()
    gc.disable()
    m = transformers.AutoModelForCausalLM.from_pretrained(
        args.ckpt, device_map={"": 0}, dtype=torch.bfloat16,
        quantization_config=transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                            bnb_4bit_use_double_quant=True,
                                                            bnb_4bit_compute_dtype=torch.bfloat16))
    loaded_alloc = torch.cuda.memory_allocated()
    del m
    torch.cuda.empty_cache()
    after_del = torch.cuda.memory_allocated()
    gc.enable()
    gc.collect()
    torch.cuda.empty_cache()
    emit(log, {"kind": "naive_del", "baseline": base2, "loaded": loaded_alloc, "after_del_empty_cache": after_del,
               "after_gc_collect": torch.cuda.memory_allocated()})


if __name__ == "__main__":
    main()
