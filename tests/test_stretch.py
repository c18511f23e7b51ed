"""Replays at many lengths from a few (:mod:`vramguard.introspect.stretch`): the polynomial in the tokens and their
padding to a Mamba-2 chunk is exact (a tiny Falcon-H1's prefill and decode replays, and its allocation tapes, equal
the replays of every layer at lengths it was never replayed at), a disagreement falls back to replaying, and the
peak read from an expanded tape (:class:`~vramguard.introspect.replayed.TapePeak`) is the tracker's."""

from __future__ import annotations

import random

import pytest

from vramguard.introspect.stretch import MAX_KEPT, TESTS, Fit, Stretch

# the tiny Falcon-H1 of tests/test_replay_trim.py: attention and Mamba-2 side by side in 9 layers (5 traced), the
# scan padding the tokens to chunks of 16
FALCON_H1 = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                 max_position_embeddings=1024, num_hidden_layers=9, mamba_d_ssm=64, mamba_n_heads=8, mamba_d_head=8,
                 mamba_d_state=16, mamba_chunk_size=16)
# lengths as a search over the prompt asks them (the ends, then within), none a length checked afterwards
ASKED = (1000, 41, 517, 263, 390, 326, 358, 342, 350, 346)


def _sizes(x: int) -> tuple[int, ...]:
    """Numbers as a chunked scan of chunk 128 gives them: a constant, bytes per token, a padded copy, the scan's
    decay between chunks (float32, (chunks + 1)^2 x 24 heads) and a score matrix."""
    padded = x + (-x) % 128
    return 3, 5 * x, 7 * padded, (padded // 128 + 1) ** 2 * 4 * 24, 2 * x * x, -1


def test_the_polynomial_through_six_lengths_gives_every_other_to_the_byte():
    # a + b x + c d + e x^2 + f x d + g d^2 with d = (-x) mod 128: (padded / 128)^2 = (x + d)^2 / 16,384, exact in
    # fractions; 129, 257, 385 share d = 127, so six points need three more residues
    xs = (129, 257, 385, 171, 299, 214)
    fit = Fit(xs, [_sizes(x) for x in xs], 128)
    for x in (342, 640, 1000, 45_206, 130_816, 130_815, 131_071):
        assert fit.at(x) == _sizes(x)


def test_a_number_the_polynomial_gives_as_no_integer_is_none():
    # through (10, 0), (20, 101), (30, 400): 97 - 19.6 x + 0.99 x^2, 897 at 40 but 25.75 at 15: no tensor's bytes
    fit = Fit((10, 20, 30), [(0, 7), (101, 7), (400, 7)], None)
    assert fit.at(40) == (897, 7)
    assert fit.at(15) is None


def test_a_design_that_does_not_determine_the_polynomial_is_refused():
    with pytest.raises(ValueError):
        Fit((129, 257, 385, 513, 641, 769), [(0,)] * 6, 128)  # one residue: d is the same at all six


def _stretch_with(values, structure="s", period=128) -> Stretch:
    st = Stretch(100, 200_000, period)
    for x in values:
        if st.wants(x):
            st.keep(x, (structure, _sizes(x)))
    return st


def test_a_stretch_answers_once_its_polynomial_passed_its_tests():
    st = _stretch_with(ASKED[:7])  # 41 is below the stretch: 6 kept, none a test of six terms yet
    assert st.state == "new" and st.at(5000) is None
    st = _stretch_with((*ASKED, 777, 900))  # 6 taken (independent), the others tests
    assert st.state == "ready"
    for x in (5000, 45_206, 130_816):
        assert st.at(x) == ("s", _sizes(x))
    assert st.at(41) is None  # below the stretch: replayed by the caller


def test_numbers_in_x_alone_are_fitted_through_three_lengths():
    st = Stretch(100, 200_000, 128)
    for x in (300, 5000, 777, 12_345, 130_000):  # 3 taken, 2 tests
        st.keep(x, ("s", (3, 7 * x, x * (x + 1) // 2)))
    assert st.state == "ready" and st.fit.period is None
    assert st.at(99_999) == ("s", (3, 7 * 99_999, 99_999 * 100_000 // 2))


def test_a_disagreement_fails_the_stretch_and_the_caller_replays():
    st = _stretch_with(ASKED[:6])
    wrong = list(_sizes(ASKED[6]))
    wrong[1] += 512  # one number of one replay off by one allocation block
    st.keep(ASKED[6], ("s", tuple(wrong)))
    for x in ASKED[7:]:
        st.keep(x, ("s", _sizes(x)))
    assert st.state == "failed" and st.at(5000) is None and not st.wants(5000)


def test_another_structure_fails_the_stretch():
    st = _stretch_with(ASKED[:4])
    st.keep(ASKED[4], ("another order of allocations", _sizes(ASKED[4])))
    assert st.state == "failed" and st.at(ASKED[0]) is None


def test_a_stretch_gives_up_after_so_many_replays():
    st = Stretch(100, 200_000, 128)
    x = 129
    while st.state == "new":
        st.keep(x, ("s", (x % 7,)))  # no polynomial of degree 2 in x and d
        x += 128 * 3 + 11
    assert st.state == "failed" and len(st.samples) <= MAX_KEPT and TESTS >= 1


# ---- the replays of a tiny Falcon-H1 ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def falcon_h1(tmp_path_factory):
    pytest.importorskip("transformers")
    from transformers import AutoConfig

    from vramguard.resolve import resolve_model
    folder = tmp_path_factory.mktemp("falcon_h1")
    AutoConfig.for_model("falcon_h1", **FALCON_H1).save_pretrained(folder)
    return resolve_model(str(folder)).config_json


def _full(config_json: str, s, past: int, chunk: int):
    """The replay of every layer (no trim, no stretch)."""
    from vramguard.introspect.build import cached_config, text_config
    from vramguard.introspect.replay import cached_replay_model, replay
    model, _ = cached_replay_model(config_json, "m", s.act_dtype, s.effective_attn, s.sdpa_kernel)
    return replay(model, text_config(cached_config(config_json, "m")), s, past, chunk)


@pytest.mark.parametrize("decode", [False, True])
def test_a_falcon_h1_forward_from_its_stretch_is_the_replay_of_every_layer(falcon_h1, decode):
    from vramguard.introspect import replay_trim
    from vramguard.settings import Settings
    s = Settings(quant="bf16", attn="sdpa", kernels="torch", prompt_tokens=1, max_new_tokens=0)

    def at(x: int):
        return (x, 1) if decode else (0, x)
    for x in ASKED:  # replayed and kept until fitted (decode steps: in x alone, after five; the prefill pads: eight)
        replay_trim.stretched_replay(falcon_h1, "m", s, *at(x))
    st = replay_trim._stretches(falcon_h1, "m", s, *at(ASKED[0]))[0][0]
    assert st.state == "ready" and st.fit.period == (None if decode else 16)
    for x in (999, 512):  # never replayed: 62 chunks and 7 tokens of padding; a whole number of chunks
        assert x not in st.samples
        assert replay_trim.stretched_replay(falcon_h1, "m", s, *at(x)) == _full(falcon_h1, s, *at(x)), x


def test_a_falcon_h1_stretch_that_disagrees_falls_back_to_the_replay(falcon_h1, monkeypatch):
    from vramguard.introspect import generic, replay_trim
    from vramguard.settings import Settings
    s = Settings(quant="nf4", attn="sdpa", kernels="torch", prompt_tokens=1, max_new_tokens=0)
    traced = replay_trim.traced

    def off_at_517(config_json, name, s_, past, chunk):
        structure, numbers = traced(config_json, name, s_, past, chunk)
        return structure, (numbers[0] + (512 if chunk == 517 else 0), *numbers[1:])
    monkeypatch.setattr(replay_trim, "traced", off_at_517)
    for x in ASKED:
        replay_trim.stretched_replay(falcon_h1, "m", s, 0, x)
    st = replay_trim._stretches(falcon_h1, "m", s, 0, ASKED[0])[0][0]
    assert st.state == "failed"
    monkeypatch.setattr(replay_trim, "traced", traced)
    assert replay_trim.stretched_replay(falcon_h1, "m", s, 0, 999) is None  # the caller replays it
    assert generic._replayed(falcon_h1, "m", s, 0, 999) == _full(falcon_h1, s, 0, 999)


def test_a_falcon_h1_tape_from_its_stretch_is_the_recorded_tape(falcon_h1):
    from vramguard.introspect import alloc_replay
    from vramguard.introspect.tape_stretch import _tape_stretch
    from vramguard.settings import Settings
    key = Settings(quant="bf16", kernels="torch", prompt_tokens=1, max_new_tokens=1)
    for p in ASKED[2:]:  # recorded and kept until the polynomial in the prompt and its padding passes its tests
        alloc_replay._rescaled_events(falcon_h1, "m", key, p, 3)
    st = _tape_stretch(falcon_h1, "m", key, 3, 2 * 16 + 1, 1024 - 3 + 1, 16)  # two chunks on, within the context
    assert st.state == "ready" and st.fit.period == 16
    for p in (999, 512):
        assert alloc_replay._rescaled_events(falcon_h1, "m", key, p, 3) == \
            alloc_replay._record_events(falcon_h1, "m", key, p, 3)


# ---- the peak of an expanded tape ---------------------------------------------------------------------------
def _reference_peak(events, notes_by_key):
    """The tracker's count, written plainly (as replay_trim computed it before numpy): a free drops what the last
    allocation of its key holds; the components in the order the live set lists them."""
    live, total, best, best_at, largest = {}, 0, 0, -1, 0
    for i, (key, n) in enumerate(events):
        if n < 0:
            total -= live.pop(key, 0)
            continue
        size = -(-n // 512) * 512 if n else 0
        live[key] = size
        total += size
        largest = max(largest, size)
        if total > best:
            best, best_at = total, i
    if best_at < 0:
        return 0, {}, "", largest
    at_peak: dict = {}
    for key, n in events[:best_at + 1]:
        if n < 0:
            at_peak.pop(key, None)
        else:
            at_peak[key] = -(-n // 512) * 512 if n else 0
    comps: dict = {}
    for key, size in at_peak.items():
        label, _, cached = notes_by_key[key]
        comps["kv_cache" if cached else label] = comps.get("kv_cache" if cached else label, 0) + size
    label, at, cached = notes_by_key[events[best_at][0]]
    where = at if not at.startswith("aten.") else "in_" + ("kv_cache" if cached else label)
    return best, {k: v for k, v in comps.items() if v}, where, largest


def test_the_peak_read_with_numpy_is_the_trackers_count():
    pytest.importorskip("numpy")
    from vramguard.introspect.replayed import TapePeak
    rng = random.Random(7)
    labels = [("activations", "aten.mm.default", False), ("attention", "aten.bmm.default", False),
              ("kv_cache", "adopted", True), ("logits", "lm_head_copy", False)]
    for _ in range(40):
        events, held, notes = [], [], {}
        for _ in range(rng.randint(0, 60)):
            if held and rng.random() < 0.4:  # a free, now and then of a key never held or held twice
                key = held.pop(rng.randrange(len(held))) if rng.random() < 0.9 else rng.randint(0, 9)
                events.append((key, -1))
                continue
            key = rng.randint(0, 9) if rng.random() < 0.2 else len(events) + 100  # some keys allocated again
            notes.setdefault(key, rng.choice(labels))
            held.append(key)
            events.append((key, rng.choice([0, 1, 511, 512, 513, 4096, 1 << 20, rng.randint(1, 1 << 16)])))
        notes.update({k: labels[0] for k, _ in events if k not in notes})
        structure = (tuple((k, n < 0) for k, n in events), tuple(notes[k] for k, n in events if n >= 0))
        got = TapePeak(*structure).at([n for _, n in events if n >= 0])
        assert got == _reference_peak(events, notes), events


def test_a_quadratic_in_the_prompt_is_not_taken_across_a_chunks_end(tmp_path):
    # tests/archs.py's GraniteMoeHybrid pads to chunks of 256 (its config's default) in a context of 512: too short a
    # stretch for the polynomial in the prompt and its padding, so a quadratic is fitted between two multiples of the
    # chunk; fitted once from 8..181 tokens for every prompt, it gave 14,916,727 B of allocations at 300 tokens
    # where the tape holds 23,694,821 B (the scan pads 300 to 512, not 256)
    pytest.importorskip("transformers")
    import sys
    from pathlib import Path

    from transformers import AutoConfig

    from vramguard.introspect import alloc_replay
    from vramguard.resolve import resolve_model
    from vramguard.settings import Settings
    sys.path.insert(0, str(Path(__file__).parent))
    from archs import ARCHS
    AutoConfig.for_model("granitemoehybrid", **ARCHS["granitemoehybrid"]).save_pretrained(tmp_path)
    spec = resolve_model(str(tmp_path))
    key = Settings(quant="bf16", prompt_tokens=1, max_new_tokens=1)
    for prompt in (200, 300):
        got = alloc_replay._rescaled_events(spec.config_json, spec.name, key, prompt, 3)
        assert got is not None and got == alloc_replay._cached_events(spec.config_json, spec.name, key, prompt, 3)
    allocated = sum(n for fw in alloc_replay._cached_events(spec.config_json, spec.name, key, 300, 3)
                    for _, n in fw if n > 0)
    assert allocated == 23_694_821
