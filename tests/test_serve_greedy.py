"""serve on the real SmolLM2-135M-Instruct on the CPU: temperature 0 is transformers' greedy ``generate`` token for
token (five prompts batched by the continuous engine, three queued by the generate engine), identical greedy requests get one text (one after another, streamed or not,
eight at once), a request's seed reproduces its draw whatever else runs, and ``deterministic`` computes one
request per step. Short answers (``MAX_TOKENS``) keep it to a few minutes on two cores."""

from __future__ import annotations

import functools
import json
import threading

import httpx
import pytest
import torch
from conftest import concurrently, save_tiny_llama, serving

MAX_TOKENS = 40
PROMPTS = ["Write one sentence about why the sky is blue.", "What is the capital of France?",
           "Give me two tips for sleeping better.", "Translate 'good morning' into Spanish.",
           "What is 12 times 7?"]
SKY = PROMPTS[0]
# the generate engine runs each request alone through transformers' own ``generate``: every prompt takes the same
# path, so one answer cut at MAX_TOKENS and two that end their turn (the capital, the translation) cover both finish
# reasons and the queue (two wait while one runs) that five would
QUEUED = [SKY, PROMPTS[1], PROMPTS[3]]


def _build(folder, **kw):
    from vramguard.serve.server import build
    args = dict(quant="fp32", page_size=16, max_batch_tokens=512, max_running=8, max_queue=16, max_kv_blocks=96,
                verify=False, served_name="smollm2", warm_up=False)
    args.update(kw)
    return build(str(folder), **args)


@pytest.fixture(scope="module")
def continuous(smollm2):
    yield from serving(_build(smollm2, engine_choice="continuous"))


@pytest.fixture(scope="module")
def generate(smollm2):
    yield from serving(_build(smollm2, engine_choice="generate"))


@pytest.fixture(scope="module")
def reference(smollm2_greedy):
    """transformers' own greedy ``generate`` on the same float32 weights (loaded apart, SDPA), on the chat prompt
    the server builds (the template with the generation prompt, tokenized without special tokens added)."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(smollm2_greedy.folder)

    @functools.cache  # each prompt's reference once for the module (both engines and the repeats compare to it)
    def greedy(prompt: str) -> tuple[str, list[int]]:
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                       tokenize=False)
        new = smollm2_greedy.new_ids(tok(text, add_special_tokens=False)["input_ids"], MAX_TOKENS)
        return tok.decode(new, skip_special_tokens=True), new

    return greedy


def _chat(url: str, prompt: str, stream: bool = False, **kw) -> dict:
    """(text, finish_reason, completion_tokens) of one chat request."""
    body = {"model": "smollm2", "messages": [{"role": "user", "content": prompt}], "max_tokens": MAX_TOKENS,
            "temperature": 0, **kw}
    if not stream:
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)
        assert r.status_code == 200, r.text
        c = r.json()
        return {"text": c["choices"][0]["message"]["content"], "finish": c["choices"][0]["finish_reason"],
                "tokens": c["usage"]["completion_tokens"]}
    text, finish, tokens = "", None, None
    body.update(stream=True, stream_options={"include_usage": True})
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for ch in chunk.get("choices") or []:
                text += ch["delta"].get("content") or ""
                finish = ch.get("finish_reason") or finish
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return {"text": text, "finish": finish, "tokens": tokens}


def _at_once(url: str, prompts: list[str], **kw) -> list[dict]:
    results: list = [None] * len(prompts)

    def one(i):
        results[i] = _chat(url, prompts[i], **kw)
    concurrently(one, len(prompts), timeout_s=900)
    assert None not in results
    return results


def _same_as_reference(result: dict, ref: tuple[str, list[int]]) -> None:
    text, tokens = ref
    stopped = tokens[-1] == 2  # <|im_end|>, the end of turn: counted as a completion token, not shown
    assert result["text"] == text
    assert (result["finish"], result["tokens"]) == ("stop" if stopped else "length", len(tokens))


@pytest.mark.parametrize("engine", ["continuous", "generate"])
def test_greedy_is_transformers_generate_token_for_token_on_prompts_sent_at_once(engine, request, reference):
    """Chat prompts sent at once (the continuous engine batches its five; the generate engine queues its three,
    :data:`QUEUED`): each answer is transformers' ``generate(do_sample=False)`` on the same weights, its stop
    included."""
    _, url = request.getfixturevalue(engine)
    prompts = PROMPTS if engine == "continuous" else QUEUED
    refs = [reference(p) for p in prompts]
    assert sum(r[1][-1] == 2 for r in refs) >= 2  # answers that end their turn within MAX_TOKENS: the stop is tested
    assert sum(r[1][-1] != 2 for r in refs) >= 1  # and one cut at the limit
    for result, ref in zip(_at_once(url, prompts), refs):
        _same_as_reference(result, ref)


def test_identical_greedy_requests_get_one_text_one_after_another_streamed_and_at_once(continuous, reference):
    _, url = continuous
    texts = [_chat(url, SKY)["text"], _chat(url, SKY, stream=True)["text"]]  # after the first test's at once
    texts += [r["text"] for r in _at_once(url, [SKY] * 8)]
    assert set(texts) == {reference(SKY)[0]}


def test_bf16_greedy_requests_get_one_text_one_after_another_and_streamed(smollm2):
    """bfloat16 weights as the server loads them: logits tie at the top often enough that a top-1 *draw* gave
    identical requests different texts; the argmax gives one. (Equal to float32's text it need not be.)"""
    served = _build(smollm2, quant="bf16", max_running=2, max_kv_blocks=24)
    url = served.start_background()
    try:
        texts = {_chat(url, SKY, max_tokens=24)["text"] for _ in range(3)}
        texts.add(_chat(url, SKY, stream=True, max_tokens=24)["text"])
        assert len(texts) == 1 and len(next(iter(texts))) > 40
        assert next(iter(served.engine.model.parameters())).dtype == torch.bfloat16
    finally:
        served.stop()


SEEDED_TOKENS = 16  # a draw of 16 tokens at temperature 1 already differs between seeds


@pytest.mark.parametrize("engine", ["continuous", "generate"])
def test_a_seed_reproduces_its_draw_whatever_else_runs(engine, request):
    """temperature 1 with ``seed``: the same text alone and beside other sampling requests (unseeded and seeded
    with other seeds) sent at the same time; other seeds draw other texts."""
    _, url = request.getfixturevalue(engine)
    poem = "Write a short poem about the sea."
    draw = dict(temperature=1.0, max_tokens=SEEDED_TOKENS)
    alone = _chat(url, poem, seed=1234, **draw)["text"]
    results: list = [None] * 7

    def one(i):
        kw = [dict(seed=1234), dict(), dict(seed=99), dict(seed=7), dict(seed=1), dict(seed=2), dict(seed=3)][i]
        results[i] = _chat(url, [poem, poem, SKY, PROMPTS[2], poem, poem, poem][i], **draw, **kw)["text"]
    concurrently(one, 7, timeout_s=900)
    assert results[0] == alone
    assert len(set(results[4:]) | {alone}) >= 3  # seeds 1, 2 and 3 of the same prompt


def test_choices_of_one_seeded_request_differ_and_repeat(continuous):
    _, url = continuous
    body = {"model": "smollm2", "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 8,
            "temperature": 1.0, "seed": 5, "n": 3}
    first = [c["message"]["content"] for c in httpx.post(url + "/v1/chat/completions", json=body,
                                                          timeout=600).json()["choices"]]
    again = [c["message"]["content"] for c in httpx.post(url + "/v1/chat/completions", json=body,
                                                          timeout=600).json()["choices"]]
    assert first == again and len(set(first)) >= 2


def test_deterministic_computes_one_request_per_step_and_keeps_the_texts(tmp_path):
    """A tiny random Llama: ``deterministic=True`` makes every engine step hold one request while eight run
    concurrently, each with the text it has alone; without it the steps batch them."""
    folder = save_tiny_llama(tmp_path / "tiny", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
                             max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
    from vramguard.serve.server import build
    steps = {}
    for deterministic in (False, True):
        served = build(str(folder), quant="fp32", page_size=16, max_batch_tokens=128, max_running=8, max_queue=8,
                       max_kv_blocks=64, verify=False, served_name="tiny", warm_up=False,
                       deterministic=deterministic)
        url = served.start_background()
        try:
            body = {"model": "tiny", "prompt": [1, 40, 41, 42], "max_tokens": 12, "temperature": 0,
                    "ignore_eos": True}
            alone = httpx.post(url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
            served.engine.clear_history()
            texts: list = [None] * 8
            lock = threading.Lock()

            def one(i):
                r = httpx.post(url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
                with lock:
                    texts[i] = r
            concurrently(one, 8)
            assert texts == [alone] * 8
            steps[deterministic] = max(len(s.request_ids) for s in served.engine.steps)
            assert any("deterministic" in n for n in served.engine.notes) == deterministic
        finally:
            served.stop()
    assert steps[True] == 1 and steps[False] > 1
