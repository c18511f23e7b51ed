"""``run`` and ``serve`` on a model whose plan is unverified measure one short prefill on the device before committing
memory, and re-plan from it (here on the CPU: the storages a real forward creates)."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from archs import save_arch
from conftest import save_word_tokenizer

from vramguard.plan import verified
from vramguard.runtime import first_prefill


@pytest.fixture(scope="module")
def olmo2(tmp_path_factory):
    folder = tmp_path_factory.mktemp("olmo2")
    save_arch(folder, "olmo2", dtype="float32")
    save_word_tokenizer(folder, 256)
    return folder


@pytest.fixture
def unverified(monkeypatch):
    """OLMo-2's full attention is measured; mark it unverified, as a layer kind no GPU run covers would be."""
    monkeypatch.setattr(verified, "unverified", lambda spec, s: ("layer:full_attention",))


@pytest.fixture
def measured(monkeypatch):
    """Each first prefill's real measurement, as returned; ``times`` multiplies it (a path the replay missed)."""
    seen = {"times": 1, "bytes": []}
    real = first_prefill.prefill_peak_bytes

    def spy(model, tokens, on_cuda):
        seen["bytes"].append(real(model, tokens, on_cuda) * seen["times"])
        return seen["bytes"][-1]
    monkeypatch.setattr(first_prefill, "prefill_peak_bytes", spy)
    return seen


def _plain_order(model, monkeypatch, prompt_tokens: int, new: int):
    """The preflight's order with the plan taken as verified (no measurement)."""
    from vramguard.run.generate import strategy_order
    with monkeypatch.context() as m:
        m.setattr(verified, "unverified", lambda spec, s: ())
        return strategy_order(model, prompt_tokens, new)[0]


def test_run_measures_the_first_prefill_and_scales_the_plan_by_it(olmo2, unverified, measured, monkeypatch):
    from vramguard import load_model
    from vramguard.run.generate import generate
    loaded = load_model(str(olmo2), quant="fp32")
    prompt = "w1 w2 w3 w4 w5 w6 w7 w8"
    plain = _plain_order(loaded, monkeypatch, 8, 4)
    measured["times"] = 3  # three times what the real forward allocates: more than the plan
    r = generate(loaded, None, prompt, max_new_tokens=4)
    [got] = measured["bytes"]
    assert got > 0
    first = first_prefill.FirstPrefill(8, _planned_prefill(loaded, 8), got, ("layer:full_attention",), "cpu")
    assert first.scale > 1
    assert first.note() in r.reason and "a first prefill of 8 tokens measured on cpu" in r.reason
    assert f"scaled by {first.scale:.2f}" in r.reason
    assert r.planned_need_bytes == int(plain[0][1] * first.scale)  # the measured figure is what the run planned by
    assert len(r.token_ids) == 4


def test_a_first_prefill_within_the_plan_keeps_it(olmo2, unverified, measured, monkeypatch):
    from vramguard import load_model
    from vramguard.run.generate import generate
    loaded = load_model(str(olmo2), quant="fp32")
    plain = _plain_order(loaded, monkeypatch, 8, 4)
    r = generate(loaded, None, "w1 w2 w3 w4 w5 w6 w7 w8", max_new_tokens=4)
    [got] = measured["bytes"]
    assert got <= _planned_prefill(loaded, 8)  # the replay of OLMo-2's forward is not below the real one
    assert "the plan is kept (it is not lowered on one measurement)" in r.reason
    assert r.planned_need_bytes == plain[0][1]


def test_a_verified_plan_runs_without_measuring(olmo2, measured):
    from vramguard import load_model
    from vramguard.run.generate import generate
    loaded = load_model(str(olmo2), quant="fp32")
    r = generate(loaded, None, "w1 w2 w3", max_new_tokens=2)
    assert measured["bytes"] == [] and "first prefill" not in r.reason


@pytest.mark.parametrize("engine", ["generate", "continuous"])
def test_serve_re_plans_its_memory_from_the_first_prefill(olmo2, unverified, measured, engine):
    """Before the generate engine's admission plan or the continuous engine's KV pool takes memory."""
    from vramguard.serve.server import build
    measured["times"] = 4
    s = build(str(olmo2), quant="fp32", page_size=16, max_batch_tokens=64, max_running=4, max_queue=4,
              max_kv_blocks=20, verify=False, served_name="tiny", vram_budget=1 << 30, engine_choice=engine)
    try:
        [got] = measured["bytes"]
        text = s.pool.source
        assert "a first prefill of 128 tokens measured on cpu" in text and "scaled by" in text
        held = sum(p.numel() * p.element_size() for p in s.engine.model.parameters())
        scale = got / _planned_prefill(s.loaded, 128)
        assert f"(usable {_fmt(2**30 - held)} / {scale:.2f})" in text
    finally:
        s.close()  # the engine's thread too (stop() ends a started HTTP server only)


def _planned_prefill(h, tokens: int) -> int:
    from vramguard.plan import choose, estimate
    return estimate(choose(h.spec, h.settings).model, h.settings.with_(prompt_tokens=tokens, max_new_tokens=1, batch=1)).prefill.peak_bytes


def _fmt(n: int) -> str:
    from vramguard.units import fmt_bytes
    return fmt_bytes(n)
