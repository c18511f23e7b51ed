"""The finding type: something the user should know about a run, with the memory at stake and the fix. Plans
(:mod:`vramguard.plan.findings`) and the Hub's pre-quantized checkpoints (:mod:`vramguard.hub.prequant`) report
them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Finding:
    """Something the user should know: ``level`` is info / warn / fail; ``bytes`` the memory at stake, if any."""

    code: str
    level: str
    message: str
    fix: str | None = None
    bytes: int | None = None
