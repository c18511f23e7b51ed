"""A live-set tape: replays the allocations of a forward pass in program order and keeps the peak.

Each tensor is allocated under a name with a component label (``activations``, ``attention``, ``kv_cache``,
``logits``...) and freed when the Python code would drop its last reference. ``transient`` adds bytes that live
only inside one call (a kernel's workspace, a dequantized weight). The peak keeps the live bytes by component at
that moment, so the components of a plan always add up to its peak exactly.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from vramguard.memory.weights import rounded


@dataclass
class Tape:
    """Live bytes by component; ``peak_bytes`` and ``peak_components`` at the largest moment seen."""

    live: dict[str, tuple[str, int]] = field(default_factory=dict)
    live_bytes: int = 0
    peak_bytes: int = 0
    peak_components: dict[str, int] = field(default_factory=dict)
    peak_at: str = ""
    largest_alloc: int = 0

    def _check(self, at: str, extra: dict[str, int] | None = None) -> None:
        total = self.live_bytes + sum((extra or {}).values())
        if total > self.peak_bytes:
            self.peak_bytes = total
            comp: Counter[str] = Counter()
            for label, nbytes in self.live.values():
                comp[label] += nbytes
            for label, nbytes in (extra or {}).items():
                comp[label] += nbytes
            self.peak_components = dict(comp)
            self.peak_at = at

    def alloc(self, name: str, nbytes: int, label: str, block: int | None = None) -> None:
        """Allocate ``name`` of ``nbytes`` (rounded to the allocator's 512 B) under ``label``.

        ``block``: for an aggregate of many tensors (the KV cache of all layers), the largest single tensor.
        """
        nbytes = rounded(max(nbytes, 0)) if nbytes > 0 else 0
        if name in self.live:
            self.free(name)
        self.live[name] = (label, nbytes)
        self.live_bytes += nbytes
        self.largest_alloc = max(self.largest_alloc, nbytes if block is None else block)
        self._check(name)

    def free(self, *names: str) -> None:
        for name in names:
            if name in self.live:
                self.live_bytes -= self.live.pop(name)[1]

    def transient(self, at: str, **by_label: int) -> None:
        """Bytes alive only during one call, by label (e.g. ``activations=dequantized_weight_bytes``)."""
        rounded_by_label = {k: rounded(v) for k, v in by_label.items() if v > 0}
        if rounded_by_label:
            self.largest_alloc = max(self.largest_alloc, max(rounded_by_label.values()))
        self._check(at, rounded_by_label)
