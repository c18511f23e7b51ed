"""What an out-of-memory error inside transformers' auto-compiled static cache leaves behind (GPU only).

transformers' ``generate`` compiles the forward (``torch.compile``, mode ``reduce-overhead``: CUDA graph trees) when
the cache is static and the model allows it. This script, on a small float32 Llama (4 layers, hidden 1024):

1. ``baseline``: ``generate(cache_implementation="static")`` with no cap: completes (compiles).
2. ``oom``: the same under a cap just above what is allocated (``set_per_process_memory_fraction``): the compiled
   call runs out of memory; records where (the exception type, and whether it came from CUDA graph recording).
3. ``after``: the cap lifted, ``empty_cache``, the same call again: does it complete, or fail (how)?
4. ``after_reset``: only if 3 failed: ``torch._dynamo.reset()`` (and ``reset_cudagraph_trees``), then again.
5. ``no_compile``: the same call with ``disable_compile=True`` under the cap of step 2 plus what step 1's graphs
   pooled: memory and tokens against step 1.

Each record is one JSON line. ``--fresh`` skips step 1 (the capped call is the first, compiling under the cap);
``--cap-mib N`` sets the cap at what is allocated after loading + N MiB (default 40: the eager prefill itself runs
out; larger caps let the eager warm-up pass and the CUDA-graph recording run out).

    PYTHONPATH=/tmp/site:$PWD python benchmarks/gpu_compile_oom.py --out $OUT/compile_oom.jsonl
    for n in 120 180 240 300 400; do PYTHONPATH=/tmp/site:$PWD python benchmarks/gpu_compile_oom.py --fresh \
        --cap-mib $n --out $OUT/compile_oom.jsonl; done
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from benchmarks.common import emit  # noqa: E402

SMALL = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=2, vocab_size=8000, max_position_embeddings=2048)


def call(m, ids, cap_bytes=None, **kw):
    """One greedy static-cache generate; returns (record, tokens or None)."""
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(1.0 if cap_bytes is None else cap_bytes / total)
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    try:
        out = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, min_new_tokens=16,
                         do_sample=False, pad_token_id=0, cache_implementation="static", **kw)
        return {"ok": True, "s": round(time.perf_counter() - t0, 2),
                "peak_allocated": torch.cuda.max_memory_allocated(),
                "reserved": torch.cuda.memory_reserved()}, out[0, ids.shape[1]:].tolist()
    except Exception as e:  # noqa: BLE001 - the point is to record what happens
        tb = traceback.extract_tb(e.__traceback__)
        return {"ok": False, "s": round(time.perf_counter() - t0, 2), "error": type(e).__name__,
                "message": str(e).splitlines()[0][:200] if str(e) else "",
                "in_cudagraph_trees": any("cudagraph_trees" in f.filename for f in tb),
                "last_frame": f"{os.path.basename(tb[-1].filename)}:{tb[-1].lineno} {tb[-1].name}"}, None
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--fresh", action="store_true", help="no successful compile before the capped call")
    ap.add_argument("--cap-mib", type=int, default=40, help="the cap: what is allocated after loading + this")
    args = ap.parse_args()
    import transformers
    log = args.out
    emit(log, {"kind": "env", "torch": torch.__version__, "transformers": transformers.__version__,
               "gpu": torch.cuda.get_device_name(0), "fresh": args.fresh})
    torch.manual_seed(0)
    folder = tempfile.mkdtemp()
    transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**SMALL)).save_pretrained(folder)
    m = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                          attn_implementation="sdpa").cuda().eval()
    ids = torch.arange(5, 1500, device="cuda")[None]
    base = None
    if not args.fresh:
        rec, base = call(m, ids)
        emit(log, {"kind": "baseline", **rec})
    torch.cuda.empty_cache()
    cap = torch.cuda.memory_allocated() + (args.cap_mib << 20)
    rec, _ = call(m, ids, cap)
    emit(log, {"kind": "oom", "cap_mib": args.cap_mib, "cap_bytes": cap, **rec})
    torch.cuda.empty_cache()
    rec, toks = call(m, ids)
    emit(log, {"kind": "after", **rec, "tokens_equal_baseline": toks == base if toks and base else None})
    if not rec["ok"]:
        from torch._inductor.cudagraph_trees import reset_cudagraph_trees
        torch._dynamo.reset()
        reset_cudagraph_trees()
        torch.cuda.empty_cache()
        rec, toks = call(m, ids)
        emit(log, {"kind": "after_reset", **rec, "tokens_equal_baseline": toks == base if toks and base else None})
    torch.cuda.empty_cache()
    rec, toks = call(m, ids, torch.cuda.memory_allocated() + (400 << 20), disable_compile=True)
    emit(log, {"kind": "no_compile", **rec, "tokens_equal_baseline": toks == base if toks and base else None})
    return 0


if __name__ == "__main__":
    sys.exit(main())
