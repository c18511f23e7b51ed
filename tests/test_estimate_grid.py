"""Every catalog architecture under every setting family: the estimate is complete, integral and consistent."""

import itertools

import pytest

from vramguard.catalog.models import MODELS
from vramguard.plan import estimate
from vramguard.resolve import resolve_model
from vramguard.settings import Settings
from vramguard.plan.choice import choose

GRID = list(itertools.product(["nf4", "int8", "bf16", "fp32"], ["eager", "sdpa", "flash_attention_2"],
                              [None, "int4"], ["dynamic", "static", "offloaded"]))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_setting_gives_integral_consistent_components(name):
    spec = resolve_model(name)
    prompt = min(2048, spec.max_position_embeddings // 2)
    for quant, attn, kv, cache in GRID:
        if kv == "int4" and cache != "dynamic":
            continue  # the quantized cache is a cache of its own (rejected by Settings)
        s = Settings(quant=quant, attn=attn, kv_dtype=kv, cache=cache, batch=2, prompt_tokens=prompt,
                     max_new_tokens=64, prefill_chunk=512)
        e = estimate(choose(spec).model, s)
        assert all(isinstance(v, int) and v >= 0 for v in e.components.values())
        assert sum(e.components.values()) == e.peak_allocated_bytes
        assert e.generate_device_bytes == e.peak_allocated_bytes + e.allocator_reserve_bytes + e.cuda_context_bytes
        load = e.load.peak_reserved_bytes + e.cuda_context_bytes if e.load else 0
        assert e.device_used_bytes == max(e.generate_device_bytes, load)
        assert e.weights.total_bytes <= e.peak_allocated_bytes


def test_more_tokens_never_need_less_memory():
    spec = resolve_model("gemma-2-9b")
    base = Settings(quant="nf4", attn="eager", prompt_tokens=1000, max_new_tokens=64)
    needs = [estimate(choose(spec).model, base.with_(prompt_tokens=p)).device_used_bytes for p in (500, 1000, 3000, 6000)]
    assert needs == sorted(needs)
