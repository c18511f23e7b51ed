"""Measure generate() peak memory of plain transformers on a GPU, for checking the planner.

For each architecture of the embedded catalog named on the command line, a random-weight bf16 checkpoint is
written with ``from_config(...).save_pretrained(...)`` (memory does not depend on weight values), loaded in bf16
and in NF4 (double quant, bf16 compute), and ``generate`` is run greedy with ``min_new_tokens = max_new_tokens``
for every (attention, prompt, batch) under a per-process cap (``torch.cuda.set_per_process_memory_fraction``).
One JSON line per event is appended to ``--out``: the load (weights bytes and a breakdown), and every case
(peak allocated during prefill and during decode, peak reserved, non-PyTorch memory, OOM message).

``--trace-dir``: for every case, the large pool's part of the caching allocator's own record
(``torch.cuda.memory._record_memory_history``: every alloc, free and segment event above 1 MiB, and the segments
at the case's start with their addresses), gzipped JSON beside the results. ``--keep-ckpt``: a checkpoint already
at ``--ckpt-dir``/ARCH is used as it is and kept. ``--trace-freed PATH``: the large pool's segments just before
the first model is freed, and its record from there to the end (the next loads and cases), in one gzipped JSON.

Run on the GPU machine (see benchmarks/README.md for the exact command and the recorded results)::

    python benchmarks/gpu_matrix.py --archs llama-3.1-8b llama-2-7b --out results.jsonl
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from benchmarks.common import build_checkpoint, emit  # noqa: E402
from vramguard.catalog.models import MODELS  # noqa: E402

GiB = 2**30






def tensor_breakdown(model):
    """Bytes of parameters, buffers and bitsandbytes quantization state actually held on the GPU."""
    seen, out = set(), {"params": 0, "buffers": 0, "quant_state": 0, "n_quant_state_tensors": 0}

    def add(t, key):
        if t is None or not torch.is_tensor(t) or t.device.type != "cuda":
            return
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen:
            return
        seen.add(ptr)
        out[key] += t.untyped_storage().nbytes()
        if key == "quant_state":
            out["n_quant_state_tensors"] += 1

    for p in model.parameters():
        add(p.data, "params")
        qs = getattr(p, "quant_state", None)
        if qs is not None:
            for name in ("absmax", "code", "offset"):
                add(getattr(qs, name, None), "quant_state")
            s2 = getattr(qs, "state2", None)
            if s2 is not None:
                for name in ("absmax", "code"):
                    add(getattr(s2, name, None), "quant_state")
        scb = getattr(p, "SCB", None)
        add(scb, "quant_state")
    for b in model.buffers():
        add(b, "buffers")
    return out


class PhaseTracker:
    """A streamer that records the peak allocated bytes of prefill and resets the peak for decode."""

    def __init__(self):
        self.calls = 0
        self.prefill_peak = None
        self.prefill_reserved_peak = None
        self.t_first = None

    def put(self, value):
        self.calls += 1
        if self.calls == 2:  # first call is the prompt, second the first generated token
            torch.cuda.synchronize()
            self.prefill_peak = torch.cuda.max_memory_allocated()
            self.prefill_reserved_peak = torch.cuda.max_memory_reserved()
            self.t_first = time.perf_counter()
            torch.cuda.reset_peak_memory_stats()

    def end(self):
        pass


K_SMALL = 1 << 20  # c10/cuda/CUDACachingAllocator.cpp kSmallSize: larger requests go to the large pool


def large_segments() -> list[list]:
    """The large pool's segments: [address, total, [[address, size, state], ...]] (state "a"ctive or "i"nactive)."""
    return [[s["address"], s["total_size"], [[b.get("address"), b["size"], b["state"][0]] for b in s["blocks"]]]
            for s in torch.cuda.memory_snapshot() if s["segment_type"] == "large"]


def large_trace() -> list[list]:
    """[action, address, size] of the recorded trace above 1 MiB (an "oom" entry carries the free device bytes);
    small-pool segments are 2 MiB, so segment events of 2 MiB are left out too."""
    snap = torch.cuda.memory._snapshot()
    keep = ("alloc", "free_completed", "segment_alloc", "segment_free", "segment_map", "segment_unmap", "oom")
    return [[e["action"], e.get("addr", e.get("device_free")), e["size"]] for t in snap.get("device_traces", [])
            for e in t if e["action"] in keep
            and (e["size"] > (2 * K_SMALL if e["action"].startswith("segment") else K_SMALL) or e["action"] == "oom")]


def run_case(model, vocab, batch, prompt, new, seed=0, trace_path=None):
    g = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randint(100, vocab - 100, (batch, prompt), generator=g).cuda()
    mask = torch.ones_like(ids)
    tracker = PhaseTracker()
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    start_segments = large_segments() if trace_path else None
    if trace_path:
        torch.cuda.memory._record_memory_history(max_entries=2_000_000, context=None)
    t0 = time.perf_counter()
    rec = {"batch": batch, "prompt": prompt, "new": new, "base_allocated": base}
    try:
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                             streamer=tracker, pad_token_id=0)
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        rec.update(ok=True, out_len=int(out.shape[1]), secs=round(time.perf_counter() - t0, 3),
                   prefill_peak=tracker.prefill_peak, decode_peak=torch.cuda.max_memory_allocated(),
                   prefill_reserved_peak=tracker.prefill_reserved_peak,
                   decode_reserved_peak=torch.cuda.max_memory_reserved(),
                   reserved_after=torch.cuda.memory_reserved(), device_used_after=total - free)
        rec["peak_total"] = max(rec["prefill_peak"], rec["decode_peak"])
        rec["nontorch_after"] = rec["device_used_after"] - rec["reserved_after"]
        del out
    except torch.OutOfMemoryError as e:
        rec.update(ok=False, oom=True, secs=round(time.perf_counter() - t0, 3),
                   peak_total=torch.cuda.max_memory_allocated(), prefill_done=tracker.prefill_peak is not None,
                   reserved_peak=torch.cuda.max_memory_reserved(), err=str(e).split("\n")[0][:400])
    if trace_path:
        import gzip
        import json
        trace = large_trace()
        torch.cuda.memory._record_memory_history(enabled=None)
        with gzip.open(trace_path, "wt") as f:
            json.dump({"segments": start_segments, "trace": trace}, f, separators=(",", ":"))
    del ids, mask
    gc.collect()
    torch.cuda.empty_cache()
    return rec


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--archs", nargs="+", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--cap-gib", type=float, default=24.0)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--prompts", type=int, nargs="+", default=[512, 4096, 16384])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--quants", nargs="+", default=["bf16", "nf4"])
    ap.add_argument("--attns", nargs="+", default=["sdpa", "eager"])
    ap.add_argument("--ckpt-dir", default="/dev/shm/vg_ckpt")
    ap.add_argument("--keep-ckpt", action="store_true", help="use a checkpoint already there, and keep it")
    ap.add_argument("--trace-dir", default=None, help="write each case's large-pool allocator trace here")
    ap.add_argument("--trace-freed", default=None,
                    help="write here the large pool's segments before the first model of an architecture is freed "
                         "and its whole trace from there on (every later load and case)")
    args = ap.parse_args()

    import transformers
    free, total = torch.cuda.mem_get_info()
    emit(args.out, {"kind": "versions", "torch": torch.__version__, "transformers": transformers.__version__,
                    "gpu": torch.cuda.get_device_name(), "cc": list(torch.cuda.get_device_capability()),
                    "total": total, "free_at_start": free, "cap_gib": args.cap_gib,
                    "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")})
    torch.cuda.set_per_process_memory_fraction(args.cap_gib * GiB / total)

    for arch in args.archs:
        try:
            measure_arch(args, arch)
        except Exception as e:  # keep measuring the other architectures; the record says what failed
            emit(args.out, {"kind": "arch_error", "model": arch, "err": repr(e)[:800]})
        if not args.keep_ckpt:
            shutil.rmtree(os.path.join(args.ckpt_dir, arch), ignore_errors=True)
        gc.collect()
        torch.cuda.empty_cache()


def measure_arch(args, arch):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig
    path = os.path.join(args.ckpt_dir, arch)
    t0 = time.perf_counter()
    if not (args.keep_ckpt and os.path.exists(os.path.join(path, "config.json"))):
        build_checkpoint(arch, path)
    emit(args.out, {"kind": "checkpoint", "model": arch, "secs": round(time.perf_counter() - t0, 1)})
    ctx = MODELS[arch]["max_position_embeddings"]
    for quant in args.quants:
        gc.collect()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated()
        kw = {}
        if quant == "nf4":
            kw["quantization_config"] = BitsAndBytesConfig(
                load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                bnb_4bit_compute_dtype=torch.bfloat16)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="cuda:0",
                                                     attn_implementation="sdpa", **kw)
        model.eval()
        weights = torch.cuda.memory_allocated() - before
        emit(args.out, {"kind": "loaded", "model": arch, "quant": quant, "weights_bytes": weights,
                        "footprint": model.get_memory_footprint(), "breakdown": tensor_breakdown(model)})
        # warm-up: cuBLAS/cuDNN handles and workspaces exist before the measured runs, as in a served model
        model.generate(torch.randint(100, 1000, (1, 16)).cuda(), max_new_tokens=2, min_new_tokens=2,
                       do_sample=False, pad_token_id=0)
        gc.collect()
        torch.cuda.empty_cache()
        emit(args.out, {"kind": "after_warmup", "model": arch, "quant": quant,
                        "allocated": torch.cuda.memory_allocated(), "weights_bytes": weights})
        for attn in args.attns:
            if hasattr(model, "set_attn_implementation"):
                model.set_attn_implementation(attn)
            else:
                model.config._attn_implementation = attn
            for prompt in args.prompts:
                if prompt + args.new > ctx:
                    continue
                for batch in args.batches:
                    name = f"trace_{arch}_{quant}_{attn}_{prompt}x{batch}.json.gz"
                    rec = run_case(model, MODELS[arch]["vocab_size"], batch, prompt, args.new,
                                   trace_path=os.path.join(args.trace_dir, name) if args.trace_dir else None)
                    rec.update(kind="gen", model=arch, quant=quant, attn=attn, weights=weights)
                    emit(args.out, rec)
        if args.trace_freed and quant == args.quants[0]:
            before_free = large_segments()
            torch.cuda.memory._record_memory_history(max_entries=8_000_000, context=None)
        del model
        gc.collect()
        torch.cuda.empty_cache()
    if args.trace_freed:
        import gzip
        import json
        with gzip.open(args.trace_freed, "wt") as f:
            json.dump({"segments": before_free, "trace": large_trace()}, f, separators=(",", ":"))
        torch.cuda.memory._record_memory_history(enabled=None)


if __name__ == "__main__":
    main()
