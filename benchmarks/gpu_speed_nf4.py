"""Batch-1 NF4 decode with vramguard's Triton kernels, against bitsandbytes and transformers, in one process.

Llama-3.1-8B architecture, random weights, NF4 with double quant (transformers' bitsandbytes defaults), bf16:

1. ``kernel``: each projection shape (q/o 4096x4096, k/v 1024x4096, gate/up 14336x4096, down 4096x14336) at 1, 4
   and 8 rows: relative error of :func:`vramguard.run.kernels.nf4.matmul_4bit` against float64 ``x @ W.T`` from
   bitsandbytes' own ``dequantize_4bit`` (and of bitsandbytes' ``matmul_4bit`` against the same), and the device
   time per call of both (a CUDA graph of one call per layer, 32 different weights, replayed 20 times: no launch
   overhead, no L2 reuse) with GB/s over the bytes read (packed weights, uint8 absmax, absmax2); at 1 row for a
   few warp counts.
2. ``decode``: at 512, 2048 and 8192 tokens of context, 128 new, greedy: transformers' default ``generate``;
   the graph decoder without kernels (the previous design) and with them (``kernels=None``, the default); ms per
   token of the replayed steps, the fraction of the bandwidth bound (weight bytes / 4.8e12 B/s), the speed-up,
   and token agreement (the gpu_speed.py record: first divergence, logit difference, margin there).
3. ``profile``: the per-kernel CUDA time of one decode step at 512 and 8192 (eager ``_step`` calls of each
   decoder under torch.profiler, 4 steps), before (no kernels) and after.
4. ``generate_default``: ``vramguard.generate`` with its defaults (fast decode where it can run) against
   transformers' default ``generate``, 2048 + 32 tokens, twice each: time to first token and decode ms/token.
5. ``fp32_identity``: the same checkpoint with float32 compute, 64 greedy tokens after 512: the graph decoder
   with the kernels against transformers' default ``generate`` (token identity, logit difference).
6. ``compile``: transformers' ``generate`` with a static cache and torch.compile, if it runs within the budget.

    PYTHONPATH=/tmp/site:$PWD python benchmarks/gpu_speed_nf4.py --out $OUT/nf4             # H200
    TRITON_INTERPRET=1 PYTHONPATH=$PWD python benchmarks/gpu_speed_nf4.py --out /tmp/nf4 --smoke   # CPU
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from benchmarks.common import cuda_ms, emit  # noqa: E402
from benchmarks.gpu_speed import BANDWIDTH, Bench, decoder_run, env_record, hf_generate, load  # noqa: E402

ROWS = (1, 4, 8)  # rows of x timed per shape (--rows)
LAYERS_TIMED = 32  # one launch per layer inside a captured graph: 32 different weights, far more than the L2


def graph_us(fns, smoke: bool, reps: int = 20) -> float:
    """Device time per call (microseconds) of ``fns`` (one call each per pass), captured once in a CUDA graph and
    replayed ``reps`` times: launch overhead and L2 reuse stay out (each call reads other weights)."""
    if smoke:
        t0 = time.perf_counter()
        for f in fns:
            f()
        return (time.perf_counter() - t0) * 1e6 / len(fns)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    return cuda_ms(g.replay, reps) * 1000 / len(fns)


def projections(m, smoke: bool) -> dict:
    """name -> one argument dict per layer (packed bytes, shape, blocksize, code, scales, quant_state)."""
    from vramguard.run.kernels.nf4 import code_table
    if smoke:  # a tiny float model on the CPU: quantize synthetic weights with bitsandbytes
        import bitsandbytes.functional as BF
        out = {}
        for name, (n, k) in {"q": (64, 128), "down": (128, 256)}.items():
            q, st = BF.quantize_4bit(torch.randn(n, k, dtype=torch.bfloat16), blocksize=64, quant_type="nf4",
                                     compress_statistics=True)
            out[name] = [_args(q, st, code_table("nf4", q.device))]
        return out
    names = {"q": ("self_attn", "q_proj"), "k": ("self_attn", "k_proj"), "gate": ("mlp", "gate_proj"),
             "down": ("mlp", "down_proj")}
    out = {}
    for name, (blk, proj) in names.items():
        mods = [getattr(getattr(layer, blk), proj) for layer in m.model.layers[:LAYERS_TIMED]]
        out[name] = [_args(v.weight, v.weight.quant_state, code_table("nf4", v.weight.device)) for v in mods]
    return out


def _args(packed, st, code):
    off = st.offset if torch.is_tensor(st.offset) else torch.tensor(st.offset, device=packed.device)
    return {"packed": packed, "shape": tuple(st.shape), "bs": st.blocksize, "code": code, "st": st,
            "scales": (st.absmax, st.state2.absmax, st.state2.code, off) if st.nested else (st.absmax,)}


def read_bytes(a) -> int:
    n, k = a["shape"]
    return n * k // 2 + sum(t.numel() * t.element_size() for t in a["scales"][:2])


def kernel_records(log, m, smoke: bool) -> None:
    """Per projection shape and row count: error against float64, device time per call (graph replay over the
    layers) of the Triton kernel at a few warp counts and of bitsandbytes' matmul_4bit, and GB/s."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as BF

    from vramguard.run.kernels import nf4
    dev = torch.device("cpu") if smoke else next(m.parameters()).device
    for name, layers in projections(m, smoke).items():
        a = layers[0]
        n, k = a["shape"]
        w64 = BF.dequantize_4bit(a["packed"], a["st"]).double()
        pieces = 1 << max(0, (k // 32 - 1).bit_length())
        warps = sorted({max(1, min(32, pieces // d)) for d in (32, 64, 128)})
        for rows in ROWS:
            x = torch.randn(rows, k, dtype=torch.bfloat16, device=dev)
            ref = x.double() @ w64.T
            ours = nf4.matmul_4bit(x, a["packed"], a["shape"], a["bs"], a["code"], *a["scales"])
            theirs = bnb.matmul_4bit(x, a["packed"].t(), quant_state=a["st"])
            rel = lambda y, ref=ref: float((y.double() - ref).norm() / ref.norm())  # noqa: E731
            rec = {"kind": "kernel", "proj": name, "rows": rows, "N": n, "K": k, "bytes": read_bytes(a),
                   "rel_err_triton_vs_f64": rel(ours), "rel_err_bnb_vs_f64": rel(theirs),
                   "rel_triton_vs_bnb": float((ours.double() - theirs.double()).norm() / theirs.double().norm())}
            lut = nf4.matmul_4bit(x, a["packed"], a["shape"], a["bs"], a["code"], *a["scales"], lut=True)
            rec.update(rel_err_lut_vs_f64=rel(lut), lut_used=nf4.LUT and not smoke)
            sweep = {}
            for w in (warps if rows == 1 else [None]):
                for use in ((True, False) if not smoke else (False,)):
                    fns = [lambda a=a, w=w, use=use, x=x: nf4.matmul_4bit(x, a["packed"], a["shape"], a["bs"],
                                                                          a["code"], *a["scales"], num_warps=w, lut=use)
                           for a in layers]
                    sweep[f"{w}{'_lut' if use else '_gather'}"] = graph_us(fns, smoke)
            best = min(sweep, key=sweep.get)
            t_bnb = graph_us([lambda a=a, x=x: bnb.matmul_4bit(x, a["packed"].t(), quant_state=a["st"])
                              for a in layers], smoke)
            rec.update(triton_us=sweep[best], best=best, variants_us=sweep, bnb_us=t_bnb,
                       triton_GBps=read_bytes(a) / sweep[best] / 1e3, bnb_GBps=read_bytes(a) / t_bnb / 1e3,
                       speedup_vs_bnb=t_bnb / sweep[best])
            emit(log, rec)


def decode_records(B: Bench, m, ctx: int, new: int, bound_ms: float, default: bool) -> None:
    from vramguard.run.fastdecode import GraphDecoder
    g = torch.Generator().manual_seed(ctx)
    ids = torch.randint(100, m.config.vocab_size - 100, (1, ctx), generator=g).to(next(m.parameters()).device)
    prompt = ids[0].tolist()
    tag = f"ctx{ctx}"

    def hf():
        hf_generate(m, ids, 8)  # warm-up
        a = B.runs[f"{tag}_default"] = hf_generate(m, ids, new)
        return {"ctx": ctx, "total_s": a["total_s"], "decode_ms_per_token": a["decode_ms_per_token"],
                "ttft_s": a["ttft_s"],
                "fraction_of_bound": bound_ms / a["decode_ms_per_token"]}

    def graph(kernels):
        name = f"{tag}_graph_{'kernels' if kernels is None else 'plain'}"

        def run():
            dec = GraphDecoder(m, ctx + new - 1, kernels=kernels)
            try:
                first = B.runs[name] = decoder_run(dec, prompt, new, keep_logits=True)
                second = decoder_run(dec, prompt, new)
            finally:
                dec.close()
            r1, r2 = first["result"], second["result"]
            ms = r2.replay_ms_per_token or r2.decode_ms_per_token
            rec = {"ctx": ctx, "mode": r2.mode, "kernels": r1.kernels, "reason": r1.reason, "ms_per_token": ms,
                   "first_call_ttft_s": r1.ttft_s, "first_call_decode_ms_per_token": r1.decode_ms_per_token,
                   "capture_s": r1.capture_s, "second_ttft_s": r2.ttft_s, "fraction_of_bound": bound_ms / ms}
            d = B.runs.get(f"{tag}_default")
            if d:
                rec["speedup_vs_default"] = d["decode_ms_per_token"] / ms
            return rec
        return run

    if default:
        B.variant("decode_default", hf, 40)
    B.variant("decode_graph_plain", graph(False), 25)
    B.variant("decode_graph_kernels", graph(None), 25)
    for a, b in ((f"{tag}_graph_kernels", f"{tag}_default"), (f"{tag}_graph_plain", f"{tag}_default"),
                 (f"{tag}_graph_kernels", f"{tag}_graph_plain")):
        B.compare(a, b)


def profile_records(log, m, ctx: int, smoke: bool) -> None:
    from torch.profiler import ProfilerActivity, profile

    from vramguard.run.fastdecode import GraphDecoder
    prompt = list(range(100, 100 + ctx))
    for kernels in (False, True):
        dec = GraphDecoder(m, ctx + 40, use_graph=False, kernels=kernels if kernels else False)
        try:
            dec.generate(prompt, 4, eos_token_id=None)
            acts = [ProfilerActivity.CPU] + ([] if smoke else [ProfilerActivity.CUDA])
            with torch.no_grad(), profile(activities=acts) as prof:
                for _ in range(4):
                    dec._step()
                if not smoke:
                    torch.cuda.synchronize()
        finally:
            dec.close()
        rows = []
        for e in prof.key_averages():
            t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0) or 0
            if t and (smoke or e.device_type.name == "CUDA"):
                rows.append({"name": e.key[:120], "us_per_step": t / 4, "calls_per_step": e.count / 4})
        rows.sort(key=lambda r: -r["us_per_step"])
        emit(log, {"kind": "profile", "ctx": ctx, "kernels": kernels, "step_us": sum(r["us_per_step"] for r in rows),
                   "launches_per_step": sum(r["calls_per_step"] for r in rows), "top": rows[:25]})


def ttft_records(B: Bench, m, ctx: int, new: int) -> None:
    """``vramguard.generate`` with its defaults (fast decode where it can run) against transformers' default
    ``generate``, twice each, alternating: time to first token, decode ms/token, the strategy and the reason."""
    from vramguard.run import generate as G
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(100, m.config.vocab_size - 100, (ctx,), generator=g).tolist()
    ids = torch.tensor([prompt], device=next(m.parameters()).device)

    def run():
        out: dict = {"ctx": ctx, "new": new}
        for i in range(2):
            hf = hf_generate(m, ids, new)
            r = G.generate(m, None, prompt, new, ignore_eos=True)
            out[f"run{i}"] = {"hf_ttft_s": hf["ttft_s"], "hf_decode_ms_per_token": hf["decode_ms_per_token"],
                              "ttft_s": r.ttft_s, "decode_ms_per_token": r.decode_ms_per_token,
                              "strategy": r.strategy, "decode_mode": r.decode_mode}
        out["reason"] = r.reason
        return out
    B.variant("generate_default", run, 30)


def compile_record(B: Bench, m, new: int) -> None:
    ids = torch.randint(100, 1000, (1, 512)).to(next(m.parameters()).device)

    def run():
        m.__dict__.pop("_previous_max_cache_length", None)
        t0 = time.perf_counter()
        hf_generate(m, ids, 16, cache_implementation="static")  # compiles
        t1 = time.perf_counter()
        m.__dict__.pop("_previous_max_cache_length", None)
        a = hf_generate(m, ids, new, cache_implementation="static")
        return {"compile_and_first_s": t1 - t0, "decode_ms_per_token": a["decode_ms_per_token"]}
    B.variant("torch_compile_static", run, 90)


def fp32_records(B: Bench, log, smoke: bool, m_smoke) -> None:
    """Float32 compute (``dtype`` and ``bnb_4bit_compute_dtype`` float32, NF4 weights): greedy tokens of the graph
    decoder with the kernels against transformers' default ``generate``, 64 tokens after 512."""
    from benchmarks.gpu_speed import CKPT
    from vramguard.run.fastdecode import GraphDecoder

    def run():
        if smoke:
            m = m_smoke
        else:
            from vramguard.runtime.load import load_model
            m = load_model(CKPT, quant="nf4", dtype="fp32", compute_dtype="fp32", attn="sdpa", verify=False).model
        ids = torch.randint(100, m.config.vocab_size - 100, (1, 40 if smoke else 512),
                            generator=torch.Generator().manual_seed(3)).to(next(m.parameters()).device)
        new = 8 if smoke else 64
        B.runs["fp32_default"] = hf_generate(m, ids, new)
        dec = GraphDecoder(m, ids.shape[1] + new - 1)
        try:
            r = B.runs["fp32_graph_kernels"] = decoder_run(dec, ids[0].tolist(), new, keep_logits=True)
        finally:
            dec.close()
        res = r["result"]
        return {"mode": res.mode, "kernels": res.kernels, "ms_per_token": res.replay_ms_per_token,
                "default_ms_per_token": B.runs["fp32_default"]["decode_ms_per_token"]}
    B.variant("fp32_identity", run, 40)
    B.compare("fp32_graph_kernels", "fp32_default")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--new", type=int, default=None)
    ap.add_argument("--budget-s", type=float, default=420.0)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--contexts", default=None, help="comma-separated context lengths (512,8192,2048)")
    ap.add_argument("--skip", default="", help="comma-separated sections to leave out: fp32, compile, ttft")
    ap.add_argument("--rows", default="1,4,8", help="rows of x for the kernel timings")
    ap.add_argument("--default-at", default=None, help="contexts at which transformers' default generate runs "
                                                        "(default: the first two)")
    args = ap.parse_args()
    new = args.new or (8 if args.smoke else 128)
    os.makedirs(args.out, exist_ok=True)
    log = os.path.join(args.out, "speed_nf4.jsonl")
    B = Bench(log, args.budget_s)
    emit(log, {**env_record(), "new": new, "smoke": args.smoke})
    m, weights = load(args, log)
    bound_ms = weights / BANDWIDTH * 1000
    global ROWS
    ROWS = tuple(int(r) for r in args.rows.split(","))
    B.variant("kernels", lambda: kernel_records(log, m, args.smoke) or {"done": True}, 60)
    ctxs = (40, 100) if args.smoke else tuple(int(c) for c in (args.contexts or "512,8192,2048").split(","))
    skip = set(args.skip.split(","))
    with_default = {int(c) for c in args.default_at.split(",")} if args.default_at else set(ctxs[:2])
    for i, ctx in enumerate(ctxs):
        decode_records(B, m, ctx, new, bound_ms, default=ctx in with_default)
        if i < 2:
            B.variant("profile", lambda c=ctx: profile_records(log, m, c, args.smoke) or {"done": True}, 20)
    if "ttft" not in skip:
        ttft_records(B, m, 2048 if not args.smoke else 40, 32 if not args.smoke else 4)
    if "fp32" not in skip:
        fp32_records(B, log, args.smoke, m)
    if not args.smoke and "compile" not in skip:
        compile_record(B, m, new)
    emit(log, {"kind": "end", "elapsed_s": time.perf_counter() - B.t0, "bound_ms": bound_ms})


if __name__ == "__main__":
    main()
