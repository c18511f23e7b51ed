"""vramguard: know before you load, see what really runs, never crash with out-of-memory.

Library entry points return dataclasses; sizes are ints of bytes (:mod:`vramguard.units`).
"""

from vramguard.check import CheckReport, check
from vramguard.extras import defer_import_time_compiles
from vramguard.plan import Plan, estimate, plan
from vramguard.resolve import resolve_model
from vramguard.run.generate import GenerationInterrupted, GenerationResult, generate
from vramguard.runtime.load import LoadedModel, LoadReport, load_model, unload
from vramguard.settings import Settings

__all__ = ["CheckReport", "GenerationInterrupted", "GenerationResult", "LoadReport", "LoadedModel", "Plan", "Settings",
           "check", "estimate", "generate", "load_model", "plan", "resolve_model", "unload"]
__version__ = "0.1.0"

defer_import_time_compiles()  # bitsandbytes' and hqq's import-time torch.compile calls (vramguard.extras)
