"""The continuous-batching engine's token choice (vramguard.serve.sampler) on hand-made scores: greedy rows take the
first of equal maxima whatever the random state, seeded rows depend on their own seed and position only, and the
draw follows the distribution. Plus the request's seed field as the API reads it."""

from __future__ import annotations

import pytest
import torch

from vramguard.serve.sampler import DRAW, GREEDY, SEEDED, RowSampler, choice_seed, mix64, sampling_rows, \
    seeded_uniform


def _choose(sampler: RowSampler, scores: torch.Tensor, rows: list[tuple[int, int, int]]) -> list[int]:
    sampler.fill(rows)
    out = torch.full((2, sampler.rows), -1, dtype=torch.int32)
    sampler(scores.unsqueeze(0), out)
    return out[0, :len(rows)].tolist()


def test_a_greedy_row_takes_the_first_of_equal_maxima_whatever_the_generator():
    # two logits tie at the top (ids 3 and 7, as bfloat16 logits often do); a draw would pick either at random
    scores = torch.full((1, 10), -5.0)
    scores[0, 3] = scores[0, 7] = 2.0
    sampler = RowSampler(4, "cpu")
    picks = set()
    for seed in range(40):
        torch.manual_seed(seed)
        picks.add(_choose(sampler, scores, [(GREEDY, 0, 0)])[0])
    assert picks == {3} and int(torch.argmax(scores[0])) == 3
    # the drawn rows of the same scores do reach both (the test of the draw itself, not of a constant)
    drawn = set()
    for seed in range(40):
        torch.manual_seed(seed)
        drawn.add(_choose(sampler, scores, [(DRAW, 0, 0)])[0])
    assert drawn == {3, 7}


def test_greedy_rows_equal_argmax_beside_drawn_and_seeded_rows():
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(6, 500, generator=g) * 3
    sampler = RowSampler(8, "cpu")
    rows = [(GREEDY, 0, 5), (DRAW, 0, 5), (SEEDED, 11, 5), (GREEDY, 0, 9), (SEEDED, 12, 5), (GREEDY, 0, 1)]
    picks = _choose(sampler, scores, rows)
    assert [picks[i] for i in (0, 3, 5)] == torch.argmax(scores[[0, 3, 5]], dim=-1).tolist()


def test_a_seeded_row_depends_on_its_seed_and_position_only():
    g = torch.Generator().manual_seed(1)
    scores = torch.randn(1, 2000, generator=g)  # a flat distribution: many tokens likely, so seeds are told apart
    sampler = RowSampler(8, "cpu")
    alone = [_choose(sampler, scores, [(SEEDED, 42, p)])[0] for p in range(30)]
    # the same seed in another row of a batch with other requests, the engine's generator in another state
    torch.manual_seed(123)
    others = torch.randn(3, 2000, generator=g)
    batch = torch.cat([others[:2], scores, others[2:]])
    beside = [_choose(sampler, batch, [(DRAW, 0, 0), (SEEDED, 7, p), (SEEDED, 42, p), (GREEDY, 0, 0)])[2]
              for p in range(30)]
    assert beside == alone
    other_seed = [_choose(sampler, scores, [(SEEDED, 43, p)])[0] for p in range(30)]
    assert other_seed != alone and len(set(alone)) > 20  # a new token at each position, not one repeated


def test_seeded_draws_follow_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    scores = torch.log(probs).unsqueeze(0)  # -inf for the token of probability 0
    sampler = RowSampler(1, "cpu")
    counts = torch.zeros(5)
    n = 4000
    for p in range(n):
        counts[_choose(sampler, scores, [(SEEDED, 9, p)])[0]] += 1
    freq = counts / n
    # binomial standard error at n = 4000 is at most 0.0079; 4 of them
    assert torch.allclose(freq, probs, atol=0.032), freq.tolist()
    assert counts[4] == 0


def test_probabilities_that_are_not_finite_are_refused_as_multinomial_refuses_them():
    scores = torch.zeros(2, 10)
    scores[1, 4] = float("nan")
    with pytest.raises(RuntimeError, match="probability tensor contains either `inf`, `nan` or element < 0"):
        _choose(RowSampler(2, "cpu"), scores, [(GREEDY, 0, 0), (DRAW, 0, 0)])
    with pytest.raises(RuntimeError, match="probability tensor"):
        torch.multinomial(torch.softmax(scores, -1), 1)  # the words of the error the engine sorts


def test_seeded_uniforms_are_in_the_open_interval_and_spread():
    u = seeded_uniform(torch.tensor([0, -5, 2**63 - 1]), torch.tensor([0, 1, 2**40]), 50_000)
    assert u.shape == (3, 50_000) and float(u.min()) > 0 and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.005 and not torch.equal(u[0], u[1])
    # SplitMix64's finaliser on known words (the C reference: z = 0 -> 0; mix of 1 -> 0x5692161d100b05e5)
    assert mix64(torch.tensor([0, 1])).tolist() == [0, 0x5692161D100B05E5]


def test_choice_seeds_keep_the_first_and_differ_within_int64():
    assert choice_seed(5, 0) == 5
    seeds = [choice_seed(5, i) for i in range(1, 5)] + [choice_seed(-2**63, 3), choice_seed(2**63 - 1, 1)]
    assert len(set(seeds)) == len(seeds) and all(-2**63 <= s < 2**63 for s in seeds)
    assert choice_seed(5, 1) != choice_seed(6, 0)


def test_sampling_rows_follow_the_step_order_and_skip_prefill_chunks():
    from types import SimpleNamespace as NS
    steps = [NS(has_new_token=True, state=NS(request_id="a", position_offset=12)),
             NS(has_new_token=False, state=NS(request_id="b", position_offset=256)),  # a prefill chunk: no token
             NS(has_new_token=True, state=NS(request_id="c", position_offset=40))]
    modes = {"a": (SEEDED, 3), "c": (GREEDY, 0)}
    assert sampling_rows(steps, modes.__getitem__) == [(SEEDED, 3, 12), (GREEDY, 0, 40)]


@pytest.mark.parametrize("value,says", [
    (2**63, "beyond a 64-bit integer"),
    (-1, "accepted: an integer from 0 to 9,223,372,036,854,775,807 (2**63 - 1)"),
    (-2**63, "accepted: an integer from 0 to 9,223,372,036,854,775,807 (2**63 - 1)"),
    ("7", "valid integer"),
    (1.5, "valid integer"),
])
def test_a_seed_outside_the_seeds_pytorch_takes_is_an_openai_error(value, says):
    """The range of ``run --seed`` (vramguard.run.generate.check_seed: torch.manual_seed's signed 64-bit integer,
    from 0), as a 400 naming ``seed``."""
    pytest.importorskip("fastapi")
    from vramguard.serve.apierrors import ApiError
    from vramguard.serve.schemas import ChatRequest
    from vramguard.serve.validate import Limits, parse_request
    import json
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "seed": value}).encode()
    limits = Limits(context_length=64, vocab_size=100, n_max=4, default_max_tokens=8, model_names=("m",))
    with pytest.raises(ApiError) as e:
        parse_request(body, ChatRequest, limits)
    assert e.value.status == 400 and e.value.param == "seed" and says in e.value.message
    assert parse_request(body.replace(json.dumps(value).encode(), b"9223372036854775807"), ChatRequest,
                         limits).seed == 2**63 - 1
