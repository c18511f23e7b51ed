"""profile and fit on the CPU: the measurement plumbing through a fake probe, the table against the plan, the
timeline files, and the plan-seeded search."""

import pytest

from vramguard.runtime import device as measure
from vramguard.profile.fit import FitRun, binding_component, search, seeds
from vramguard.runtime.device import MemorySnapshot, StepSample
from vramguard.profile.profiler import build_rows, kv_growth_per_token
from vramguard.resolve import resolve_model
from vramguard.profile.measured_run import RunResult, run_generate
from vramguard.settings import Settings
from vramguard.units import GiB


class FakeProbe:
    """Memory that grows by ``step`` bytes at every read, with a peak 100 bytes above."""

    def __init__(self, step=1000):
        self.n, self.step = 0, step

    def read(self):
        self.n += 1
        a = 10_000 + self.n * self.step
        return {"allocated": a, "reserved": a + 500, "peak_allocated": a + 100, "peak_reserved": a + 600,
                "inactive_split": 50, "device_used": a + 900, "total": 10**9}

    def reset_peak(self):
        pass

    def sync(self):
        pass


def test_snapshot_subtracts_field_by_field():
    a = MemorySnapshot(allocated=10, reserved=30, device_used=50)
    b = MemorySnapshot(allocated=4, reserved=10, device_used=20)
    d = a - b
    assert (d.allocated, d.reserved, d.device_used) == (6, 20, 30)
    assert a.nontorch == 20 and a.fragmentation == 20


def test_runner_records_one_sample_per_token_on_a_tiny_model(tiny, monkeypatch):
    import transformers
    monkeypatch.setattr(measure, "PROBE", FakeProbe())
    folder, _ = tiny("LlamaConfig", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=300, max_position_embeddings=256)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    r = run_generate(model, Settings(quant="bf16", prompt_tokens=12, max_new_tokens=5, batch=2))
    assert r.ok and len(r.samples) == 5 and [s.step for s in r.samples] == [0, 1, 2, 3, 4]
    assert r.peak_allocated == r.samples[-1].allocated + 100
    assert all(b.t_s >= a.t_s for a, b in zip(r.samples, r.samples[1:]))


def test_kv_growth_is_the_least_squares_slope():
    samples = [StepSample(i, i * 0.1, 1000 + (500 if i else 0) + 131_072 * i, 0, 0, 0, 0) for i in range(10)]
    assert kv_growth_per_token(samples) == 131_072
    assert kv_growth_per_token(samples[:3]) is None


def test_profile_rows_put_measurements_beside_the_plan():
    spec = resolve_model("llama-2-7b")
    s = Settings(quant="nf4", attn="sdpa", prompt_tokens=3968, max_new_tokens=128)
    samples = [StepSample(0, 0.5, 4_000_000_000, 7_000_000_000, 6_399_500_288, 7_300_000_000, 10)] + [
        StepSample(i, 0.5 + i * 0.03, 4_000_000_000 + i * 524_288, 7_000_000_000, 6_100_000_000, 7_300_000_000, 20)
        for i in range(1, 128)]
    run = RunResult(True, samples, 4.3, 3_910_000_000, None, 8_100_000_000, 7_300_000_000)
    rows = {r.name: r for r in build_rows(run, 3_876_562_944, spec, s)}
    assert rows["weights"].planned == 3_866_075_136 and abs(rows["weights"].rel) < 0.01
    assert rows["prefill peak allocated"].measured == 6_399_500_288
    assert abs(rows["prefill peak allocated"].rel) < 0.02  # the reference peak against the plan
    assert rows["KV growth per generated token"].measured == 524_288 == rows["KV growth per generated token"].planned
    assert rows["memory outside PyTorch"].measured == 800_000_000
    assert rows["reserved minus allocated (largest)"].measured == 3_000_000_000


def test_timeline_png_and_self_contained_html(tmp_path):
    from vramguard.profile.timeline import write_fit_plot, write_timeline
    samples = [StepSample(i, 0.2 + i * 0.05, GiB + i * 2**20, 2 * GiB, GiB + i * 2**20 + 10, 2 * GiB, 0)
               for i in range(20)]
    png, page = write_timeline(samples, tmp_path, "test run", "<table><tr><td>x</td></tr></table>", int(1.1 * GiB))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = page.read_text()
    assert "<svg" in text and "<table>" in text and "http" not in text.split("<svg")[0]
    fit_png = write_fit_plot([100, 200, 300], [GiB, 2 * GiB, None], [True, True, False], 3 * GiB, "prompt", 200,
                             tmp_path / "fit.png", "fit")
    assert fit_png.read_bytes()[:4] == b"\x89PNG"


def test_fit_search_on_the_h200_measurements():
    """The measured H200 runs (benchmarks/results/h200_profile_fit): reserved peak 23,295,164,416 B at 57,344
    tokens growing ~303.8 KB a token; the fine linear search found 65,024 completing and 65,536 failing."""
    spec = resolve_model("llama-3.1-8b")
    s = Settings(quant="nf4", attn="sdpa", max_new_tokens=64)

    def run(v):
        ok = v <= 65_024
        return FitRun(v, ok, None, 23_295_164_416 + (v - 57_344) * 303_800 if ok else None, 1.0)
    best, fail, runs = search(spec, s, "prompt", 24 * GiB, run)
    assert len(runs) <= 6 and (65_024 - best) / 65_024 <= 0.02 and fail <= 65_536 + 1024


def test_fit_search_is_seeded_by_the_plan():
    spec = resolve_model("llama-3.1-8b")
    s = Settings(quant="nf4", attn="sdpa", max_new_tokens=64)
    budget = 24 * GiB
    cons, opt = seeds(spec, s, "prompt", budget)
    assert 30_000 < cons < opt < 131_072
    for true in (int(opt * 1.03), int((cons + opt) / 2) + 300, int(cons * 0.9), 100_000):
        # a run completes up to ``true``; its measured reserved peak reaches the budget there (300 KB a token)
        def run(v, true=true):
            return FitRun(v, v <= true, None, budget - (true - v) * 300_000 if v <= true else None, 1.0)
        best, fail, runs = search(spec, s, "prompt", budget, run)
        assert best <= true < fail and (true - best) / true <= 0.02
        assert len(runs) <= 6, [(r.value, r.ok) for r in runs]
        # without measurements (no reserved peak) it still converges, by bisection
        best, fail, runs = search(spec, s, "prompt", budget, lambda v, true=true: FitRun(v, v <= true, None, None, 1))
        assert best <= true < fail and (true - best) / true <= 0.02 and len(runs) <= 8


def test_fit_search_stops_when_the_whole_context_fits(monkeypatch):
    """Llama-3.2-1B NF4 under 24 GiB completes its whole context (131,072 - 16 new = 131,056 prompt tokens): the
    search used to retry the clamped value forever without a run. Runs are rounded down to 128 tokens, so the
    largest value it runs is 131,056 // 128 * 128 = 130,944; one run, no failure."""
    spec = resolve_model("llama-3.2-1b")
    s = Settings(quant="nf4", attn="sdpa", max_new_tokens=16)
    import vramguard.profile.fit as fit_module
    slopes = []

    def slope(*args):  # the search asks for the plan's slope once per step it takes
        slopes.append(args)
        if len(slopes) > 20:
            raise RuntimeError("the search repeats itself without a run")
        return 300_000.0
    monkeypatch.setattr(fit_module, "_reserved_slope", slope)

    def run(v):
        return FitRun(v, True, 10 * GiB, 11 * GiB, 1.0)
    best, fail, runs = search(spec, s, "prompt", 24 * GiB, run, max_runs=3)
    assert (best, fail, [r.value for r in runs]) == (130_944, None, [130_944])


def test_binding_component_at_the_boundary():
    spec = resolve_model("llama-3.1-8b")
    s = Settings(quant="nf4", attn="sdpa", max_new_tokens=64)
    name, comps = binding_component(spec, s, "prompt", 80_000, None)
    assert name in ("prefill activations", "KV cache") and comps["kv_cache"] > 9 * GiB
    assert binding_component(spec, s, "prompt", 80_000, 50 * GiB)[0] == "fragmentation"


def test_profile_and_fit_need_a_model_and_a_gpu(tiny, monkeypatch):
    from conftest import run_cli
    from vramguard.errors import InvalidValue, NoCudaGpu, UnknownModel
    from vramguard.profile.fit import fit
    from vramguard.profile.profiler import profile
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a machine without a GPU
    with pytest.raises(UnknownModel):
        profile("/no/such/model", Settings())
    with pytest.raises(UnknownModel):
        fit("llama-2-7b", Settings(), "prompt", GiB)  # a catalog name has no weights
    folder, _ = tiny("LlamaConfig", hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                     num_attention_heads=4, vocab_size=300, max_position_embeddings=128)
    with pytest.raises(NoCudaGpu, match="needs a CUDA GPU; none found"):
        profile(str(folder), Settings())
    with pytest.raises(NoCudaGpu, match="needs a CUDA GPU; none found"):
        fit(str(folder), Settings(), "prompt", GiB)
    with pytest.raises(InvalidValue, match="vary"):
        fit(str(folder), Settings(), "tokens", GiB)
    # the CLI: no option was wrong, so not exit 2 (a bad value) but 3, what a missing environment gives
    for cmd in (("profile", str(folder)), ("fit", str(folder), "--vary", "batch")):
        r = run_cli(*cmd, columns="400")
        assert r.returncode == 3 == NoCudaGpu.exit_code, r.stderr
        assert f"error {cmd[0]}: needs a CUDA GPU; none found (" in r.stderr
        assert "run it on a machine with an NVIDIA GPU (vramguard plan predicts without one)" in r.stderr
        assert "is not valid" not in r.stderr
