"""vramguard: know before you load, see what really runs, never crash with out-of-memory.

Library entry points return dataclasses; sizes are ints of bytes (:mod:`vramguard.units`).
"""

from vramguard.plan import Plan, estimate, plan
from vramguard.resolve import resolve_model
from vramguard.settings import Settings

__all__ = ["Plan", "Settings", "estimate", "plan", "resolve_model"]
__version__ = "0.1.0"
