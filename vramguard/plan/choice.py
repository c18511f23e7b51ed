"""Where a plan's numbers come from, decided once per model and settings: the memory model and the reserve.

The memory model (:class:`~vramguard.memory.model.MemoryModel`): a hand-written family's arithmetic
(:class:`~vramguard.memory.model.HandModel`, its load's peak from transformers on the meta device where transformers
is installed and the spec carries its config.json), or transformers itself for every other architecture
(:class:`~vramguard.introspect.model.TransformersModel`); over either, the weights a pre-quantized checkpoint's
safetensors headers store (:class:`~vramguard.hub.prequant.CheckpointModel`).

The reserve (``memory_reserved - memory_allocated`` at the peak): the formula of :mod:`vramguard.memory.runtime`,
or the caching-allocator model (:mod:`vramguard.plan.allocator`, a replay of transformers' forward) under a
``PYTORCH_CUDA_ALLOC_CONF`` parsed here, once.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from vramguard.errors import InvalidValue, NotPlannable
from vramguard.finding import Finding
from vramguard.hub.prequant import CheckpointModel, uses_headers
from vramguard.introspect import hand
from vramguard.introspect.alloc_replay import not_covered
from vramguard.introspect.generic import load_plan as transformers_load_plan
from vramguard.introspect.model import META, TransformersModel
from vramguard.memory.allocator import AllocatorConfig
from vramguard.memory.model import HandModel, LoadPlan, MemoryModel
from vramguard.plan.allocator import GPU_EXTRA_FIX, auto_alloc_conf, reserve_formula_finding
from vramguard.settings import Settings
from vramguard.spec import ModelSpec

AUTO = "auto"  # plan's alloc_conf default: the allocator model where it can run, else the reserve formula


@dataclass(frozen=True)
class Reserve:
    """The reserve strategy: the allocator model under ``alloc_conf`` (its parsed ``config``), or the formula
    (``alloc_conf`` None). ``asked``: the caller named ``alloc_conf`` (a replay that cannot run is then an error,
    not a fall back to the formula)."""

    alloc_conf: str | None
    config: AllocatorConfig | None = None
    asked: bool = False

    @property
    def replay(self) -> bool:
        return self.config is not None


@dataclass(frozen=True)
class Choice:
    """A model's memory model and reserve strategy, why (``reason``, in words), and the finding the user should
    see about it (None where there is nothing to say)."""

    model: MemoryModel
    reserve: Reserve
    reason: str
    finding: Finding | None = None


def _load_from_transformers(spec: ModelSpec, s: Settings) -> LoadPlan | None:
    """The load of a hand family as transformers does it: its module tree written by hand where
    :func:`vramguard.introspect.hand.covers` the family (no import of transformers), else from transformers' meta
    model; None where transformers is not installed (found, not imported)."""
    if importlib.util.find_spec("transformers") is None:
        return None
    if hand.covers(spec):
        return hand.load_plan(spec, s)
    return transformers_load_plan(spec, s)


def choose(spec: ModelSpec, s: Settings | None = None, alloc_conf: str | None = None) -> Choice:
    """The memory model of ``spec`` and the reserve strategy for ``s`` under ``alloc_conf`` (None: the formula;
    ``"auto"``: the allocator model under this process's ``PYTORCH_CUDA_ALLOC_CONF`` where it can run, else the
    formula with an ``info`` finding ``reserve_formula``; any other text: the allocator model under it).

    Raises:
        InvalidValue: ``alloc_conf`` is not allocator options.
        NotPlannable: ``alloc_conf`` asked for the allocator model of a spec without a config.json, or without
            torch and transformers installed.
    """
    if spec.generic:
        base: MemoryModel = TransformersModel(spec)
        why = f"{spec.model_type} is not a hand-written family: its memory is taken from {META}"
    elif spec.config_json:
        base = HandModel(spec, _load_from_transformers, f"{META} (where transformers is installed)")
        why = f"{spec.model_type} is a hand-written family"
    else:
        base, why = HandModel(spec), f"{spec.model_type} is a hand-written family (planned from bare numbers)"
    model = base
    if uses_headers(spec):
        model = CheckpointModel(base)
        why += f"; its weights are what the pre-quantized checkpoint stores ({spec.prequantized})"
    reserve, finding = _reserve(spec, s or Settings(), alloc_conf)
    return Choice(model, reserve, why + ("; reserve: the caching-allocator model" if reserve.replay else
                                         "; reserve: the formula"), finding)


def _reserve(spec: ModelSpec, s: Settings, alloc_conf: str | None) -> tuple[Reserve, Finding | None]:
    """:func:`choose`'s reserve strategy and its finding."""
    if alloc_conf is None:
        return Reserve(None), None
    if alloc_conf == AUTO:
        conf, config, why = auto_alloc_conf(spec, s)  # this process's PYTORCH_CUDA_ALLOC_CONF, parsed there
        return Reserve(conf, config), why
    if (setting := not_covered(s)) is not None:  # asked for, not possible: said, not skipped silently
        return Reserve(None), reserve_formula_finding(f"its tape does not cover {setting}")
    try:
        config = AllocatorConfig.parse(alloc_conf)
    except ValueError as e:
        raise InvalidValue("alloc_conf", alloc_conf, "PYTORCH_CUDA_ALLOC_CONF options, e.g. expandable_segments:True",
                           f"pass options the caching allocator takes ({e})") from None
    if not spec.config_json:
        raise NotPlannable("alloc_conf", alloc_conf, "a model with a config.json (the allocator tape is its forward)",
                           "plan a model folder, a catalog name or a Hub id, or leave alloc_conf out")
    if importlib.util.find_spec("transformers") is None:  # found, not imported: a hand family's tape needs no import
        raise NotPlannable("alloc_conf", alloc_conf or "default", "torch and transformers installed (the allocator "
                           "tape is transformers' forward replayed on meta tensors)",
                           f"{GPU_EXTRA_FIX}, or leave alloc_conf out (No module named 'transformers')")
    return Reserve(alloc_conf, config, asked=True), None
