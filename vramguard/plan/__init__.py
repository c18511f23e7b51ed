"""``plan``: memory of a transformers inference run, by component, before anything is loaded.

Parts: :mod:`~vramguard.plan.choice` (where the figures come from: the memory model and the reserve, chosen once),
:mod:`~vramguard.plan.estimator` (the memory estimate of one run and its fit on one card),
:mod:`~vramguard.plan.solve` (the largest prompt, new tokens and batch; the ranked changes),
:mod:`~vramguard.plan.findings` (what will fail, waste memory or change what runs) and
:mod:`~vramguard.plan.planner` (:func:`plan`, which puts them together).
"""

from vramguard.plan.choice import Choice, choose
from vramguard.plan.estimator import (COMPONENT_ORDER, CardVerdict, Change, Finding, MemoryEstimate, Plan, estimate,
                                      need_bytes, verdict)
from vramguard.plan.planner import check_context, plan

__all__ = ["COMPONENT_ORDER", "CardVerdict", "Change", "Choice", "Finding", "MemoryEstimate", "Plan",
           "check_context", "choose", "estimate", "need_bytes", "plan", "verdict"]
