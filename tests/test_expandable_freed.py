"""Expandable segments after a freed model: ``get_free_block`` counts a free block as the size it can grow to
(``expandable_size``: its bytes plus the unmapped range right after it) and walks on in size order while the next
block can grow to less. With one unmapped range (a fresh process: the segment's end) that is "the block that can
grow counts as larger"; after a freed model there are two, and the walk decides. Checked against the H200 trace of
benchmarks/results/h200_freed_trace (Qwen2.5-7B bf16 loaded and freed, then NF4, expandable_segments:True)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from vramguard.memory.allocator import AllocatorConfig, CachingAllocator

MiB = 2**20
TRACE = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "h200_freed_trace" / "trace_freed.json.gz"


def _layout(a: CachingAllocator) -> list[tuple[int, int, str]]:
    seg = a._expandable[False]
    return [((b.addr - seg.addr) // MiB, b.size // MiB, b.state) for b in seg.blocks()][:-1]  # not the end


def test_a_free_block_before_an_inner_unmapped_range_counts_as_the_size_it_can_grow_to():
    """Pages of 20 MiB, offsets in MiB:
    a = 10 -> maps [0,20): a [0,10), free [10,20)
    b = 35 -> grows the free [10,20) by 2 pages: maps [20,60); b [10,45), free [45,60)
    c = 15 -> takes the free [45,60) whole
    d = 30 -> maps [60,100): d [60,90), free [90,100)
    free b, empty_cache -> the whole pages [20,40) of the free [10,45) are unmapped:
        a [0,10) | F1 free [10,20) | unmapped [20,40) | F2 free [40,45) | c | d | F3 free [90,100) | the end
    reserved 80 MiB. A request of 8 MiB: best fit is F1 (10 MiB; F3 ties at a higher address). F1 can grow to
    10 + 20 = 30 MiB, F3 to 10 MiB plus the segment's end: F3 can grow to more, so get_free_block stays on F1, and
    the request lands at [10,18). (Taking "a block that can grow" as larger than any other would move it to F3.)"""
    a = CachingAllocator(AllocatorConfig(expandable_segments=True))
    x = a.malloc(10 * MiB)
    b = a.malloc(35 * MiB)
    a.malloc(15 * MiB)
    a.malloc(30 * MiB)
    assert a.reserved_bytes == 100 * MiB
    a.free(b)
    a.empty_cache()
    assert a.reserved_bytes == 80 * MiB
    assert _layout(a) == [(0, 10, "used"), (10, 10, "free"), (20, 20, "unmapped"), (40, 5, "free"),
                          (45, 15, "used"), (60, 30, "used"), (90, 10, "free")]
    r = a.malloc(8 * MiB)
    assert (r.addr - x.addr) // MiB == 10
    assert a.reserved_bytes == 80 * MiB
    # the next 10 MiB goes to F3 (the only free block that holds it); then 12 MiB fits no free block: the
    # unmapped [20,40) and the 2 MiB free before it hold it, one page is mapped there
    assert (a.malloc(10 * MiB).addr - x.addr) // MiB == 90
    assert (a.malloc(12 * MiB).addr - x.addr) // MiB == 18
    assert a.reserved_bytes == 100 * MiB


@pytest.mark.skipif(not TRACE.exists(), reason="the H200 trace is not in this checkout")
def test_the_h200_trace_after_a_freed_model_replays_address_for_address():
    """The model's own load replay of Qwen2.5-7B bf16 (warm-up block, every tensor, the cuBLAS workspace), freed and
    emptied, leaves the segment the H200 recorded: the freed model's 15,225,323,520 B unmapped at the start and the
    workspace at 15,230,566,400 B. From there, every large request of the recorded trace (the NF4 load and its
    cases) lands at the recorded offset, and the large pool peaks at the recorded 20,132,659,200 B (SDPA, 16,384 x
    4; the whole process measured 20,208,156,672 B with the small pool)."""
    pytest.importorskip("transformers")
    from vramguard.introspect.alloc_replay import _load
    from vramguard.resolve import resolve_model
    from vramguard.settings import Settings
    a = CachingAllocator(AllocatorConfig(expandable_segments=True))
    for blk in _load(a, resolve_model("qwen2.5-7b"), Settings(quant="bf16")):
        a.free(blk)
    a.empty_cache()
    seg = a._expandable[False]
    assert [(b.addr - seg.addr, b.size, b.state) for b in seg.blocks()][:3] == [
        (0, 15_225_323_520, "unmapped"), (15_225_323_520, 5_242_880, "free"), (15_230_566_400, 33_554_432, "used")]
    d = json.load(gzip.open(TRACE, "rt"))
    base = min(s[0] for s in d["segments"])
    mapped = sum(s[1] for s in d["segments"])  # before the free: the recorded trace frees and unmaps it
    recorded, modelled, placed, wrong = [], [], {}, 0
    for action, addr, size in d["trace"]:  # its first frees and unmap are the bf16 model's (done above)
        if action == "oom":
            break  # the first case that ran out of memory on the H200 (the model has no cap here)
        large = addr - base < 1 << 37  # the large pool's segment (the small pool's lies elsewhere)
        if action == "alloc":
            placed[addr] = a.malloc(size)
            wrong += placed[addr].addr - seg.addr != addr - base
            if len(modelled) < len(recorded):  # the pages the H200 mapped for this request
                modelled.append(sum(b.size for b in seg.blocks() if b.state != "unmapped"))
        elif action == "free_completed" and addr in placed:
            a.free(placed.pop(addr))
        elif action == "segment_unmap" and large:  # torch.cuda.empty_cache between cases
            a.empty_cache()
            mapped -= size
        elif action == "segment_map" and large:
            mapped += size
            recorded.append(mapped)
    assert wrong == 0
    assert len(recorded) > 100 and modelled == recorded
    assert 20_132_659_200 in recorded
