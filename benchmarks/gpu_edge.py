"""Measure the edge (the largest prompt whose ``generate`` completes) under a per-process cap, with the caching
allocator's own record of every allocation, for checking :mod:`vramguard.memory.allocator`.

One process per (architecture, allocator setting): the setting is ``PYTORCH_CUDA_ALLOC_CONF`` as the process
started with. The random-weight checkpoint at ``--ckpt`` is loaded (bf16 or NF4 with double quant and bf16
compute), warmed up with a 16-token ``generate``, and then ``generate`` (greedy, ``min_new_tokens = --new``) is run
at prompt lengths chosen by bisection between ``--lo`` (taken to fit) and ``--hi`` (taken not to), until the
bracket is at most ``--step`` tokens or ``--run-seconds`` have passed (``--probe`` runs come first, and may set
the batch or switch the attention). Written to ``--out`` (JSON lines): the segments after load and after warm-up,
each run (peak allocated and reserved, OOM message), and for every run the allocator's trace
(``torch.cuda.memory._record_memory_history``: alloc, free_completed, segment_alloc/free/map/unmap and oom, each
with address and size; an ``oom`` entry carries the free device bytes instead of an address) gzipped beside it,
and the trace of the load and warm-up (``trace_TAG_load.json.gz``).

    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python benchmarks/gpu_edge.py --ckpt /dev/shm/llama \\
        --arch llama-3.1-8b --quant nf4 --attn sdpa --cap-gib 24 --lo 65280 --hi 80012 --out edge.jsonl
"""

from __future__ import annotations

import argparse
import gc
import gzip
import json
import os
import time

import torch

GiB = 2**30
TRACE_ACTIONS = ("alloc", "free_completed", "segment_alloc", "segment_free", "segment_map", "segment_unmap", "oom")


def emit(path: str, rec: dict) -> None:
    line = json.dumps(rec)
    print(line[:400], flush=True)
    with open(path, "a") as f:
        f.write(line + "\n")


def segments() -> list[dict]:
    """The allocator's segments: total and allocated bytes, pool, and the (size, state) of each block."""
    out = []
    for seg in torch.cuda.memory_snapshot():
        out.append({"address": seg["address"], "total": seg["total_size"], "allocated": seg["allocated_size"],
                    "type": seg["segment_type"],
                    "blocks": [[b["size"], b["state"][0]] for b in seg["blocks"]]})
    return out


def trace() -> list[list]:
    snap = torch.cuda.memory._snapshot()
    # an "oom" entry carries device_free instead of addr
    return [[e["action"], e.get("addr", e.get("device_free")), e["size"]] for t in snap.get("device_traces", [])
            for e in t if e["action"] in TRACE_ACTIONS]


def load(path: str, quant: str, attn: str):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig
    kw = {}
    if quant == "nf4":
        kw["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="cuda:0",
                                                 attn_implementation=attn, **kw)
    return model.eval()


def one_run(model, vocab: int, prompt: int, new: int, batch: int = 1) -> tuple[dict, list]:
    ids = torch.randint(100, vocab - 100, (batch, prompt), generator=torch.Generator().manual_seed(0)).cuda()
    mask = torch.ones_like(ids)
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    rec = {"prompt": prompt, "batch": batch, "new": new, "attn": model.config._attn_implementation,
           "base_allocated": torch.cuda.memory_allocated(), "base_reserved": torch.cuda.memory_reserved()}
    torch.cuda.memory._record_memory_history(max_entries=900000, context=None)
    t0 = time.perf_counter()
    try:
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                             pad_token_id=0)
        torch.cuda.synchronize()
        rec.update(ok=True, out_len=int(out.shape[1]))
        del out
    except torch.OutOfMemoryError as e:
        rec.update(ok=False, err=str(e).split("\n")[0][:500])
    rec.update(secs=round(time.perf_counter() - t0, 2), peak_allocated=torch.cuda.max_memory_allocated(),
               peak_reserved=torch.cuda.max_memory_reserved(), reserved_end=torch.cuda.memory_reserved())
    tr = trace()
    torch.cuda.memory._record_memory_history(enabled=None)
    del ids, mask
    gc.collect()
    torch.cuda.empty_cache()
    return rec, tr


def parse_probe(text: str) -> tuple[int, int, str | None]:
    """``4096`` (batch 1), ``512x4`` (batch 4), ``4096@eager`` (switch the attention first)."""
    text, _, attn = text.partition("@")
    prompt, _, batch = text.partition("x")
    return int(prompt), int(batch or 1), attn or None


def main() -> None:
    ap = argparse.ArgumentParser()
    for name in ("--ckpt", "--arch", "--quant", "--attn", "--out"):
        ap.add_argument(name, required=True)
    ap.add_argument("--cap-gib", type=float, default=24.0)
    ap.add_argument("--lo", type=int, required=True)
    ap.add_argument("--hi", type=int, required=True)
    ap.add_argument("--step", type=int, default=256)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--probe", nargs="*", default=[],
                    help="runs to make first: PROMPT, PROMPTxBATCH or PROMPT@ATTN (e.g. a known edge)")
    ap.add_argument("--run-seconds", type=float, default=60, help="time for the runs, from the end of warm-up")
    ap.add_argument("--deadline", type=float, default=time.time() + 500, help="epoch seconds to stop by")
    args = ap.parse_args()
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    tag = f"{args.arch}_{args.quant}_{'exp' if 'expandable_segments:True' in conf else 'default'}"
    total = torch.cuda.mem_get_info()[1]
    torch.cuda.set_per_process_memory_fraction(args.cap_gib * GiB / total)
    import transformers
    emit(args.out, {"kind": "versions", "tag": tag, "torch": torch.__version__, "transformers":
                    transformers.__version__, "alloc_conf": conf, "cap_gib": args.cap_gib, "total": total,
                    "allowed": int(args.cap_gib * GiB / total * total)})
    torch.cuda.memory._record_memory_history(max_entries=900000, context=None)  # the load and warm-up, too
    model = load(args.ckpt, args.quant, args.attn)
    emit(args.out, {"kind": "loaded", "tag": tag, "allocated": torch.cuda.memory_allocated(),
                    "reserved": torch.cuda.memory_reserved(), "peak_reserved": torch.cuda.max_memory_reserved(),
                    "segments": segments()})
    model.generate(torch.randint(100, 1000, (1, 16)).cuda(), max_new_tokens=2, min_new_tokens=2, do_sample=False,
                   pad_token_id=0)
    gc.collect()
    torch.cuda.empty_cache()
    emit(args.out, {"kind": "warm", "tag": tag, "allocated": torch.cuda.memory_allocated(),
                    "reserved": torch.cuda.memory_reserved(), "segments": segments()})
    with gzip.open(os.path.join(os.path.dirname(args.out), f"trace_{tag}_load.json.gz"), "wt") as f:
        json.dump(trace(), f, separators=(",", ":"))
    torch.cuda.memory._record_memory_history(enabled=None)
    vocab = model.config.get_text_config().vocab_size
    lo, hi, n = args.lo, args.hi, 0
    todo = [parse_probe(p) for p in args.probe]
    stop = min(args.deadline, time.time() + args.run_seconds)
    longest = 0.0
    while time.time() + longest < stop:
        if todo:
            p, batch, attn = todo.pop(0)
            if attn and hasattr(model, "set_attn_implementation"):
                model.set_attn_implementation(attn)
        elif hi - lo > args.step:
            p, batch = (lo + hi) // 2, 1
            if model.config._attn_implementation != args.attn:
                model.set_attn_implementation(args.attn)
        else:
            break
        rec, tr = one_run(model, vocab, p, args.new, batch)
        rec.update(kind="run", tag=tag)
        emit(args.out, rec)
        longest = max(longest, rec["secs"])
        if batch == 1 and rec["attn"] == args.attn:
            if rec["ok"]:
                lo = max(lo, p)
            else:
                hi = min(hi, p)
                if p <= lo:  # a failure at or below the lower bound: that bound was not one
                    lo = p * 9 // 10
        n += 1
        name = f"trace_{tag}_{n}_{rec['attn']}_{p}x{batch}_{'ok' if rec['ok'] else 'oom'}.json.gz"
        with gzip.open(os.path.join(os.path.dirname(args.out), name), "wt") as f:
            json.dump(tr, f, separators=(",", ":"))
    emit(args.out, {"kind": "edge", "tag": tag, "largest_ok": lo, "smallest_fail": hi})


if __name__ == "__main__":
    main()
