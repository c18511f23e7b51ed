"""``profile`` and ``fit``: real runs measured beside the plan.

Parts: :mod:`~vramguard.profile.profiler` (one measured run beside the plan),
:mod:`~vramguard.profile.fit` (the largest value that really completes under a budget),
:mod:`~vramguard.profile.measured_run` (the one measured ``generate`` call both share) and
:mod:`~vramguard.profile.timeline` (the pictures).
"""

from vramguard.profile.profiler import ProfileReport, profile

__all__ = ["ProfileReport", "profile"]
