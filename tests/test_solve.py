"""Solving for the largest prompt / new tokens / batch, and ranking the changes."""

from vramguard.plan import estimate, plan
from vramguard.resolve import resolve_model
from vramguard.settings import Settings
from vramguard.plan.solve import max_batch, max_new_tokens, max_prompt_tokens, ranked_changes
from vramguard.catalog.gpus import GPUS
from vramguard.units import GiB
from vramguard.plan.choice import choose


def _need(spec, s):
    return estimate(choose(spec).model, s).device_used_bytes


def test_max_prompt_is_the_exact_boundary():
    spec = resolve_model("llama-3.1-8b")
    s = Settings(quant="nf4", attn="sdpa", max_new_tokens=256)
    usable = 12 * GiB
    p = max_prompt_tokens(choose(spec).model, s, usable)
    assert p is not None and 1000 < p < 131_072
    assert _need(spec, s.with_(prompt_tokens=p)) <= usable < _need(spec, s.with_(prompt_tokens=p + 1))


def test_max_new_tokens_and_batch_are_boundaries():
    spec = resolve_model("llama-2-7b")
    s = Settings(quant="nf4", attn="sdpa", prompt_tokens=1024, max_new_tokens=128)
    usable = 8 * GiB
    n = max_new_tokens(choose(spec).model, s, usable)
    assert n == spec.max_position_embeddings - 1024 or (
        _need(spec, s.with_(max_new_tokens=n)) <= usable < _need(spec, s.with_(max_new_tokens=n + 1)))
    b = max_batch(choose(spec).model, s, usable)
    assert _need(spec, s.with_(batch=b)) <= usable < _need(spec, s.with_(batch=b + 1))


def test_nothing_fits_gives_none():
    spec = resolve_model("llama-3.1-70b")
    s = Settings(quant="bf16", prompt_tokens=128, max_new_tokens=128)
    assert max_prompt_tokens(choose(spec).model, s, 24 * GiB) is None
    assert max_batch(choose(spec).model, s, 24 * GiB) is None


def test_c6_ranks_kv_quantization_and_shorter_context():
    """C6: Llama-3.1-70B in NF4 at 131,072 tokens on an 80 GB card: the KV cache (40 GiB) is as large as the
    weights; the fixes include quantizing the KV cache and shortening the context."""
    spec = resolve_model("llama-3.1-70b")
    s = Settings(quant="nf4", attn="sdpa", prompt_tokens=131_072 - 512, max_new_tokens=512, prefill_chunk=2048)
    p = plan(spec, s, gpu="h100-80gb")
    assert not p.cards[0].fits
    kv = next(f for f in p.findings if f.code == "kv_as_large_as_weights")
    assert "40.00 GiB" in kv.message
    descs = [c.description for c in p.changes]
    assert any("int8 quantized cache" in d for d in descs)
    assert any("int4 quantized cache" in d for d in descs)
    assert any(d.startswith("shorter prompt") for d in descs)
    from vramguard.plan.solve import HARDWARE_KEYS
    settings = [c for c in p.changes if not set(HARDWARE_KEYS) & set(c.settings)]
    keep = [c.saved_bytes for c in settings if not c.reduces_request]
    cut = [c.saved_bytes for c in settings if c.reduces_request]
    assert keep == sorted(keep, reverse=True) and cut == sorted(cut, reverse=True)
    assert all(x > 0 for x in keep + cut)
    assert settings.index(next(c for c in settings if c.reduces_request)) == len(keep)
    int4 = next(c for c in p.changes if "int4" in c.description)
    assert int4.saved_bytes > 25 * GiB
    # the quantized format's group-scale overhead is stated with the plan of a quantized KV cache
    q = plan(spec, s.with_(kv_dtype="int4"), gpu="h100-80gb")
    fmt = next(f for f in q.findings if f.code == "kv_quantized_format")
    assert "0.5 B per value" in fmt.message and "0.0625 B per value, +12.5%" in fmt.message
    assert "last 128 tokens stay in 16-bit" in fmt.message and "11.28 GiB" in fmt.message
    q8 = plan(spec, s.with_(kv_dtype="int8"), gpu="h100-80gb")
    assert "+6.2%" in next(f for f in q8.findings if f.code == "kv_quantized_format").message
    assert not any(f.code == "kv_quantized_format" for f in p.findings)


def test_eager_to_sdpa_is_ranked_with_its_saving():
    spec = resolve_model("llama-2-7b")
    s = Settings(quant="nf4", attn="eager", batch=4, prompt_tokens=3968, max_new_tokens=128)
    changes = ranked_changes(choose(spec).model, s, [GPUS["rtx-4090"]])
    top = changes[0]
    assert top.settings["attn"] == "sdpa" and not top.reduces_request
    assert top.saved_bytes > 15 * GiB and "rtx-4090" in top.fits_on
    batch = next(c for c in changes if "batch" in c.settings)
    assert batch.reduces_request and batch.settings["batch"] == 1


def test_weights_larger_than_the_card_are_said_plainly():
    p = plan("llama-3.1-70b", Settings(quant="nf4", prompt_tokens=128, max_new_tokens=128), gpu="rtx-4090")
    f = next(f for f in p.findings if f.code == "weights_exceed_card")
    assert f.level == "fail" and "no prompt, batch or KV setting can fit" in f.message and "several GPUs" in f.fix
    assert not any(f.code == "weights_exceed_card" for f in plan("llama-3.1-8b", Settings(), gpu="rtx-4090").findings)


def test_when_no_setting_fits_the_changes_of_hardware_come_with_the_bytes_they_need():
    """Llama-3.1-70B in NF4 on an RTX 4090: the weights alone exceed it, so KV changes cannot help; what fits is
    weights in CPU RAM (the shortfall), a second card (the two-card plan's split) or a larger card."""
    p = plan("llama-3.1-70b", Settings(), gpu="rtx-4090", alloc_conf=None)  # the changes are the formula's
    card, need = p.cards[0], p.estimate.device_used_bytes
    assert not card.fits
    top = p.changes[:3]
    assert [next(k for k in ("cpu_offload_bytes", "gpus", "gpu") if k in c.settings) for c in top] == \
        ["cpu_offload_bytes", "gpus", "gpu"]
    offload, second, larger = top
    assert offload.settings["cpu_offload_bytes"] == need - card.usable_bytes == offload.saved_bytes
    assert offload.need_bytes == card.usable_bytes and "rtx-4090" in offload.fits_on
    # the second card is the two-card plan's split (its fuller card), not half the model on each
    from vramguard.plan.multigpu import plan_gpus
    two = plan_gpus(p.model, p.settings, gpus=[card.gpu, card.gpu], solve=False)
    assert second.need_bytes == max(c.need_bytes for c in two.cards) and two.fits and "rtx-4090" in second.fits_on
    # the smallest catalog card whose reported total holds the need
    smallest = min((g for g in GPUS.values() if g.total_bytes >= need), key=lambda g: g.total_bytes)
    assert larger.settings == {"gpu": smallest.name} and larger.fits_on == (smallest.name,)
    # the KV changes that cannot make it fit come after
    assert all("rtx-4090" not in c.fits_on for c in p.changes[3:])


def test_the_bracketed_search_finds_the_exact_boundary_of_any_monotone_need():
    """``_largest`` interpolates, so it must be checked against the definition: the largest v with need(v) <= u,
    for steps, plateaus, quadratics and jumps alike."""
    from hypothesis import given, settings, strategies as st

    from vramguard.plan.solve import _largest

    @settings(max_examples=300, deadline=None)
    @given(st.lists(st.integers(0, 1000), min_size=1, max_size=300), st.integers(-10, 160_000),
           st.integers(0, 2))
    def check(steps, usable, lo):
        values = []
        total = 0
        for d in steps:
            total += d * d  # non-decreasing, with plateaus and convex jumps
            values.append(total)
        hi = len(values) - 1
        if lo > hi:
            return
        calls = []

        def need(v):
            calls.append(v)
            return values[v]
        want = max((v for v in range(lo, hi + 1) if values[v] <= usable), default=None)
        assert _largest(lo, hi, need, usable) == want
    check()


def test_known_needs_give_the_same_boundary_in_fewer_evaluations():
    """Searches of one need against several budgets share what they evaluated (a plan's cards): for any
    non-decreasing need, budgets and order, each answer is the definition's and no point is evaluated twice; four
    cards' budgets on a convex need cost fewer evaluations than four searches from nothing."""
    from hypothesis import given, settings, strategies as st

    from vramguard.plan.limits import largest

    @settings(max_examples=300, deadline=None)
    @given(st.lists(st.integers(0, 1000), min_size=2, max_size=300), st.lists(st.integers(-10, 160_000),
                                                                              min_size=1, max_size=5))
    def check(steps, budgets):
        values, total = [], 0
        for d in steps:
            total += d * d
            values.append(total)
        hi = len(values) - 1
        known: dict[int, int] = {}
        shared, alone = [], []
        for usable in budgets:
            want = max((v for v in range(hi + 1) if values[v] <= usable), default=None)
            assert largest(0, hi, lambda v: shared.append(v) or values[v], usable, known) == want
            assert largest(0, hi, lambda v: alone.append(v) or values[v], usable) == want
            assert all(known[v] == values[v] for v in known)
        assert len(set(shared)) == len(shared)  # each point evaluated once
    check()

    def need(v):  # weights, then KV and activations growing with v (bytes)
        return 5_000_000_000 + 131_072 * v + 3 * v * v
    shared, alone, known = [], [], {}
    for usable in (8 << 30, 12 << 30, 16 << 30, 24 << 30):
        a = largest(1, 131_072, lambda v: shared.append(v) or need(v), usable, known)
        assert a == largest(1, 131_072, lambda v: alone.append(v) or need(v), usable)
        assert need(a) <= usable < need(a + 1)
    assert len(shared) < len(alone), (len(shared), len(alone))


def test_known_needs_that_decrease_are_not_used():
    """A need seen decreasing (not the non-decreasing need the bracket assumes) starts the search from its ends,
    as without known needs: need(v) = 10 v with a wrong known 5 -> 0 and 2 -> 999 gives 9 for a budget of 95."""
    from vramguard.plan.limits import largest

    known = {2: 999, 5: 0}
    assert largest(0, 20, lambda v: 10 * v, 95, known) == 9
    assert known[0] == 0 and known[20] == 200  # evaluated: the known bracket was not trusted


def test_max_batch_is_the_exact_boundary_in_few_evaluations(monkeypatch):
    """``max_batch`` starts from the line through batch 1 and 2: against the definition (largest b <= 65,536 with
    need(b) <= usable) for needs that are linear, convex or stepped, and in at most 6 evaluations for a linear need
    (doubling from 1 took 17 to reach 65,536)."""
    from hypothesis import given, settings, strategies as st

    from vramguard.plan import solve

    def run(base, slope, curve, step, usable):
        """(max_batch's answer, the definition's, max_batch's evaluations) for this need."""
        calls = []

        def need(_spec, s):
            calls.append(s.batch)
            b = s.batch
            return base + slope * b + curve * b * b + ((b // step) * step * 3 if step < 4096 else 0)
        monkeypatch.setattr(solve, "_need", need)
        want = None
        lo, hi = 1, solve.MAX_BATCH_SEARCH  # need is increasing in b: the boundary by bisection is the definition
        if need(None, Settings(batch=1)) <= usable:
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if need(None, Settings(batch=mid)) <= usable else (lo, mid - 1)
            want = lo
        calls.clear()
        return solve.max_batch(None, Settings(), usable), want, len(calls)

    @settings(max_examples=200, deadline=None)
    @given(st.integers(1, 10**6), st.integers(0, 10**4), st.integers(0, 50), st.integers(1, 4096),
           st.integers(0, 10**11))
    def check(base, slope, curve, step, usable):
        got, want, _ = run(base, slope, curve, step, usable)
        assert got == want
    check()
    # linear needs: 10**6 + 7 b under 10**9 -> (10**9 - 10**6) // 7 = 142,714, beyond the search: 65,536;
    # 3 + b under 40,000 -> 39,997; 5e9 + 123,456,789 b under 24 GiB -> (25,769,803,776 - 5e9) // 123,456,789 = 168
    for args, boundary in (((10**6, 7, 0, 4096, 10**9), 65_536), ((3, 1, 0, 4096, 40_000), 39_997),
                           ((5 * 10**9, 123_456_789, 0, 4096, 24 * 2**30), 168)):
        got, want, calls = run(*args)
        assert got == want == boundary and calls <= 6, (args, got, calls)


def test_the_shorter_prompt_change_is_the_card_tables_largest_prompt():
    """Where the allocator model gives a card's largest prompt, the change that shortens the prompt for that card
    names the same prompt, and its need is the plan of that prompt on that card (which fits)."""
    s = Settings(prompt_tokens=8192)
    p = plan("llama-3.1-8b", s, vram="8GiB")
    card = p.cards[0]
    assert not card.fits and card.max_prompt_tokens is not None
    shorter = [c for c in p.changes if set(c.settings) == {"prompt_tokens"}]
    assert len(shorter) == 1 and shorter[0].settings["prompt_tokens"] == card.max_prompt_tokens
    assert shorter[0].description == f"shorter prompt: {card.max_prompt_tokens:,} tokens"
    at = plan("llama-3.1-8b", s.with_(prompt_tokens=card.max_prompt_tokens), vram="8GiB", solve=False).cards[0]
    assert at.fits and at.need_bytes == shorter[0].need_bytes
    assert shorter[0].need_bytes + shorter[0].saved_bytes == card.need_bytes


def test_a_card_the_run_fits_never_shows_limits_below_the_run():
    """A card the allocator model fits the run on shows at least the run's own prompt, new tokens and batch (the
    reserve formula's search, higher than the allocator model, can find none)."""
    s = Settings(prompt_tokens=6700)
    card = plan("llama-3.1-8b", s, vram="8GiB").cards[0]
    assert card.fits
    assert card.max_prompt_tokens >= 6700 and card.max_new_tokens >= s.max_new_tokens and card.max_batch >= 1


def test_a_second_card_that_takes_no_layer_is_not_offered():
    """At a 100 M-token prompt one layer's KV cache exceeds a 24 GiB card: the two-card split leaves the second
    card empty, which lowers nothing, so it is no change to suggest (it was shown as saving -1 KiB)."""
    p = plan("qwen2.5-0.5b", Settings(quant="nf4", prompt_tokens=100_000_000, max_new_tokens=256), vram="24GiB",
             context=100_000_256, alloc_conf=None)
    assert not p.cards[0].fits
    assert all(c.saved_bytes > 0 or c.fits_on for c in p.changes)
    assert not any("gpus" in c.settings for c in p.changes)
    # where a second card holds layers it is still offered (the 70B case of the test above keeps it first)
    q = plan("llama-3.1-70b", Settings(), gpu="rtx-4090", alloc_conf=None)
    assert any("gpus" in c.settings and c.saved_bytes > 0 for c in q.changes)
