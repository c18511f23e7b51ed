"""Plans for a process that has given a model's memory back to CUDA before (``plan(..., freed_before=True)``):
cudaMalloc may place new segments above the older ones there, or below them as in a fresh process; the plan
replays both layouts and judges each card on the worse."""

import sys
import types

import pytest

from vramguard.units import GiB
from vramguard.settings import Settings

MiB = 1 << 20
S = Settings(quant="nf4", attn="eager", prompt_tokens=4096, max_new_tokens=64)


def test_llama31_8b_after_a_freed_model_plans_both_layouts_the_h200_measured():
    """Llama-3.1-8B NF4 eager 4,096 + 64 under 24 GiB. The H200 measured 12,490,637,312 and 12,492,734,464 B of
    peak reserved in the two matrix processes that had freed their bf16 model (results/h200_matrix,
    results/h200_reserved_misses), and 14,640,218,112 B in a fresh process (results/h200_reserved_misses/f1): the
    upward layout's 12,492,734,464 B is the first, the fresh layout's 14,640,218,112 B the second. The card's need
    is the worse layout's, so the verdict is the fresh process's."""
    from vramguard.plan import plan
    fresh = plan("llama-3.1-8b", S, vram="24GiB", solve=False, freed_before=False)
    freed = plan("llama-3.1-8b", S, vram="24GiB", solve=False, freed_before=True)
    assert fresh.estimate.peak_reserved_bytes == freed.estimate.peak_reserved_bytes == 14_640_218_112
    assert fresh.estimate.freed_layout_reserved_bytes is None
    assert freed.estimate.freed_layout_reserved_bytes == 12_492_734_464
    assert freed.cards[0].need_bytes == fresh.cards[0].need_bytes and freed.cards[0].fits
    f = next(f for f in freed.findings if f.code == "freed_before")
    assert f.level == "info" and "11.63 GiB" in f.message and "13.63 GiB" in f.message
    assert not any(f.code == "freed_before" for f in fresh.findings)
    assert freed.estimate.fresh_layout_reserved_bytes == 14_640_218_112
    assert "the plan is a fresh process's" in f.message and f.fix is None


def test_where_the_upward_layout_reserves_more_the_plan_needs_that_and_says_by_how_much():
    """Llama-3.1-8B with the default settings: the upward layout reserves one 2 MiB small segment more than the
    fresh one (6,033,506,304 B against 6,031,409,152 B), so a freed-before plan needs 2 MiB more."""
    from vramguard.plan import plan
    fresh = plan("llama-3.1-8b", vram="24GiB", solve=False, freed_before=False)
    freed = plan("llama-3.1-8b", vram="24GiB", solve=False, freed_before=True)
    e = freed.estimate
    assert (e.fresh_layout_reserved_bytes, e.freed_layout_reserved_bytes) == (6_031_409_152, 6_033_506_304)
    assert e.peak_reserved_bytes == 6_033_506_304 == fresh.estimate.peak_reserved_bytes + 2 * MiB
    assert freed.cards[0].need_bytes == fresh.cards[0].need_bytes + 2 * MiB
    f = next(f for f in freed.findings if f.code == "freed_before")
    assert "the upward layout, the larger by 2.00 MiB" in f.message and f.bytes == 2 * MiB and "fresh process" in f.fix


def test_the_worse_layout_decides_each_card():
    from vramguard.catalog.gpus import GPUS
    from vramguard.plan.allocator import _worse
    from vramguard.plan.estimator import CardVerdict
    g = GPUS["rtx-4090"]
    up = CardVerdict(g, 24 * GiB, 20 * GiB, True, 4 * GiB, max_prompt_tokens=9000)
    down = CardVerdict(g, 24 * GiB, 22 * GiB, True, 2 * GiB, max_prompt_tokens=9500)
    w = _worse(up, down)
    assert (w.need_bytes, w.headroom_bytes, w.max_prompt_tokens) == (22 * GiB, 2 * GiB, 9000)
    short = CardVerdict(g, 24 * GiB, 25 * GiB, False, -GiB, max_prompt_tokens=None)
    assert _worse(up, short) is short and _worse(short, down) is short


def _torch(initialized: bool, freed: int):
    cuda = types.SimpleNamespace(is_initialized=lambda: initialized, device_count=lambda: 2,
                                 memory_stats=lambda i: {"reserved_bytes.all.freed": freed if i == 1 else 0})
    return types.SimpleNamespace(cuda=cuda)


@pytest.mark.parametrize("initialized, freed, expected", [(True, 2 * GiB, True), (True, 132 * MiB, False),
                                                         (False, 2 * GiB, False)])
def test_this_process_counts_as_freed_before_once_its_allocator_gave_back_a_gib(monkeypatch, initialized, freed,
                                                                              expected):
    """``torch.cuda.memory_stats()["reserved_bytes.all.freed"]`` of any GPU: 2 GiB (a deleted model) counts, the
    132 MiB a fresh process's warm-up released on the H200 does not; without CUDA initialized nothing is read."""
    from vramguard.plan.allocator import process_freed_memory
    monkeypatch.setitem(sys.modules, "torch", _torch(initialized, freed))
    assert process_freed_memory() is expected


def test_without_torch_imported_the_process_has_freed_nothing(monkeypatch):
    from vramguard.plan.allocator import process_freed_memory
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    assert process_freed_memory() is False


TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=300, max_position_embeddings=512)


@pytest.mark.parametrize("alloc_conf, says", [(None, "reserve formula's"),
                                              ("expandable_segments:True", "unmapped in place")])
def test_a_plan_with_one_layout_says_why(tmp_path, alloc_conf, says):
    """The formula models no segment layout, and with expandable segments the range the freed model left is not
    visible to the plan: a plan for a process that freed memory before says so and has no second figure."""
    from tests.conftest import save_tiny_llama
    from vramguard.plan import plan
    path = str(save_tiny_llama(tmp_path, **TINY))
    s = Settings(quant="bf16", attn="sdpa", prompt_tokens=64, max_new_tokens=8)
    p = plan(path, s, vram="1GiB", alloc_conf=alloc_conf, freed_before=True, solve=False)
    f = [f for f in p.findings if f.code == "freed_before"]
    assert len(f) == 1 and says in f[0].message and p.estimate.freed_layout_reserved_bytes is None
    fresh = plan(path, s, vram="1GiB", alloc_conf=alloc_conf, freed_before=False, solve=False)
    assert fresh.estimate == p.estimate and not any(f.code == "freed_before" for f in fresh.findings)


@pytest.mark.parametrize("bad", ["yes", 1, 0.0])
def test_freed_before_takes_a_bool_or_none(bad):
    from vramguard.errors import InvalidValue
    from vramguard.plan import plan
    with pytest.raises(InvalidValue) as e:
        plan("llama-3.1-8b", vram="24GiB", freed_before=bad, alloc_conf=None, solve=False)
    assert e.value.field == "freed_before" and "True, False or None" in str(e.value)


def test_the_cli_plans_a_process_that_freed_a_model_and_says_it_plans_one_card(tmp_path):
    from typer.testing import CliRunner

    from tests.conftest import save_tiny_llama
    from vramguard.cli import app
    path = str(save_tiny_llama(tmp_path, **TINY))
    r = CliRunner().invoke(app, ["plan", path, "--prompt-tokens", "64", "--max-new-tokens", "8", "--vram", "1GiB",
                                 "--freed-before", "--format", "json"])
    assert r.exit_code == 0, r.output
    import json
    d = json.loads(r.stdout)
    assert d["freed_layout_reserved_bytes"] > 0 and d["reserved_from"] == "caching-allocator model"
    assert d["freed_before"] is True and d["fresh_layout_reserved_bytes"] > 0
    assert any(f["code"] == "freed_before" for f in d["findings"])
    r = CliRunner().invoke(app, ["plan", path, "--prompt-tokens", "64", "--max-new-tokens", "8", "--vram",
                                 "1GiB,1GiB", "--freed-before"])
    assert r.exit_code == 0 and "--freed-before plans one card" in r.output

