"""The tracker's memo of meta outputs (:func:`vramguard.introspect.tracker._meta_call`) changes no replay: the same
events (keys and raw bytes, every allocation and free in order), labels and places, the same result, for a tiny
DeepSeek-V2 (MLA, a dense layer before MoE ones) and Falcon-H1 (attention beside Mamba-2's chunked scan), a decode
step after a filled cache; and it runs no kernel for an operator seen before on the same metadata, but every view and in-place
operator."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from vramguard.introspect import tracker  # noqa: E402

from test_replay_trim import _config_json  # noqa: E402


def _recorded(config_json: str, s, past: int, chunk: int):
    from vramguard.introspect.build import cached_config, text_config
    from vramguard.introspect.replay import Recording, cached_replay_model, replay
    model, _ = cached_replay_model(config_json, "m", s.act_dtype, s.effective_attn, s.sdpa_kernel)
    rec = Recording(9)
    r = replay(model, text_config(cached_config(config_json, "m")), s, past, chunk, record=rec)
    return r, rec.events, rec.notes


@pytest.mark.parametrize("model_type", ["deepseek_v2", "falcon_h1"])
def test_a_replay_with_the_memo_is_the_replay_without(tmp_path, monkeypatch, model_type):
    from vramguard.settings import Settings
    config_json = _config_json(tmp_path, model_type)
    s = Settings(quant="bf16", attn="sdpa", prompt_tokens=1, max_new_tokens=0)
    for past, chunk in ((39, 1),):  # a decode step: the forward that fills the cache, then the tracked one
        tracker._OUTPUTS.clear()
        with monkeypatch.context() as m:
            m.setattr(tracker, "_meta_call", lambda func, args, kwargs: func(*args, **kwargs))
            want = _recorded(config_json, s, past, chunk)
        got = _recorded(config_json, s, past, chunk)  # memo filled by the first layers, then read
        assert tracker._OUTPUTS, "nothing was memoized"
        again = _recorded(config_json, s, past, chunk)  # every operator read from the memo
        assert got == want and again == want


def test_only_operators_that_return_new_tensors_are_memoized():
    tracker._OUTPUTS.clear()
    x = torch.empty((4, 6), dtype=torch.bfloat16, device="meta")
    calls = []

    class Counting:
        """``aten.mm``, counting the kernel's runs (a memo hit runs none)."""

        _schema = torch.ops.aten.mm.default._schema

        def __call__(self, *args):
            calls.append(args)
            return torch.ops.aten.mm.default(*args)
    mm = Counting()
    a = tracker._meta_call(mm, (x, x.t()), {})
    b = tracker._meta_call(mm, (x, x.t()), {})
    assert len(calls) == 1 and a.shape == b.shape == (4, 4) and a.stride() == b.stride() == (4, 1)
    assert a.dtype == b.dtype == torch.bfloat16 and a.untyped_storage().nbytes() == 32  # 4 x 4 x 2 bytes
    assert a.untyped_storage() is not b.untyped_storage()  # a new storage each, as the kernel gives
    tracker._meta_call(mm, (x, x.t().contiguous()), {})  # other strides: the kernel runs
    assert len(calls) == 2
    view = tracker._meta_call(torch.ops.aten.view.default, (x, [24]), {})
    assert view.untyped_storage() is x.untyped_storage()  # a view is never made anew
    tracker._meta_call(torch.ops.aten.add_.Tensor, (x, x), {})  # in place: not memoized
    assert all(k[0] in (mm,) for k in tracker._OUTPUTS)
