"""Replay the H200 allocator traces kept in ``results/h200_reserved_misses/traces`` through the allocator model
(:mod:`vramguard.memory.allocator`), from the segments recorded where each trace starts:

* ``trace_*`` (a fresh ``gpu_edge.py`` process): from the segments after warm-up (``f*/edge.jsonl``); the trace's
  own allocations, and the plan's tape (:func:`vramguard.introspect.alloc_replay.generate_events`);
* ``matrix_*`` (``gpu_matrix.py``, large pool only): from the segments at the case's start, with new segments
  placed below the lowest (the model's rule) and at the addresses the driver gave them.

    python benchmarks/replay_trace.py
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from vramguard.memory.allocator import K_SMALL_SIZE, AllocatorConfig, CachingAllocator  # noqa: E402

HERE = os.path.join(os.path.dirname(__file__), "results", "h200_reserved_misses")
CAP = 24 << 30


def warm_segments(edge_jsonl: str) -> list:
    """The segments of a ``gpu_edge.py`` process after warm-up, as :meth:`CachingAllocator.from_segments` takes."""
    for line in open(edge_jsonl):
        r = json.loads(line)
        if r["kind"] == "warm":
            return [(s["address"], s["type"] == "small", [(b[0], b[1] == "a") for b in s["blocks"]])
                    for s in r["segments"]]
    raise ValueError(f"{edge_jsonl} has no warm record")


def replay(alloc: CachingAllocator, trace: list, large_only: bool = False) -> CachingAllocator:
    """Place the trace's allocations and frees (``[action, address, bytes]``) through ``alloc``."""
    live = {}
    for action, addr, size in trace:
        if action == "alloc" and not (large_only and size <= K_SMALL_SIZE):
            live[addr] = alloc.malloc(size)
        elif action == "free_completed" and addr in live:
            alloc.free(live.pop(addr))
    return alloc


def recorded_peak(start_reserved: int, trace: list) -> int:
    """The peak of reserved memory the trace's segment events give from ``start_reserved``."""
    res = peak = start_reserved
    for action, _addr, size in trace:
        res += size if action == "segment_alloc" else -size if action == "segment_free" else 0
        peak = max(peak, res)
    return peak


def matrix_case(path: str, at_recorded_addresses: bool, freed_before: bool = False) -> tuple[int, int]:
    """(the model's large-pool peak replaying a ``matrix_*`` trace, the trace's own large-pool peak); new segments
    below the lowest (a fresh process), above the highest (``freed_before``) or at the recorded addresses."""
    d = json.load(gzip.open(path, "rt"))
    segs = [(addr, False, [(size, state == "a") for _, size, state in blocks]) for addr, _, blocks in d["segments"]]
    a = CachingAllocator.from_segments(AllocatorConfig(allowed_bytes=CAP, freed_before=freed_before), segs)
    start = a.reserved_bytes
    if at_recorded_addresses:
        a.segment_addresses = iter([addr for action, addr, _ in d["trace"] if action == "segment_alloc"])
    return replay(a, d["trace"], large_only=True).peak_reserved_bytes, recorded_peak(start, d["trace"])


def fresh_case(trace_path: str, edge_jsonl: str) -> int:
    """The model's peak reserved replaying a fresh process's trace from its post-warm-up segments."""
    a = CachingAllocator.from_segments(AllocatorConfig(allowed_bytes=CAP), warm_segments(edge_jsonl))
    return replay(a, json.load(gzip.open(trace_path, "rt"))).peak_reserved_bytes


FRESH = {"llama-3.1-8b_nf4": "f1", "qwen2.5-7b_nf4": "f2", "phi-3-mini-128k_nf4": "f3", "llama-2-7b_bf16": "f4"}


def fresh_measured(name: str) -> tuple[int, str]:
    """(measured peak reserved, edge.jsonl) of a ``trace_TAG_N_...`` file: the N-th run of its process."""
    tag, rest = name[len("trace_"):].split("_default_")
    edge = os.path.join(HERE, FRESH[tag], "edge.jsonl")
    runs = [r for r in map(json.loads, open(edge)) if r["kind"] == "run"]
    return runs[int(rest.split("_")[0]) - 1]["peak_reserved"], edge


def main() -> None:
    for path in sorted(glob.glob(os.path.join(HERE, "traces", "trace_*_ok.json.gz"))):
        name = os.path.basename(path)
        measured, edge = fresh_measured(name)
        print(f"{name:58} measured {measured:>15,}  trace replayed {fresh_case(path, edge):>15,}")
    for path in sorted(glob.glob(os.path.join(HERE, "traces", "matrix_*.json.gz"))):
        below, recorded = matrix_case(path, False)
        at, _ = matrix_case(path, True)
        above, _ = matrix_case(path, False, freed_before=True)
        print(f"{os.path.basename(path):58} large pool: recorded {recorded:>15,}  at its addresses {at:>15,}  "
              f"new segments below {below:>15,}  above {above:>15,}")


if __name__ == "__main__":
    main()
