"""Guarded generation on the CPU: every strategy, OOM injected at prefill and at decode step k, the preflight
refusal, and the CLI streaming text from a tiny model with a real (locally built) tokenizer."""

import copy

import pytest
from conftest import oom_when, run_cli, save_word_tokenizer

from vramguard.run import generate as G
from vramguard.errors import Infeasible
from vramguard.resolve import resolve_model
from vramguard.settings import Settings
from vramguard.units import GiB, MiB

CFG = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
           vocab_size=300, max_position_embeddings=512)
PROMPT = list(range(5, 45))


@pytest.fixture(scope="module")
def model():
    import torch
    import transformers
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**CFG)).eval()


def oom_at(attempt, phase, step=0):
    return oom_when(lambda ph, att, st: att == attempt and ph == phase and (phase == "prefill" or st == step))


def cpu_strategies():
    return [s for s in G.STRATEGIES if s.available(False)[0]]


def test_the_cpu_runs_every_strategy_it_can(model):
    names = [s.name for s in cpu_strategies()]  # the test extras install hqq (int8 and int4): none is skipped
    assert names == ["dynamic", "chunked prefill 2048", "static cache + chunked prefill 512",
                     "int8 KV cache + chunked prefill 512", "int4 KV cache + chunked prefill 512"]
    assert [st.name for st, _ in G.strategy_order(model, len(PROMPT), 16)[0]] == names  # no budget on the CPU
    base = G.generate(model, None, PROMPT, 16, ignore_eos=True).token_ids  # as min_new_tokens below
    assert len(base) == 16
    for st in cpu_strategies():
        import torch
        ids = torch.tensor([PROMPT])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, min_new_tokens=16,
                             do_sample=False, pad_token_id=0, **copy.deepcopy(st.kwargs))
        assert out[0, len(PROMPT):].tolist() == base, st.name


def test_int4_kv_runs_on_hqq_and_on_quanto_only_without_it():
    """hqq's quantizer is PyTorch code; optimum-quanto compiles C++ kernels at first use, so it is the int4 backend
    only where it is installed and hqq is not (transformers' quanto backend takes 2 or 4 bits)."""
    hqq, quanto = G.int4_kv_strategy("hqq"), G.int4_kv_strategy("quanto")
    assert (hqq.kwargs["cache_config"], hqq.needs_module) == ({"backend": "hqq", "nbits": 4}, "hqq")
    assert (quanto.kwargs["cache_config"], quanto.needs_module) == ({"backend": "quanto", "nbits": 4}, "optimum.quanto")
    assert hqq.name == quanto.name and hqq.plan == quanto.plan == {"kv_dtype": "int4", "prefill_chunk": 512}
    assert G.INT4_KV_BACKEND == "hqq" and G.STRATEGIES[-1] == hqq  # the test extras install hqq
    assert not G._installed("no_such_package.quanto")


@pytest.mark.parametrize("phase,step", [("prefill", 0), ("decode", 1), ("decode", 7), ("decode", 15)])
def test_oom_is_recovered_with_identical_greedy_tokens(model, phase, step):
    base = G.generate(model, None, PROMPT, 16)
    G.OOM_INJECTOR = oom_at(0, phase, step)
    r = G.generate(model, None, PROMPT, 16)
    assert r.token_ids == base.token_ids and len(r.token_ids) == 16
    assert [a.strategy for a in r.attempts] == ["dynamic", "chunked prefill 2048"]
    assert (r.attempts[0].phase, r.attempts[0].step, r.attempts[0].new_tokens) == (phase, step, step)
    assert "ran out at" in r.reason


def test_strategies_are_not_changed_by_running_them(model):
    """transformers 5.17 pops ``backend`` from a quantized cache's ``cache_config`` and adds the model's config:
    run twice, the int8 (HQQ) strategy must still be HQQ the second time (it fell back to quanto, which refuses
    8 bits, before each run got its own copy)."""
    before = copy.deepcopy([s.kwargs for s in G.STRATEGIES])
    n = len(cpu_strategies())
    for _ in range(2):
        G.OOM_INJECTOR = oom_when(lambda phase, attempt, step: attempt < n - 2)
        r = G.generate(model, None, PROMPT, 4)
        assert r.strategy == "int8 KV cache + chunked prefill 512"
    G.OOM_INJECTOR = None
    assert [s.kwargs for s in G.STRATEGIES] == before


def test_a_pinned_flash_sdpa_is_lifted_for_strategies_that_pass_a_mask(model):
    """load_model pins SDPA to the flash kernel on a GPU; that kernel takes no attention mask, which chunked prefill
    and the static/quantized/offloaded caches pass. The fallback strategies run unpinned, say so, and the pin is
    back afterwards; the plain dynamic attempt keeps it."""
    from vramguard.runtime.handle import pin_of, pin_sdpa, unpin_sdpa
    pin_sdpa(model, "flash")
    seen = []

    def first_prefill(phase, attempt, step):
        seen.append((attempt, pin_of(model) is not None))
        return attempt == 0 and phase == "prefill"
    G.OOM_INJECTOR = oom_when(first_prefill)
    try:
        r = G.generate(model, None, PROMPT, 4)
    finally:
        G.OOM_INJECTOR = None
        pinned_after = pin_of(model) is not None
        unpin_sdpa(model)
    assert (0, True) in seen and (1, False) in seen and (1, True) not in seen
    assert pinned_after
    assert r.attempts[0].sdpa_note is None and "pin to flash was lifted" in r.attempts[1].sdpa_note
    assert "pin to flash was lifted" in r.reason


def test_every_strategy_recovers_in_turn(model):
    """OOM in each strategy's own run (prefill in one, decode in the next) until the last one completes."""
    base = G.generate(model, None, PROMPT, 12).token_ids
    n = len(cpu_strategies())
    G.OOM_INJECTOR = oom_when(lambda phase, attempt, step: attempt < n - 1 and (
        (attempt % 2 == 0 and phase == "prefill") or (attempt % 2 == 1 and step == 3)))
    r = G.generate(model, None, PROMPT, 12)
    assert r.token_ids == base and len(r.attempts) == n and r.strategy == cpu_strategies()[-1].name


def test_a_request_that_never_fits_ends_with_a_clear_error(model):
    G.OOM_INJECTOR = oom_when(lambda phase, attempt, step: True)
    with pytest.raises(Infeasible) as e:
        G.generate(model, None, PROMPT, 8)
    assert "every strategy ran out of memory" in str(e.value)


def test_preflight_picks_the_first_strategy_that_fits_and_refuses_otherwise():
    spec = resolve_model("llama-3.1-8b")
    s = Settings(quant="nf4", attn="sdpa", prompt_tokens=120_000, max_new_tokens=512)
    order, why = G.preflight(spec, s, 18 * GiB, auto=True, on_cuda=True, weights_loaded=True)
    assert order[0][0].name != "dynamic" and order[0][1] <= 18 * GiB and "planned" in why
    assert all(n < order[0][1] for _, n in order[1:])  # fallbacks are smaller than the first choice
    with pytest.raises(Infeasible) as e:
        G.preflight(spec, s, 18 * GiB, auto=False, on_cuda=True, weights_loaded=True)
    from vramguard.cli.flags import as_flags
    assert "auto=True" in str(e.value) and "--auto" in as_flags(str(e.value)) and "dynamic" in str(e.value)
    with pytest.raises(Infeasible) as e:
        G.preflight(spec, s, 512 * MiB, auto=True, on_cuda=True, weights_loaded=True)
    assert "at most 512.00 MiB" in str(e.value)


def _tokenizer(folder):
    save_word_tokenizer(folder, 300)


def test_cli_run_streams_text_and_summarizes(tiny):
    folder, _ = tiny("LlamaConfig", **CFG)
    _tokenizer(folder)
    r = run_cli("run", str(folder), "--prompt", "w1 w2 w3 w4", "--max-new-tokens", "6", "--quant", "bf16")
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.split()) == 6 and all(w.startswith("w") or w.startswith("[") for w in r.stdout.split())
    assert "strategy: dynamic" in r.stderr and "6 tokens" in r.stderr
    bad = run_cli("run", str(folder))
    assert bad.returncode == 2 and "--prompt" in bad.stderr and "Traceback" not in bad.stderr


def test_ctrl_c_while_generating_keeps_the_tokens_and_their_timings(tiny):
    """A KeyboardInterrupt while tokens stream (Ctrl-C) ends generate with :class:`GenerationInterrupted`, a
    KeyboardInterrupt that carries the tokens so far: stop ``interrupted``, decode steps timed."""
    from transformers import AutoTokenizer
    folder, model = tiny("LlamaConfig", **CFG)
    _tokenizer(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    pieces = []

    def on_text(piece):
        pieces.append(piece)
        if len(pieces) == 5:
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt) as e:
        G.generate(model, tok, PROMPT, 64, on_text=on_text, ignore_eos=True)
    assert isinstance(e.value, G.GenerationInterrupted)
    r = e.value.result
    n = len(r.token_ids)
    assert r.stop == "interrupted" and 5 <= n < 64 and r.stop_detail == f"interrupted (Ctrl-C) after {n} tokens"
    assert r.timings.prefill_s is not None and r.attempts[-1].decode_steps == n - 1


def test_cli_run_interrupted_prints_the_summary_then_exits_130(tiny):
    """Ctrl-C while ``run`` streams (a stdout whose fifth write is interrupted): the summary of what came, then
    exit 130 with the interrupt's line."""
    import io
    folder, _ = tiny("LlamaConfig", **CFG)
    _tokenizer(folder)

    class Interrupted(io.StringIO):
        writes = 0

        def write(self, s):
            self.writes += 1
            if self.writes == 5:
                raise KeyboardInterrupt
            return super().write(s)
    r = run_cli("run", str(folder), "--prompt", "w1 w2 w3 w4", "--max-new-tokens", "40", "--quant", "bf16",
                "--ignore-eos", stdout=Interrupted())
    said = " ".join(r.stderr.split())
    assert r.returncode == 130, r.stderr
    assert "stopped: interrupted (Ctrl-C) after" in said and "time to first token" in said
    assert said.endswith("interrupted: stopped at Ctrl-C (exit 130)")


def test_context_chunks_rank_and_pack_within_the_budget(tiny):
    from transformers import AutoTokenizer

    from vramguard.run.context import bm25_scores, build_prompt, pack, split_chunks
    folder, _ = tiny("LlamaConfig", **CFG)
    _tokenizer(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    text = "\n\n".join(" ".join(f"w{(i * 7 + j) % 290 + 3}" for j in range(30)) for i in range(12))
    text += "\n\nhello w200 w201 w202"
    chunks = split_chunks(text, "doc.txt", tok, chunk_tokens=64)
    assert all(c.tokens <= 64 for c in chunks) and len(chunks) >= 6
    scores = bm25_scores("w201 w202", [c.text for c in chunks])
    best = max(range(len(chunks)), key=lambda i: scores[i])
    assert "w201" in chunks[best].text
    budget = len(tok(build_prompt("w201 w202", [chunks[best]]))["input_ids"]) + 5
    packed = pack("w201 w202", chunks, tok, budget)
    assert packed.used == [chunks[best]] and packed.prompt_tokens <= budget and packed.notes


def test_summarize_then_ask_fits_context_that_never_could(tiny):
    from transformers import AutoTokenizer

    from vramguard.run.context import split_chunks, summarize_then_ask
    folder, _ = tiny("LlamaConfig", **CFG)
    _tokenizer(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    chunks = split_chunks("\n\n".join(" ".join(f"w{j}" for j in range(i, i + 40)) for i in range(10)), "d", tok, 48)
    calls = []

    def summ(prompt, n):
        calls.append(n)
        return " ".join(["w5"] * min(n, 4))
    packed = summarize_then_ask("w5", chunks, tok, 120, summ)
    assert packed.summarized and len(calls) == len(chunks) and packed.prompt_tokens <= 120
    assert len(packed.used) == len(chunks)
    # chunks whose summary request is longer than the model's context are refused before any generation, with a
    # --chunk-tokens that fits (here 40 tokens of context for 48-token chunks, an instruction and their share)
    from vramguard.errors import InvalidValue
    calls.clear()
    with pytest.raises(InvalidValue) as e:
        summarize_then_ask("w5", chunks, tok, 120, summ, context_tokens=40, chunk_tokens=48)
    assert e.value.field == "chunk_tokens" and "fits the model's context of 40 tokens" in str(e.value)
    fits = int(e.value.fix.split("=")[-1])
    assert e.value.fix.startswith("pass chunk_tokens=") and 16 <= fits < 48 and calls == []
    small = split_chunks("\n\n".join(" ".join(f"w{j}" for j in range(i, i + 40)) for i in range(10)), "d", tok, fits)
    summarize_then_ask("w5", small, tok, 120, summ, context_tokens=40, chunk_tokens=fits)  # following the fix


def test_cli_run_with_context_files(tiny, tmp_path):
    folder, _ = tiny("LlamaConfig", **CFG)
    _tokenizer(folder)
    doc = tmp_path / "doc.txt"
    doc.write_text("\n\n".join(" ".join(f"w{(i * 5 + j) % 290 + 3}" for j in range(50)) for i in range(30)))
    r = run_cli("run", str(folder), "--prompt", "w7 w8", "--context", str(doc), "--max-new-tokens", "4", "--quant",
                "bf16")
    assert r.returncode == 0, r.stderr
    assert "context:" in r.stderr and "chunks" in r.stderr and len(r.stdout.split()) == 4


@pytest.mark.parametrize("kw,field", [({"temperature": -1.0}, "temperature"), ({"temperature": 0.0}, "temperature"),
                                      ({"top_p": 2.0}, "top_p"), ({"top_p": 0.0}, "top_p"), ({"top_k": 0}, "top_k")])
def test_bad_sampling_values_are_refused(model, kw, field):
    from vramguard.errors import InvalidValue
    with pytest.raises(InvalidValue) as e:
        G.generate(model, None, PROMPT, 4, do_sample=True, **kw)
    assert field in str(e.value)


def test_sampling_values_without_do_sample_are_refused_not_ignored(model):
    """Greedy decoding ignores temperature/top_p/top_k (transformers warns and drops them): refuse, naming the fix."""
    from vramguard.errors import InvalidValue
    with pytest.raises(InvalidValue) as e:
        G.generate(model, None, PROMPT, 4, temperature=0.7, top_p=0.9)
    assert e.value.field == "temperature" and "do_sample=True" in e.value.fix and "temperature, top_p" in e.value.fix


def test_cli_run_fast_decode_reports_the_decode_mode(tiny):
    folder, _ = tiny("LlamaConfig", **CFG)
    _tokenizer(folder)
    r = run_cli("run", str(folder), "--prompt", "w1 w2 w3", "--max-new-tokens", "5", "--quant", "bf16",
                "--fast-decode")
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.split()) == 5
    assert "static cache + CUDA-graph decode" in r.stderr and "eager" in r.stderr and "ms/token" in r.stderr


def test_sampling_defaults_come_from_the_models_generation_config(model):
    import torch
    gc = model.generation_config
    saved = (gc.temperature, gc.top_p, gc.top_k)
    gc.temperature, gc.top_p, gc.top_k = 0.6, 0.9, 5
    try:
        kw, note = G.resolve_sampling(model, True, None, None, 3)
        assert kw == {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 3}
        assert note == "sampling with the model's generation_config: temperature 0.6, top_p 0.9"
        assert G.resolve_sampling(model, False, None, None, None) == (
            {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}, None)
        r = G.generate(model, None, [1, 2, 3, 4], 12, do_sample=True, seed=7)
        torch.manual_seed(7)
        ref = model.generate(torch.tensor([[1, 2, 3, 4]]), max_new_tokens=12, min_new_tokens=12, do_sample=True,
                             pad_token_id=0)[0, 4:].tolist()
        assert r.token_ids == ref and "temperature 0.6, top_p 0.9, top_k 5" in r.reason
    finally:
        gc.temperature, gc.top_p, gc.top_k = saved


def test_a_request_over_the_context_is_refused_with_its_room(model):
    """max_position_embeddings=512: 500 + 20 tokens is refused before any work, with the prompt that fits; the fix
    does not point at `plan --context` (a loaded model's context is its config's)."""
    from vramguard.errors import InvalidValue
    with pytest.raises(InvalidValue) as e:
        G.generate(model, None, list(range(5, 505)), 20)
    assert "500 + 20 = 520" in str(e.value)
    assert e.value.fix == "at most 12 new tokens with this prompt or a prompt of at most 492 tokens with 20 new tokens"
    assert "plan --context" not in str(e.value)
    with pytest.raises(InvalidValue) as e:  # following the fix works: 2 + 510 fits, 2 + 511 does not
        G.generate(model, None, [5, 6], 511)
    assert e.value.fix.startswith("at most 510 new tokens with this prompt or a prompt of at most 1 token with")
    assert len(G.generate(model, None, [5, 6], 510).token_ids) == 510
    with pytest.raises(InvalidValue) as e:  # the prompt alone fills the context: only a shorter prompt helps
        G.generate(model, None, list(range(5, 517)), 20)
    assert e.value.fix == "a prompt of at most 492 tokens with 20 new tokens"
