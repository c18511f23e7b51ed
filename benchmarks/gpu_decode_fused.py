"""Batch-1 NF4 decode with the fused step (:mod:`vramguard.run.fused_step`) against the unfused kernel step and
transformers' default ``generate``, in one process. Llama-3.1-8B architecture, random weights, NF4 with double quant,
bf16 compute, 128 new tokens, greedy.

1. ``fused_kernel``: device time per layer (a CUDA graph over the 32 layers' own weights, replayed; no launch
   overhead, no L2 reuse) of each fused kernel against the unfused calls it replaces, at a few warp counts.
2. ``decode``: at each context, transformers' default ``generate`` (after a short warm-up), the graph decoder with
   the unfused kernel step (``fused=False``, the previous design) and with the fused step (the default), each
   decoder called twice: ms per token of the replayed steps (second call), the GPU time of one replay (CUDA events
   around 20 replays), the first call's time to first token, speed-ups and token agreement.
3. ``profile``: per-kernel device time of one replayed step (torch.profiler around 4 graph replays), before and
   after, at each context.
4. ``ttft_repeat``: time to first token at 512, five rounds alternating transformers, a warm decoder and
   ``vramguard.generate``; and the prefill forward alone, static cache against transformers' dynamic cache.
   ``generate_default``: ``vramguard.generate`` with its defaults against transformers' default ``generate``.
5. ``fp32_identity``: float32 compute, 64 greedy tokens after 512: the fused decoder against transformers.

    PYTHONPATH=/tmp/site:$PWD python benchmarks/gpu_decode_fused.py --out $OUT/fused          # H200
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
from benchmarks.gpu_speed_nf4 import fp32_records, graph_us, ttft_records  # noqa: E402


SPARE_SLOTS = 32  # cache slots past the request: the unfused step's replays after the calls each write one more


def _scales(w):
    return (w["absmax"], w["absmax2"], w["code2"], w["offset"]) if "absmax2" in w else (w["absmax"],)


def fused_kernel_records(log, m) -> None:
    """Per-layer device time of the fused kernels against the unfused calls (graph over all layers)."""
    from vramguard.run.kernels import fused as FK
    from vramguard.run.kernels.fused import weight_args
    from vramguard.run.kernels.nf4 import code_table, matmul_4bit
    dev = next(m.parameters()).device
    code = code_table("nf4", dev)
    layers = m.model.layers
    W = [{n: weight_args(getattr(getattr(L, b), n)) for b, ns in (("self_attn", ("q_proj", "k_proj", "v_proj",
                                                                                   "o_proj")),
                                                                  ("mlp", ("gate_proj", "up_proj", "down_proj")))
          for n in ns} for L in layers]
    h = m.config.hidden_size
    x = torch.randn(h, dtype=torch.bfloat16, device=dev)
    r = torch.randn(h, dtype=torch.bfloat16, device=dev)
    xi = torch.randn(m.config.intermediate_size, dtype=torch.bfloat16, device=dev)

    def mm(v, w, nw=None):
        return matmul_4bit(v.view(1, -1), w["packed"], w["shape"], w["blocksize"], code, *_scales(w), num_warps=nw)

    cases = {
        "qkv: 3 launches": lambda w: (mm(x, w["q_proj"]), mm(x, w["k_proj"]), mm(x, w["v_proj"])),
        "qkv: fused": lambda w: FK.matmul_4bit_segments(x, [w["q_proj"], w["k_proj"], w["v_proj"]], code),
        "gate/up: 2 launches + silu * up": lambda w: torch.nn.functional.silu(mm(x, w["gate_proj"]))
        * mm(x, w["up_proj"]),
        "gate/up: fused": lambda w: FK.matmul_4bit_glu(x, w["gate_proj"], w["up_proj"], code),
        "o": lambda w: mm(x, w["o_proj"]),
        "down": lambda w: mm(xi, w["down_proj"]),
        "RMSNorm + add: torch": lambda w, L=layers[0]: L.input_layernorm(r + x),
        "RMSNorm + add: fused": lambda w, L=layers[0]: FK.add_rms_norm(x, r, L.input_layernorm.weight, 1e-5),
    }
    for name, fn in cases.items():
        sweep = {}
        for nw in ((None, 1, 4) if "fused" in name and "RMS" not in name else (None,)):
            FK.WARPS = nw
            sweep[str(nw)] = graph_us([lambda w=w: fn(w) for w in W], False)
        FK.WARPS = None
        for nw in ((4, 16) if name == "down" else (1, 4) if name == "o" else ()):
            sweep[str(nw)] = graph_us([lambda w=w, nw=nw: mm(xi if name == "down" else x,
                                                              w["down_proj" if name == "down" else "o_proj"], nw)
                                       for w in W], False)
        emit(log, {"kind": "fused_kernel", "case": name, "us_per_layer": sweep["None"], "variants_us": sweep})


def replay_gpu_ms(dec, reps: int = 20) -> float:
    """GPU time of one replayed step (CUDA events around ``reps`` replays; the host's sampling left out)."""
    return cuda_ms(dec._replay, reps)


def profile_replay(log, dec, ctx: int, label: str) -> None:
    """Per-kernel device time of one replayed step: torch.profiler around 4 graph replays."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(4):
            dec._replay()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0) or 0
        if t and e.device_type.name == "CUDA":
            rows.append({"name": e.key[:120], "us_per_step": t / 4, "calls_per_step": e.count / 4})
    rows.sort(key=lambda r: -r["us_per_step"])
    emit(log, {"kind": "profile_replay", "ctx": ctx, "step": label, "kernel_us": sum(r["us_per_step"] for r in rows),
               "launches_per_step": sum(r["calls_per_step"] for r in rows), "top": rows[:30]})


def decode_records(B: Bench, log, m, ctx: int, new: int, bound_ms: float) -> None:
    from vramguard.run.fastdecode import GraphDecoder
    g = torch.Generator().manual_seed(ctx)
    ids = torch.randint(100, m.config.vocab_size - 100, (1, ctx), generator=g).to(next(m.parameters()).device)
    prompt, tag = ids[0].tolist(), f"ctx{ctx}"

    def hf():
        hf_generate(m, ids, 8)  # warm-up
        a = B.runs[f"{tag}_default"] = hf_generate(m, ids, new)
        return {"ctx": ctx, "decode_ms_per_token": a["decode_ms_per_token"], "ttft_s": a["ttft_s"],
                "fraction_of_bound": bound_ms / a["decode_ms_per_token"]}

    def graph(fused):
        label = "fused" if fused is None else "unfused"

        def run():
            dec = GraphDecoder(m, ctx + new - 1 + SPARE_SLOTS, fused=fused)
            try:
                first = B.runs[f"{tag}_{label}"] = decoder_run(dec, prompt, new, keep_logits=True)
                second = decoder_run(dec, prompt, new)
                gpu_ms = replay_gpu_ms(dec) if dec._replay is not None else None
                if dec._replay is not None:
                    profile_replay(log, dec, ctx, label)
            finally:
                dec.close()
            r1, r2 = first["result"], second["result"]
            ms = r2.replay_ms_per_token or r2.decode_ms_per_token
            rec = {"ctx": ctx, "step": label, "mode": r2.mode, "kernels": r1.kernels, "reason": r1.reason,
                   "ms_per_token": ms, "replay_gpu_ms": gpu_ms, "first_call_ttft_s": r1.ttft_s,
                   "first_call_decode_ms_per_token": r1.decode_ms_per_token, "capture_s": r1.capture_s,
                   "second_ttft_s": r2.ttft_s, "fraction_of_bound": bound_ms / ms}
            d = B.runs.get(f"{tag}_default")
            if d:
                rec.update(speedup_vs_default=d["decode_ms_per_token"] / ms,
                           ttft_vs_default=r1.ttft_s / d["ttft_s"], second_ttft_vs_default=r2.ttft_s / d["ttft_s"])
            return rec
        return run

    B.variant("decode_default", hf, 35)
    B.variant("decode_graph", graph(False), 20)
    rec = B.variant("decode_graph", graph(None), 20)
    if rec and "the fused step's logits differ" in (rec.get("kernels") or ""):  # timed anyway, marked as such
        from vramguard.run import fused_step
        fused_step.STEP_TOLERANCE = float("inf")
        B.variant("decode_graph_step_check_overridden", graph(None), 20)
        fused_step.STEP_TOLERANCE = 0.1
    for a, b in ((f"{tag}_fused", f"{tag}_default"), (f"{tag}_fused", f"{tag}_unfused")):
        B.compare(a, b)


def _timed(fn, dev):
    """(wall seconds, GPU seconds by CUDA events) of ``fn()``, synchronised before and after."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    a.record()
    fn()
    b.record()
    torch.cuda.synchronize(dev)
    return time.perf_counter() - t0, a.elapsed_time(b) / 1000


def ttft_repeat(B: Bench, m, ctx: int, reps: int) -> None:
    """Time to first token, ``reps`` rounds alternating transformers' default ``generate``, a warm graph decoder's
    call and ``vramguard.generate`` with its defaults (2 new tokens each); then the prefill forward alone (wall and
    GPU time): the decoder's static-cache prefill against the model's forward with transformers' dynamic cache."""
    from transformers import DynamicCache

    from vramguard.run import generate as G
    from vramguard.run.fastdecode import GraphDecoder
    dev = next(m.parameters()).device
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(100, m.config.vocab_size - 100, (1, ctx), generator=g).to(dev)
    prompt = ids[0].tolist()

    def run():
        out: dict = {"ctx": ctx, "hf": [], "decoder": [], "generate": [], "prefill_static": [], "prefill_dynamic": []}
        dec = GraphDecoder(m, ctx + 16)
        try:
            dec.generate(prompt, 8, eos_token_id=None)  # warm: check, compile, capture
            for _ in range(reps):
                out["hf"].append(hf_generate(m, ids, 2)["ttft_s"])
                out["decoder"].append(decoder_run(dec, prompt, 2)["result"].ttft_s)
                out["generate"].append(G.generate(m, None, prompt, 2, ignore_eos=True).ttft_s)
            with torch.no_grad():
                for _ in range(reps):
                    dec.cache.reset()
                    out["prefill_static"].append(_timed(lambda: dec._prefill(ids), dev))
                    out["prefill_dynamic"].append(_timed(lambda: m(input_ids=ids, past_key_values=DynamicCache(
                        config=m.config), use_cache=True, logits_to_keep=1), dev))
        finally:
            dec.close()
        for k in ("hf", "decoder", "generate"):
            out[f"{k}_median_s"] = sorted(out[k])[reps // 2]
        out["decoder_vs_hf"] = out["decoder_median_s"] / out["hf_median_s"]
        out["generate_vs_hf"] = out["generate_median_s"] / out["hf_median_s"]
        return out
    B.variant("ttft_repeat", run, 25)


def profile_markdown(path: str) -> str:
    """The ``profile_replay`` records of a results file as Markdown tables (CPU; ``--profile-md``)."""
    import json
    out = []
    for line in open(path):
        r = json.loads(line)
        if r.get("kind") != "profile_replay":
            continue
        out += [f"## context {r['ctx']}, {r['step']} step: {r['kernel_us']:.0f} us of kernels per step, "
                f"{r['launches_per_step']:.0f} launches", "", "| us/step | launches/step | kernel |", "|---:|---:|---|"]
        out += [f"| {t['us_per_step']:.1f} | {t['calls_per_step']:.0f} | `{t['name'][:100]}` |" for t in r["top"][:25]]
        out.append("")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile-md", default=None, help="print a results file's profiles as Markdown and exit")
    ap.add_argument("--out")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--budget-s", type=float, default=300.0)
    ap.add_argument("--contexts", default="512,8192")
    ap.add_argument("--skip", default="", help="comma-separated: kernels, ttft_repeat, ttft, fp32")
    args = ap.parse_args()
    if args.profile_md:
        print(profile_markdown(args.profile_md))
        return
    if not args.out:
        ap.error("--out is required")
    args.smoke = False
    os.makedirs(args.out, exist_ok=True)
    log = os.path.join(args.out, "decode_fused.jsonl")
    B = Bench(log, args.budget_s)
    emit(log, {**env_record(), "new": args.new, "argv": sys.argv[1:]})
    m, weights = load(args, log)
    bound_ms = weights / BANDWIDTH * 1000
    skip = set(args.skip.split(","))
    if "kernels" not in skip:
        B.variant("fused_kernels", lambda: fused_kernel_records(log, m) or {"done": True}, 30)
    for ctx in (int(c) for c in args.contexts.split(",") if c):
        decode_records(B, log, m, ctx, args.new, bound_ms)
    if "ttft_repeat" not in skip:
        ttft_repeat(B, m, 512, 5)
    if "ttft" not in skip:
        ttft_records(B, m, 2048, 32)
    if "fp32" not in skip:
        fp32_records(B, log, False, m)
    emit(log, {"kind": "end", "elapsed_s": time.perf_counter() - B.t0, "bound_ms": bound_ms})


if __name__ == "__main__":
    main()
