"""The allocator model over a whole ``gpu_matrix.py`` process, as the benchmark ran it: the first model's load
(bf16), the warm-up's cuBLAS workspace, that model freed and ``torch.cuda.empty_cache()``, then the next model's
load and its case. A plan does not know the history of the process it runs in; this replay does, and shows how
far the model follows the H200 when it does (benchmarks/README.md, "After a freed model").

With expandable segments the freed model's pages are unmapped in place, below the workspace that stays: the next
model's blocks fill that range from its low end, and where a request does not fit the rest of it, it goes past the
workspace (``get_free_block``'s ``expandable_size``, ``try_allocate_expandable_block``). Without expandable
segments the next segments' addresses are the driver's: the replay places them upwards (the plan's upward
layout), so it is only as exact as that layout.
"""

from __future__ import annotations

from functools import lru_cache

from vramguard.introspect.alloc_replay import _load, generate_events
from vramguard.memory.allocator import AllocatorConfig, CachingAllocator
from vramguard.resolve import resolve_model
from vramguard.settings import Settings


def _place(alloc: CachingAllocator, events: list[tuple[int, int]]) -> None:
    """Place a tape (``(key, bytes)`` / ``(key, -1)``) and free what it leaves."""
    live = {}
    for key, nbytes in events:
        if nbytes < 0:
            alloc.free(live.pop(key))
        else:
            live[key] = alloc.malloc(nbytes)
    for b in live.values():
        alloc.free(b)


@lru_cache(maxsize=8)
def _after_first(arch: str, conf: str) -> tuple:
    """The allocator after the first model (bf16) was loaded, warmed up and freed; not to be changed (copied)."""
    spec = resolve_model(arch)
    a = CachingAllocator(AllocatorConfig.parse(conf, None))
    for b in _load(a, spec, Settings(quant="bf16")):
        a.free(b)
    a.empty_cache()
    return a, spec


def peak_reserved(arch: str, conf: str, s: Settings) -> int:
    """Peak reserved bytes of case ``s`` in a process that loaded and freed ``arch`` in bf16 first."""
    import copy
    base, spec = _after_first(arch, conf)
    a = copy.deepcopy(base)
    _load(a, spec, s, workspace=False)
    a.peak_reserved_bytes = a.reserved_bytes
    _place(a, generate_events(spec, s))
    return a.peak_reserved_bytes
