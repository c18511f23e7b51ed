"""Teacher-forced quality of vramguard's fast paths on real weights: top-1 agreement and perplexity of each path
against bitsandbytes' own NF4 forward and against bf16, over public-domain English text
(``benchmarks/data/kjv_ruth.txt``, see ``benchmarks/data/README.md``).

Every path sees the same token ids. A path scores position ``i`` with the logits it computes after reading tokens
``0..i``: its argmax (top-1) and the log-probability of the true token ``i + 1`` (float32 ``log_softmax``).
Perplexity is ``exp(-mean log-prob)`` over the ``T - 1`` scored positions. The decode paths are teacher-forced one
token at a time (the KV cache grows by one token per step), so every position after the first comes from the decode
step itself; the first is a one-token forward that fills the cache.

Paths (:data:`PATHS`; the two references first):

* ``bf16``: the model in bfloat16, one forward over the text (transformers, SDPA).
* ``bnb_nf4``: transformers ``from_pretrained(..., quantization_config=BitsAndBytesConfig(nf4, double quant, bf16
  compute))``, one forward over the text: bitsandbytes' own NF4 forward, the reference of the goal.
* ``bnb_nf4_decode``: the same model teacher-forced one token at a time with a ``DynamicCache`` (bitsandbytes' own
  one-row 4-bit matmul): how far the decode shape alone moves the figures.
* ``sdpa_pin``: as ``bnb_nf4_decode`` with SDPA pinned the way ``load_model`` pins it (the first of
  ``vramguard.runtime.load.SDPA_PIN_ORDER`` that runs; :func:`vramguard.runtime.handle.pin_sdpa`).
* ``fused``: :mod:`vramguard.run.fused_step` (the step ``run`` captures on a GPU), built and checked by
  :func:`vramguard.run.fused_step.build` on a static cache; on CUDA with ``nf4.LUT`` as shipped (the 4-bit values
  looked up in registers, rounded to ``nf4.LUT_TABLE``, float16, before the block scale).
* ``fused_lut_bf16``: the same with the register table in bfloat16 (as shipped before; one shift per value instead
  of a conversion); CUDA only.
* ``fused_gather``: the same with ``nf4.LUT = False`` (the values gathered from the float32 table); CUDA only.
* ``gemv``: ``bnb_nf4_decode`` with bitsandbytes' ``gemm_4bit`` routed to :func:`vramguard.run.kernels.nf4.matmul_4bit`
  (:func:`vramguard.run.kernels.route.gemm_4bit_route`: the unfused kernel step of ``run``, ``serve`` up to 8 rows).
* ``serve_gemm`` / ``serve_gemm_lut``: the text in chunks of :data:`GEMM_ROWS` tokens (each a forward on the cache
  of the chunks before it), every projection a ``GEMM_ROWS``-row call routed to
  :func:`vramguard.run.kernels.nf4_gemm.gemm_4bit` as ``serve``'s decode steps route it (9 to 64 rows), reading the
  4-bit values by gather or (CUDA only) by the register lookup.
* ``kv_int8`` / ``kv_int4``: ``bnb_nf4_decode`` with transformers' ``QuantizedCache`` configured as ``run``'s int8 and
  int4 KV strategies configure ``generate`` (:data:`vramguard.run.generate.STRATEGIES`: HQQ, groups of 64, the last
  128 tokens kept in 16 bits).

The goal: the fused path within 0.5% of bitsandbytes' NF4 perplexity and
at least 99% top-1 agreement with it (:data:`GOAL_PPL_RATIO`, :data:`GOAL_AGREEMENT`).

    python3 benchmarks/quality.py MODEL_DIR OUT_DIR                  # H200: 2048 tokens, every path
    python3 benchmarks/quality.py MODEL_DIR OUT_DIR --tokens 8 --layers 1 --dtype float32   # CPU trial, ~4 min

writes ``OUT_DIR/quality.json`` (raw figures) and ``OUT_DIR/quality.md`` (the table). Needs torch, transformers,
bitsandbytes, hqq and triton (on the CPU Triton's interpreter runs the kernels: ``TRITON_INTERPRET=1`` is set when
CUDA is absent, before triton is imported).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

if not torch.cuda.is_available():  # before anything imports triton: the kernels then run in its interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

TEXT = Path(__file__).parent / "data" / "kjv_ruth.txt"
GEMM_ROWS = 32  # rows of each routed GEMM call in serve_gemm (serve routes 9 to 64 rows to the GEMM)
GOAL_PPL_RATIO = 0.005  # the fused path's perplexity within 0.5% of bitsandbytes' NF4
GOAL_AGREEMENT = 0.99  # and top-1 agreement with it of at least 99%
REFERENCES = ("bf16", "bnb_nf4", "bnb_nf4_decode")
PATHS = ("bf16", "bnb_nf4", "fused", "fused_lut_bf16", "fused_gather", "serve_gemm", "serve_gemm_lut",
         "bnb_nf4_decode", "sdpa_pin", "gemv", "kv_int8", "kv_int4")  # the run's order: the goal's paths first
CUDA_ONLY = ("fused_gather", "fused_lut_bf16", "serve_gemm_lut")  # register lookups are PTX; the CPU gathers


@dataclass
class Scores:
    """One path over the text: ``top1`` (long ``[T-1]``, the argmax at each position), ``logprob`` (float64
    ``[T-1]``, log-probability of the next true token), the seconds it took and a note (what ran). Positions before
    ``first`` came from a forward that filled the cache, not from the path: they are not scored."""

    top1: torch.Tensor
    logprob: torch.Tensor
    seconds: float = 0.0
    note: str = ""
    first: int = 0

    @property
    def perplexity(self) -> float:
        return math.exp(-float(self.logprob[self.first:].mean()))


def text_ids(tokenizer, tokens: int | None = None) -> list[int]:
    """The first ``tokens`` ids of :data:`TEXT` under ``tokenizer`` (no special tokens; all when None).

    Raises:
        ValueError: the text has fewer than ``tokens`` tokens, or ``tokens`` below 2.
    """
    ids = tokenizer(TEXT.read_text(), add_special_tokens=False)["input_ids"]
    if tokens is not None and not 2 <= tokens <= len(ids):
        raise ValueError(f"--tokens: {tokens}; the text has {len(ids)} tokens under this tokenizer: pass 2 to "
                         f"{len(ids)}")
    return ids[:tokens] if tokens else ids


def score(logits, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(argmax, log-probability of the next true token) for logits ``[n, vocab]`` at positions ``0..n-1``."""
    lf = logits.float()
    target = torch.tensor(ids[1:lf.shape[0] + 1], device=lf.device)
    lp = torch.log_softmax(lf, dim=-1).gather(1, target.view(-1, 1)).view(-1)
    return lf.argmax(-1).cpu(), lp.double().cpu()


def _cache_kw(model) -> str:
    from vramguard.run.fastdecode import _cache_keyword
    return _cache_keyword(model)


@torch.no_grad()
def forward_scores(model, ids: list[int], chunk: int | None = None, ctx=contextlib.nullcontext) -> Scores:
    """The text in one forward (``chunk`` None) or in chunks of ``chunk`` tokens on a ``DynamicCache`` (each chunk a
    forward over it and the chunks before), inside ``ctx()``."""
    from transformers import DynamicCache
    dev = next(model.parameters()).device
    x = torch.tensor([ids[:-1]], device=dev)
    t0 = time.perf_counter()
    if chunk is None:
        with ctx():
            logits = model(input_ids=x).logits[0]
        top1, lp = score(logits, ids)
    else:
        cache, parts = DynamicCache(config=model.config), []
        for s in range(0, x.shape[1], chunk):
            with ctx():
                out = model(input_ids=x[:, s:s + chunk], use_cache=True, **{_cache_kw(model): cache})
            parts.append(score(out.logits[0], ids[s:]))
        top1, lp = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    return Scores(top1, lp, time.perf_counter() - t0)


@torch.no_grad()
def decode_scores(model, ids: list[int], cache=None, ctx=contextlib.nullcontext) -> Scores:
    """Teacher-forced one token at a time on ``cache`` (default a ``DynamicCache``), each step inside ``ctx()``."""
    from transformers import DynamicCache
    dev = next(model.parameters()).device
    cache = DynamicCache(config=model.config) if cache is None else cache
    kw = _cache_kw(model)
    top1, lp = torch.empty(len(ids) - 1, dtype=torch.long), torch.empty(len(ids) - 1, dtype=torch.float64)
    t0 = time.perf_counter()
    for i in range(len(ids) - 1):
        with ctx():
            out = model(input_ids=torch.tensor([[ids[i]]], device=dev), use_cache=True, **{kw: cache})
        a, b = score(out.logits[0, -1:], ids[i:])
        top1[i], lp[i] = a[0], b[0]
    return Scores(top1, lp, time.perf_counter() - t0)


@torch.no_grad()
def fused_scores(model, ids: list[int], lut: bool = True, prefill: int = 1, table: str | None = None) -> Scores:
    """Teacher-forced through :class:`vramguard.run.fused_step.FusedDecodeStep`: the first ``prefill`` tokens fill a
    ``StaticCache`` of ``len(ids)`` slots by one forward (a one-token fill is scored like a decode step, a longer
    one is not: the CPU test starts the fused steps late in the text, the interpreter being slow),
    :func:`vramguard.run.fused_step.build` checks the step (each kernel, then a whole step against transformers'
    forward), then every later token is one fused step. ``lut``: ``nf4.LUT`` for the run (CUDA: register lookup
    of the values rounded to ``table``, default ``nf4.LUT_TABLE``; the CPU always gathers).

    Raises:
        RuntimeError: the fused step was not built (its reason): a fused row must never measure another path.
    """
    from transformers import StaticCache

    from vramguard.run import fused_step
    from vramguard.run.kernels import nf4
    dev = next(model.parameters()).device
    n = len(ids)
    cache = StaticCache(config=model.config, max_cache_len=n)
    kw = _cache_kw(model)
    slots = torch.arange(n, device=dev).view(1, 1, 1, n)
    tok, pos = torch.zeros((1, 1), dtype=torch.long, device=dev), torch.zeros((1, 1), dtype=torch.long, device=dev)

    def forward():  # transformers' own step from the buffers (SDPA, a bool mask over the static cache)
        out = model(input_ids=tok, position_ids=pos, attention_mask=slots <= pos.view(1, 1, 1, 1), use_cache=True,
                    logits_to_keep=1, **{kw: cache})
        return out.logits[:, -1, :].float()

    top1, lp = torch.empty(n - 1, dtype=torch.long), torch.empty(n - 1, dtype=torch.float64)
    before, table_before = nf4.LUT, nf4.LUT_TABLE
    nf4.LUT, nf4.LUT_TABLE = lut, table or nf4.LUT_TABLE
    try:
        t0 = time.perf_counter()
        out = model(input_ids=torch.tensor([ids[:prefill]], device=dev), position_ids=torch.arange(prefill,
                    device=dev).view(1, -1), attention_mask=slots <= torch.arange(prefill, device=dev).view(1, 1, -1, 1),
                    use_cache=True, **{kw: cache})
        top1[:prefill], lp[:prefill] = score(out.logits[0], ids)
        if n - 1 > prefill:
            tok.fill_(ids[prefill])
            pos.fill_(prefill)
            step, note = fused_step.build(model, cache, n, prefill, tok, pos, forward)
            if step is None:
                raise RuntimeError(note)
            for i in range(prefill, n - 1):
                tok.fill_(ids[i])
                pos.fill_(i)
                a, b = score(step(tok, pos), ids[i:])
                top1[i], lp[i] = a[0], b[0]
        else:
            note = "one position: no decode step"
    finally:
        nf4.LUT, nf4.LUT_TABLE = before, table_before
    return Scores(top1, lp, time.perf_counter() - t0, note, first=prefill if prefill > 1 else 0)


def quantized_cache(model, nbits: int):
    """transformers' ``QuantizedCache`` as ``generate`` builds it from the cache config of ``run``'s int8 / int4 KV
    strategy (:data:`vramguard.run.generate.STRATEGIES`)."""
    from transformers import QuantizedCache

    from vramguard.run.generate import STRATEGIES
    cfg = next(dict(s.kwargs["cache_config"]) for s in STRATEGIES
               if s.kwargs.get("cache_implementation") == "quantized" and s.kwargs["cache_config"].get("nbits") == nbits)
    cfg.setdefault("config", model.config.get_text_config(decoder=True))
    return QuantizedCache(backend=cfg.pop("backend"), **cfg)


def pin_as_load_model(model) -> tuple[str, list[str]]:
    """Pin SDPA on ``model`` as ``load_model`` does: the first backend of ``SDPA_PIN_ORDER`` under which a 4-token
    forward runs (:func:`vramguard.runtime.handle.pin_sdpa`). Returns (backend, the errors of those before it).

    Raises:
        RuntimeError: no backend runs (each one's error).
    """
    from vramguard.runtime.handle import pin_sdpa, unpin_sdpa
    from vramguard.runtime.load import SDPA_PIN_ORDER
    dev = next(model.parameters()).device
    errors = []
    for backend in SDPA_PIN_ORDER:
        pin_sdpa(model, backend)
        try:
            with torch.no_grad():
                model(input_ids=torch.zeros((1, 4), dtype=torch.long, device=dev))
            return backend, errors
        except RuntimeError as e:
            errors.append(f"{backend}: {str(e).splitlines()[0][:120]}")
            unpin_sdpa(model)
    raise RuntimeError("no SDPA backend of " + ", ".join(SDPA_PIN_ORDER) + " runs here: " + "; ".join(errors))


def routed(max_rows: int, lut: bool, model):
    """A context factory of :func:`vramguard.run.kernels.route.gemm_4bit_route` that routes every 4-bit call of
    ``model`` (GEMV up to 8 rows, GEMM up to ``max_rows``), the GEMM reading by register lookup when ``lut``."""
    import functools

    from vramguard.run.kernels.route import gemm_4bit_route
    choice = None
    if lut:
        choice = {(int(m.weight.quant_state.shape[0]), int(m.weight.quant_state.shape[1]), "gemm"): "lut"
                  for m in model.modules() if getattr(getattr(m, "weight", None), "quant_state", None) is not None}
    return functools.partial(gemm_4bit_route, max_rows, choice)


def run_path(name: str, nf4_model, bf16_model, ids: list[int]) -> Scores:
    """One path of :data:`PATHS` over ``ids``."""
    from vramguard.run.kernels import nf4_gemm
    if name == "bf16":
        return forward_scores(bf16_model, ids)
    if name == "bnb_nf4":
        return forward_scores(nf4_model, ids)
    if name == "bnb_nf4_decode":
        return decode_scores(nf4_model, ids)
    if name == "sdpa_pin":
        from vramguard.runtime.handle import unpin_sdpa
        backend, errors = pin_as_load_model(nf4_model)
        try:
            s = decode_scores(nf4_model, ids)
        finally:
            unpin_sdpa(nf4_model)
        s.note = f"SDPA pinned to {backend}" + (f" ({'; '.join(errors)})" if errors else "")
        return s
    if name in ("fused", "fused_gather", "fused_lut_bf16"):
        return fused_scores(nf4_model, ids, lut=name != "fused_gather",
                            table="bfloat16" if name == "fused_lut_bf16" else None)
    if name == "gemv":
        route = routed(nf4_gemm.MAX_ROWS, False, nf4_model)
        holder = {}

        @contextlib.contextmanager
        def ctx():
            with route() as r:
                yield
            holder.update(r.counts)
        s = decode_scores(nf4_model, ids, ctx=ctx)
        s.note = _route_note(holder)
        return s
    if name in ("serve_gemm", "serve_gemm_lut"):
        route = routed(nf4_gemm.MAX_ROWS, name.endswith("lut"), nf4_model)
        holder = {}

        @contextlib.contextmanager
        def ctx():
            with route() as r:
                yield
            for k, v in r.counts.items():
                holder[k] = holder.get(k, 0) + v if isinstance(v, int) else v
        s = forward_scores(nf4_model, ids, chunk=GEMM_ROWS, ctx=ctx)
        s.note = _route_note(holder)
        return s
    if name in ("kv_int8", "kv_int4"):
        nbits = 8 if name == "kv_int8" else 4
        s = decode_scores(nf4_model, ids, cache=quantized_cache(nf4_model, nbits))
        s.note = f"QuantizedCache hqq nbits={nbits}"
        return s
    raise ValueError(f"--paths: {name!r} is not one of {', '.join(PATHS)}")


def _route_note(counts: dict) -> str:
    return (f"{counts.get('routed', 0)} 4-bit calls routed, {counts.get('declined', 0)} left to bitsandbytes"
            + (f" ({counts['declined_why']})" if counts.get("declined") else ""))


def compare(s: Scores, ref: Scores) -> dict:
    """Top-1 agreement of ``s`` with ``ref`` (fraction of the positions both score), the perplexity ratio over those
    positions and the mean absolute difference of the next-token log-probabilities there (nats)."""
    f = max(s.first, ref.first)
    a, b = s.logprob[f:], ref.logprob[f:]
    return {"agreement": float((s.top1[f:] == ref.top1[f:]).double().mean()),
            "ppl_ratio": math.exp(float(b.mean() - a.mean())),
            "mean_abs_logprob_diff": float((a - b).abs().mean())}


def report(results: dict[str, Scores]) -> dict:
    """Every path against each reference present, and whether the fused paths meet the goal."""
    rows = {}
    for name, s in results.items():
        row = {"perplexity": s.perplexity, "positions": int(s.top1.numel()) - s.first, "seconds": s.seconds,
               "note": s.note}
        for ref in REFERENCES:
            if ref in results:
                row[f"vs_{ref}"] = compare(s, results[ref])
        if name.startswith("fused") and "bnb_nf4" in results:
            c = row["vs_bnb_nf4"]
            row["goal_met"] = bool(abs(c["ppl_ratio"] - 1) <= GOAL_PPL_RATIO and c["agreement"] >= GOAL_AGREEMENT)
        rows[name] = row
    return rows


def markdown(rows: dict, meta: dict) -> str:
    """The table of :func:`report`'s rows."""
    head = ("| path | top-1 vs bnb NF4 | top-1 vs bnb NF4 decode | top-1 vs bf16 | perplexity | ppl / bnb NF4 "
            "| mean abs dlogp vs bnb NF4 | s |\n|---|---|---|---|---|---|---|---|\n")

    def cell(row, ref, key, fmt):
        return fmt.format(row[f"vs_{ref}"][key]) if f"vs_{ref}" in row else "-"

    lines = [f"| {n} | {cell(r, 'bnb_nf4', 'agreement', '{:.2%}')} | {cell(r, 'bnb_nf4_decode', 'agreement', '{:.2%}')}"
             f" | {cell(r, 'bf16', 'agreement', '{:.2%}')} | {r['perplexity']:.4f} | "
             f"{cell(r, 'bnb_nf4', 'ppl_ratio', '{:.4f}')} | {cell(r, 'bnb_nf4', 'mean_abs_logprob_diff', '{:.4f}')}"
             f" | {r['seconds']:.1f} |" for n, r in rows.items()]
    notes = [f"- {n}: {r['note']}" + (f" (goal {'met' if r['goal_met'] else 'MISSED'})" if "goal_met" in r else "")
             for n, r in rows.items() if r["note"] or "goal_met" in r]
    notes += [f"- {n}: FAILED: {why}" for n, why in meta.get("failed", {}).items()]
    notes += [f"- {n}: not run (CUDA only)" for n in meta.get("skipped", [])]
    return (f"Teacher-forced over {meta['tokens']} tokens of {meta['text']} ({meta['positions']} scored positions), "
            f"{meta['model']}, {meta['device']}, torch {meta['torch']}, transformers {meta['transformers']}, "
            f"bitsandbytes {meta['bitsandbytes']}.\n\n" + head + "\n".join(lines) + "\n\n" + "\n".join(notes) + "\n")


def load_models(folder: str, device: str, compute: torch.dtype, layers: int | None, need_bf16: bool):
    """(NF4 model, bf16 model or None) from ``folder``: bitsandbytes NF4 with double quant and ``compute`` compute
    dtype (transformers' ``BitsAndBytesConfig``), and the model in ``compute`` itself; ``layers`` keeps the first
    decoder layers only (a quick trial on the CPU)."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig
    extra = {"num_hidden_layers": layers} if layers else {}
    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                           bnb_4bit_compute_dtype=compute)
    nf4_model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=q, dtype=compute, device_map=device,
                                                     attn_implementation="sdpa", **extra).eval()
    for m in nf4_model.modules():  # bitsandbytes' CPU kernel on an AVX512-BF16 CPU repacks the weights on the first
        if hasattr(m, "support_avx512bf16_for_cpu"):  # forward and computes in bfloat16 (bitsandbytes.nn.Linear4bit
            m.support_avx512bf16_for_cpu = False  # .forward): the reference stays bitsandbytes' NF4 in `compute`
    plain = None
    if need_bf16:
        plain = AutoModelForCausalLM.from_pretrained(folder, dtype=compute, device_map=device,
                                                     attn_implementation="sdpa", **extra).eval()
    return nf4_model, plain


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="a Llama-style model folder (SmolLM2-135M-Instruct: tests/real_model.py builds it)")
    ap.add_argument("out", help="output directory (quality.json, quality.md)")
    ap.add_argument("--tokens", type=int, default=2048, help="tokens of the text (default 2048)")
    ap.add_argument("--paths", default=",".join(PATHS), help="comma list of " + ", ".join(PATHS))
    ap.add_argument("--layers", type=int, default=None, help="first N decoder layers only (CPU trials)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                    help="compute dtype of the NF4 model and of the 'bf16' reference (float32: CPU checks)")
    a = ap.parse_args(argv)
    import bitsandbytes
    import transformers
    from transformers import AutoTokenizer
    cuda = torch.cuda.is_available()
    paths = [p for p in a.paths.split(",") if p]
    for p in paths:
        if p not in PATHS:
            ap.error(f"--paths: {p!r} is not one of {', '.join(PATHS)}")
    skipped = [p for p in paths if p in CUDA_ONLY and not cuda]
    paths = [p for p in paths if p not in skipped]
    ids = text_ids(AutoTokenizer.from_pretrained(a.model), a.tokens)
    t0 = time.perf_counter()
    nf4_model, plain = load_models(a.model, "cuda" if cuda else "cpu", getattr(torch, a.dtype), a.layers,
                                   "bf16" in paths)
    load_s = time.perf_counter() - t0
    meta = {"model": a.model, "tokens": len(ids), "positions": len(ids) - 1, "text": TEXT.name,
            "device": torch.cuda.get_device_name(0) if cuda else "CPU (Triton's interpreter)",
            "torch": torch.__version__, "transformers": transformers.__version__,
            "bitsandbytes": bitsandbytes.__version__, "dtype": a.dtype, "layers": a.layers, "load_s": load_s,
            "skipped": skipped, "command": " ".join(sys.argv)}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for p in paths:  # the files are rewritten after each path: a run cut short keeps what it measured
        try:
            results[p] = run_path(p, nf4_model, plain, ids)
            print(f"{p}: perplexity {results[p].perplexity:.4f} in {results[p].seconds:.1f} s "
                  f"{results[p].note}", file=sys.stderr, flush=True)
        except Exception as e:  # noqa: BLE001 -- one path's failure is a result: the others still run
            if isinstance(e, torch.OutOfMemoryError):
                raise
            meta.setdefault("failed", {})[p] = f"{type(e).__name__}: {str(e).strip()[:400]}"
            print(f"{p}: failed: {meta['failed'][p]}", file=sys.stderr, flush=True)
        rows = report(results)
        (out / "quality.json").write_text(json.dumps({"meta": meta, "paths": rows}, indent=1))
        (out / "quality.md").write_text(markdown(rows, meta))
    print((out / "quality.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
