"""Every catalog architecture under every setting family: the estimate is complete, integral and consistent."""

import itertools

import pytest

from vramguard.catalog.models import MODELS
from vramguard.plan import estimate
from vramguard.resolve import resolve_model
from vramguard.settings import Settings
from vramguard.plan.choice import choose

GRID = [(quant, attn, kv, cache) for quant, attn, kv, cache in itertools.product(
    ["nf4", "int8", "bf16", "fp32"], ["eager", "sdpa", "flash_attention_2"], [None, "int4"],
    ["dynamic", "static", "offloaded"]) if not (kv == "int4" and cache != "dynamic")]  # int4 is a cache of its own
SHARES = 4  # the grid's settings of each (quant, attn) pair: None with three caches, and the int4 cache
NAMES = sorted(MODELS)


@pytest.mark.parametrize("name", NAMES)
def test_every_setting_gives_integral_consistent_components(name):
    """Each catalog model under every weight format and attention, with one of the four KV cache settings in turn
    (model i takes the i-th mod 4): every point of the grid on several models, every model on every format and
    attention."""
    spec = resolve_model(name)
    prompt = min(2048, spec.max_position_embeddings // 2)
    turn = NAMES.index(name) % SHARES
    for quant, attn, kv, cache in GRID[turn::SHARES]:
        s = Settings(quant=quant, attn=attn, kv_dtype=kv, cache=cache, batch=2, prompt_tokens=prompt,
                     max_new_tokens=64, prefill_chunk=512)
        e = estimate(choose(spec).model, s)
        assert all(isinstance(v, int) and v >= 0 for v in e.components.values())
        assert sum(e.components.values()) == e.peak_allocated_bytes
        assert e.generate_device_bytes == e.peak_allocated_bytes + e.allocator_reserve_bytes + e.cuda_context_bytes
        load = e.load.peak_reserved_bytes + e.cuda_context_bytes if e.load else 0
        assert e.device_used_bytes == max(e.generate_device_bytes, load)
        assert e.weights.total_bytes <= e.peak_allocated_bytes


def test_the_grid_shares_cover_every_setting_and_each_model_every_format_and_attention():
    assert len(GRID) == 48 and len(NAMES) >= SHARES
    for turn in range(SHARES):
        assert {(q, a) for q, a, _, _ in GRID[turn::SHARES]} == {(q, a) for q, a, _, _ in GRID}
    assert set().union(*(GRID[t::SHARES] for t in range(SHARES))) == set(GRID)


def test_more_tokens_never_need_less_memory():
    spec = resolve_model("gemma-2-9b")
    base = Settings(quant="nf4", attn="eager", prompt_tokens=1000, max_new_tokens=64)
    needs = [estimate(choose(spec).model, base.with_(prompt_tokens=p)).device_used_bytes for p in (500, 1000, 3000, 6000)]
    assert needs == sorted(needs)
