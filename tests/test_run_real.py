"""``run`` and ``generate()`` on the real SmolLM2-135M-Instruct (float32, CPU) stop where transformers' own greedy
``generate`` stops: the same token ids for the same chat prompt, the end of turn ``<|im_end|>`` (id 2) included,
for the CLI, the Python API and every strategy that runs on the CPU; an out-of-memory retry keeps the stop, and
``ignore_eos`` generates exactly ``max_new_tokens``."""

import json

import pytest
from conftest import oom_when, run_cli

from vramguard.errors import InvalidValue
from vramguard.run import generate as G

# everyday questions whose greedy answers end well before NEW tokens (checked by the reference fixture)
PROMPTS = ("Name the three primary colors.", "What is the capital of France?", "What is 2 + 2?",
           "Translate 'good morning' into Spanish.", "How many days are in a week?")  # 23, 8, 12, 9, 9 tokens
NEW = 64
EOS = 2  # <|im_end|>, the checkpoint's generation_config.eos_token_id


@pytest.fixture(scope="module")
def loaded(smollm2):
    from vramguard.runtime.load import load_model
    return load_model(str(smollm2), quant="fp32", verify=False)


class _Reference(dict):
    """prompt -> (chat prompt ids, transformers' greedy new ids), from the model transformers loads on its own
    (:class:`conftest.GreedyReference`, one per test process); each prompt's answer is generated when a test first
    asks for it (a test's time limit covers one answer)."""

    def __init__(self, greedy, tokenizer):
        super().__init__()
        self.greedy, self.tok = greedy, tokenizer

    def __missing__(self, text):
        from vramguard.run.prompt import prepare_prompt
        enc = self.tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
        ids = enc["input_ids"][0].tolist()
        assert enc["attention_mask"].all()  # the reference's mask: every prompt token
        assert prepare_prompt(self.tok, text).ids == ids  # run's prompt is transformers' chat prompt
        new = self.greedy.new_ids(ids, NEW)
        assert new[-1] == EOS and len(new) < NEW, (text, len(new))  # an answer that ends before the limit
        self[text] = (ids, new)
        return self[text]


@pytest.fixture(scope="module")
def reference(smollm2_greedy, loaded):
    return _Reference(smollm2_greedy, loaded.tokenizer)


@pytest.mark.parametrize("text", PROMPTS)
def test_generate_stops_where_transformers_stops(loaded, reference, text):
    ids, want = reference[text]
    r = G.generate(loaded, None, ids, NEW)
    assert r.token_ids == want
    assert (r.stop, r.eos_token_ids, r.ignore_eos) == ("eos", [EOS], False)
    assert r.stop_detail == f"end of turn: the model generated '<|im_end|>' (id 2) after {len(want)} tokens"
    assert r.timings.decode_steps == len(want) - 1 and r.timings.prefill_s > 0
    assert r.loaded["quant"] == "fp32" and r.loaded["device"] == "cpu"


@pytest.mark.parametrize("text", PROMPTS[:2])
def test_cli_run_stops_where_transformers_stops(smollm2, reference, text):
    """The CLI's default on a machine without CUDA: float32 weights (said, with why), the end of turn, in JSON.
    Two prompts (the longest answer and a short one): the library's tokens on all five are compared above, and
    the CLI adds its load and its JSON, which no prompt changes."""
    ids, want = reference[text]
    r = run_cli("run", str(smollm2), "--prompt", text, "--max-new-tokens", str(NEW), "--format", "json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["token_ids"] == want and out["stop"] == "eos"
    assert out["prompt_tokens"] == len(ids)  # the chat template's ids, as sent to the model
    assert (out["loaded"]["quant"], out["loaded"]["dtype"], out["loaded"]["device"]) == ("fp32", "float32", "cpu")
    assert out["loaded"]["why"][0].startswith("weights fp32: no CUDA device: full-precision float32 weights")
    t = out["timings"]
    assert t["decode_steps"] == len(want) - 1 and all(t[k] > 0 for k in ("import_s", "load_s", "prefill_s"))
    assert t["total_s"] >= t["import_s"] + t["load_s"] + t["prefill_s"] + t["decode_s"]
    # the first token's time since the interpreter started holds every phase before it, and the decode follows it
    before = t["startup_s"] + t["import_s"] + t["prepare_s"] + t["load_s"] + t["plan_s"] + t["prefill_s"]
    assert before <= t["command_first_token_s"] <= t["total_s"] - t["decode_s"]


def test_cli_run_text_summary_says_what_ran_and_why_it_stopped(smollm2, loaded, reference):
    text = PROMPTS[1]
    ids, want = reference[text]
    r = run_cli("run", str(smollm2), "--prompt", text, "--max-new-tokens", str(NEW))
    assert r.returncode == 0, r.stderr
    err = " ".join(r.stderr.split())
    assert "loaded: fp32 weights, dtype float32, attention sdpa, on cpu - weights fp32: no CUDA device" in err
    assert f"stopped: end of turn: the model generated '<|im_end|>' (id 2) after {len(want)} tokens" in err
    assert "time: startup" in err and "load" in err and "prefill (TTFT)" in err and f"({len(want) - 1} steps)" in err
    assert r.stdout == loaded.tokenizer.decode(want, skip_special_tokens=True) + "\n"  # no <|im_end|> printed


def _cpu_strategies():
    return [s for s in G.STRATEGIES if s.available(False)[0]]


@pytest.mark.parametrize("name", [s.name for s in G.STRATEGIES if s.available(False)[0]][1:])
def test_every_cpu_strategy_stops_at_the_end_of_turn(loaded, reference, name):
    """Chunked prefill and the static cache are exact: transformers' tokens. The int8 / int4 KV caches round the
    keys and values (HQQ, groups of 64), so their text may part from float32's: they must still stop at the end of
    turn, within the limit, and say so."""
    import torch
    ids, want = reference[PROMPTS[1]]
    st = next(s for s in G.STRATEGIES if s.name == name)
    # earlier strategies run out of memory at the prefill: the one under test runs, as after real OOMs
    index = [s.name for s in _cpu_strategies()].index(name)
    G.OOM_INJECTOR = oom_when(lambda phase, attempt, step: attempt < index and phase == "prefill")
    r = G.generate(loaded, None, ids, NEW)
    assert r.strategy == name and r.stop == "eos" and r.token_ids[-1] == EOS and len(r.token_ids) < NEW
    if "kv_dtype" not in st.plan:
        assert r.token_ids == want
    else:  # the quantized cache against transformers' own run of it, which must agree exactly
        import copy
        hf = loaded.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                   max_new_tokens=NEW, do_sample=False, **copy.deepcopy(st.kwargs))
        assert r.token_ids == hf[0, len(ids):].tolist()


def test_the_graph_decoder_stops_at_the_end_of_turn(loaded, reference):
    """fast_decode=True on the CPU: the graph decoder's static-input step, run eagerly (no CUDA to capture)."""
    ids, want = reference[PROMPTS[1]]
    r = G.generate(loaded, None, ids, NEW, fast_decode=True)
    assert r.strategy == G.GRAPH_STRATEGY.name and r.decode_mode == "eager"
    assert r.token_ids == want and r.stop == "eos"
    assert r.timings.decode_steps == len(want) - 1 and r.timings.one_time_s == 0  # nothing captured on the CPU


@pytest.mark.parametrize("where", ["middle", "last"])
def test_an_oom_retry_keeps_the_stop(loaded, reference, where):
    """An OOM at decode step k: the next strategy continues from prompt + the k tokens with the budget left and
    stops at the same end of turn; at the step that produces the end token ("last"), the retry's prefill produces
    it and nothing follows."""
    ids, want = reference[PROMPTS[1]]
    k = len(want) // 2 if where == "middle" else len(want) - 1
    G.OOM_INJECTOR = oom_when(lambda phase, attempt, step: attempt == 0 and phase == "decode" and step == k)
    r = G.generate(loaded, None, ids, NEW)
    assert r.token_ids == want and r.stop == "eos"
    assert [(a.strategy, a.new_tokens) for a in r.attempts] == [("dynamic", k), ("chunked prefill 2048",
                                                                                 len(want) - k)]


def test_nothing_is_generated_after_an_end_token_or_the_budget():
    """What a retry checks before it continues: the budget spent, or an end token last (unless ignore_eos)."""
    assert G._done([5, EOS], 64, [EOS], False) and not G._done([5, EOS], 64, [EOS], True)
    assert G._done([5, 6], 2, [EOS], True) and not G._done([5, 6], 3, [EOS], False) and not G._done([], 3, [], False)


def test_ignore_eos_generates_exactly_max_new_tokens(smollm2, loaded, reference):
    ids, want = reference[PROMPTS[2]]
    n = len(want) + 6
    r = G.generate(loaded, None, ids, n, ignore_eos=True)
    assert len(r.token_ids) == n and EOS not in r.token_ids and r.token_ids[:len(want) - 1] == want[:-1]
    assert (r.stop, r.ignore_eos) == ("max_new_tokens", True)
    assert r.stop_detail == f"the token limit: {n} of max_new_tokens {n} (ignore_eos: the end tokens were masked)"
    limit = G.generate(loaded, None, ids, len(want) - 1)  # a limit before the end of turn
    assert limit.token_ids == want[:-1] and limit.stop == "max_new_tokens"
    cli = run_cli("run", str(smollm2), "--prompt", PROMPTS[2],
                  "--max-new-tokens", str(n), "--ignore-eos", "--format", "json")
    assert cli.returncode == 0, cli.stderr
    out = json.loads(cli.stdout)
    assert out["token_ids"] == r.token_ids and (out["stop"], out["ignore_eos"]) == ("max_new_tokens", True)
    with pytest.raises(InvalidValue) as e:
        G.generate(loaded, None, ids, 4, ignore_eos="yes")
    assert e.value.field == "ignore_eos" and "ignore_eos=True" in e.value.fix


def test_an_explicit_quant_is_honoured_and_said(smollm2):
    """--quant given: loaded as asked (bf16 here: the CPU has no bitsandbytes NF4 requirement to test), and the
    summary says it was asked for."""
    r = run_cli("run", str(smollm2), "--prompt", PROMPTS[3], "--max-new-tokens", "4", "--quant", "bf16",
                "--format", "json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert (out["loaded"]["quant"], out["loaded"]["dtype"]) == ("bf16", "bfloat16")
    assert out["loaded"]["why"][0] == "weights bf16: --quant was given"
    from vramguard.runtime.load import default_quant
    assert default_quant(True)[0] == "nf4" and default_quant(False)[0] == "fp32"  # CUDA: NF4, as before


def test_a_full_precision_load_does_not_import_bitsandbytes(tiny):
    """run's default without CUDA is float32: its load never imports bitsandbytes (seconds of import, unused), in a
    new process, where nothing imported it before."""
    import subprocess
    import sys
    folder, _ = tiny("LlamaConfig", hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1, vocab_size=300)
    code = ("import sys; from vramguard.runtime.load import load_model; "
            f"load_model({str(folder)!r}, quant='fp32', verify=False); print('bitsandbytes' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"
