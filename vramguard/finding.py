"""The finding type: something the user should know about a run, with the memory at stake and the fix. Plans
(:mod:`vramguard.plan.findings`), ``check`` (:mod:`vramguard.check.rules`) and the Hub's pre-quantized
checkpoints (:mod:`vramguard.hub.prequant`) report them."""

from __future__ import annotations

from dataclasses import dataclass

LEVELS = ("ok", "info", "warn", "fail")


@dataclass(frozen=True)
class Finding:
    """Something the user should know.

    ``code`` names the rule (``fa2_compute_capability``, ``ram_vs_shard``); ``level`` is one of :data:`LEVELS`
    (``ok`` only where a check passed); ``message`` the reason, ``fix`` what to change, if anything; ``bytes`` the
    memory at stake (int bytes), if any; ``value`` the value a check found (``"float32 (checkpoint stores
    bf16)"``), None where the finding is no reading of one value."""

    code: str
    level: str
    message: str
    fix: str | None = None
    bytes: int | None = None
    value: str | None = None
