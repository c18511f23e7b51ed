"""Greedy token identity and quantized-KV agreement on a GPU (issue #4): Llama-3.1-8B architecture in NF4, prompt
512, 128 new tokens, greedy, EOS suppressed (``min_new_tokens``), as ``vramguard.run.generate`` runs them.

1. Determinism of the reference itself. The same prefill forward twice (bitwise equal? if not, the first module
   whose output differs), the same single-token decode step twice from copies of one cache, and transformers'
   ``generate`` twice (the first step whose logits differ).
2. Identity. ``vramguard.run.generate`` on its default (dynamic cache) against transformers' ``generate``; every other
   strategy (reached by injecting an out-of-memory error at the prefill of the ones before it) against
   transformers' ``generate`` with the same cache settings; an OOM injected at decode step 40 (the request
   continues on the next strategy from prompt + 40 tokens); ``fast_decode`` (CUDA graph) against transformers'
   static cache.
3. Quantized KV (int8 HQQ, int4 quanto): free-running token agreement with the 16-bit reference, and teacher-forced
   top-1 agreement (at each of the 128 steps the reference's token is forced, so every step sees the same prefix).

Random weights give nearly flat logits, where two correct paths can pick different tokens once their rounding
differs; each token comparison therefore gives the first diverging step and the reference's top-1 minus top-2 logit
margin there. ``--deterministic`` (run with ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` in the environment) turns on
``torch.use_deterministic_algorithms`` and turns off bf16 reduced-precision reductions in cuBLAS;
``--compute-dtype fp32`` loads the NF4 weights with float32 compute (and a float32 KV cache).

    PYTHONPATH=/tmp/site:$PWD python benchmarks/gpu_identity.py --out $OUT/id                       # H200
    CUBLAS_WORKSPACE_CONFIG=:4096:8 PYTHONPATH=/tmp/site:$PWD python benchmarks/gpu_identity.py --out $OUT/id \\
        --deterministic
    PYTHONPATH=$PWD python benchmarks/gpu_identity.py --out /tmp/id --smoke        # tiny random Llama on the CPU
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from benchmarks.common import build_checkpoint, emit  # noqa: E402
from benchmarks.gpu_speed import CKPT, agreement, env_record, hf_generate, margins, smoke_model  # noqa: E402


def first_diff(a: list, b: list) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def module_outputs(model, fn) -> dict:
    """Run ``fn()`` with a forward hook on every module; returns {module name: a copy of its first tensor output}."""
    outs, hooks = {}, []
    for name, mod in model.named_modules():
        def hook(_m, _i, o, name=name):
            t = o[0] if isinstance(o, (tuple, list)) and o and isinstance(o[0], torch.Tensor) else o
            if isinstance(t, torch.Tensor):
                outs[name] = t.detach().clone()
        hooks.append(mod.register_forward_hook(hook))
    try:
        with torch.no_grad():
            fn()
    finally:
        for h in hooks:
            h.remove()
    return outs


def compare_outputs(a: dict, b: dict) -> dict:
    """Whether two hooked runs computed the same numbers; else the first module (in execution order) that differs."""
    differ = [n for n in a if n in b and a[n].shape == b[n].shape and not torch.equal(a[n], b[n])]
    return {"bitwise_equal": not differ, "modules": len(a), "modules_differing": len(differ),
            "first_differing_module": differ[0] if differ else None,
            "max_abs_diff_there": float((a[differ[0]].float() - b[differ[0]].float()).abs().max()) if differ else None}


def determinism(m, ids) -> dict:
    """Part 1: prefill twice, one decode step twice (from copies of the same cache), generate twice."""
    from transformers import DynamicCache
    pre = compare_outputs(module_outputs(m, lambda: m(ids)), module_outputs(m, lambda: m(ids)))
    with torch.no_grad():
        cache = DynamicCache(config=m.config)
        out = m(ids, past_key_values=cache, use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
    pos = torch.tensor([ids.shape[1]], device=ids.device)

    def step(c):
        return lambda: m(nxt, past_key_values=c, use_cache=True, cache_position=pos)
    dec = compare_outputs(module_outputs(m, step(copy.deepcopy(cache))), module_outputs(m, step(copy.deepcopy(cache))))
    a, b = hf_generate(m, ids, 64), hf_generate(m, ids, 64)
    steps_equal = [torch.equal(x, y) for x, y in zip(a["logits"], b["logits"])]
    return {"prefill_twice": pre, "decode_step_twice": dec,
            "generate_twice": {"steps": 64, "tokens_identical": a["tokens"] == b["tokens"],
                               "first_token_divergence": first_diff(a["tokens"], b["tokens"]),
                               "first_step_logits_differ": next((i for i, e in enumerate(steps_equal) if not e), None),
                               "steps_logits_bitwise_equal": sum(steps_equal)}}


class _Force:
    """Logits processor for teacher forcing: records whether the model's own top-1 is the reference token, then
    forces the reference token, so every step sees the reference prefix."""

    def __init__(self, ref: list[int]):
        self.ref, self.i, self.hits, self.margin_at_miss = ref, 0, 0, []

    def __call__(self, input_ids, scores):
        top = scores[0].float().topk(2)
        want = self.ref[self.i]
        if int(top.indices[0]) == want:
            self.hits += 1
        else:
            self.margin_at_miss.append(float(top.values[0] - scores[0, want].float()))
        forced = torch.full_like(scores, float("-inf"))
        forced[0, want] = 0.0
        self.i += 1
        return forced


def teacher_forced(m, ids, ref: list[int], kwargs: dict) -> dict:
    from transformers import LogitsProcessorList
    f = _Force(ref)
    m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=len(ref), min_new_tokens=len(ref),
               do_sample=False, pad_token_id=0, logits_processor=LogitsProcessorList([f]), **kwargs)
    miss = sorted(f.margin_at_miss)
    return {"top1_agreement": f.hits / len(ref), "steps": len(ref),
            "median_gap_at_miss": miss[len(miss) // 2] if miss else None}


def identity(m, ids, new, log, t_end) -> None:
    """Parts 2 and 3."""
    from vramguard.run import generate as G
    prompt = ids[0].tolist()
    on_cuda = ids.device.type == "cuda"
    order = [st for st, _ in G.strategy_order(m, len(prompt), new)[0]]  # generate's own fallback order
    emit(log, {"kind": "order", "strategies": [st.name for st in order]})
    runs: dict = {}

    def rec(kind, fn):
        if time.perf_counter() > t_end:
            emit(log, {"kind": kind, "skipped": "time budget"})
            return None
        t = time.perf_counter()
        try:
            r = fn()
        except Exception as e:  # recorded; the others still run
            emit(log, {"kind": kind, "error": f"{type(e).__name__}: {e}"[:1200],
                       "traceback": traceback.format_exc()[-2000:]})
            return None
        emit(log, {"kind": kind, "s": round(time.perf_counter() - t, 2), **(r or {})})
        return r

    def cmp(name, a, b_name="reference"):
        b = runs[b_name]
        d = first_diff(a["tokens"], b["tokens"])
        out = {"vs": b_name, "identical": d is None and len(a["tokens"]) == len(b["tokens"]), "first_divergence": d}
        if d is not None and b.get("logits"):
            out["reference_margin_at_divergence"] = margins([b["logits"][d]])[0]
        if d is not None and a.get("logits") and b.get("logits"):
            out.update({k: v for k, v in agreement(name, a, b_name, b).items()
                        if k in ("max_abs_logit_diff", "steps_with_logits_bitwise_equal")})
        return out

    def plain(kind, **kw):
        def fn():
            m.__dict__.pop("_previous_max_cache_length", None)
            r = runs[kind] = hf_generate(m, ids, new, **kw)
            return {"decode_ms_per_token": r["decode_ms_per_token"], "kwargs": {k: str(v) for k, v in kw.items()}}
        return rec(kind, fn)

    plain("reference")
    plain("reference_again")
    if "reference_again" in runs:
        rec("plain_vs_plain", lambda: cmp("reference_again", runs["reference_again"]))

    def ours(kind, inj=None, vs="reference", **kw):
        def fn():
            G.OOM_INJECTOR = inj
            try:
                r = G.generate(m, None, prompt, new, ignore_eos=True, **kw)  # as min_new_tokens
            finally:
                G.OOM_INJECTOR = None
            runs[kind] = {"tokens": r.token_ids}
            out = {"strategy": r.strategy, "attempts": [(a.strategy, a.phase, a.step) for a in r.attempts],
                   "decode_mode": r.decode_mode}
            if vs in runs:
                out.update(cmp(kind, runs[kind], vs))
            if vs == "reference" and "reference_again" in runs:  # the reference's own run-to-run variation
                out["vs_reference_again"] = cmp(kind, runs[kind], "reference_again")
            return out
        return rec(kind, fn)

    ours("vramguard_default")
    for k, st in enumerate(order[1:], start=1):
        def skip_to(phase, attempt, step, k=k):
            if attempt < k and phase == "prefill":
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB (injected)")
        same = f"plain[{st.name}]"
        if st.plan.get("kv_dtype") is None:  # 16-bit KV: transformers with the same settings is the reference
            plain(same, **copy.deepcopy(st.kwargs))
            ours(f"vramguard[{st.name}]", skip_to, vs=same)
            if same in runs:
                rec(f"plain[{st.name}]_vs_reference", lambda same=same: cmp(same, runs[same]))
        else:  # quantized KV: agreement with the 16-bit reference
            r = ours(f"vramguard[{st.name}]", skip_to)
            if r is not None and "reference" in runs:
                ref = runs["reference"]["tokens"]
                got = runs[f"vramguard[{st.name}]"]["tokens"]
                rec(f"agreement[{st.name}]", lambda ref=ref, got=got, st=st: {
                    "free_running_match": sum(x == y for x, y in zip(ref, got)) / len(ref),
                    "first_divergence": first_diff(ref, got),
                    "teacher_forced": teacher_forced(m, ids, ref, copy.deepcopy(st.kwargs))})
    if "reference" in runs:
        rec("teacher_forced[reference_settings]", lambda: teacher_forced(m, ids, runs["reference"]["tokens"], {}))

    def oom_at_decode_40(phase, attempt, step):
        if attempt == 0 and phase == "decode" and step == 40:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB (injected)")
    ours("recovery_decode_step_40", oom_at_decode_40)
    if on_cuda:
        plain("plain[static]", cache_implementation="static")
        ours("vramguard_fast_decode", vs="plain[static]", fast_decode=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--new", type=int, default=None, help="new tokens (128; 16 with --smoke)")
    ap.add_argument("--prompt", type=int, default=None, help="prompt tokens (512; 40 with --smoke)")
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--compute-dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--budget-s", type=float, default=240.0, help="skip what would start after this many seconds")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    t0 = time.perf_counter()
    os.makedirs(args.out, exist_ok=True)
    log = os.path.join(args.out, "identity.jsonl")
    if args.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    mode = {"deterministic": args.deterministic, "compute_dtype": args.compute_dtype,
            "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG")}
    emit(log, {**env_record(), "kind": "env", "mode": mode, "smoke": args.smoke})
    if args.smoke:
        m = smoke_model()
    else:
        from vramguard.runtime.load import load_model
        if not os.path.exists(os.path.join(CKPT, "config.json")):
            build_checkpoint("llama-3.1-8b", CKPT)
        loaded = load_model(CKPT, quant="nf4", attn="sdpa", compute_dtype=args.compute_dtype,
                            dtype=args.compute_dtype, verify=False)
        m = loaded.model
        emit(log, {"kind": "model", "active": {k: str(v) for k, v in loaded.report.active.items()}})
    prompt, new = args.prompt or (40 if args.smoke else 512), args.new or (16 if args.smoke else 128)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, m.config.vocab_size - 100, (1, prompt), generator=g).to(next(m.parameters()).device)
    try:
        emit(log, {"kind": "determinism", "mode": mode, **determinism(m, ids)})
    except Exception as e:  # recorded; part 2 still runs
        emit(log, {"kind": "determinism", "error": f"{type(e).__name__}: {e}"[:1200],
                   "traceback": traceback.format_exc()[-2000:]})
    identity(m, ids, new, log, t0 + args.budget_s)
    emit(log, {"kind": "done", "mode": mode, "elapsed_s": round(time.perf_counter() - t0, 1)})


if __name__ == "__main__":
    main()
