"""The shortcuts of a cold plan's caching-allocator search give the figures of the plain computation: the card
searches forked into a second process, replays that continue a copy of the loaded state, prefix replays that do
not build the later decode steps, rescaled tapes with their constant sizes kept as they are, and the later decode
steps' tapes from a compiled pattern."""

from __future__ import annotations

import os
import sys

import pytest

from vramguard.introspect import alloc_replay
from vramguard.memory.allocator import AllocatorConfig, CachingAllocator
from vramguard.memory.decode_steps import ALLOC, FREE_PREV, FREE_SAME, DecodeSteps, Placer
from vramguard.plan import allocator as plan_allocator
from vramguard.resolve import resolve_model
from vramguard.settings import Settings

MiB = 1 << 20


def _plan(monkeypatch, tmp_path, fork: bool, model: str, settings: Settings, **kw):
    """A plan with empty disk caches of its own, the card searches forked or not."""
    from vramguard.plan import planner
    folder = tmp_path / ("fork" if fork else "one")
    monkeypatch.setenv("VRAMGUARD_CACHE_DIR", str(folder))
    monkeypatch.setenv("VRAMGUARD_PLAN_CACHE", "0")
    monkeypatch.setenv("VRAMGUARD_TAPE_CACHE", str(folder / "tapes"))
    monkeypatch.setattr(plan_allocator, "FORK_SEARCHES", fork)
    monkeypatch.setattr(plan_allocator, "_fork_pays", lambda n, torch_ok=False: fork and n >= 2)  # torch or not
    return planner.plan(model, settings, alloc_conf="", **kw)


@pytest.mark.parametrize("model,settings,kw", [
    ("llama-3.2-1b", Settings(prompt_tokens=2048, max_new_tokens=8), {}),
    ("qwen2.5-0.5b", Settings(prompt_tokens=1024, max_new_tokens=8, quant="nf4"), {"vram": "6GiB"}),
    ("qwen2.5-0.5b", Settings(prompt_tokens=512, max_new_tokens=3, quant="int8"), {}),
])  # two plans each, about a second: the one test that a plan of forked searches is the plan of one process
def test_forked_card_searches_give_the_plan_of_one_process(monkeypatch, tmp_path, model, settings, kw):
    one = _plan(monkeypatch, tmp_path, False, model, settings, **kw)
    forked = _plan(monkeypatch, tmp_path, True, model, settings, **kw)
    assert [c.max_prompt_tokens for c in one.cards] == [c.max_prompt_tokens for c in forked.cards]
    assert any(c.max_prompt_tokens for c in one.cards)
    assert one == forked


@pytest.mark.parametrize("freed", [False, True], ids=["fresh", "freed-before"])
def test_the_estimate_replay_started_ahead_gives_the_plan_of_one_process(monkeypatch, tmp_path, freed):
    """A generic plan's estimate replays (one per segment layout), forked before the estimate and the card searches
    (torch imported: meta tensors only), give the same plan as the one computed in line; the child's replays are
    the ones taken."""
    import json

    from archs import ARCHS
    from transformers import AutoConfig
    folder = tmp_path / "deepseek_v2"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(AutoConfig.for_model("deepseek_v2", **ARCHS["deepseek_v2"])
                                                   .to_dict()))
    taken, traced = [], []
    take = plan_allocator.Ahead.take
    monkeypatch.setattr(plan_allocator.Ahead, "take", lambda self, d: taken.append(d) or take(self, d))
    for cached in (alloc_replay._stretch_events, alloc_replay._cached_events, alloc_replay._loaded):
        cached.cache_clear()
    tape = alloc_replay._cached_events  # read from disk or traced: each forward's tape
    monkeypatch.setattr(alloc_replay, "_cached_events", lambda *a: traced.append(a) or tape(*a))
    s = Settings(prompt_tokens=256, max_new_tokens=8)
    monkeypatch.setattr(plan_allocator, "_can_fork", lambda: True)
    ahead = _plan(monkeypatch, tmp_path, True, str(folder), s, vram="12GiB", freed_before=freed)
    assert [d.freed_before for d in taken] == ([False, True] if freed else [False])
    assert traced == [] and alloc_replay._HANDED == {}  # the child traced the prompt's stretch and handed it over
    monkeypatch.setattr(plan_allocator, "_can_fork", lambda: False)
    n = len(taken)
    one = _plan(monkeypatch, tmp_path, False, str(folder), s, vram="12GiB", freed_before=freed)
    assert len(taken) == n
    assert {d.allowed_bytes for d in taken} == {one.cards[0].usable_bytes - one.estimate.cuda_context_bytes}
    assert ahead == one and one.estimate.allocator is not None and one.cards[0].max_prompt_tokens
    assert (one.estimate.freed_layout_reserved_bytes is not None) is freed


def test_a_failed_child_is_done_again_here():
    parent = os.getpid()

    def work(x):
        if os.getpid() != parent:
            raise RuntimeError("the child fails")
        return x * 2
    child = plan_allocator._Forked([lambda x=x: work(x) for x in (1, 2, 3)])
    assert child.result() == [2, 4, 6]
    ok = plan_allocator._Forked([lambda: os.getpid()])
    assert ok.result() != [parent]  # computed in the child


def test_close_ends_a_child_whose_result_is_not_taken():
    import time
    child = plan_allocator._Forked([lambda: time.sleep(60)])
    pid = child.pid
    child.close()
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, 0)


def test_a_child_is_forked_beside_the_progress_line_only_among_threads(monkeypatch):
    """Threads copy no state into a forked child, and a lock one holds stays held there: a plan forks beside the
    progress line's threads, which draw under locks held across a fork, and beside no other."""
    import io
    import threading
    import time

    from vramguard.cli import common

    class Tty(io.StringIO):
        def isatty(self):
            return True
    two = hasattr(os, "sched_getaffinity") and len(os.sched_getaffinity(0)) >= 2

    def stray() -> list:  # threads of earlier tests in this process, if any
        return [t for t in threading.enumerate() if t is not threading.main_thread() and not getattr(t, "fork_safe",
                                                                                                     False)]
    stop = threading.Event()
    other = threading.Thread(target=stop.wait, daemon=True)
    other.start()
    try:
        assert not plan_allocator._can_fork()
        other.fork_safe = True  # type: ignore[attr-defined]
        assert plan_allocator._can_fork() is (two and not stray())
    finally:
        stop.set()
        other.join()
    monkeypatch.setattr("sys.stderr", Tty())
    before = set(threading.enumerate())
    with common.working("planning", delay_s=0):
        for _ in range(200):  # the timer has started rich's spinner
            if len(common._DRAWING) == 2:
                break
            time.sleep(0.01)
        started = set(threading.enumerate()) - before
        assert len(common._DRAWING) == 2 and started and all(t.fork_safe for t in started)
        assert plan_allocator._can_fork() is (two and not stray())
        assert plan_allocator._Forked([lambda: os.getpid()]).result() != [os.getpid()]
    assert common._DRAWING == [] and "planning" in sys.stderr.getvalue()


def _spec(name: str):
    return resolve_model(name)


@pytest.mark.parametrize("name,s", [
    ("llama-3.2-1b", Settings(prompt_tokens=3000, max_new_tokens=40)),
    ("qwen2.5-0.5b", Settings(prompt_tokens=777, max_new_tokens=9, quant="nf4")),
    ("mistral-7b-v0.3", Settings(prompt_tokens=1500, max_new_tokens=5, quant="int8")),
])
def test_a_prefix_replay_places_the_head_of_the_full_tape(name, s):
    spec = _spec(name)
    head, steps, note = alloc_replay._decode_tape(spec, s, True)
    short = alloc_replay._decode_tape(spec, s, True, later_steps=False)
    assert steps is not None and short == (head, None, note)
    for cap in (None, 3 << 30):
        conf = AllocatorConfig(allowed_bytes=cap)
        alloc = CachingAllocator(AllocatorConfig())
        alloc_replay._load(alloc, spec, s)
        base, alloc.config = alloc.reserved_bytes, conf
        alloc.peak_reserved_bytes, alloc.peak_allocated_bytes = alloc.reserved_bytes, alloc.allocated_bytes
        placer = Placer(alloc)
        placer.place(head)  # the plain computation: the load replayed, the whole head placed
        r = alloc_replay._replay(spec, s, conf, True, False)
        assert (r.peak_allocated_bytes, r.peak_reserved_bytes, r.base_reserved_bytes, r.segments_at_peak, r.oom) \
            == (alloc.peak_allocated_bytes, alloc.peak_reserved_bytes, base, placer.segments_at_peak, alloc.oom)
        assert alloc_replay.loaded_reserved_bytes(spec, s, conf) == base


def _layout(a: CachingAllocator) -> tuple:
    return (a.allocated_bytes, a.reserved_bytes, a.peak_allocated_bytes, a.peak_reserved_bytes, a.requests,
            a.small_segments_opened, [(s.addr, s.small, [(b.addr, b.size, b.state) for b in s.blocks()])
                                      for s in a.segments],
            {k: [(n, x, b.addr, b.size) for n, x, b in v] for k, v in a._free.items()})


@pytest.mark.parametrize("conf", [AllocatorConfig(), AllocatorConfig(expandable_segments=True),
                                  AllocatorConfig(max_split_size=64 * MiB), AllocatorConfig(freed_before=True)])
def test_a_copied_state_continues_as_the_original(conf):
    import random
    rng = random.Random(7)
    a = CachingAllocator(conf)
    live = [a.malloc(rng.choice([300, 4096, 700_000, 3 * MiB, 25 * MiB, 90 * MiB])) for _ in range(200)]
    for b in live[::3]:
        a.free(b)
    b_ = a.copy()
    assert _layout(a) == _layout(b_)
    mine = {id(x) for s in a.segments for x in s.blocks()}
    assert not mine & {id(x) for s in b_.segments for x in s.blocks()}  # nothing shared
    tape = [rng.choice([512, 9000, 1 * MiB, 5 * MiB, 40 * MiB]) for _ in range(300)]
    for alloc in (a, b_):
        held = [alloc.malloc(n) for n in tape]
        for h in held[::2]:
            alloc.free(h)
        alloc.empty_cache()
    assert _layout(a) == _layout(b_)


def test_compiled_decode_tapes_equal_the_pattern():
    step1 = [(1, 1000), (2, 5 * MiB), (2, -1), (3, 64), (9, -1)]
    step2 = [(4, 1008), (5, 5 * MiB + 2048), (5, -1), (6, 64), (1, -1), (3, -1)]
    steps = DecodeSteps.from_steps(step1, step2, 6)
    for j in range(1, steps.n):
        base, n = steps.first_key + j * steps.allocs, steps.allocs
        want = [(base + i, steps.size(j, i)) if op == ALLOC else (base + i, -1) if op == FREE_SAME
                else (base - n + i, -1) if op == FREE_PREV else (i, -1) for op, i in steps.pattern]
        assert steps.events(j) == want


def test_rescaled_tapes_equal_the_replayed_ones():
    spec = _spec("llama-3.2-1b")
    key = Settings(prompt_tokens=1, max_new_tokens=1, quant="nf4")
    for prompt in (400, 2049, 7777):
        assert alloc_replay._rescaled_events(spec.config_json, spec.name, key, prompt, 3) == \
            alloc_replay._cached_events(spec.config_json, spec.name, key, prompt, 3)


def test_side_by_side_runs_the_first_in_a_child_with_one_thread_beside_torch(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(plan_allocator, "_can_fork", lambda: True)
    parent = os.getpid()
    first, second = plan_allocator.side_by_side(
        lambda: (os.getpid(), torch.get_num_threads(), float(torch.ones(3).sum())), lambda: os.getpid())
    assert first[0] != parent and first[1:] == (1, 3.0) and second == parent
    monkeypatch.setattr(plan_allocator, "_can_fork", lambda: False)
    assert plan_allocator.side_by_side(lambda: os.getpid(), lambda: 2) == (parent, 2)  # one after the other
