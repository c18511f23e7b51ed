"""vramguard serve on a tiny random Llama on the CPU: the real engine, the real HTTP server on loopback, driven
with the official ``openai`` client and raw HTTP. Every loop is bounded in count and time."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
from conftest import concurrently, save_tiny_llama, serving

CFG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           vocab_size=300, max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
PAGE = 16


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("serve") / "tiny-llama", **CFG)


def _build(folder, **kw):
    from vramguard.serve.server import build
    args = dict(quant="fp32", page_size=PAGE, max_batch_tokens=64, max_running=4, max_queue=4, max_kv_blocks=20,
                verify=False, served_name="tiny")
    args.update(kw)
    return build(str(folder), **args)


@pytest.fixture(scope="module")
def server(folder):
    yield from serving(_build(folder))


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server[1] + "/v1", api_key="unused", max_retries=0, timeout=60)


_REF_MODELS: dict = {}


def _reference(served, ids: list[int], n: int) -> list[int]:
    """Greedy tokens of plain transformers ``generate`` on the same weights, loaded separately in float32 (the served
    model object runs the engine's paged attention and is not used for a plain forward)."""
    from transformers import AutoModelForCausalLM
    folder = served.engine.model.config._name_or_path
    if folder not in _REF_MODELS:
        _REF_MODELS[folder] = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                                   attn_implementation="sdpa").eval()
    m = _REF_MODELS[folder]
    with torch.no_grad():
        out = m.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


def _words(tokens: list[int]) -> str:
    return " ".join(f"w{t - 3}" for t in tokens)


def _post(url, path, body, **kw):
    return httpx.post(url + path, json=body, timeout=60, **kw)


def _err(r) -> dict:
    return r.json()["error"]


# ---------------------------------------------------------------------------------------------- the happy paths
def test_completion_greedy_matches_transformers(server, client):
    s, _ = server
    ids = [1, 10, 11, 12, 13]
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == _words(_reference(s, ids, 12))
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (5, 12, 17)


def test_chat_stream_equals_non_stream_and_reports_usage(server, client):
    msgs = [{"role": "system", "content": "w1 w2"}, {"role": "user", "content": "w3 w4 w5"}]
    full = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=9, temperature=0,
                                          extra_body={"ignore_eos": True})
    chunks = list(client.chat.completions.create(model="tiny", messages=msgs, max_tokens=9, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert text == full.choices[0].message.content and len(text.split()) == 9
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 9 and chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_completion_stream_and_stop_sequence(server, client):
    s, _ = server
    ids = [1, 20, 21, 22]
    ref = _words(_reference(s, ids, 10)).split()
    stop = ref[4]
    pieces = list(client.completions.create(model="tiny", prompt=ids, max_tokens=10, temperature=0, stream=True,
                                            stop=[stop], extra_body={"ignore_eos": True}))
    text = "".join(p.choices[0].text for p in pieces)
    assert stop not in text.split() or ref.index(stop) < 4
    assert text.split() == ref[:ref.index(stop)]
    assert pieces[-1].choices[0].finish_reason == "stop"


def test_sampling_n_and_models_and_health(server, client):
    r = client.completions.create(model="tiny", prompt="w1 w2", max_tokens=5, temperature=1.0, top_p=0.9, n=3,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2] and all(len(c.text.split()) == 5 for c in r.choices)
    assert r.usage.completion_tokens == 15
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    h = httpx.get(server[1] + "/health").json()
    assert h["status"] == "ok" and h["kv_blocks_total"] == 20 and h["kv_tokens_total"] == 20 * PAGE
    assert h["in_flight"] == 0 and h["kv_blocks_used"] == 0


def test_metrics_count_requests_and_tokens(server, client):
    before = _metric(server[1], "vramguard_generation_tokens_total")
    client.completions.create(model="tiny", prompt=[1, 5, 6], max_tokens=7, temperature=0,
                              extra_body={"ignore_eos": True})
    text = httpx.get(server[1] + "/metrics").text
    assert _metric(server[1], "vramguard_generation_tokens_total") == before + 7
    for name in ("vramguard_kv_blocks_total 20.0", "vramguard_queue_depth", "vramguard_vram_allocated_bytes",
                 "vramguard_time_to_first_token_seconds_bucket", "vramguard_time_per_output_token_seconds_count",
                 "vramguard_oom_recoveries_total", 'vramguard_requests_total{outcome="completed"}',
                 "vramguard_prompt_tokens_total"):
        assert name in text


def _metric(url, name) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(name)


# ---------------------------------------------------------------------------------------------- validation
@pytest.mark.parametrize("body,status,param,code", [
    ({"prompt": [5] * 512}, 400, "prompt", "context_length_exceeded"),  # 512 = the context
    ({"prompt": [5] * 300, "max_tokens": 300}, 400, "max_tokens", "context_length_exceeded"),
    ({"prompt": [5] * 200, "max_tokens": 200}, 400, "max_tokens", "kv_budget_exceeded"),   # 400 > 320 pool tokens
    ({"prompt": [5, -1]}, 400, "prompt", "invalid_value"),
    ({"prompt": [5, 300]}, 400, "prompt", "invalid_value"),                               # vocab is 300
    ({"prompt": "w1", "n": 5}, 400, "n", "invalid_value"),
    ({"prompt": "w1", "best_friend": 1}, 400, "best_friend", "unknown_parameter"),
    ({"prompt": "w1", "max_tokens": "ten"}, 400, "max_tokens", "invalid_value"),
    ({"prompt": "w1", "temperature": 3}, 400, "temperature", "invalid_value"),
    ({"prompt": "w1", "presence_penalty": 0.5}, 400, "presence_penalty", "unsupported_parameter"),
    ({"prompt": "w1", "model": "gpt-4"}, 404, "model", "model_not_found"),
    ({"prompt": "w1", "max_tokens": "3"}, 400, "max_tokens", "invalid_value"),     # JSON types as sent
    ({"prompt": "w1", "max_tokens": True}, 400, "max_tokens", "invalid_value"),
    ({"prompt": "w1", "stream": "yes"}, 400, "stream", "invalid_value"),
    ({"prompt": "w1", "n": "2"}, 400, "n", "invalid_value"),
    ({"prompt": 5}, 400, "prompt", "invalid_value"),                                # no union-branch tags
    ({"prompt": [[1, 2], [3]]}, 400, "prompt", "invalid_value"),                    # one prompt per request
])
def test_validation_errors_are_openai_shaped(server, body, status, param, code):
    r = _post(server[1], "/v1/completions", {"model": "tiny", **body})
    assert r.status_code == status, r.text
    e = _err(r)
    assert (e["param"], e["code"]) == (param, code) and e["message"] and e["type"]


def test_validation_messages_name_limits(server):
    e = _err(_post(server[1], "/v1/completions", {"model": "tiny", "prompt": [5] * 300, "max_tokens": 300}))
    assert "512" in e["message"] and "max_tokens <= 212" in e["message"]
    e = _err(_post(server[1], "/v1/completions", {"model": "tiny", "prompt": [5] * 200, "max_tokens": 200}))
    assert "320" in e["message"]
    r = _post(server[1], "/v1/chat/completions", {"model": "tiny", "messages": []})
    assert r.status_code == 400 and _err(r)["param"] == "messages"
    r = httpx.post(server[1] + "/v1/completions", content=b"{not json", timeout=10)
    assert r.status_code == 400 and _err(r)["code"] == "invalid_json"


def test_unknown_routes_and_methods_are_openai_shaped_and_model_aliases_work(server, folder):
    url = server[1]
    r = httpx.get(url + "/v1/nothing")
    assert r.status_code == 404 and _err(r)["code"] == "not_found" and "/v1/completions" in _err(r)["message"]
    r = httpx.get(url + "/v1/completions")
    assert r.status_code == 405 and _err(r)["code"] == "method_not_allowed" and r.headers["Allow"] == "POST"
    r = _post(url, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": 5}]})
    assert r.status_code == 400 and _err(r)["param"] == "messages.0.content"
    for name in (str(folder), folder.name, folder.name + "/"):  # the folder's path and name, as well as the served name
        r = _post(url, "/v1/completions", {"model": name, "prompt": [1, 2], "max_tokens": 2, "ignore_eos": True})
        assert r.status_code == 200, r.text


def test_openai_client_raises_on_context(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=[7] * 600, max_tokens=4)
    assert e.value.code == "context_length_exceeded"


def test_body_over_limit_is_413(server):
    r = httpx.post(server[1] + "/v1/completions", content=b'{"model":"tiny","prompt":"' + b"w1 " * 400_000 + b'"}',
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 413 and _err(r)["code"] == "request_too_large"


def test_rejected_requests_cost_no_engine_step(server):
    s, url = server
    steps = s.engine.stats()["steps"]
    for body in ({"prompt": [5, -1]}, {"prompt": "w1", "n": 9}, {"prompt": [5] * 200, "max_tokens": 200}):
        assert _post(url, "/v1/completions", {"model": "tiny", **body}).status_code == 400
    time.sleep(0.3)
    assert s.engine.stats()["steps"] == steps


# ---------------------------------------------------------------------------------------------- API key
def test_api_key_guards_every_route_but_health(folder):
    s = _build(folder, api_key="s3cret")
    url = s.start_background()
    try:
        for method, path in (("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/completions"),
                             ("POST", "/v1/chat/completions")):
            r = httpx.request(method, url + path, json={"model": "tiny", "prompt": "w1"}, timeout=10)
            assert r.status_code == 401 and _err(r)["code"] == "invalid_api_key", path
        r = httpx.get(url + "/v1/models", headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
        assert httpx.get(url + "/health").status_code == 200
        c = openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0)
        assert len(c.completions.create(model="tiny", prompt="w1", max_tokens=3, temperature=0,
                                        extra_body={"ignore_eos": True}).choices[0].text.split()) == 3
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0).models.list()
    finally:
        s.stop()


# ---------------------------------------------------------------------------------------------- cancellation
def _slow(engine, seconds=0.01):
    engine.before_step = lambda i, ids: time.sleep(seconds)


def test_stream_disconnect_frees_blocks_within_one_step(server):
    """Steps are counted from the moment the server cancels the request (its disconnect seen), not from the
    client's close: how soon the event loop sees the close depends on the machine's load, the rule does not."""
    s, url = server
    e = s.engine
    _slow(e)
    cancelled_at = {}

    def cancel(request_id):
        cancelled_at.setdefault(request_id, time.perf_counter())
        type(e).cancel(e, request_id)
    e.cancel = cancel
    try:
        rid = _next_id(e)
        with httpx.stream("POST", url + "/v1/completions", timeout=30,
                          json={"model": "tiny", "prompt": [1, 7, 8], "max_tokens": 200, "stream": True,
                                "temperature": 0, "ignore_eos": True}) as r:
            assert r.status_code == 200, (r.read(), e.stats(), {k: vars(v) for k, v in e.handles.items()})
            lines = r.iter_lines()  # kept open: leaving a for-loop would close the connection before the asserts
            n = 0
            while n < 5:
                n += next(lines).startswith("data:")
            assert rid in e.handles and e.kv_blocks_used() >= 1, (e.stats(), list(e.steps)[-3:])
        deadline = time.time() + 60
        while (e.kv_blocks_used() or rid not in cancelled_at) and time.time() < deadline:
            time.sleep(0.01)
        assert e.kv_blocks_used() == 0 and rid in cancelled_at
        after = [st for st in e.steps if st.at > cancelled_at[rid] and rid in st.request_ids]
        assert len(after) <= 1, after  # at most the step already under way when the request was cancelled
        assert rid not in e.handles
    finally:
        e.before_step = None
        del e.cancel


def test_queued_disconnect_costs_no_gpu_work(folder):
    s = _build(folder, max_running=1, max_queue=2)
    url = s.start_background()
    e = s.engine
    _slow(e, 0.02)
    try:
        got = {}
        long = threading.Thread(target=lambda: got.setdefault("a", _post(url, "/v1/completions", {
            "model": "tiny", "prompt": [1, 4, 5], "max_tokens": 60, "temperature": 0, "ignore_eos": True})))
        long.start()
        deadline = time.time() + 10
        while not e.steps and time.time() < deadline:
            time.sleep(0.01)
        known = set(e.handles)
        with pytest.raises(httpx.ReadTimeout):  # the client gives up while its request waits behind the long one
            httpx.post(url + "/v1/completions", timeout=0.3,
                       json={"model": "tiny", "prompt": [1, 9, 9], "max_tokens": 5, "temperature": 0})
        long.join(timeout=30)
        assert got["a"].status_code == 200
        time.sleep(0.3)
        queued = [rid for st in e.steps for rid in st.request_ids if rid not in known]
        assert queued == [], str([(st.index, st.request_ids) for st in e.steps][-70:])
        assert e.kv_blocks_used() == 0 and e.in_flight() == 0
        assert _metric(url, 'vramguard_requests_total{outcome="cancelled"}') == 1
    finally:
        e.before_step = None
        s.stop()


# ---------------------------------------------------------------------------------------------- overload
def test_burst_beyond_the_queue_gets_429_and_the_rest_complete(folder):
    s = _build(folder, max_running=2, max_queue=2)
    url = s.start_background()
    _slow(s.engine, 0.01)
    results = []
    lock = threading.Lock()

    def one(i):
        t0 = time.perf_counter()
        r = _post(url, "/v1/completions", {"model": "tiny", "prompt": [1, 3 + i], "max_tokens": 16,
                                           "temperature": 0, "ignore_eos": True})
        with lock:
            results.append((r, time.perf_counter() - t0))

    try:
        concurrently(one, 12, 60)
        codes = sorted(r.status_code for r, _ in results)
        assert len(results) == 12 and set(codes) <= {200, 429}
        ok = [r for r, _ in results if r.status_code == 200]
        busy = [(r, dt) for r, dt in results if r.status_code == 429]
        assert 4 <= len(ok) < 12 and busy
        assert all(r.json()["usage"]["completion_tokens"] == 16 for r in ok)
        for r, _dt in busy:
            assert int(r.headers["Retry-After"]) >= 1 and _err(r)["code"] == "queue_full"
        assert _metric(url, 'vramguard_requests_total{outcome="rejected_overload"}') == len(busy)
    finally:
        s.stop()


# ---------------------------------------------------------------------------------------------- faults
def test_injected_oom_at_step_k_is_recovered_with_the_same_tokens(folder):
    s = _build(folder)
    url = s.start_background()
    e = s.engine
    prompts = [[1, 30, 31, 32], [1, 40, 41], [1, 50]]
    refs = [_reference(s, p, 24) for p in prompts]
    fired = []

    def inject(index, ids):
        time.sleep(0.005)
        if not fired and len(ids) >= 2 and e.handles and index >= 8:
            fired.append((index, tuple(ids)))
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")

    e.before_step = inject
    try:
        out = [None] * 3

        def one(i):
            out[i] = _post(url, "/v1/completions", {"model": "tiny", "prompt": prompts[i], "max_tokens": 24,
                                                     "temperature": 0, "ignore_eos": True})

        concurrently(one, 3, 60)
        assert fired, "the injection did not fire"
        assert [o.status_code for o in out] == [200, 200, 200]
        assert [o.json()["choices"][0]["text"] for o in out] == [_words(r) for r in refs]
        assert e.oom_recoveries == 1 and e.oom_events[0]["requeued"]
        assert httpx.get(url + "/health").json()["status"] == "ok"
        assert _metric(url, "vramguard_oom_recoveries_total") == 1
    finally:
        s.stop()


def test_request_that_keeps_running_out_of_memory_fails_cleanly(folder):
    s = _build(folder)
    url = s.start_background()
    e = s.engine
    victim = {}

    def inject(index, ids):
        rid = victim.get("id")
        if rid is not None and rid in ids:
            raise torch.OutOfMemoryError("CUDA out of memory (injected, every step)")

    e.before_step = inject
    try:
        res = {}
        t = threading.Thread(target=lambda: res.setdefault("r", _post(url, "/v1/completions", {
            "model": "tiny", "prompt": [1, 9], "max_tokens": 8, "temperature": 0})))
        victim["id"] = _next_id(e)
        t.start()
        t.join(timeout=30)
        r = res["r"]
        assert r.status_code == 503 and _err(r)["type"] == "server_error" and "out of memory" in _err(r)["message"]
        ok = _post(url, "/v1/completions", {"model": "tiny", "prompt": [1, 5], "max_tokens": 4, "temperature": 0,
                                            "ignore_eos": True})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
        assert httpx.get(url + "/health").json()["status"] == "ok"
    finally:
        s.stop()


def _next_id(engine) -> str:
    import copy
    return f"vg-{next(copy.copy(engine._ids))}"


def test_unrecoverable_device_error_fails_health_and_exits_nonzero(folder):
    s = _build(folder)
    url = s.start_background()

    def boom(index, ids):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    s.engine.before_step = boom
    r = _post(url, "/v1/completions", {"model": "tiny", "prompt": [1, 9], "max_tokens": 4})
    assert r.status_code == 503 and _err(r)["type"] == "server_error"
    t = s._thread
    t.join(timeout=15)
    assert not t.is_alive() and s.exit_code == 3
    assert "illegal memory access" in str(s.fatal)


# ---------------------------------------------------------------------------------------------- router and CLI
def _run_router(workers, **kw):
    from vramguard.serve.router import create_router
    from vramguard.serve.server import make_server
    fatal = []
    app = create_router(workers, on_fatal=fatal.append, **kw)
    server = make_server(app, "127.0.0.1", 0)
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    deadline = time.time() + 20
    while not server.started and time.time() < deadline:
        time.sleep(0.02)
    h, p = server.servers[0].sockets[0].getsockname()[:2]
    return server, t, f"http://{h}:{p}", fatal


def test_router_balances_two_workers_by_free_kv(folder):
    from vramguard.serve.router import Worker, pick
    a, b = _build(folder, api_key="ka"), _build(folder, api_key="kb")
    ua, ub = a.start_background(), b.start_background()
    for s in (a, b):
        _slow(s.engine, 0.01)
    server, t, url, fatal = _run_router([Worker("a", ua, key="ka"), Worker("b", ub, key="kb")], api_key="front")
    try:
        time.sleep(0.4)  # first /health poll
        h = httpx.get(url + "/health").json()
        assert h["status"] == "ok" and set(h["workers"]) == {"a", "b"}
        assert httpx.get(url + "/v1/models").status_code == 401
        seen = []

        def one(i):
            r = _post(url, "/v1/completions", {"model": "tiny", "prompt": [1, 3 + i], "max_tokens": 20,
                                               "temperature": 0, "ignore_eos": True},
                      headers={"Authorization": "Bearer front"})
            seen.append((r.status_code, r.headers.get("x-vramguard-worker"), r.json()["usage"]["completion_tokens"]))

        concurrently(one, 6, 60)
        assert sorted(x[0] for x in seen) == [200] * 6 and all(x[2] == 20 for x in seen)
        assert {x[1] for x in seen} == {"a", "b"}
        c = openai.OpenAI(base_url=url + "/v1", api_key="front", max_retries=0)
        assert c.models.retrieve("tiny").id == "tiny"
        text = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "w1"}], max_tokens=5, temperature=0, stream=True,
            extra_body={"ignore_eos": True}) if ch.choices)
        assert len(text.split()) == 5
        r = _post(url, "/v1/completions", {"model": "tiny", "prompt": [5, -1]},
                  headers={"Authorization": "Bearer front"})
        assert r.status_code == 400 and _err(r)["param"] == "prompt"  # the worker's own error, relayed
    finally:
        server.should_exit = True
        t.join(timeout=10)
        a.stop()
        b.stop()
    # the choice itself: most free KV among workers with admission slots (slots counted by the router itself)
    stats = {"kv_tokens_total": 1000, "max_running": 2, "max_queue": 0}
    w1 = Worker("x", "", stats={**stats, "kv_tokens_reserved": 900}, healthy=True, relaying=1)
    w2 = Worker("y", "", stats={**stats, "kv_tokens_reserved": 100}, healthy=True, relaying=2)
    assert pick([w1, w2]).name == "x"  # y has more free KV but no slot
    w2.relaying = 1
    assert pick([w1, w2]).name == "y"
    w2.healthy = False
    assert pick([w1, w2]).name == "x"
    w1.relaying = 2
    assert pick([w1, w2]) is None  # every healthy worker full: the router answers 429 itself


def test_router_rejects_when_every_worker_is_full_without_asking_them(folder):
    from vramguard.serve.router import Worker
    a = _build(folder, max_running=1, max_queue=1)
    ua = a.start_background()
    _slow(a.engine, 0.02)
    server, t, url, fatal = _run_router([Worker("a", ua)])
    try:
        time.sleep(0.3)
        out = []

        def one(i):
            out.append(_post(url, "/v1/completions", {"model": "tiny", "prompt": [1, 3 + i], "max_tokens": 12,
                                                      "temperature": 0, "ignore_eos": True}))

        concurrently(one, 8, 60)
        ok = [r for r in out if r.status_code == 200]
        busy = [r for r in out if r.status_code == 429]
        assert len(ok) == 2 and len(busy) == 6 and len(out) == 8
        assert all(r.json()["usage"]["completion_tokens"] == 12 for r in ok)
        assert all(int(r.headers["Retry-After"]) >= 1 and _err(r)["code"] == "queue_full" for r in busy)
        assert all("x-vramguard-worker" not in r.headers for r in busy)  # answered by the router itself
        assert _metric(ua, 'vramguard_requests_total{outcome="rejected_overload"}') == 0
        assert _metric(url, "vramguard_router_rejected_total") == 6
    finally:
        server.should_exit = True
        t.join(timeout=10)
        a.stop()


def test_router_fails_health_when_a_worker_dies(folder):
    from vramguard.serve.router import Worker
    a = _build(folder)
    ua = a.start_background()
    server, t, url, fatal = _run_router([Worker("a", ua)])
    try:
        time.sleep(0.4)
        assert httpx.get(url + "/health").status_code == 200
        def boom(i, ids):
            raise RuntimeError("CUDA error: unspecified launch failure")
        a.engine.before_step = boom
        assert _post(url, "/v1/completions", {"model": "tiny", "prompt": [1, 2]}).status_code == 503
        deadline = time.time() + 10
        while not fatal and time.time() < deadline:
            time.sleep(0.05)
        assert fatal and httpx.get(url + "/health").status_code == 503
    finally:
        server.should_exit = True
        t.join(timeout=10)
        a.stop()


def test_cli_serve_rejects_bad_or_busy_ports_before_loading(folder, monkeypatch):
    import socket

    from conftest import run_cli
    from vramguard.runtime import load
    monkeypatch.setattr(load, "load_model", lambda *a, **k: pytest.fail("loaded before the port was checked"))
    r = run_cli("serve", str(folder), "--port", "99999")
    assert r.returncode == 2 and "error --port: 99999 is not valid; accepted: 0..65535" in r.stderr
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = run_cli("serve", str(folder), "--port", str(port))
    assert r.returncode == 2 and "a free port on 127.0.0.1" in r.stderr and "Traceback" not in r.stderr
    assert "choose another --port" in r.stderr


def test_cli_serve_answers_then_stops_with_a_request_in_flight(folder, tmp_path):
    """One ``vramguard serve`` process: it answers a chat request, then Ctrl-C with a request in flight answers
    that request 503 and exits 0, with no traceback."""
    import signal
    import subprocess
    import sys
    ready = tmp_path / "url"
    p = subprocess.Popen([sys.executable, "-m", "vramguard", "serve", str(folder), "--port", "0", "--quant", "fp32",
                          "--page-size", "16", "--max-batch-tokens", "64", "--max-running", "4",
                          "--served-model-name", "tiny", "--ready-file", str(ready)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while not ready.exists() and p.poll() is None and time.time() < deadline:
            time.sleep(0.1)
        assert ready.exists(), p.stderr.read() if p.poll() is not None else "no ready file"
        url = ready.read_text()
        assert url.startswith("http://127.0.0.1:")
        r = _post(url, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "w1 w2"}],
                                                "max_tokens": 4, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200 and len(r.json()["choices"][0]["message"]["content"].split()) == 4
        res = {}
        t = threading.Thread(target=lambda: res.setdefault("r", _post(url, "/v1/completions", {
            "model": "tiny", "prompt": [1, 2], "max_tokens": 400, "ignore_eos": True, "temperature": 0})))
        t.start()
        deadline = time.time() + 30
        while httpx.get(url + "/health").json()["in_flight"] == 0 and time.time() < deadline:
            time.sleep(0.01)
        p.send_signal(signal.SIGINT)  # once: a second Ctrl-C is uvicorn's forced exit
        t.join(timeout=60)
        out, errs = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    r = res["r"]
    assert r.status_code == 503 and _err(r)["type"] == "server_error" and "shutting down" in _err(r)["message"]
    assert _err(r)["code"] == "shutting_down" and r.headers["Retry-After"] == "5"
    assert p.returncode == 0, errs
    assert "Traceback" not in errs and "Event loop is closed" not in errs, errs
    assert "KV pool" in errs and "serving tiny on http://127.0.0.1:" in errs
    # the chat request completed; the completion cut by the stop did not
    said = re.search(r"stopped: Ctrl-C or SIGTERM; 1 completion, 1 refused, failed or cancelled, (\d+) tokens? "
                     r"generated", " ".join(errs.split()))  # wrapped at the terminal's width
    assert said and int(said[1]) >= 4, errs  # the chat request's 4 tokens at least


def test_greedy_server_refuses_sampling_and_matches_transformers(folder):
    s = _build(folder, greedy=True)
    url = s.start_background()
    try:
        ids = [1, 60, 61]
        r = _post(url, "/v1/completions", {"model": "tiny", "prompt": ids, "max_tokens": 10, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == _words(_reference(s, ids, 10))
        r = _post(url, "/v1/completions", {"model": "tiny", "prompt": ids, "max_tokens": 4, "temperature": 0.7})
        assert r.status_code == 400 and (_err(r)["param"], _err(r)["code"]) == ("temperature", "unsupported_parameter")
        from vramguard.cli.flags import as_flags
        assert "greedy=True" in _err(r)["message"] and "--greedy" in as_flags(_err(r)["message"])
    finally:
        s.stop()


def test_cli_serve_names_missing_packages(monkeypatch, folder):
    import importlib.util

    from typer.testing import CliRunner

    from vramguard.cli import app
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("fastapi", "uvicorn")
                        else real(name, *a))
    r = CliRunner().invoke(app, ["serve", str(folder)])
    assert r.exit_code == 3
    text = r.output + (r.stderr if hasattr(r, "stderr") and r.stderr_bytes is not None else "")
    assert "fastapi, uvicorn not installed" in text and "pip install 'vramguard[serve,gpu]'" in text


def test_step_budget_halved_by_an_oom_grows_back(folder, monkeypatch):
    from vramguard.serve import engine as E
    monkeypatch.setattr(E, "RESTORE_AFTER_STEPS", 5)
    s = _build(folder)
    url = s.start_background()
    e = s.engine
    fired = []

    def inject(index, ids):
        if not fired and ids:
            fired.append(index)
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
    e.before_step = inject
    try:
        r = _post(url, "/v1/completions", {"model": "tiny", "prompt": [1, 8], "max_tokens": 30, "temperature": 0,
                                           "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 30
        assert e.oom_events[0]["max_batch_tokens"] == [64, 32]
        assert e._manager.batch_processor.max_batch_tokens == 64  # 30 steps later: doubled back to the plan's
    finally:
        s.stop()


def test_engine_refusing_the_pool_is_a_clear_error(folder, monkeypatch):
    """transformers' own free-memory check refusing the planned pool ends the start with Infeasible (exit 4 in the
    CLI) naming both numbers, not with the engine's traceback."""
    from vramguard.errors import Infeasible
    from vramguard.serve import _compat
    real = _compat.guarded_manager_class()

    class Refusing(real):
        def _create_batch_processor(self):
            raise MemoryError("Memory footprint 22563073024 is more than available memory 20719665152")

    monkeypatch.setattr(_compat, "guarded_manager_class", lambda: Refusing)
    with pytest.raises(Infeasible) as e:
        _build(folder)
    msg = str(e.value)
    assert "21.01 GiB" in msg and "19.30 GiB" in msg and e.value.exit_code == 4
    # the fix gives the shortfall and a pool that would pass: 20 blocks of 16 tokens planned (--max-kv-blocks 20)
    from vramguard.cli.flags import as_flags
    assert "lower vram_budget= by at least 1.72 GiB" in e.value.fix
    assert "--max-kv-blocks 1," in as_flags(e.value.fix) and "a KV pool of 20 blocks" in msg


def test_a_model_without_a_tokenizer_says_what_that_means(tmp_path):
    """A folder with weights and no tokenizer serves token-id prompts; completions then carry no text, which the
    start notes and /health say (with the fix), and chat is refused with a 400 naming the reason."""
    import transformers
    torch.manual_seed(0)
    folder = tmp_path / "no-tok"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**CFG)).save_pretrained(folder)
    s = _build(folder)
    url = s.start_background()
    try:
        health = httpx.get(url + "/health").json()
        note = next(n for n in health["notes"] if n.startswith("no tokenizer"))
        assert "completions carry no text" in note and "add the tokenizer files" in note
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 3,
                                                       "temperature": 0, "ignore_eos": True}, timeout=60).json()
        assert r["usage"]["completion_tokens"] == 3 and r["choices"][0]["text"] == ""
        c = httpx.post(url + "/v1/chat/completions", json={"model": "tiny", "messages": [
            {"role": "user", "content": "hi"}]}, timeout=60)
        assert c.status_code == 400 and c.json()["error"]["code"] == "no_tokenizer"
    finally:
        s.stop()


# ---------------------------------------------------------------------------------------------- close
def test_close_stops_serving_and_drops_the_pool_and_the_model(folder):
    """An in-process server gives its memory back on close(): the engine's manager (KV pool, paged cache) is
    garbage, the model's parameters are gone, and the port no longer answers. On the GPU the same call's
    UnloadReport is checked in tests/test_gpu.py."""
    import gc
    import weakref
    s = _build(folder)
    url = s.start_background()
    r = _post(url, "/v1/completions", {"model": "tiny", "prompt": [1, 5, 6], "max_tokens": 4, "temperature": 0,
                                       "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    manager = weakref.ref(s.engine._manager)
    rep = s.close()
    gc.collect()
    assert manager() is None and s.engine._cache is None
    assert all(p is None for mod in s.engine.model.modules() for p in mod._parameters.values())
    assert rep.residual_bytes is None  # CPU: not measured
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/health", timeout=2)
    with pytest.raises(RuntimeError, match="build"):
        s.start_background()


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_between_admission_and_submit_answers_503_not_500(folder, stream):
    """SIGTERM landing while an admitted request's body is still being checked: the engine has stopped by the time
    the request reaches it. The answer is the 503 shutting_down error object (with Retry-After), never a 500 with
    a traceback, and nothing is left queued."""
    s = _build(folder)
    url = s.start_background()
    e = s.engine
    submit = e.submit

    def stopped_first(*a, **kw):
        e.stop()  # what the shutdown hook does, between this request's admission and its submit
        return submit(*a, **kw)
    e.submit = stopped_first
    try:
        r = _post(url, "/v1/completions", {"model": "tiny", "prompt": [1, 5, 6], "max_tokens": 4, "stream": stream})
        assert r.status_code == 503, r.text
        assert _err(r)["code"] == "shutting_down" and r.headers["Retry-After"] == "5"
        assert e.handles == {}
    finally:
        s.stop()


def test_sigterm_ends_every_accepted_stream_with_an_error_event(folder):
    """SIGTERM with streams accepted (200 and headers sent), one generating and the rest queued: each ends with
    the shutting_down error event and [DONE], none is cut. sse-starlette cancels open streams within 0.5 s of the
    signal unless given a grace period; the server's drain (here held back 1.5 s) ends them itself."""
    import asyncio
    import json
    import signal

    from sse_starlette.sse import AppStatus
    s = _build(folder, max_running=1, max_queue=8)
    drain = s._drain

    async def late_drain():
        await asyncio.sleep(1.5)
        await drain()
    s._drain = late_drain
    url = s.start_background()
    _slow(s.engine, 0.02)
    n, started, ends = 4, threading.Semaphore(0), {}

    def one(i):
        try:
            with httpx.stream("POST", url + "/v1/completions", timeout=60, json={
                    "model": "tiny", "prompt": [1, 2 + i], "max_tokens": 200, "ignore_eos": True, "stream": True}) as r:
                started.release()
                data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
                ends[i] = (r.status_code, data[-2:])
        except httpx.HTTPError as e:
            ends[i] = ("cut", type(e).__name__)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    try:
        for t in threads:
            t.start()
        for _ in range(n):
            assert started.acquire(timeout=30)  # every stream accepted: headers sent
        s.server.handle_exit(signal.SIGTERM, None)  # what the signal handler runs
        for t in threads:
            t.join(timeout=60)
    finally:
        s.stop()
        AppStatus.should_exit = False  # process-wide in sse-starlette: the next test's server starts clean
    assert len(ends) == n
    for i, end in ends.items():
        assert end[0] == 200, (i, end)
        last, done = end[1]
        assert done == "[DONE]" and json.loads(last)["error"]["code"] == "shutting_down", (i, end)


def test_a_hybrid_models_pool_holds_the_planned_blocks_on_every_transformers(tmp_path):
    """Gemma-2 (2 sliding + 2 full layers): transformers 5.17 counts blocks of one layer group (2 groups here), 5.24
    blocks of every layer; either way the engine's pool is the 20 whole-model blocks planned, of PAGE tokens, and a
    request's blocks are counted in them (48 + 8 tokens: ceil(56 / 16) = 4 blocks at most)."""
    import httpx

    from conftest import save_tiny
    from vramguard.serve._compat import blocks_per_pool_block
    folder, model = save_tiny(tmp_path, "Gemma2Config", hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=32,
                              vocab_size=300, max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
    groups = blocks_per_pool_block(model.config)
    for s, url in serving(_build(folder)):
        e = s.engine
        assert e.pool.num_blocks == 20 and e._cache.num_blocks == 20 * groups
        _slow(e, 0.02)
        seen = []
        t = threading.Thread(target=lambda: seen.append(httpx.post(url + "/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": list(range(3, 51)), "max_tokens": 8, "temperature": 0, "ignore_eos": True})))
        t.start()
        held = 0
        deadline = time.time() + 30
        while t.is_alive() and time.time() < deadline:
            held = max(held, e.kv_blocks_used())
            time.sleep(0.005)
        t.join(30)
        e.before_step = None
        assert seen and seen[0].status_code == 200 and seen[0].json()["usage"]["completion_tokens"] == 8
        assert 1 <= held <= 4 and e.kv_blocks_used() == 0


def test_a_budget_the_weights_alone_fill_is_refused_before_loading(folder, monkeypatch):
    """``vram_budget`` below the planned weights: refused before any weight is read (on the CPU too, where no hard
    cap is set), naming the weights' bytes; the load is never called."""
    from vramguard.errors import Infeasible
    from vramguard.plan.choice import choose
    from vramguard.resolve import resolve_model
    from vramguard.serve import server
    from vramguard.settings import Settings

    def no_load(*a, **k):
        raise AssertionError("the model was loaded")
    monkeypatch.setattr(server, "load_model", no_load)
    s = Settings(quant="fp32")
    weights = choose(resolve_model(str(folder)), s).model.weight_bytes(s).total_bytes
    with pytest.raises(Infeasible) as e:
        _build(folder, vram_budget=weights)
    assert e.value.field == "vram_budget" and "planned before loading" in str(e.value)
    from vramguard.units import fmt_bytes
    assert f"more than the {fmt_bytes(weights)} the weights take" in str(e.value)
    assert "quant=bf16" in e.value.fix and "nf4" not in e.value.fix  # no CUDA device: NF4 would crawl on the CPU


def test_the_fix_for_a_small_budget_loads_smaller_weights_only_where_that_helps():
    from vramguard.serve.pool import smaller_weights_fix
    assert smaller_weights_fix("nf4", True) == smaller_weights_fix("nf4", False) == ""  # already 4-bit
    assert smaller_weights_fix("bf16", True) == ", or quantize the weights (quant=nf4)"
    assert smaller_weights_fix("fp32", False) == ", or load 16-bit weights (quant=bf16: half of float32's memory)"
    assert smaller_weights_fix("bf16", False) == ""  # on the CPU NF4 dequantizes every weight at each step
