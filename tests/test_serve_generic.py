"""``vramguard serve`` on the architectures transformers' continuous batching cannot run (MLA, linear attention,
Mamba, chunked attention, and the models whose attention calls the cache's own methods): the server falls back to
the generate engine, and everything a client sees works as on the paged engine, with the model's own greedy tokens."""

import logging
import threading

import httpx
import pytest

torch = pytest.importorskip("torch")

from archs import CB_REFUSED, CB_REFUSED_524, save_arch  # noqa: E402
from conftest import save_word_tokenizer  # noqa: E402

BUILD = dict(quant="fp32", page_size=16, max_batch_tokens=64, max_running=4, max_queue=8, max_kv_blocks=20,
             verify=False, served_name="tiny")


def _folder(tmp_path_factory, model_type):
    folder = tmp_path_factory.mktemp(model_type)
    save_arch(folder, model_type)
    save_word_tokenizer(folder, 256)
    return folder


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """One running server per architecture for the whole module (built on first use), stopped at its end."""
    from vramguard.serve.server import build
    made = {}

    def get(model_type):
        if model_type not in made:
            log, records = logging.getLogger("vramguard.serve"), _Records()
            level = log.level
            log.addHandler(records)
            log.setLevel(logging.DEBUG)
            try:
                s = build(str(_folder(tmp_path_factory, model_type)), **BUILD)
            finally:
                log.removeHandler(records)
                log.setLevel(level)
            BUILD_LOGS[model_type] = records.records
            made[model_type] = (model_type, s, s.start_background())
        return made[model_type]

    yield get
    for _, s, _ in made.values():
        s.stop()


BUILD_LOGS: dict[str, list] = {}  # the vramguard.serve log records of each server's build


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture
def served(request, servers):
    return servers(request.param)


def _reference(s, prompt: str, max_new_tokens: int) -> tuple[str, int]:
    """The text and token count of the model's own greedy ``generate`` for ``prompt`` (the server is idle; a model
    continuous batching serves runs paged attention, so the folder is loaded again for it)."""
    tok, model = s.app.state.api.tokenizer, s.engine.model
    if s.engine.name != "generate":
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(model.config._name_or_path, dtype=torch.float32)
    ids = torch.tensor([tok(prompt)["input_ids"]])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False)
    new = out[0, ids.shape[1]:].tolist()
    return tok.decode(new, skip_special_tokens=True), len(new)


def _complete(url, prompt="w5 w6 w7", max_tokens=6, **kw):
    return httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                                                     "temperature": 0, **kw}, timeout=60)


@pytest.mark.parametrize("served", CB_REFUSED + CB_REFUSED_524, indirect=True)
def test_serves_with_the_generate_engine_and_the_models_own_greedy_tokens(served):
    """Engine named at start (/health, /v1/models, the note saying why); completion and chat, streamed and not,
    give the tokens of the model's own ``generate`` and their counts. Bloom, Falcon and GPT-NeoX are served by
    continuous batching where it runs them (transformers 5.17), and then the same holds."""
    model_type, s, url = served
    engine = s.engine.name
    assert engine == "generate" or model_type in CB_REFUSED_524
    assert (engine == "generate") == any(f"continuous batching cannot run {model_type}" in n for n in s.engine.notes)
    # the fallback is expected: said once, at info, with the probe's own error; no warning of its failed step
    logs = BUILD_LOGS[model_type]
    assert not [r.getMessage() for r in logs if r.levelno >= logging.WARNING]
    said = [r.getMessage() for r in logs if r.levelno == logging.INFO and "cannot run" in r.getMessage()]
    assert len(said) == (engine == "generate") and all("Send it again" not in m for m in said), said
    health = httpx.get(url + "/health").json()
    assert health["engine"] == engine and health["status"] == "ok"
    assert health["max_running"] == (1 if engine == "generate" else BUILD["max_running"])
    assert httpx.get(url + "/v1/models").json()["data"][0]["engine"] == engine
    text, n = _reference(s, "w5 w6 w7", 6)
    r = _complete(url)
    assert r.status_code == 200
    body = r.json()
    assert body["choices"][0]["text"] == text
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n}
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "w9 w8"}], "max_tokens": 5, "temperature": 0}
    whole = httpx.post(url + "/v1/chat/completions", json=chat, timeout=60).json()
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=60,
                      json={**chat, "stream": True, "stream_options": {"include_usage": True}}) as resp:
        events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    import json
    chunks = [json.loads(e) for e in events[:-1]]
    assert events[-1] == "[DONE]"
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert streamed == whole["choices"][0]["message"]["content"]
    assert chunks[-1]["usage"] == whole["usage"]


@pytest.mark.parametrize("served", ["deepseek_v2", "qwen3_next"], indirect=True)
def test_concurrent_requests_each_get_their_own_greedy_tokens(served):
    """Five clients at once (one asking n=2): all answered, one request at a time, each with the solo tokens."""
    _, s, url = served
    prompts = [f"w{10 + i} w{20 + i}" for i in range(5)]
    want = [_reference(s, p, 4)[0] for p in prompts]
    got: dict[int, list[str]] = {}

    def client(i):
        r = _complete(url, prompts[i], 4, n=2 if i == 0 else 1)
        got[i] = [c["text"] for c in r.json()["choices"]] if r.status_code == 200 else [r.text]

    threads = [threading.Thread(target=client, args=(i,)) for i in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert got == {0: [want[0], want[0]], **{i: [want[i]] for i in range(1, 5)}}


@pytest.mark.parametrize("served", ["granitemoehybrid"], indirect=True)
def test_a_disconnected_stream_stops_its_generation(served):
    """The client leaves after the first chunk of a 400-token stream: the generation stops within a few steps,
    and the next request is served."""
    import time
    _, s, url = served
    before = s.engine.stats()["steps"]
    with httpx.stream("POST", url + "/v1/completions", timeout=60,
                      json={"model": "tiny", "prompt": "w3 w4", "max_tokens": 400, "ignore_eos": True,
                            "stream": True, "temperature": 0}) as resp:
        next(line for line in resp.iter_lines() if line.startswith("data: "))
    deadline = time.time() + 20
    while s.engine.in_flight() or s.engine._running_job is not None:
        assert time.time() < deadline
        time.sleep(0.01)
    assert s.engine.stats()["steps"] - before < 400
    assert _complete(url).status_code == 200


@pytest.mark.parametrize("served", ["llama4_text"], indirect=True)
def test_stop_sequences_ignore_eos_and_max_tokens(served):
    _, s, url = served
    text, _ = _reference(s, "w5 w6 w7", 6)
    stop = text.split()[2]
    r = _complete(url, stop=[stop]).json()["choices"][0]
    assert r == {"index": 0, "text": text[:text.find(stop)], "finish_reason": "stop", "logprobs": None}
    r = _complete(url, max_tokens=9, ignore_eos=True).json()
    assert r["usage"]["completion_tokens"] == 9 and r["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("served", ["deepseek_v3"], indirect=True)
def test_an_oom_in_a_step_continues_with_the_same_tokens(served):
    """An out-of-memory error in the 4th forward: the request goes on from its tokens so far and ends with the
    model's own greedy tokens; one recovery counted (stats and /metrics)."""
    _, s, url = served
    text, n = _reference(s, "w5 w6 w7", 6)
    calls = []

    def oom_once(_index, _ids):
        calls.append(1)
        if len(calls) == 4:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB (injected)")

    s.engine.before_step = oom_once
    try:
        r = _complete(url)
    finally:
        s.engine.before_step = None
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == text
    assert s.engine.stats()["oom_recoveries"] == 1
    assert "vramguard_oom_recoveries_total 1.0" in httpx.get(url + "/metrics").text
    assert len(calls) == n + 1  # 3 forwards, then a prefill of the prompt + 3 tokens and 2 more decodes


@pytest.mark.parametrize("served", ["qwen3_next"], indirect=True)
def test_a_request_that_fails_fails_alone(served):
    _, s, url = served

    def broken(_index, _ids):
        raise ValueError("a value this request's step cannot compute (injected)")

    s.engine.before_step = broken
    try:
        r = _complete(url)
    finally:
        s.engine.before_step = None
    assert r.status_code == 500 and r.json()["error"]["code"] == "request_failed"
    assert "injected" in r.json()["error"]["message"]
    assert _complete(url).status_code == 200 and s.engine.stats()["step_failures"] == 1


def test_a_request_beyond_the_budget_is_refused_with_the_numbers(tmp_path_factory):
    """The budget leaves room for a 64-token request of DeepSeek-V2 (MLA) and not for 5 + 400 tokens: 400
    kv_budget_exceeded naming the field and what always fits; the requests that fit are served."""
    from vramguard.plan import choose
    from vramguard.resolve import resolve_model
    from vramguard.runtime.load import load_model
    from vramguard.serve.generate_engine import _bound
    from vramguard.serve.server import build
    from vramguard.settings import Settings
    folder = _folder(tmp_path_factory, "deepseek_v2")
    loaded = load_model(str(folder), quant="fp32", verify=False)
    held = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    s32 = Settings(quant="fp32", attn="sdpa")
    usable = _bound(choose(resolve_model(str(folder)), s32).model, s32, 64)
    s = build(str(folder), loaded=loaded, vram_budget=held + usable, engine_choice="generate", **BUILD)
    url = s.start_background()
    try:
        limit = s.pool.pool_tokens
        assert limit >= 64 and s.pool.usable_bytes == usable
        r = _complete(url, max_tokens=400)
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["code"] == "kv_budget_exceeded" and err["param"] == "max_tokens"
        assert "3 prompt + 400 new tokens" in err["message"] and f"<= {limit:,}" in err["message"]
        assert _complete(url, max_tokens=limit - 3).status_code == 200
    finally:
        s.stop()


def test_the_engine_choice(tmp_path_factory):
    """continuous refuses what it cannot run (naming the model type and the generate engine); generate serves
    a model continuous batching runs too; anything else is refused before loading."""
    from vramguard.errors import InvalidValue
    from vramguard.serve.server import ContinuousBatchingRefused, build
    with pytest.raises(ContinuousBatchingRefused) as e:
        build(str(_folder(tmp_path_factory, "qwen3_next")), engine_choice="continuous", **BUILD)
    assert "qwen3_next" in str(e.value) and "'generate'" in str(e.value) and "linear_attention" in e.value.why
    with pytest.raises(InvalidValue) as e:
        build("no-such-folder", engine_choice="paged", **BUILD)
    assert "auto | continuous | generate" in str(e.value)
    s = build(str(_folder(tmp_path_factory, "gpt2")), engine_choice="generate", **BUILD)
    url = s.start_background()
    try:
        assert s.engine.name == "generate" and "engine 'generate' chosen" in s.engine.notes[-1]
        text, _ = _reference(s, "w5 w6 w7", 6)
        assert _complete(url).json()["choices"][0]["text"] == text
    finally:
        s.stop()
