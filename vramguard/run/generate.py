"""``generate``: guarded generation that plans before it starts and recovers from out-of-memory errors.

1. Preflight: the plan of every strategy (:data:`STRATEGIES`, in order of speed) against the memory this process
   can still use (the budget, or the card's free memory plus what PyTorch holds unused, minus the loaded
   weights). The first that fits is used; with ``auto=False`` only the plain strategy is considered. When none
   fits, :class:`~vramguard.errors.Infeasible` is raised with the numbers and the plan's fix, before any GPU work.
2. On ``torch.OutOfMemoryError`` in the prefill or at any decode step, everything the failed attempt held is
   freed, the next strategy that the plan ranks as smaller is taken, and generation continues from the prompt plus
   the tokens already produced (streamed text is never repeated). Nothing is lost unless no strategy is left,
   which ends in :class:`~vramguard.errors.Infeasible`, not a traceback.

Generation stops where transformers' ``generate`` stops: after one of the model's end tokens
(``generation_config.eos_token_id``, one id or a list), kept in the output, or after ``max_new_tokens``;
``ignore_eos=True`` generates exactly ``max_new_tokens`` (for measurements). A retry after an out-of-memory error
keeps the stop: it continues with the budget left, and nothing more when an end token was already produced.

Continuing re-encodes the tokens produced so far in one prefill; with a 16-bit KV cache and greedy decoding the
result equals an uninterrupted run up to floating-point reassociation (exactly equal in the CPU tests).

Fast decode (on by default where it can run, :func:`fast_decode_choice`) puts :data:`GRAPH_STRATEGIES` first: a
static cache decoded by :class:`vramguard.run.fastdecode.GraphDecoder` (one CUDA graph replayed per token, with
vramguard's Triton kernels where they apply; eager, and reported as such, when capture fails), prefilled in one
forward or, where that does not fit, in 512-token chunks. Its greedy tokens equal the static-cache strategy's; the
strategies that would run without it follow, in the same order, as the fallbacks after an out-of-memory error.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import importlib.util
import time
from dataclasses import dataclass, field
from typing import Callable

from vramguard import diskcache
from vramguard.errors import Infeasible, InvalidValue, NotPlannable
from vramguard.plan import check_context, choose, estimate
from vramguard.plan.solve import _largest
from vramguard.run.sampling import (  # noqa: F401 -- MAX_SEED, SEED_ACCEPTED, check_seed: read here by serve
    MAX_SEED, SEED_ACCEPTED, check_generation_args, check_seed, eos_list, resolve_sampling)
from vramguard.run.timing import STOP_INTERRUPTED, RunTimings, stop_reason
from vramguard.runtime.device import is_oom, memory_cap, usable_bytes
from vramguard.runtime.first_prefill import measure_first_prefill, noted, scaled
from vramguard.runtime.handle import LoadedModel, handle_of, sdpa_unpinned
from vramguard.settings import Settings
from vramguard.units import fmt_bytes

OOM_INJECTOR: Callable[[str, int, int], None] | None = None  # tests: (phase, attempt, step) -> raise or not


@dataclass(frozen=True)
class Strategy:
    """A way to run ``generate``: transformers keyword arguments and the matching plan settings."""

    name: str
    kwargs: dict
    plan: dict
    needs_cuda: bool = False
    needs_module: str | None = None
    graph: bool = False  # decoded by vramguard.run.fastdecode.GraphDecoder instead of model.generate

    def available(self, on_cuda: bool) -> tuple[bool, str]:
        if self.needs_cuda and not on_cuda:
            return False, "needs a CUDA device"
        if self.needs_module and importlib.util.find_spec(self.needs_module.split(".")[0]) is None:
            return False, f"needs the {self.needs_module} package"
        return True, ""


def int4_kv_strategy(backend: str) -> Strategy:
    """The int4 KV rung: transformers' ``QuantizedCache`` (``nbits=4``, groups of 64, the format of
    :mod:`vramguard.memory.kv`) through ``backend``: ``"hqq"`` (HQQ's quantizer, PyTorch code on any device, the
    int8 rung's package) or ``"quanto"`` (optimum-quanto, whose CPU and CUDA kernels are C++ extensions compiled at
    their first use: a compiler is needed, and the first int4 step waits for the build, 80 to 110 s on two CPU
    cores). :data:`STRATEGIES` takes quanto only where it is installed and hqq is not."""
    module = {"hqq": "hqq", "quanto": "optimum.quanto"}[backend]
    return Strategy("int4 KV cache + chunked prefill 512",
                    {"cache_implementation": "quantized", "cache_config": {"backend": backend, "nbits": 4},
                     "prefill_chunk_size": 512}, {"kv_dtype": "int4", "prefill_chunk": 512}, needs_module=module)


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a submodule of a package that is not installed
        return False


INT4_KV_BACKEND = "quanto" if not _installed("hqq") and _installed("optimum.quanto") else "hqq"


STRATEGIES: tuple[Strategy, ...] = (
    Strategy("dynamic", {}, {}),
    Strategy("chunked prefill 2048", {"prefill_chunk_size": 2048}, {"prefill_chunk": 2048}),
    # disable_compile: transformers otherwise compiles the forward for a static cache (torch.compile with CUDA graph
    # trees): tens of seconds before the first token of a fallback, and a private memory pool the plan does not
    # count (benchmarks/gpu_compile_oom.py measures what an OOM inside that compiled call leaves behind).
    Strategy("static cache + chunked prefill 512", {"cache_implementation": "static", "prefill_chunk_size": 512,
                                                    "disable_compile": True},
             {"cache": "static", "prefill_chunk": 512}),
    Strategy("int8 KV cache + chunked prefill 512",  # HQQ takes 8 bits (quanto 2 or 4 only)
             {"cache_implementation": "quantized", "cache_config": {"backend": "hqq", "nbits": 8},
              "prefill_chunk_size": 512}, {"kv_dtype": "int8", "prefill_chunk": 512}, needs_module="hqq"),
    # exact before lossy: the offloaded cache changes no token; an int4 cache changed 27% of SmolLM2-135M's top-1
    # tokens on real text (+38% perplexity; benchmarks/results/h200_final_1202/quality_kv_int4.md)
    Strategy("offloaded KV cache + chunked prefill 512",
             {"cache_implementation": "offloaded", "prefill_chunk_size": 512},
             {"cache": "offloaded", "prefill_chunk": 512}, needs_cuda=True),
    int4_kv_strategy(INT4_KV_BACKEND),
)


# The graph strategies: one prefill forward (the time to first token of transformers' own generate), then, where
# that does not fit, 512-token chunks (each new chunk length is a new attention shape: slower to the first token).
GRAPH_STRATEGY = Strategy("static cache + CUDA-graph decode", {"prefill_chunk_size": None}, {"cache": "static"},
                          graph=True)
GRAPH_CHUNKED = Strategy("static cache + chunked prefill 512 + CUDA-graph decode", {"prefill_chunk_size": 512},
                         {"cache": "static", "prefill_chunk": 512}, graph=True)
GRAPH_STRATEGIES = (GRAPH_STRATEGY, GRAPH_CHUNKED)


@dataclass
class Attempt:
    """One try: the strategy, how many tokens it added, and the OOM that ended it (phase and step)."""

    strategy: str
    new_tokens: int
    oom: str | None = None
    phase: str | None = None
    step: int | None = None
    peak_allocated_bytes: int | None = None
    decode_mode: str | None = None  # graph strategy only: "cuda_graph" or "eager" (see decode_reason)
    decode_reason: str | None = None
    decode_ms_per_token: float | None = None
    sdpa_note: str | None = None  # load_model's SDPA pin lifted for this attempt, and why
    ttft_s: float | None = None  # its prefill: the prompt in, its first token out (one-time work apart)
    decode_s: float | None = None  # its decode steps alone (one-time work after the first token left out)
    decode_steps: int = 0
    one_time: dict = field(default_factory=dict)  # graph strategy: selftest_s, warmup_s, capture_s


@dataclass
class GenerationResult:
    """The generated text and token ids, the strategy that finished, every attempt, and the measurements
    (``peak_allocated_bytes``: the finishing attempt's peak; each attempt keeps its own). ``decode_mode`` and
    ``decode_reason`` are set when the graph strategy finished (``fast_decode``). ``stop`` says why generation
    ended: ``"eos"`` (one of ``eos_token_ids``, the model's end tokens, was generated, and is the last id),
    ``"max_new_tokens"`` or ``"interrupted"`` (Ctrl-C: :class:`GenerationInterrupted`); ``stop_detail`` says it in
    words. ``timings`` splits the wall time (plan, one-time work, prefill, decode;
    :class:`~vramguard.run.timing.RunTimings`); ``ttft_s`` is the prefill (the prompt in, the first token out:
    ``timings.prefill_s``) and ``decode_ms_per_token`` counts decode steps only, the one-time work
    of the graph strategy (kernel check, warm-up, capture) done before the prefill and timed apart. ``loaded`` says
    what ran (weight format, dtypes, attention, device) when the model came from
    :func:`~vramguard.runtime.load.load_model`; ``prompt_tokens``: the prompt's ids as sent (chat template
    applied)."""

    text: str
    token_ids: list[int]
    strategy: str
    reason: str
    attempts: list[Attempt] = field(default_factory=list)
    peak_allocated_bytes: int | None = None
    ttft_s: float | None = None
    tokens_per_s: float | None = None
    planned_need_bytes: int | None = None
    usable_bytes: int | None = None
    decode_mode: str | None = None
    decode_reason: str | None = None
    decode_ms_per_token: float | None = None
    stop: str = "max_new_tokens"
    stop_detail: str = ""
    eos_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    timings: RunTimings = field(default_factory=RunTimings)
    loaded: dict | None = None
    prompt_tokens: int | None = None


def _candidates(spec, s: Settings, pool, on_cuda: bool, weights_loaded: bool) -> tuple[list, list[str]]:
    """(strategy, planned bytes beyond the loaded weights) for each strategy of ``pool`` that can run, and why the
    others cannot."""
    cands: list[tuple[Strategy, int]] = []
    skipped: list[str] = []
    for st in pool:
        ok, why = st.available(on_cuda)
        if not ok:
            skipped.append(f"{st.name}: {why}")
            continue
        try:
            reserved, weights = _planned_bytes(spec, s.with_(**st.plan))
        except NotPlannable as e:  # the architecture cannot run this strategy (a static cache with ALiBi...)
            skipped.append(f"{st.name}: not plannable for this model ({e.fix})")
            continue
        cands.append((st, reserved - (weights if weights_loaded else 0)))
    return cands, skipped


def _planned_bytes(spec, s: Settings) -> tuple[int, int]:
    """(peak reserved, weights) bytes of :func:`vramguard.plan.estimate` for ``spec`` and ``s``, kept on disk by
    :mod:`vramguard.diskcache` (keyed by the spec with its config text and checkpoint headers, the settings, the
    library versions and vramguard's source), so a later run of the same model and request reads two integers
    instead of planning again.

    Raises:
        NotPlannable: from the estimate (never kept).
    """
    path = diskcache.entry_key("run_strategy", spec, spec.config_json, spec.checkpoint, s)
    kept = diskcache.read(path)
    if isinstance(kept, tuple) and len(kept) == 2 and all(isinstance(v, int) for v in kept):
        return kept
    est = estimate(choose(spec, s).model, s)
    out = (int(est.peak_reserved_bytes), int(est.weights.total_bytes))
    diskcache.write(path, out)
    return out


def preflight(spec, s: Settings, usable: int | None, auto: bool, on_cuda: bool, weights_loaded: bool,
              fast_decode: bool = False, need_scale: float = 1.0) -> tuple[list[tuple[Strategy, int]], str]:
    """Strategies that may run, first the one to use, each with its planned need in bytes beyond what is already
    loaded (times ``need_scale``); and the reason. Without ``fast_decode``: the first strategy that fits, then those
    planned to need less. With it, the graph strategies that fit come first (:data:`GRAPH_STRATEGY` alone when not
    ``auto``), followed by that same order. Raises Infeasible when none fits ``usable``."""
    plain = (STRATEGIES if auto else STRATEGIES[:1]) if (auto or not fast_decode) else ()
    graph = (GRAPH_STRATEGIES if auto else GRAPH_STRATEGIES[:1]) if fast_decode else ()
    cands, skipped = scaled(_candidates(spec, s, graph + plain, on_cuda, weights_loaded), need_scale)
    if not cands:
        raise NotPlannable("strategy", ", ".join(st.name for st in graph + plain), "a strategy this model runs with",
                           "; ".join(skipped))
    if usable is None:
        return cands, ("no CUDA device: nothing to plan against; " + (
            f"{cands[0][0].name} runs" if cands[0][0].graph else "the plain strategy runs"))
    order = [c for c in cands if c[0].graph and c[1] <= usable]
    plain_fit = [c for c in cands if not c[0].graph and c[1] <= usable]
    if plain_fit:
        first_plain = plain_fit[0]
        order += [first_plain] + [c for c in cands if not c[0].graph and c[0] is not first_plain[0]
                                  and c[1] < first_plain[1]]
    if not order:
        best = min(cands, key=lambda c: c[1])
        raise Infeasible("request", f"{s.prompt_tokens:,} prompt + {s.max_new_tokens:,} new tokens",
                         f"at most {fmt_bytes(usable)} of memory left; the smallest strategy ({best[0].name}) "
                         f"needs {fmt_bytes(best[1])}",
                         "shorten the prompt or the generation, use a smaller batch, or run `vramguard plan` for "
                         "what fits" + ("" if auto else "; or let vramguard pick a strategy (auto=True)"))
    first = order[0]
    why = (f"{first[0].name}: planned {fmt_bytes(first[1])} of {fmt_bytes(usable)} usable"
           + (f" (skipped: {'; '.join(skipped)})" if skipped else ""))
    if fast_decode and not first[0].graph and cands[0][0].graph:
        why += (f"; fast decode not used: its static cache needs {fmt_bytes(cands[0][1])}, more than the "
                f"{fmt_bytes(usable)} usable")
    return order, why


class _Tap:
    """Streamer: keeps new token ids, streams decoded text, and lets tests inject an OOM at a given step."""

    def __init__(self, tokenizer, on_text: Callable[[str], None] | None, attempt: int, already: list[int],
                 prompt_len: int):
        self.tok, self.on_text, self.attempt = tokenizer, on_text, attempt
        self.ids = already
        self.start = len(already)
        self.calls = 0
        self.prompt_len = prompt_len
        self.t_first: float | None = None
        self.t_last: float | None = None
        self.printed = len(self._text(already))

    def _text(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True) if self.tok is not None else ""

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 1:  # the prompt
            return
        self.t_last = time.perf_counter()
        if self.t_first is None:
            self.t_first = self.t_last
        self.ids.extend(int(x) for x in value.reshape(-1).tolist())
        if self.on_text is not None and self.tok is not None:
            text = self._text(self.ids)
            if len(text) > self.printed and not text.endswith("\ufffd"):
                self.on_text(text[self.printed:])
                self.printed = len(text)

    def end(self) -> None:
        if self.on_text is not None and self.tok is not None:
            text = self._text(self.ids)
            if len(text) > self.printed:
                self.on_text(text[self.printed:])
                self.printed = len(text)


def _inject_hook(model, attempt: int, tap: _Tap):
    """A forward pre-hook calling :data:`OOM_INJECTOR` (tests only): phase prefill on the first forward of an
    attempt, decode at step k after that."""
    if OOM_INJECTOR is None:
        return None
    calls = {"n": 0}

    def hook(_m, _a):
        calls["n"] += 1
        phase = "prefill" if len(tap.ids) == tap.start else "decode"
        OOM_INJECTOR(phase, attempt, len(tap.ids) - tap.start)

    return model.register_forward_pre_hook(hook)


def _prompt_ids(tokenizer, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, str):
        if tokenizer is None:
            raise InvalidValue("tokenizer", None, "a tokenizer for a text prompt", "pass token ids, or a tokenizer")
        ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    else:
        ids = [int(x) for x in prompt]
    if not ids:
        raise InvalidValue("prompt", "", "at least one token", "pass a non-empty prompt")
    return ids


def _done(generated: list[int], max_new_tokens: int, eos: list[int], ignore_eos: bool) -> bool:
    """Whether nothing is left to generate: the budget is spent, or (unless ``ignore_eos``) an end token ended it."""
    return len(generated) >= max_new_tokens or (not ignore_eos and bool(generated) and generated[-1] in eos)


def _attempts(model, tokenizer, prompt_ids: list[int], max_new_tokens: int, order, on_text, sample: dict,
              seed: int | None, eos: list[int],
              ignore_eos: bool) -> tuple[list[int], list[Attempt], float | None, bool]:
    """Run the strategies in ``order`` until one completes; each continues from the tokens produced so far and
    stops as transformers' ``generate`` does (at an ``eos`` id unless ``ignore_eos``, else after the budget).
    Returns the tokens, the attempts, the ``time.perf_counter()`` of the first token (None: none came) and whether
    Ctrl-C ended it (a ``KeyboardInterrupt`` in an attempt: what came until then is kept)."""
    import torch

    on_cuda = next(model.parameters()).device.type == "cuda"
    generated: list[int] = []
    attempts: list[Attempt] = []
    first_at = None  # time.perf_counter() when the first token was streamed
    for i, (st, _need) in enumerate(order):
        tap = _Tap(tokenizer, on_text, i, generated, len(prompt_ids))
        hook = _inject_hook(model, i, tap)
        ids = torch.tensor([prompt_ids + generated], device=next(model.parameters()).device)
        remaining = max_new_tokens - len(generated)
        at_least = remaining if ignore_eos else 0  # ignore_eos: EOS is masked until the budget is spent
        if seed is not None:
            torch.manual_seed((seed + len(generated)) % (MAX_SEED + 1))
        sdpa_note = None
        t_start = time.perf_counter()
        try:
            dec = None
            if st.graph:
                dec = _graph_attempt(model, ids, remaining, tap, sample, st.kwargs["prefill_chunk_size"], at_least,
                                     eos)
            else:
                with (sdpa_unpinned(model, "chunked prefill and the non-dynamic caches pass an attention mask")
                      if st.kwargs else contextlib.nullcontext()) as sdpa_note:
                    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=remaining,
                                   min_new_tokens=at_least, streamer=tap, eos_token_id=eos or None,
                                   pad_token_id=getattr(model.generation_config, "pad_token_id", None) or 0,
                                   **sample, **copy.deepcopy(st.kwargs))  # transformers 5.17 pops keys of
                    # cache_config ("backend") and adds the model's config to it: each call gets its own copy
            attempts.append(Attempt(st.name, len(generated) - tap.start,
                                    peak_allocated_bytes=torch.cuda.max_memory_allocated() if on_cuda else None,
                                    sdpa_note=sdpa_note, **{**_timing_fields(tap, t_start), **_decode_fields(dec)}))
            first_at = first_at if first_at is not None else tap.t_first
            return generated, attempts, first_at, False
        except KeyboardInterrupt:  # Ctrl-C: what came so far, with its timings, goes up with the interrupt
            added = len(generated) - tap.start
            attempts.append(Attempt(st.name, added, None, "prefill" if added == 0 else "decode", added,
                                    torch.cuda.max_memory_allocated() if on_cuda else None,
                                    **_timing_fields(tap, t_start)))
            return generated, attempts, first_at if first_at is not None else tap.t_first, True
        except RuntimeError as e:  # out of memory: free what the attempt held, then the next strategy continues
            if not is_oom(e):
                raise
            added = len(generated) - tap.start
            attempts.append(Attempt(st.name, added, str(e).split("\n")[0][:300],
                                    "prefill" if added == 0 else "decode", added,
                                    torch.cuda.max_memory_allocated() if on_cuda else None,
                                    **_timing_fields(tap, t_start)))
            first_at = first_at if first_at is not None else tap.t_first
            if _done(generated, max_new_tokens, eos, ignore_eos):  # it ran out after the last token: nothing is
                return generated, attempts, first_at, False  # left to continue (an end token was already produced)
            del ids
            gc.collect()
            if on_cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()  # the next attempt's peak is its own
        finally:
            if hook is not None:
                hook.remove()
    raise Infeasible("request", f"{len(prompt_ids):,} + {max_new_tokens:,} tokens", "a strategy that completes",
                     "every strategy ran out of memory: "
                     + "; ".join(f"{a.strategy}: {a.phase} step {a.step}" for a in attempts)
                     + ". Shorten the prompt or the generation")


class GenerationInterrupted(KeyboardInterrupt):
    """Ctrl-C during :func:`generate`: a ``KeyboardInterrupt`` (a caller that catches that still does) carrying
    ``result``, the :class:`GenerationResult` of the tokens generated until then (``stop`` is ``"interrupted"``,
    its timings those of the steps that ran)."""

    def __init__(self, result: GenerationResult):
        super().__init__(result.stop_detail)
        self.result = result


def _graph_attempt(model, ids, remaining: int, tap: _Tap, sample: dict, chunk: int, at_least: int, eos: list[int]):
    """The graph strategy's run: :func:`vramguard.run.fastdecode.graph_decode` with ``generate``'s semantics (stop
    after an ``eos`` id, which cannot be chosen before ``at_least`` tokens, as ``min_new_tokens`` does there),
    streaming through ``tap``."""
    import torch

    from vramguard.run.fastdecode import graph_decode  # the graph decoder: loaded by a run, not by a plan
    tap.put(ids)  # the prompt, as transformers' streamers receive it first
    res = graph_decode(model, ids[0].tolist(), remaining, prefill_chunk_tokens=chunk, min_new_tokens=at_least,
                       eos_token_id=eos, on_token=lambda t: tap.put(torch.tensor([t])), **sample)
    tap.end()
    return res


def _timing_fields(tap: _Tap, t_start: float) -> dict:
    """An attempt's first-token time and decode time from its streamer (every step after the first token is
    decode; the graph strategy's own split, its one-time work before the prefill apart, replaces these:
    :func:`_decode_fields`)."""
    if tap.t_first is None:
        return {}
    steps = len(tap.ids) - tap.start - 1
    decode_s = tap.t_last - tap.t_first if steps > 0 else None
    return {"ttft_s": tap.t_first - t_start, "decode_s": decode_s, "decode_steps": max(steps, 0),
            "decode_ms_per_token": decode_s * 1000 / steps if steps > 0 else None}


def _decode_fields(dec) -> dict:
    if dec is None:
        return {}
    note = (f"; kernels: {dec.kernels}" if dec.kernels else "") + (f"; {dec.sdpa_note}" if dec.sdpa_note else "")
    return {"decode_mode": dec.mode, "decode_reason": dec.reason + note, "decode_s": dec.decode_s,
            "decode_steps": dec.decode_steps, "decode_ms_per_token": dec.decode_ms_per_token, "ttft_s": dec.ttft_s,
            "one_time": {"selftest_s": dec.selftest_s, "warmup_s": dec.warmup_s, "warmup_steps": dec.warmup_steps,
                         "capture_s": dec.capture_s, "kernel_check": dec.kernel_check}}


def strategy_order(model, prompt_tokens: int, max_new_tokens: int, *, budget_bytes: int | None = None,
                   auto: bool = True, fast_decode: bool = False,
                   settings: Settings | None = None) -> tuple[list[tuple[Strategy, int]], str]:
    """The strategies :func:`generate` tries for a request of ``prompt_tokens`` + ``max_new_tokens`` on ``model``,
    in its order, each with its planned need in bytes beyond the loaded weights; and the reason for the first.
    After the first strategy that fits, only those planned to need less memory follow (a fallback that needs as
    much would run out again): e.g. chunked prefill 2048 is left out for a prompt of at most 2048 tokens.

    Raises:
        InvalidValue: the request is over the model's context. Infeasible: no strategy fits, before any GPU work.
    """
    h = handle_of(model)
    s = (settings or h.settings).with_(prompt_tokens=prompt_tokens, max_new_tokens=max_new_tokens, batch=1)
    check_context(h.spec, s, beyond=None, field="prompt + max_new_tokens")
    usable, _ = usable_bytes(budget_bytes) if h.on_cuda else (None, 0)
    first = measure_first_prefill(h, s)  # a short prefill measured now where the plan is unverified, else None
    return noted(first, preflight(h.spec, s, usable, auto, h.on_cuda, True, fast_decode, first.scale if first else 1))


def generate(model, tokenizer, prompt: str | list[int], max_new_tokens: int = 256, *, budget_bytes: int | None = None,
             auto: bool = True, on_text: Callable[[str], None] | None = None, do_sample: bool = False,
             temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
             seed: int | None = None, settings: Settings | None = None,
             fast_decode: bool | None = None, ignore_eos: bool = False) -> GenerationResult:
    """Generate up to ``max_new_tokens`` after ``prompt`` without running out of memory (see the module docstring),
    stopping at the model's end tokens as transformers' ``generate`` does.

    Args:
        model, tokenizer: the :class:`~vramguard.runtime.handle.LoadedModel` :func:`vramguard.runtime.load.load_model`
            returns (tokenizer None: its own), or a model and its tokenizer (None with token ids).
        prompt: text, or a list of token ids.
        budget_bytes: memory PyTorch may use in total (default: what the card has free).
        auto: choose the strategy from the plan (else only the plain dynamic cache, refused if it cannot fit).
        on_text: called with each new piece of text as it is generated.
        fast_decode: try the graph strategies first (CUDA-graph decode on a static cache, :data:`GRAPH_STRATEGIES`);
            None (default): when the model can run it on one CUDA device (:func:`fast_decode_choice`, its reason in
            the result's ``reason``); the result's ``decode_mode`` / ``decode_reason`` say whether the graph ran.
        ignore_eos: generate exactly ``max_new_tokens``, the end tokens masked as ``min_new_tokens`` does (for
            measuring decode speed); default False: stop after the first of ``generation_config.eos_token_id``.

    Raises:
        Infeasible: no strategy fits, before any GPU work; or every strategy ran out of memory.
        InvalidValue: a bad argument, or (``fast_decode``) a model the graph decoder cannot run.
        GenerationInterrupted: Ctrl-C (a ``KeyboardInterrupt``) while generating; its ``result`` holds the tokens
            generated until then and their timings.
    """
    import torch

    check_generation_args(max_new_tokens, do_sample, temperature, top_p, top_k, seed)
    if not isinstance(ignore_eos, bool):
        raise InvalidValue("ignore_eos", ignore_eos, "True or False", "pass ignore_eos=True to generate exactly "
                           "max_new_tokens, or leave it out to stop at the model's end of turn")
    if isinstance(model, LoadedModel) and tokenizer is None:
        tokenizer = model.tokenizer
    t_plan = time.perf_counter()
    prompt_ids = _prompt_ids(tokenizer, prompt)
    h = handle_of(model)
    model, on_cuda = h.model, h.on_cuda
    eos = eos_list(model, "model")
    fast, fast_why = fast_decode_choice(model, fast_decode)
    order, why = strategy_order(h, len(prompt_ids), max_new_tokens, budget_bytes=budget_bytes, auto=auto,
                                fast_decode=fast, settings=settings)
    plan_s = time.perf_counter() - t_plan
    if fast_decode is None:
        why += f"; fast decode {'on' if fast else 'off'} by default: {fast_why}"
    usable, _ = usable_bytes(budget_bytes) if on_cuda else (None, 0)
    if on_cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    sample, sampling_note = resolve_sampling(model, do_sample, temperature, top_p, top_k)
    with memory_cap(budget_bytes if on_cuda else None):
        generated, attempts, first_at, interrupted = _attempts(model, tokenizer, prompt_ids, max_new_tokens, order,
                                                               on_text, sample, seed, eos, ignore_eos)
    elapsed = time.perf_counter() - t0
    last = attempts[-1]
    if budget_bytes is not None and not on_cuda:
        why += "; no CUDA device: the memory budget was not applied"
    reason = why if len(attempts) == 1 else (
        f"{last.strategy} after {len(attempts) - 1} out-of-memory error(s): "
        + "; ".join(f"{a.strategy} ran out at {a.phase} step {a.step}" for a in attempts[:-1]))
    if last.decode_mode is not None:
        reason += f"; decode: {last.decode_mode} ({last.decode_reason})"
    if last.sdpa_note:
        reason += f"; {last.sdpa_note}"
    if sampling_note:
        reason += f"; {sampling_note}"
    text = tokenizer.decode(generated, skip_special_tokens=True) if tokenizer is not None else ""
    stop, stop_detail = stop_reason(generated, max_new_tokens, eos, ignore_eos, tokenizer)
    if interrupted:
        stop, stop_detail = STOP_INTERRUPTED, f"interrupted (Ctrl-C) after {len(generated):,} tokens"
    timings = RunTimings.of_attempts(attempts, plan_s, elapsed, first_at - t_plan if first_at else None)
    result = GenerationResult(text, list(generated), last.strategy, reason, attempts,
                              last.peak_allocated_bytes, timings.prefill_s,
                              len(generated) / elapsed if elapsed > 0 else None, order[0][1], usable,
                              last.decode_mode, last.decode_reason, timings.decode_ms_per_token, stop, stop_detail,
                              eos, ignore_eos, timings, _loaded_as(h), prompt_tokens=len(prompt_ids))
    if interrupted:
        raise GenerationInterrupted(result)
    return result


def _loaded_as(h) -> dict | None:
    """What :func:`~vramguard.runtime.load.load_model` loaded (its report's active settings and why), or None for
    a model vramguard did not load."""
    report = h.report
    if report is None:
        return None
    active = report.active or {}
    out = {k: active.get(k) for k in ("dtype", "compute_dtype", "attn", "device")}
    out = {"quant": h.settings.quant, **out}  # the weight format as the plan names it (fp32, bf16, nf4...)
    out["why"] = list(report.overrides) + [n for n in report.notes if n.startswith("attention")]
    return out


def fast_decode_choice(model, fast_decode: bool | None) -> tuple[bool, str]:
    """Whether :func:`generate` tries the graph strategies first, and why. ``True``: yes, after
    :func:`vramguard.run.fastdecode.check_model` (which raises for a model the decoder cannot run); ``False``: no;
    ``None`` (the default): yes when the model is on one CUDA device and the decoder can run it exactly (a
    ``GraphDecoder`` still falls back to eager steps, and says so, when the capture fails)."""
    from vramguard.run.fastdecode import check_model, graph_support  # as above: loaded by a run, not by a plan
    if fast_decode is not None:
        if fast_decode:
            check_model(model)
        return bool(fast_decode), f"fast_decode={fast_decode} was passed"
    ok, why = graph_support(model)
    if not ok:
        return False, why
    try:
        check_model(model)
    except InvalidValue as e:
        return False, f"{e.field} is {e.value!r}; accepted: {e.accepted}"
    return True, f"batch 1 on {why}"


def prompt_budget(model, max_new_tokens: int, budget_bytes: int | None = None, auto: bool = True) -> int:
    """The longest prompt (tokens) that some strategy can run with ``max_new_tokens`` in the memory left: the
    plan's :func:`~vramguard.plan.solve.max_prompt_tokens` per strategy, the largest of them; the model's context when
    there is no CUDA device to plan against."""
    h = handle_of(model)
    ctx = h.spec.max_position_embeddings - max_new_tokens
    usable, _ = usable_bytes(budget_bytes) if h.on_cuda else (None, 0)
    if usable is None:
        return ctx
    s = h.settings.with_(max_new_tokens=max_new_tokens)
    memory, best = choose(h.spec, s).model, 0
    for st in STRATEGIES if auto else STRATEGIES[:1]:
        if not st.available(h.on_cuda)[0]:
            continue
        ss = s.with_(**st.plan)

        def need(p: int, ss=ss) -> int:  # beyond the loaded weights, as preflight counts it
            est = estimate(memory, ss.with_(prompt_tokens=p))
            return est.peak_reserved_bytes - est.weights.total_bytes
        best = max(best, _largest(1, ctx, need, usable) or 0)
    return best
