"""Where a plan rests on a path no GPU measurement covers (:func:`vramguard.plan.verified.unverified`), measure one
short prefill on the real device before any memory is committed to the run, and scale the plan by what it shows.

The measurement is one forward of :data:`FIRST_PREFILL_TOKENS` tokens (fewer for a shorter prompt), batch 1, with a
cache and ``logits_to_keep=1`` as ``generate``'s prefill runs it: on CUDA its peak above what was allocated before it
(``torch.cuda.max_memory_allocated``); on a CPU the peak of the storages its operators create (a dispatch mode,
rounded to 512 B as the replay rounds them). Beside it, the plan's prefill peak at the same length
(:func:`vramguard.plan.estimate`). Their ratio, where above 1, scales every planned need beyond the weights (the
plan is never lowered on one measurement).
"""

from __future__ import annotations

from dataclasses import dataclass

from vramguard.plan import choose, estimate
from vramguard.plan import verified
from vramguard.units import fmt_bytes

FIRST_PREFILL_TOKENS = 256  # short enough to cost little on any card, long enough to cover a chunk of a Mamba scan


@dataclass(frozen=True)
class FirstPrefill:
    """One short prefill measured beside the plan: ``tokens`` long; ``planned_bytes`` / ``measured_bytes`` its peak
    above the memory before it; ``unverified``: the parts of the forward no measurement covered (the reason to
    measure); ``device``: ``cuda`` or ``cpu``."""

    tokens: int
    planned_bytes: int
    measured_bytes: int
    unverified: tuple[str, ...]
    device: str

    @property
    def scale(self) -> float:
        """What every planned need beyond the weights is multiplied by: measured / planned, at least 1."""
        return max(1.0, self.measured_bytes / max(self.planned_bytes, 1))

    def note(self) -> str:
        """The run's words for it."""
        head = (f"the plan is unverified ({', '.join(self.unverified)}): a first prefill of {self.tokens} tokens "
                f"measured on {self.device} before the run took {fmt_bytes(self.measured_bytes)} against "
                f"{fmt_bytes(self.planned_bytes)} planned")
        if self.scale > 1:
            return head + f"; every planned need beyond the weights scaled by {self.scale:.2f}"
        return head + "; the plan is kept (it is not lowered on one measurement)"


def measure_first_prefill(handle, settings=None) -> FirstPrefill | None:
    """The :class:`FirstPrefill` of ``handle``'s model (a :class:`~vramguard.runtime.handle.LoadedModel`) with
    ``settings`` (default: as loaded); None where the plan is verified or the model has no spec to plan
    (nothing to measure against)."""
    spec = handle.spec
    s = settings or handle.settings
    if spec is None or s is None:
        return None
    model = choose(spec, s).model
    missing = verified.unverified(model, s)
    if not missing:
        return None
    tokens = min(FIRST_PREFILL_TOKENS, max(1, s.prompt_tokens))
    planned = estimate(model, s.with_(prompt_tokens=tokens, max_new_tokens=1, batch=1)).prefill.peak_bytes
    measured = prefill_peak_bytes(handle.model, tokens, handle.on_cuda)
    return FirstPrefill(tokens, planned, measured, missing, "cuda" if handle.on_cuda else "cpu")


def scaled(found: tuple[list, list], scale: float) -> tuple[list, list]:
    """``(candidates, skipped)`` of a preflight with each candidate's planned need (``(strategy, bytes)``) times
    ``scale`` (:attr:`FirstPrefill.scale`; 1: unchanged)."""
    cands, skipped = found
    return ([(st, need if scale == 1 else int(need * scale)) for st, need in cands], skipped)


def noted(first: FirstPrefill | None, found: tuple[list, str]) -> tuple[list, str]:
    """``(order, why)`` of a preflight, with ``first``'s words added to the reason where a prefill was measured."""
    order, why = found
    return (order, why) if first is None else (order, f"{why}; {first.note()}")


def usable_after_first_prefill(loaded, usable: int, source: str) -> tuple[int, str]:
    """A server's ``(usable bytes, where they come from)`` re-planned from one short prefill measured on the device
    where the model's plan is unverified, before the KV pool or any request takes memory: the usable bytes divided
    by :attr:`FirstPrefill.scale` (every planned need times it), and the source saying so; else unchanged."""
    first = measure_first_prefill(loaded)
    if first is None or usable <= 0:
        return usable, source
    return int(usable / first.scale), f"{source}; {first.note()}" + (
        f" (usable {fmt_bytes(usable)} / {first.scale:.2f})" if first.scale > 1 else "")


def prefill_peak_bytes(model, tokens: int, on_cuda: bool) -> int:
    """Peak bytes above what was allocated before one forward of ``tokens`` tokens (batch 1, a new cache, the last
    position's logits), on the model's device (see the module docstring)."""
    import torch
    device = next(model.parameters()).device
    ids = torch.full((1, tokens), 1, dtype=torch.long, device=device)
    with torch.no_grad():
        if on_cuda:
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - before
        else:
            with cpu_allocations() as counted:
                out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
            peak = counted.peak
    del out
    if on_cuda:
        torch.cuda.empty_cache()
    return peak


def cpu_allocations():
    """A dispatch mode that keeps the live bytes of the storages real (CPU) operators create, each rounded up to 512 B
    as the replay rounds them (``now``), and their peak (``peak``), in bytes."""
    import weakref

    import torch
    from torch.utils._pytree import tree_flatten

    class Counted(torch.utils._python_dispatch.TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.live: dict[int, int] = {}
            self.now = self.peak = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            inputs = {id(a.untyped_storage()) for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)}
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and id(st := t.untyped_storage()) not in inputs | self.live.keys():
                    self.live[id(st)] = -(-st.nbytes() // 512) * 512
                    self.now += self.live[id(st)]
                    self.peak = max(self.peak, self.now)
                    weakref.finalize(st, self._free, id(st))
            return out

        def _free(self, key: int) -> None:
            self.now -= self.live.pop(key, 0)
    return Counted()

