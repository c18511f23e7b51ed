"""Which path a plan replays for the mixers with a package kernel (Mamba / Mamba-2 scans, causal convolutions, gated
delta rules; :mod:`vramguard.introspect.mixers`): the settings' ``kernels`` where given; else what transformers binds
in this process where the plan is for this machine's GPU; else (another machine, whose packages cannot be known from
here) both paths, the larger taken. Says which, and why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from vramguard.catalog.gpus import GpuSpec
from vramguard.finding import Finding
from vramguard.hardware import detect_gpus
from vramguard.introspect.generic import kernel_paths
from vramguard.introspect.mixers import describe, installed_packages
from vramguard.settings import Settings


@dataclass(frozen=True)
class KernelChoice:
    """The path a plan replayed for its kernel-backed mixers.

    ``replayed``: ``installed``, ``fast`` or ``torch`` (see :data:`vramguard.settings.KERNELS`); ``asked``: the
    settings' ``kernels`` (None: not given); ``why``: the reason in words; ``other``: where both paths were planned,
    the other path's name and its card need in bytes (the plan keeps the larger)."""

    replayed: str
    asked: str | None
    why: str
    other: tuple[str, int] | None = None


def this_machine(gpus: list[GpuSpec], cards_reason: str) -> bool:
    """Whether the plan's cards are this machine's GPU: the detected one, a size given (``vram=``) on a machine with
    a GPU, or the catalog card this machine's GPU is (same memory and compute capability). False without a GPU
    here: the packages installed on the machine that will run cannot be seen from this one."""
    if cards_reason.startswith("detected"):
        return True
    found = detect_gpus().gpus
    if not found:
        return False
    if cards_reason.startswith("given with vram"):
        return True
    here = found[0]
    return all(g.total_bytes == here.total_bytes and g.compute_capability == here.compute_capability for g in gpus)


Estimates = Callable[[Settings, Settings], tuple]  # (fast settings, torch settings) -> their estimates


def choose_path(model, s: Settings, gpus: list[GpuSpec], cards_reason: str,
                compute: Callable[[Settings], object], estimates: Estimates | None = None):
    """``(plan, choice)``: ``compute(settings)`` on the path this plan follows (see the module docstring); choice
    None for a model without a kernel-backed mixer (the path changes nothing). Where both paths are planned, the
    one whose card need (``estimate.device_used_bytes``, then the peak allocated) is larger is returned, its
    settings' ``kernels`` set to that path. ``estimates(fast, torch)``: the estimates ``compute`` gives the two
    settings, without the rest of the plan (its solved cards): the two paths are compared on them and only the
    larger one is computed (which, were its estimate not the one compared, is compared again with the other
    computed too)."""
    spec = model.spec  # a MemoryModel (vramguard.plan.choice.choose): only transformers' replays kernel paths
    paths = kernel_paths(spec, s) if model.needs_transformers and spec.config_json else ()
    if not paths:
        return compute(s), None
    packages = ", ".join(dict.fromkeys(p.package for p in paths))
    here = f"{packages}: {', '.join(p for p in installed_packages() if p in packages) or 'none of them'} installed here"
    if s.kernels is not None:
        return compute(s), KernelChoice(s.kernels, s.kernels, f"kernels='{s.kernels}' was asked ({here})")
    if this_machine(gpus, cards_reason):
        return compute(s), KernelChoice("installed", None, "the plan is for this machine's GPU, where transformers "
                                        f"binds the kernels of the packages installed ({here})")
    plans, larger = _larger(s, compute, estimates)
    need = {k: p.estimate.device_used_bytes for k, p in plans.items()}  # type: ignore[attr-defined]
    other = "fast" if larger == "torch" else "torch"
    why = (f"the plan is for a card that is not this machine's ({cards_reason.split(' (')[0]}), where {packages} may "
           f"or may not be installed, and kernels= was not given: both paths were planned and the larger kept "
           f"(kernels='{larger}' needs {need[larger]:,} B, kernels='{other}' {need[other]:,} B); plan with "
           "kernels='fast' (the packages installed there) or kernels='torch' (missing) to plan one")
    return plans[larger], KernelChoice(larger, None, why, (other, need[other]))


def _larger(s: Settings, compute: Callable[[Settings], object], estimates: Estimates | None):
    """(``{path: the plan or its estimate}``, the path of the larger need, then peak allocated) over ``fast`` and
    ``torch`` (:func:`choose_path`): the larger one's plan computed, the other's estimate where ``estimates`` is
    given, else both plans."""
    def key(p) -> tuple[int, int]:
        return p.estimate.device_used_bytes, p.estimate.peak_allocated_bytes
    plans: dict[str, object] = {}
    if estimates is not None:
        both = estimates(s.with_(kernels="fast"), s.with_(kernels="torch"))
        seen = {k: _Estimated(e) for k, e in zip(("fast", "torch"), both)}
        larger = "torch" if key(seen["torch"]) >= key(seen["fast"]) else "fast"
        plans[larger] = compute(s.with_(kernels=larger))
        if key(plans[larger]) == key(seen[larger]):
            return {**seen, **plans}, larger
    for k in ("fast", "torch"):
        plans.setdefault(k, compute(s.with_(kernels=k)))
    return plans, "torch" if key(plans["torch"]) >= key(plans["fast"]) else "fast"


@dataclass(frozen=True)
class _Estimated:
    """An estimate where :func:`_larger` compares plans (``.estimate``)."""

    estimate: object


def kernel_finding(p):
    """The ``info`` finding ``mixer_path`` of a plan whose model has kernel-backed mixers: the path replayed for each
    package and why (:attr:`KernelChoice.why`)."""
    import transformers

    choice = p.kernel_path
    return Finding("mixer_path", "info", describe(kernel_paths(p.model, p.settings), transformers.__version__,
                                                  choice.replayed, choice.why))

