"""Decode steps placed with the small pool skipped while it cycles (vramguard.memory.decode_steps) against placing
every event of every step: the allocator must end in the same state, with the same peaks, request count and
out-of-memory point, for caps that never bind, that make release_cached_blocks run mid-cycle, and that end in OOM."""

import pytest

from vramguard.memory.allocator import AllocatorConfig, CachingAllocator
from vramguard.memory.decode_steps import DecodeSteps, Placer

MiB = 1 << 20
GiB = 1 << 30


def _tapes(k0: int, row: int):
    """A prefill leaving a KV tensor of ``k0`` bytes (key 1) and last logits (key 2), then two decode steps: an
    activation (4,096 B, freed in the step), two 1 MiB temporaries (the second opens a small segment of its own and
    leaves it entirely free), the KV tensor grown by ``row`` bytes (the previous one freed after), the next logits
    (1,000 B, freed in the next step) and a 70,000 B temporary."""
    head = [(1, k0), (2, 512)]
    step1 = [(10, 4096), (14, MiB), (15, MiB), (15, -1), (14, -1), (11, k0 + row), (1, -1), (12, 1000), (2, -1),
             (13, 70000), (10, -1), (13, -1)]
    step2 = [(20, 4096), (24, MiB), (25, MiB), (25, -1), (24, -1), (21, k0 + 2 * row), (11, -1), (22, 1000),
             (12, -1), (23, 70000), (20, -1), (23, -1)]
    return head, step1, step2


def _placed(conf: AllocatorConfig, n: int, shortcut: bool, tapes=None):
    head, step1, step2 = tapes or _tapes(30 * MiB, 64 * 1024)
    alloc = CachingAllocator(conf)
    placer, steps = Placer(alloc), DecodeSteps.from_steps(step1, step2, n)
    if placer.place(head + step1 + step2):
        if shortcut:
            placer.decode(steps)
        else:
            placer.place([e for j in range(n) for e in steps.events(j)])
    state = (alloc.peak_allocated_bytes, alloc.peak_reserved_bytes, alloc.reserved_bytes, alloc.allocated_bytes,
             alloc.requests, alloc.oom, placer.segments_at_peak, alloc.segment_sizes())
    return state, placer


def test_the_steps_follow_the_tape_of_steps_1_and_2():
    _, step1, step2 = _tapes(30 * MiB, 64 * 1024)
    steps = DecodeSteps.from_steps(step1, step2, 2)
    # allocations of step 3 are keys 26.. (one past step 2's largest key, 25), sizes grown by one more step's growth
    assert steps.events(0)[:6] == [(26, 4096), (27, MiB), (28, MiB), (28, -1), (27, -1), (29, 30 * MiB + 3 * 65536)]
    assert steps.events(0)[6] == (21, -1)  # the KV tensor of step 2
    assert steps.events(1)[6] == (29, -1)  # ... and in step 4 that of step 3
    with pytest.raises(ValueError, match="differ in structure"):
        DecodeSteps.from_steps(step1, [e for e in step2 if e != (23, 70000)], 1)


@pytest.mark.parametrize("cap_mib", [None, 200, 120, 90])
@pytest.mark.parametrize("expandable, freed_before", [(False, False), (True, False), (False, True)])
def test_skipping_the_small_pool_changes_nothing(cap_mib, expandable, freed_before):
    conf = AllocatorConfig(expandable, allowed_bytes=None if cap_mib is None else cap_mib * MiB,
                           freed_before=freed_before)
    short, placer = _placed(conf, 400, True)
    full, _ = _placed(conf, 400, False)
    assert short == full
    if cap_mib is None:  # the small pool repeats from the first steps on: at most 4 of 400 steps placed in full
        assert placer.skipped_steps >= 396
    if (cap_mib, expandable, freed_before) == (200, False, False):  # the cap makes release_cached_blocks free the 1 MiB segment mid-step
        assert placer.placed_in_full > 0 and placer.skipped_steps > 300


def test_a_growing_small_tensor_breaks_the_cycle_only_where_its_rounded_size_changes():
    # the mask of generate grows by 8 B a step: its 512 B block changes every 64 steps
    head = [(1, 512)]
    step1 = [(10, 4096 + 8), (1, -1), (11, 600), (10, -1)]
    step2 = [(20, 4096 + 16), (10, -1), (21, 600), (11, -1)]
    conf = AllocatorConfig()
    short, placer = _placed(conf, 300, True, (head, step1, step2))
    assert short == _placed(conf, 300, False, (head, step1, step2))[0]
    assert 200 < placer.skipped_steps < 300


def test_a_real_decode_tape_is_replayed_the_same(tmp_path):
    from tests.conftest import save_tiny_llama
    from vramguard.introspect import alloc_replay
    from vramguard.resolve import resolve_model
    from vramguard.settings import Settings
    spec = resolve_model(str(save_tiny_llama(tmp_path, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
                                             max_position_embeddings=2048)))
    s = Settings(quant="bf16", attn="sdpa", prompt_tokens=300, max_new_tokens=200)
    for cap in (None, 12 * MiB):
        conf = AllocatorConfig(allowed_bytes=cap)
        r = alloc_replay.replay_generate(spec, s, conf)
        alloc = CachingAllocator(AllocatorConfig())
        alloc_replay._load(alloc, spec, s)
        base, alloc.config = alloc.reserved_bytes, conf
        alloc.peak_reserved_bytes, alloc.peak_allocated_bytes = alloc.reserved_bytes, alloc.allocated_bytes
        placer = Placer(alloc)
        placer.place(alloc_replay.generate_events(spec, s))
        assert (r.peak_allocated_bytes, r.peak_reserved_bytes, r.base_reserved_bytes, r.segments_at_peak, r.oom) == \
            (alloc.peak_allocated_bytes, alloc.peak_reserved_bytes, base, placer.segments_at_peak, alloc.oom)
