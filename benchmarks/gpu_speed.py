"""Batch-1 decode speed on a GPU (issue #4), Llama-3.1-8B architecture in NF4, prompt 512, 128 new tokens, greedy,
every path timed after a warm-up:

* transformers' default ``generate`` (dynamic cache), twice: its ms/token, and whether two GPU runs agree;
* vramguard's ``generate`` with its defaults: the guard's overhead and token identity;
* transformers' ``generate`` with a static cache (eager);
* vramguard.run.fastdecode's graph decoder: the first call (warm-up and capture), a second call replaying the graph
  (``sync_every=1``: a host sync per token, as streaming does; and ``sync_every=16``), the same decoder without a
  graph, and ``vramguard.run.generate(fast_decode=True)``; its mode and reason, ms/token, and the fraction of the
  bandwidth bound (weight bytes / 4.8e12 B/s, the H200 datasheet's HBM bandwidth: one read of the weights per token).

Token agreement: random weights give nearly flat logits, where two correct paths can pick different tokens once
their rounding differs. A larger ``initializer_range`` would not help: it scales the logits and their rounding
error alike. So every path that can records its float32 logits, and each comparison reports, besides token identity,
the first diverging step, the largest logit difference before it (0.0: the two paths computed the same numbers) and
the top-1 minus top-2 margin at the divergence (a divergence at a margin below that difference is rounding, not a
bug). Each variant is wrapped so that one failure is recorded and the others still run; a time budget
(``--budget-s``) skips what would not finish.

    PYTHONPATH=/tmp/site:$PWD python benchmarks/gpu_speed.py --out $OUT/speed      # H200
    PYTHONPATH=$PWD python benchmarks/gpu_speed.py --out /tmp/speed --smoke        # tiny random Llama on the CPU
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from benchmarks.common import build_checkpoint, emit  # noqa: E402

BANDWIDTH = 4.8e12  # H200 datasheet, bytes/s
CKPT = "/dev/shm/vg_speed"


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Clock:
    """Streamer recording the time of the first new token and of the last (synchronizing at each)."""

    def __init__(self, device):
        self.device, self.n, self.t_first, self.t_last = device, 0, None, None

    def put(self, value):
        self.n += 1
        sync(self.device)
        now = time.perf_counter()
        if self.n == 2:
            self.t_first = now
        self.t_last = now

    def end(self):
        pass


def hf_generate(model, ids, new, **kw) -> dict:
    """transformers' ``generate`` (greedy, exactly ``new`` tokens): tokens, float32 logits per step, timings."""
    c = Clock(ids.device)
    sync(ids.device)
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                         do_sample=False, pad_token_id=0, streamer=c, return_dict_in_generate=True,
                         output_logits=True, **kw)
    sync(ids.device)
    total = time.perf_counter() - t0
    return {"tokens": out.sequences[0, ids.shape[1]:].tolist(), "logits": [x[0] for x in out.logits],
            "total_s": total, "decode_ms_per_token": (c.t_last - c.t_first) * 1000 / (new - 1),
            "ttft_s": c.t_first - t0}


def decoder_run(dec, prompt, new, keep_logits=False, **kw) -> dict:
    """One :meth:`GraphDecoder.generate` call (EOS suppressed for ``new`` tokens, as ``min_new_tokens`` does)."""
    logits: list = []
    hook = (lambda i, lg: logits.append(lg[0].clone())) if keep_logits else None
    sync(dec.device)
    t0 = time.perf_counter()
    r = dec.generate(prompt, new, min_new_tokens=new, on_logits=hook, **kw)
    sync(dec.device)
    return {"tokens": r.token_ids, "logits": logits or None, "total_s": time.perf_counter() - t0, "result": r}


def margins(logits) -> list[float]:
    """Top-1 minus top-2 logit at each step."""
    if not logits:
        return []
    top = torch.stack([x.float() for x in logits]).topk(2, dim=-1).values
    return (top[:, 0] - top[:, 1]).tolist()


def agreement(name_a, a, name_b, b) -> dict:
    """Token identity of runs ``a`` and ``b``; with logits, how close their numbers were up to the divergence."""
    ta, tb = a["tokens"], b["tokens"]
    first = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
    if first is None and len(ta) != len(tb):
        first = min(len(ta), len(tb))
    rec = {"kind": "agreement", "a": name_a, "b": name_b, "identical": first is None, "first_divergence": first,
           "steps": min(len(ta), len(tb))}
    la, lb = a.get("logits"), b.get("logits")
    if la and lb:
        upto = len(ta) if first is None else first + 1  # the diverging step itself saw the same inputs
        diffs = [float((x.float() - y.float()).abs().max()) for x, y in zip(la[:upto], lb[:upto])]
        rec["max_abs_logit_diff"] = max(diffs) if diffs else None
        rec["steps_with_logits_bitwise_equal"] = sum(d == 0.0 for d in diffs)
        if first is not None and first < len(la) and first < len(lb):
            rec["margin_a_at_divergence"] = margins([la[first]])[0]
            rec["margin_b_at_divergence"] = margins([lb[first]])[0]
    return rec


def _slim(run: dict) -> dict:
    return {k: v for k, v in run.items() if k not in ("logits", "result", "tokens")}


class Bench:
    """Runs the variants, each guarded, within a time budget; keeps their runs for the agreement records."""

    def __init__(self, log, budget_s):
        self.log, self.t0, self.budget_s, self.runs = log, time.perf_counter(), budget_s, {}

    def variant(self, kind, fn, need_s=20.0):
        left = self.budget_s - (time.perf_counter() - self.t0)
        if left < need_s:
            emit(self.log, {"kind": kind, "skipped": f"time budget: {left:.0f} s left, about {need_s:.0f} s needed"})
            return None
        try:
            rec = fn()
        except Exception as e:  # recorded; the other variants still run
            emit(self.log, {"kind": kind, "error": f"{type(e).__name__}: {e}"[:1500],
                            "traceback": traceback.format_exc()[-3000:]})
            return None
        emit(self.log, {"kind": kind, **rec, "elapsed_s": time.perf_counter() - self.t0})
        return rec

    def compare(self, a, b):
        if a in self.runs and b in self.runs:
            emit(self.log, agreement(a, self.runs[a], b, self.runs[b]))


def smoke_model():
    """The ``--smoke`` model: a tiny random float32 Llama on the CPU (initializer_range 0.2: peaked logits)."""
    import transformers
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=1000,
                                   max_position_embeddings=512, initializer_range=0.2)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()


def load(args, log):
    """The model (NF4 checkpoint on the GPU, or a tiny float32 Llama on the CPU with ``--smoke``) and its weight
    bytes."""
    if args.smoke:
        m = smoke_model()
        weights = sum(p.numel() * p.element_size() for p in m.parameters())
        emit(log, {"kind": "model", "smoke": True, "weights_bytes": weights})
        return m, weights
    from vramguard.runtime.load import load_model
    t0 = time.perf_counter()
    reused = os.path.exists(os.path.join(CKPT, "config.json"))
    if not reused:
        build_checkpoint("llama-3.1-8b", CKPT)
    t1 = time.perf_counter()
    loaded = load_model(CKPT, quant="nf4", attn="sdpa", verify=False)  # plain SDPA, as the first measurement
    emit(log, {"kind": "model", "checkpoint_reused": reused, "build_s": t1 - t0, "load_s": time.perf_counter() - t1,
               "weights_bytes": loaded.report.weights_bytes,
               "active": {k: v if isinstance(v, (str, int, float, bool, type(None))) else str(v)
                          for k, v in loaded.report.active.items()}})
    return loaded.model, loaded.report.weights_bytes


def env_record() -> dict:
    import transformers
    rec = {"kind": "env", "torch": torch.__version__, "transformers": transformers.__version__,
           "cuda": torch.version.cuda, "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    try:
        import bitsandbytes
        rec["bitsandbytes"] = bitsandbytes.__version__
    except Exception as e:  # recorded, not fatal: the smoke run needs no bitsandbytes
        rec["bitsandbytes"] = f"not importable: {type(e).__name__}: {e}"[:200]
    return rec


def _decoder_record(r) -> dict:
    return {k: getattr(r, k) for k in ("mode", "reason", "sdpa_note", "ttft_s", "decode_ms_per_token", "eager_steps",
                                       "replay_steps", "replay_ms_per_token", "capture_s", "stop")}


def run_variants(B: Bench, m, ids, new, bound_ms):
    from vramguard.run import generate as G
    from vramguard.run.fastdecode import GraphDecoder
    prompt, n_prompt, dev = ids[0].tolist(), ids.shape[1], ids.device
    ref: dict = {}

    def default():
        hf_generate(m, ids, new)  # warm-up
        a = B.runs["default"] = hf_generate(m, ids, new)
        b = B.runs["default_again"] = hf_generate(m, ids, new)
        ref.update(ms=a["decode_ms_per_token"], total=a["total_s"])
        mg = sorted(margins(a["logits"]))
        return {**_slim(a), "again_ms_per_token": b["decode_ms_per_token"], "bound_ms": bound_ms,
                "fraction_of_bound": bound_ms / a["decode_ms_per_token"], "margins": margins(a["logits"]),
                "min_margin": mg[0], "median_margin": mg[len(mg) // 2]}

    def graph():
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        dec = GraphDecoder(m, n_prompt + new - 1)
        try:
            first = B.runs["graph_first"] = decoder_run(dec, prompt, new, keep_logits=True)
            second = B.runs["graph"] = decoder_run(dec, prompt, new)
            third = B.runs["graph_sync16"] = decoder_run(dec, prompt, new, sync_every=16)
            peak = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None
        finally:
            dec.close()
        r2 = second["result"]
        ms = r2.replay_ms_per_token or r2.decode_ms_per_token
        rec = {"mode": first["result"].mode, "first_call_logits_kept": _decoder_record(first["result"]),
               "second_call": _decoder_record(r2), "sync_every_16": _decoder_record(third["result"]),
               "ms_per_token": ms, "fraction_of_bound": bound_ms / ms, "peak_allocated_bytes": peak}
        if ref:
            rec["speedup_vs_default"] = ref["ms"] / ms
        return rec

    def static():
        m.__dict__.pop("_previous_max_cache_length", None)  # the cache stays prompt + new - 1, as the decoder's
        hf_generate(m, ids, new, cache_implementation="static")  # warm-up
        m.__dict__.pop("_previous_max_cache_length", None)
        return _slim(B.runs.setdefault("static", hf_generate(m, ids, new, cache_implementation="static")))

    def guard():
        sync(dev)
        t0 = time.perf_counter()
        r = G.generate(m, None, prompt, new, ignore_eos=True)
        sync(dev)
        total = time.perf_counter() - t0
        B.runs["vramguard"] = {"tokens": r.token_ids}
        return {"strategy": r.strategy, "reason": r.reason, "total_s": total, "tokens_per_s": r.tokens_per_s,
                "overhead_fraction": (total - ref["total"]) / ref["total"] if ref else None}

    def decoder_eager():
        dec = GraphDecoder(m, n_prompt + new - 1, use_graph=False)
        try:
            run = B.runs["decoder_eager"] = decoder_run(dec, prompt, new, keep_logits=True)
        finally:
            dec.close()
        return _decoder_record(run["result"])

    def fast():
        sync(dev)
        t0 = time.perf_counter()
        r = G.generate(m, None, prompt, new, fast_decode=True, ignore_eos=True)
        sync(dev)
        total = time.perf_counter() - t0
        B.runs["vramguard_fast"] = {"tokens": r.token_ids}
        return {"strategy": r.strategy, "reason": r.reason, "decode_mode": r.decode_mode,
                "decode_reason": r.decode_reason, "decode_ms_per_token": r.decode_ms_per_token, "total_s": total,
                "total_speedup_vs_default": ref["total"] / total if ref else None}

    for kind, fn, need_s in (("default", default, 30), ("graph_decoder", graph, 20), ("static", static, 25),
                             ("vramguard_generate", guard, 15), ("decoder_eager", decoder_eager, 15),
                             ("vramguard_generate_fast_decode", fast, 10)):
        B.variant(kind, fn, need_s)
    for a, b in (("default", "default_again"), ("vramguard", "default"), ("graph_first", "static"),
                 ("graph_first", "default"), ("graph", "graph_first"), ("graph_sync16", "graph_first"),
                 ("decoder_eager", "static"), ("graph_first", "decoder_eager"), ("vramguard_fast", "graph_first")):
        B.compare(a, b)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompt", type=int, default=None, help="prompt tokens (512; 40 with --smoke)")
    ap.add_argument("--new", type=int, default=None, help="new tokens (128; 16 with --smoke)")
    ap.add_argument("--budget-s", type=float, default=330.0, help="skip variants that would end past this")
    ap.add_argument("--smoke", action="store_true", help="a tiny random Llama on the CPU: checks the script runs")
    args = ap.parse_args()
    prompt = args.prompt or (40 if args.smoke else 512)
    new = args.new or (16 if args.smoke else 128)
    os.makedirs(args.out, exist_ok=True)
    log = os.path.join(args.out, "speed.jsonl")
    B = Bench(log, args.budget_s)
    emit(log, {**env_record(), "prompt": prompt, "new": new, "smoke": args.smoke})
    try:
        m, weights = load(args, log)
    except Exception as e:  # nothing to measure without the model: record why and stop
        emit(log, {"kind": "model", "error": f"{type(e).__name__}: {e}"[:1500],
                   "traceback": traceback.format_exc()[-3000:]})
        raise SystemExit(1) from e
    g = torch.Generator().manual_seed(0)
    vocab = m.config.vocab_size
    ids = torch.randint(100, vocab - 100, (1, prompt), generator=g).to(next(m.parameters()).device)
    bound_ms = weights / BANDWIDTH * 1000
    run_variants(B, m, ids, new, bound_ms)
    d, gr = B.runs.get("default"), B.runs.get("graph")
    if d and gr:
        ms = gr["result"].replay_ms_per_token or gr["result"].decode_ms_per_token
        emit(log, {"kind": "summary", "default_ms_per_token": d["decode_ms_per_token"], "graph_ms_per_token": ms,
                   "graph_mode": gr["result"].mode, "speedup": d["decode_ms_per_token"] / ms,
                   "goal_2x_met": d["decode_ms_per_token"] / ms >= 2.0, "bound_ms": bound_ms,
                   "fraction_of_bound": bound_ms / ms, "elapsed_s": time.perf_counter() - B.t0})


if __name__ == "__main__":
    main()
