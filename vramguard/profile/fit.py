"""``fit``: the largest prompt, number of new tokens or batch that really completes under a memory budget.

Real ``generate`` runs under ``torch.cuda.set_per_process_memory_fraction(budget / total)``, which caps PyTorch's
reserved memory and so emulates a smaller card on a bigger one. The search is seeded by the plan: the largest
value whose *planned reserved* peak fits (conservative) and the one whose *planned allocated* peak fits
(optimistic) bracket the boundary, so a few runs narrow it to ``tolerance``:

1. run the conservative seed (its planned reserved peak fits); on failure step down by 20% until a run completes;
2. from the largest completed run, extrapolate with its *measured* reserved peak and the plan's slope (reserved
   bytes per unit) to where the budget is reached, less half the tolerance, and run there;
   When that is within the tolerance of the largest success, probe just past it to close the bracket;
3. when it points outside the bracket (or nothing was measured), bisect between the largest success and the
   smallest failure, or step up (to the optimistic seed, at least 5%) when no run has failed yet; stop when the
   two are within ``tolerance``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable

from vramguard.errors import InvalidValue
from vramguard.explain import explain
from vramguard.introspect.alloc_replay import allowed_bytes, replay_generate, supported
from vramguard.memory.allocator import AllocatorConfig
from vramguard.plan import choose, estimate
from vramguard.plan.allocator import edge_prompt_tokens
from vramguard.profile.measured_run import free_memory, run_generate
from vramguard.profile.timeline import write_fit_plot
from vramguard.resolve import local_model_folder
from vramguard.runtime.device import memory_cap, require_cuda, total_bytes
from vramguard.runtime.load import LoadedModel, load_model
from vramguard.settings import Settings
from vramguard.plan.solve import _largest
from vramguard.spec import ModelSpec

VARY = {"prompt": "prompt_tokens", "new-tokens": "max_new_tokens", "batch": "batch"}
DYNAMIC = ("kv_cache", "attention", "activations", "dequant", "logits")


@dataclass
class FitRun:
    """One real run: the value tried, whether it completed, its peaks (bytes) and time."""

    value: int
    ok: bool
    peak_allocated: int | None
    peak_reserved: int | None
    seconds: float
    oom_kind: str | None = None
    error: str | None = None


@dataclass
class FitReport:
    """The boundary found (largest completed value), the runs made, and what binds there."""

    vary: str
    budget_bytes: int
    boundary: int | None
    smallest_failure: int | None
    runs: list[FitRun]
    seed_conservative: int | None
    seed_optimistic: int | None
    binding_component: str
    components_at_boundary: dict = field(default_factory=dict)
    plot: str | None = None


def limits(spec: ModelSpec, s: Settings, vary: str) -> tuple[int, int]:
    """The range the varied value may take: the model's context bounds prompt and new tokens."""
    if vary == "prompt":
        return 1, spec.max_position_embeddings - s.max_new_tokens
    if vary == "new-tokens":
        return 1, spec.max_position_embeddings - s.prompt_tokens
    return 1, 4096


def seeds(spec: ModelSpec, s: Settings, vary: str, budget: int,
          use_allocator: bool = False) -> tuple[int | None, int | None]:
    """(largest value whose planned reserved peak fits the budget, largest whose planned allocated peak fits).

    ``use_allocator``: for the prompt, where the caching-allocator model covers the settings
    (:func:`allocator_seeds`), its edge with the plan's margin and without it instead."""
    lo, hi = limits(spec, s, vary)
    key = VARY[vary]
    if vary == "prompt" and use_allocator:
        import os
        found = allocator_seeds(spec, s, budget, os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
        if found is not None:
            return found
    model = choose(spec, s).model
    cons = _largest(lo, hi, lambda v: estimate(model, s.with_(**{key: v})).peak_reserved_bytes, budget)
    opt = _largest(lo, hi, lambda v: estimate(model, s.with_(**{key: v})).peak_allocated_bytes, budget)
    return cons, opt


@lru_cache(maxsize=16)
def allocator_seeds(spec: ModelSpec, s: Settings, budget: int, alloc_conf: str | None) -> tuple[int, int] | None:
    """(the allocator model's largest prompt under ``budget`` less the plan's margin, the same without the margin)
    under ``alloc_conf`` (``PYTORCH_CUDA_ALLOC_CONF`` text); None without transformers, a config, or for settings
    the tape does not cover."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return None
    if not spec.config_json or not supported(s):
        return None
    try:
        conf = AllocatorConfig.parse(alloc_conf)
    except ValueError:
        return None
    base = replay_generate(spec, s.with_(prompt_tokens=1), conf).base_reserved_bytes
    from dataclasses import replace
    model = choose(spec, s).model
    cons = edge_prompt_tokens(model, s, replace(conf, allowed_bytes=allowed_bytes(budget, base)), None)
    opt = edge_prompt_tokens(model, s, replace(conf, allowed_bytes=budget), cons)
    return (cons, opt) if cons and opt else None


def _round(v: int, vary: str) -> int:
    return max(128, v // 128 * 128) if vary == "prompt" and v >= 256 else max(1, v)


def _reserved_slope(spec: ModelSpec, s: Settings, vary: str, v: int) -> float:
    """Planned reserved bytes per unit of the varied value at ``v`` (finite difference over 1%)."""
    key = VARY[vary]
    dv = max(1, v // 100)
    model = choose(spec, s).model
    hi = estimate(model, s.with_(**{key: v + dv})).peak_reserved_bytes
    lo = estimate(model, s.with_(**{key: v})).peak_reserved_bytes
    return max((hi - lo) / dv, 1.0)


def search(spec: ModelSpec, s: Settings, vary: str, budget: int, run: Callable[[int], FitRun],
           max_runs: int = 8, tolerance: float = 0.015,
           on_run: Callable[[FitRun], None] | None = None,
           use_allocator: bool = False) -> tuple[int | None, int | None, list[FitRun]]:
    """The boundary search of the module docstring. ``run(value)`` performs one real run; ``use_allocator``: seed
    from the caching-allocator model (:func:`seeds`), whose two seeds are close, so the search runs the margined
    seed, the unmargined one and one just past the edge before anything else.

    Returns (largest completed value, smallest failed value, the runs in order); the search stops once the
    largest value the model allows (:func:`limits`) completes, with no failed value (None).
    """
    lo_lim, hi_lim = limits(spec, s, vary)
    cons, opt = seeds(spec, s, vary, budget, use_allocator)

    def clamp(v: int) -> int:  # the value a run is made at: rounded, within the limits
        return min(max(_round(v, vary), lo_lim), hi_lim)
    runs: list[FitRun] = []
    ok_runs: dict[int, FitRun] = {}
    first_fail: int | None = None

    def go(v: int) -> bool:
        nonlocal first_fail
        v = clamp(v)
        prior = next((r for r in runs if r.value == v), None)
        r = prior or run(v)
        if prior is None:
            runs.append(r)
            if on_run:
                on_run(r)
        if r.ok:
            ok_runs[v] = r
        else:
            first_fail = v if first_fail is None else min(first_fail, v)
        return r.ok

    def closed() -> bool:
        best = max(ok_runs, default=None)
        return (best is not None and first_fail is not None
                and first_fail - best <= max(tolerance * best, 128 if vary == "prompt" else 1))

    start = cons or opt or lo_lim
    while len(runs) < max_runs and not go(start) and start > lo_lim:  # 1. a run that completes
        start = max(lo_lim, int(start * 0.8))
    def past(v: int) -> int:  # the first value past ``v`` by the tolerance that the rounding keeps distinct
        return max(int(v * (1 + tolerance)), v + (128 if vary == "prompt" and v >= 256 else 1))

    close_seeds = use_allocator and cons and opt and opt - cons <= 2 * tolerance * cons
    if close_seeds and ok_runs and len(runs) < max_runs:  # the edge is near: the unmargined seed, then just past
        go(opt if _round(opt, vary) > max(ok_runs) else past(max(ok_runs)))
        if first_fail is None and not closed() and len(runs) < max_runs:
            go(past(max(ok_runs)))
    while len(runs) < max_runs and ok_runs and not closed() and max(ok_runs) < clamp(hi_lim):
        best = max(ok_runs)
        r = ok_runs[best]
        ceiling = first_fail if first_fail is not None else hi_lim + 1
        target = None
        if r.peak_reserved:  # 2. secant: the measured reserved peak plus the plan's slope reach the budget here
            step = (budget - r.peak_reserved) / _reserved_slope(spec, s, vary, best)
            target = int(best + step * (1 - tolerance / 2))
        if target is not None and best < target < ceiling and target - best < tolerance * best:
            target = int(best * (1 + tolerance))  # the edge is close: probe just past it to close the bracket
        if target is None or target <= best or target >= ceiling:
            # 3. no measurement to extrapolate from, or it points outside the bracket: bisect or expand
            target = ((best + ceiling) // 2 if first_fail is not None
                      else max(int(best * 1.05), best + 1, (opt or 0) if (opt or 0) > best else 0))
        if clamp(target) in (r2.value for r2 in runs):
            target = past(best) if first_fail is None else (best + ceiling) // 2
            if clamp(target) in (r2.value for r2 in runs):
                break  # every value left to try has been run: nothing narrows the bracket further
        go(target)
    return max(ok_runs, default=None), first_fail, runs


def binding_component(spec: ModelSpec, s: Settings, vary: str, boundary: int | None,
                      measured_fragmentation: int | None) -> tuple[str, dict]:
    """The component that grows into the budget at the boundary: the largest dynamic component of the plan, or
    fragmentation when the measured reserved-minus-allocated is larger than it, or the weights."""
    if boundary is None:
        return "weights", {}
    est = estimate(choose(spec, s).model, s.with_(**{VARY[vary]: boundary}))
    comps = {k: v for k, v in est.components.items()}
    dyn = {k: comps.get(k, 0) for k in DYNAMIC}
    name, size = max(dyn.items(), key=lambda kv: kv[1])
    if measured_fragmentation and measured_fragmentation > size:
        return "fragmentation", comps
    if comps.get("weights", 0) > sum(dyn.values()):
        return "weights", comps
    return {"kv_cache": "KV cache", "attention": "attention workspace", "activations": "prefill activations",
            "dequant": "dequantized weights", "logits": "logits"}[name], comps


def fit(model, s: Settings, vary: str, budget_bytes: int, out_dir: str | None = None, max_runs: int = 8,
        tolerance: float = 0.015, progress: bool = True) -> FitReport:
    """Find the largest ``vary`` value (prompt / new-tokens / batch) that completes under ``budget_bytes``.

    Args:
        model: a local model folder / cached id, or a :class:`~vramguard.runtime.load.LoadedModel`.
        budget_bytes: the memory PyTorch may reserve (the emulated card, context excluded).

    Raises:
        InvalidValue: unknown ``vary``, or a budget above the card.
        NoCudaGpu: no CUDA device (fit makes real runs).
    """
    if vary not in VARY:
        raise InvalidValue("vary", vary, " | ".join(VARY), "vary one of those")
    if not isinstance(model, LoadedModel):
        local_model_folder(model)  # a missing path or a name with no weights is said before anything else
    require_cuda("fit", "fit makes real runs on the GPU: run it on a machine with an NVIDIA GPU (vramguard plan "
                 "predicts without one)")
    total = total_bytes()
    if budget_bytes > total:
        raise InvalidValue("budget_bytes", budget_bytes, f"at most the card's {total:,} B", "give a smaller budget")
    loaded = model if isinstance(model, LoadedModel) else load_model(model, quant=s.quant, attn=s.attn)
    spec = loaded.spec
    key = VARY[vary]

    def one(v: int) -> FitRun:
        r = run_generate(loaded.model, s.with_(**{key: v}))
        kind = None
        if not r.ok and r.error and "Tried to allocate" in r.error:
            kind = explain(r.error).kind
        return FitRun(v, r.ok, r.peak_allocated, r.peak_reserved, round(r.seconds, 2), kind, r.error)

    with memory_cap(budget_bytes):
        free_memory()
        bar = _progress(progress, max_runs)
        with bar:
            task = bar.add_task(f"fit, varying {vary}", total=max_runs)
            best, fail, runs = search(spec, s, vary, budget_bytes, one, max_runs, tolerance,
                                      on_run=lambda r: bar.update(task, advance=1,
                                                                  description=f"{vary}={r.value:,} "
                                                                              f"{'ok' if r.ok else 'OOM'}"),
                                      use_allocator=True)
    cons, opt = seeds(spec, s, vary, budget_bytes, use_allocator=True)
    frag = max(((r.peak_reserved or 0) - (r.peak_allocated or 0) for r in runs if r.ok), default=None)
    binding, comps = binding_component(spec, s, vary, best, frag)
    rep = FitReport(vary, budget_bytes, best, fail, runs, cons, opt, binding, comps)
    if out_dir:
        from pathlib import Path
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        rep.plot = str(write_fit_plot([r.value for r in runs], [r.peak_allocated for r in runs],
                                      [r.ok for r in runs], budget_bytes, vary, best,
                                      Path(out_dir) / f"fit_{vary}.png",
                                      f"{spec.name}: largest {vary} under {budget_bytes / 2**30:.1f} GiB"))
    return rep


def _progress(enabled: bool, total: int):
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=Console(stderr=True), disable=not enabled, transient=False)
