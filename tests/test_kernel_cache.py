"""The kernel check's verdict kept on disk (``vramguard.run.kernels.verdict``, ``vramguard.run.kernel_check``): a miss
runs the whole check and writes the verdict, a hit runs a spot check instead, any change of what the verdict
depends on misses, a corrupt file is ignored with a message and rewritten, a verdict whose spot check fails is
checked again; and the decoder's time split: one-time work before the first token, the streamed wall clock equal
to the reported decode. On the CPU (Triton's interpreter for the kernels, an emulated graph for the capture)."""

import gzip
import json
import os
import time

import pytest
from conftest import interpreted_kernels

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():  # before triton decorates the kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")
transformers = pytest.importorskip("transformers")

from vramguard.run import fastdecode as F  # noqa: E402
from vramguard.run.kernels import verdict as V  # noqa: E402

PROMPT = list(range(5, 25))


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.setenv("VRAMGUARD_KERNEL_CACHE", str(tmp_path / "kernels"))
    return tmp_path / "kernels"


def _llama(**over):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**{**dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                             num_attention_heads=4, num_key_value_heads=2, vocab_size=64), **over})
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


VERDICT = V.KernelVerdict(True, True, True, True, "4-bit matmul; decode attention", "logits 0.05")


# -- the cache alone -------------------------------------------------------------------------------------------------

def test_a_verdict_is_read_back_as_written_and_a_missing_one_is_a_miss(folder):
    m = _llama()
    key = V.verdict_key(m, torch.device("cpu"), torch.bfloat16, (True, True, True, True))
    assert key.parent == folder and V.read_verdict(key) == (None, None)  # a miss: nothing said
    V.write_verdict(key, VERDICT)
    assert V.read_verdict(key) == (VERDICT, None)


def test_every_input_of_the_verdict_changes_its_key(folder, monkeypatch):
    m, cpu = _llama(), torch.device("cpu")
    base = V.verdict_key(m, cpu, torch.bfloat16, (True, True, True, True))
    assert V.verdict_key(_llama(), cpu, torch.bfloat16, (True, True, True, True)) == base  # same config, same key
    others = [V.verdict_key(_llama(hidden_size=128), cpu, torch.bfloat16, (True, True, True, True)),
              V.verdict_key(m, cpu, torch.float16, (True, True, True, True)),
              V.verdict_key(m, cpu, torch.bfloat16, (True, True, False, True))]  # fused=False asked for
    monkeypatch.setattr(V, "device_signature", lambda d: ("cuda", "NVIDIA H200", (9, 0), "13.0"))
    others.append(V.verdict_key(m, cpu, torch.bfloat16, (True, True, True, True)))
    monkeypatch.setattr(V, "device_signature", lambda d: ("cuda", "NVIDIA GeForce RTX 4090", (8, 9), "13.0"))
    others.append(V.verdict_key(m, cpu, torch.bfloat16, (True, True, True, True)))
    monkeypatch.setattr(V.diskcache, "environment_version", lambda: "another torch, triton or vramguard source")
    others.append(V.verdict_key(m, cpu, torch.bfloat16, (True, True, True, True)))
    assert len({base, *others}) == 1 + len(others)


def test_the_cache_is_off_with_0_and_a_corrupt_file_is_said_not_raised(folder, monkeypatch):
    m = _llama()
    key = V.verdict_key(m, torch.device("cpu"), torch.bfloat16, ())
    key.parent.mkdir(parents=True)
    key.write_bytes(b"not gzip")
    got, why = V.read_verdict(key)
    assert got is None and why.startswith(f"the kept kernel check {key} could not be read (BadGzipFile")
    with gzip.open(key, "wt") as f:
        json.dump({"t": [1, 2]}, f)  # valid JSON of another kind
    assert V.read_verdict(key)[1].endswith("holds tuple, not a kernel verdict")
    monkeypatch.setenv("VRAMGUARD_KERNEL_CACHE", "0")
    assert V.verdict_key(m, torch.device("cpu"), torch.bfloat16, ()) is None
    V.write_verdict(None, VERDICT)  # nothing to write, nothing raised


# -- in the decoder --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def nf4_model():
    interpreted_kernels(("nf4", "_matmul_4bit_kernel"), ("decode_attention", "_split_kernel"))
    from test_fused_step import _nf4_llama
    return _nf4_llama()


@pytest.fixture(scope="module")
def attn_model():
    """A one-layer Llama without 4-bit layers: the decode attention is its only kernel (a cheap full check)."""
    interpreted_kernels(("decode_attention", "_split_kernel"))
    return _llama(initializer_range=0.2)


def _decode(model, new=2):
    dec = F.GraphDecoder(model, len(PROMPT) + new - 1, kernels=True)
    return dec.generate(PROMPT, new, eos_token_id=None)


def test_a_second_decoder_reuses_the_verdict_after_a_spot_check(nf4_model, folder, monkeypatch):
    from vramguard.run.kernels import selftest
    first = _decode(nf4_model)
    assert first.kernel_check == "full" and first.kernels.startswith("fused step")
    assert len(list(folder.glob("kernels-*.json.gz"))) == 1
    calls = []
    monkeypatch.setattr(selftest, "check_4bit_layers", lambda *a, **k: calls.append(k))
    second = _decode(nf4_model)
    assert second.kernel_check == "kept" and second.token_ids == first.token_ids
    assert calls == [{"limit": 1}]  # one layer, not one per shape
    assert "checked: the kept verdict and a spot check" in second.kernels and second.kernels.startswith("fused step")


def test_a_corrupt_verdict_is_said_and_rewritten(attn_model, folder):
    first = _decode(attn_model)
    assert first.kernel_check == "full" and first.kernels.startswith("decode attention")
    (path,) = folder.glob("kernels-*.json.gz")
    path.write_bytes(b"\x1f\x8b broken")
    again = _decode(attn_model)
    assert again.kernel_check == "full" and again.token_ids == first.token_ids
    assert f"the kept kernel check {path} could not be read" in again.kernels and "checked again" in again.kernels
    assert V.read_verdict(path)[0] is not None  # written again


def test_a_verdict_whose_spot_check_fails_is_checked_again(attn_model, folder, monkeypatch):
    from vramguard.run.kernels import decode_attention
    assert _decode(attn_model).kernel_check == "full"
    real = decode_attention.decode_attention
    monkeypatch.setattr(decode_attention, "decode_attention", lambda *a: 2 * real(*a))  # the kernel now disagrees
    r = _decode(attn_model)
    assert r.kernel_check == "full" and "the kept kernel check did not hold (RuntimeError: it differs" in r.kernels
    assert r.kernels.startswith("none: decode attention kernel off")  # the whole check turned it off: kept so
    (path,) = folder.glob("kernels-*.json.gz")
    assert V.read_verdict(path)[0].attn is False


# -- the time split --------------------------------------------------------------------------------------------------

def test_one_time_work_is_done_before_the_first_token_and_decode_is_the_stream(monkeypatch):
    """A slow capture (0.3 s) and slow warm-up steps: both before the first token, timed apart; the decode time is
    the first streamed token to the last (it holds the stream, and none of the capture)."""
    from test_fastdecode import CFG, emulated_capture
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**CFG)).eval()
    events = []

    def slow_capture(step):
        time.sleep(0.3)
        events.append(("capture", time.perf_counter()))
        return emulated_capture(step)

    monkeypatch.setattr(F, "GRAPH_OVERRIDE", lambda model: (True, "forced by the test"))
    monkeypatch.setattr(F, "CAPTURE_OVERRIDE", slow_capture)
    r = F.graph_decode(m, PROMPT, 12, min_new_tokens=12,
                       on_token=lambda t: events.append(("token", time.perf_counter())))
    end = time.perf_counter()
    kinds = [k for k, _ in events]
    assert kinds == ["capture"] + ["token"] * 12  # the capture came before the first token
    tokens = [t for k, t in events if k == "token"]
    assert r.capture_s >= 0.3 and r.one_time_s >= r.capture_s
    assert (r.decode_steps, r.replay_steps, r.eager_steps, r.warmup_steps) == (11, 11, 0, 2)
    # the rule, by the order of the clock's readings (true however busy the machine): the decode time holds the
    # stream from its first token to its last, and none of the capture (the capture ended before the first token)
    wall, capture_end = tokens[-1] - tokens[0], events[0][1]
    assert wall <= r.decode_s <= end - capture_end
    assert r.decode_ms_per_token == pytest.approx(r.decode_s * 1000 / 11)


def test_generate_reports_plan_one_time_prefill_and_decode_apart(monkeypatch):
    """:func:`vramguard.run.generate.generate` on the graph strategy: prefill (TTFT) is the prefill alone, the
    capture is one-time work, and the first token's time holds plan + one-time + prefill."""
    from test_fastdecode import CFG, emulated_capture

    from vramguard.run.generate import generate
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**CFG)).eval()
    monkeypatch.setattr(F, "GRAPH_OVERRIDE", lambda model: (True, "forced by the test"))
    monkeypatch.setattr(F, "CAPTURE_OVERRIDE", lambda step: (time.sleep(0.2), emulated_capture(step))[1])
    r = generate(m, None, PROMPT, 10, fast_decode=True, ignore_eos=True)
    t = r.timings
    assert r.strategy.endswith("CUDA-graph decode") and r.decode_mode == "emulated_graph"
    assert t.capture_s >= 0.2 and t.prefill_s > 0 and r.ttft_s == t.prefill_s
    assert t.decode_steps == 9 and t.decode_ms_per_token == pytest.approx(t.decode_s * 1000 / 9)
    assert t.first_token_s >= t.plan_s + t.one_time_s + t.prefill_s
    assert t.generate_s >= t.one_time_s + t.prefill_s + t.decode_s
    assert t.to_json()["one_time_s"] == t.one_time_s


def test_the_strategy_plan_is_read_back_from_disk(tmp_path, monkeypatch):
    """``run``'s preflight plans each strategy once per model and request: a later process reads the two integers
    it uses (the kept plan in VRAMGUARD_PLAN_CACHE), and gets the same order."""
    import sys

    from vramguard.resolve import resolve_model
    from vramguard.run import generate as G
    from vramguard.settings import Settings
    from vramguard.units import GiB
    monkeypatch.setenv("VRAMGUARD_PLAN_CACHE", str(tmp_path / "plans"))
    spec, s = resolve_model("llama-3.1-8b"), Settings(prompt_tokens=2000, max_new_tokens=256)
    first = G.preflight(spec, s, 40 * GiB, auto=True, on_cuda=True, weights_loaded=True, fast_decode=True)
    assert len(list((tmp_path / "plans").glob("run_strategy-*.json.gz"))) >= len(first[0]) > 2

    def no_plan(*a, **k):
        raise AssertionError("planned again")
    monkeypatch.setattr(sys.modules["vramguard.plan"], "estimate", no_plan)
    assert G.preflight(spec, s, 40 * GiB, auto=True, on_cuda=True, weights_loaded=True, fast_decode=True) == first


def test_triton_s_own_key_is_computed_ahead(monkeypatch):
    """``run`` computes Triton's cache key (a hash of its 400 MB library) in a thread while the weights load: the
    function it calls is Triton's own, found where Triton keeps it."""
    cache = pytest.importorskip("triton.runtime.cache")
    from vramguard.run.kernels import warm_triton
    calls = []
    monkeypatch.setattr(cache, "triton_key", lambda: calls.append(1) or "key")
    warm_triton()
    assert calls == [1]


def test_the_decode_attention_is_not_compiled_again_for_every_prompt_length():
    """Triton compiles a kernel once per value of each ``tl.constexpr`` parameter (and keeps it in its own cache on
    disk): the number of splits, which follows the cache length every 64 to 128 slots, is a run-time integer, or
    nearly every new prompt length would compile the kernels again (run's one-time work before the first token).
    The iterations per split stay a constexpr (Triton's interpreter cannot loop over a run-time argument): they
    change every 2,048 slots for 8 KV heads."""
    pytest.importorskip("triton")
    import inspect

    from vramguard.run.kernels import decode_attention as A
    for kernel, per_length in ((A._split_kernel, {"SPLITS"}), (A._merge_kernel, {"SPLITS"})):
        params = inspect.signature(kernel.fn).parameters.values()
        constexprs = {p.name for p in params if "constexpr" in str(p.annotation)}
        assert constexprs and not constexprs & per_length, constexprs
    assert A.split_plan(2255, 8) == (18, 2) and A.split_plan(2400, 8) == (19, 2)  # a new split count, same kernel


def test_serves_4bit_matmul_timing_is_kept_and_read_back_by_the_next_process(folder, monkeypatch):
    """``serve``'s choice of the fastest 4-bit matmul path per shape is timed once per model, GPU and versions: the
    second engine start reads it back (tuple keys and all) instead of timing again, and says so in its note; a
    kernel verdict in the same folder is not taken for it."""
    from vramguard.serve import decode_graphs as D
    calls = []
    choice = {(128, 64, "gemv"): "gather", (128, 64, "gemm"): "lut"}
    times = [{"shape": [128, 64], "rows": 8, "bnb_us": 9.5, "gather_us": 4.25}]

    def timed(model, route, dtype, rows):
        calls.append(rows)
        return dict(choice), list(times)
    monkeypatch.setattr(D, "fastest_4bit_paths", timed)
    m = _llama()
    first = D.timed_paths(m, None, torch.bfloat16, torch.device("cpu"))
    second = D.timed_paths(m, None, torch.bfloat16, torch.device("cpu"))
    assert first == (choice, times, False) and second == (choice, times, True) and len(calls) == 1
    assert D.timed_paths(m, None, torch.float16, torch.device("cpu"))[2] is False  # another dtype: timed again
    key = V.verdict_key(m, torch.device("cpu"), torch.bfloat16, ("other",))
    V.write_verdict(key, VERDICT)
    assert V.read_verdict(key, V.GemmChoice) == (None, f"the kept kernel check {key} holds KernelVerdict, not a "
                                                       "4-bit matmul choice")
