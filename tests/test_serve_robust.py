"""vramguard serve against hostile and unlucky requests, on a tiny random Llama on the CPU: values the engine cannot
compute are refused before admission; a step that still fails because of one request fails that request alone;
clients that send no body hold no slot; stop sequences are never partly sent; Retry-After follows the engine."""

from __future__ import annotations

import json
import logging
import math
import re
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
from conftest import save_tiny_llama, serving
from test_serve import CFG, _build, _err, _metric, _next_id, _post, _reference, _words

from vramguard.serve.engine import device_fault
from vramguard.serve.streaming import StopText


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("robust") / "tiny-llama", **CFG)


@pytest.fixture(scope="module")
def server(folder):
    yield from serving(_build(folder))


def _text(tokens: list[int]) -> str:
    """What the server returns for ``tokens``: the words, special tokens ([UNK] [BOS] [EOS]) skipped."""
    return _words([t for t in tokens if t >= 3])


def _raw(url: str, path: str, body: bytes):
    return httpx.post(url + path, content=body, headers={"content-type": "application/json"}, timeout=30)


# ---------------------------------------------------------------------------------------------- refused up front
@pytest.mark.parametrize("body,param,limit", [
    ('"top_k": 2147483648', "top_k", "300"),                 # the engine's int32 top-k tensor; the vocabulary is 300
    ('"top_k": 301', "top_k", "300"),
    ('"temperature": 1e-39', "temperature", "0.0001"),       # NaN in multinomial
    ('"temperature": 5e-324', "temperature", "0.0001"),
    ('"temperature": NaN', "temperature", "finite"),
    ('"top_p": Infinity', "top_p", "finite"),
    ('"temperature": -Infinity', "temperature", "finite"),
    ('"top_p": 1e999', "top_p", "finite"),
    ('"max_tokens": 123456789012345678901234567890', "max_tokens", "64-bit"),
    ('"prompt": "w1 \\ud800 w2"', "prompt", "surrogate"),
    ('"user": "\\udfff"', "user", "surrogate"),
    ('"logit_bias": ' + '{"a": ' * 20 + "1" + "}" * 20, "logit_bias" + ".a" * 15, "16"),  # 17 levels, the body being 1
    ('"stop": ""', "stop", "at least one character"),
    ('"stop": ["a", "b", "c", "d", "e"]', "stop", "at most 4"),
])
def test_values_the_engine_cannot_compute_are_refused_naming_field_limit_and_value(server, body, param, limit):
    s, url = server
    steps = s.engine.stats()["steps"]
    raw = ('{"model": "tiny", "prompt": "w1 w2", "max_tokens": 4, ' + body + "}").encode()
    if '"prompt"' in body:
        raw = ('{"model": "tiny", "max_tokens": 4, ' + body + "}").encode()
    r = _raw(url, "/v1/completions", raw)
    assert r.status_code == 400, r.text
    e = _err(r)
    assert e["param"] == param and limit in e["message"] and e["type"] == "invalid_request_error", e
    assert len(e["message"].splitlines()) <= 2
    assert s.engine.stats()["steps"] == steps  # refused before admission: no engine work


@pytest.mark.parametrize("raw,code", [
    (b'{"model": "tiny", "prompt": "w1 \xff\xfe"}', "invalid_json"),                  # broken UTF-8
    (b'{"model": "tiny", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "invalid_json"),  # deeper than json
    (b'{"model": "tiny", "prompt": [1, 2], "max_tokens": 1' + b"0" * 5000 + b"}", "invalid_value"),  # digit limit
    (b"[1, 2, 3]", "invalid_json"),
])
def test_bodies_that_are_not_json_objects_get_400(server, raw, code):
    r = _raw(server[1], "/v1/chat/completions", raw)
    assert r.status_code == 400 and _err(r)["code"] == code, r.text


def test_the_hostile_requests_of_the_report_leave_the_server_serving(server):
    """The report's two requests (top_k 2**31, temperature 1e-39), streamed and not, then a normal one."""
    s, url = server
    for extra in ({"top_k": 2147483648}, {"temperature": 1e-39}, {"temperature": 5e-324}):
        for stream in (False, True):
            r = _post(url, "/v1/completions", {"model": "tiny", "prompt": "w1 w2", "max_tokens": 4,
                                               "stream": stream, **extra})
            assert r.status_code == 400, r.text
    ok = _post(url, "/v1/completions", {"model": "tiny", "prompt": [1, 5], "max_tokens": 4, "temperature": 0,
                                        "ignore_eos": True})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
    assert s.engine.check_fatal() is None and httpx.get(url + "/health").json()["status"] == "ok"


def test_device_faults_are_told_from_request_faults():
    import torch
    assert device_fault(RuntimeError("CUDA error: an illegal memory access was encountered")) == "CUDA error"
    assert device_fault(RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED when calling cublasGemmEx")) == "CUBLAS_STATUS"
    assert device_fault(RuntimeError("value cannot be converted to type int32 without overflow")) is None
    assert device_fault(RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")) is None
    assert device_fault(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")) is None


# ---------------------------------------------------------------------------------------------- one request fails
def _victim_among(url: str, e, prompts: list[list[int]], n_new: int, victim_body: dict, victim: dict):
    """Start one greedy request per prompt, wait until all are generating, then send ``victim_body``, which the
    engine schedules beside them (``victim["id"]`` is its request id once it is known, before it is sent).
    Returns (the victim's request id, its response, the others' responses)."""
    out = [None] * len(prompts)

    def one(i):
        out[i] = _post(url, "/v1/completions", {"model": "tiny", "prompt": prompts[i], "max_tokens": n_new,
                                                 "temperature": 0, "ignore_eos": True})
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    deadline = time.time() + 20
    while (len(e.handles) < len(prompts) or min(h.generated for h in list(e.handles.values())) < 2) \
            and time.time() < deadline:
        time.sleep(0.002)
    victim["id"] = _next_id(e)
    r = _post(url, "/v1/completions", {"model": "tiny", **victim_body})
    for t in threads:
        t.join(timeout=60)
    return victim["id"], r, out


def test_an_injected_step_failure_fails_its_request_and_the_batch_completes_exactly(folder):
    """Every step that holds the victim raises (not an OOM, not a device fault). The first such step also holds
    three generating requests: the engine isolates the four, the victim fails alone with its 500 request_failed
    error, the three others complete with exactly their greedy tokens, and the server keeps serving."""
    s = _build(folder)
    url = s.start_background()
    e = s.engine
    prompts = [[1, 30, 31, 32], [1, 40, 41], [1, 50]]
    refs = [_reference(s, p, 30) for p in prompts]
    victim = {}

    def inject(index, ids):
        time.sleep(0.01)
        if victim.get("id") in ids:
            raise ValueError("injected: this request's values cannot be computed")

    e.before_step = inject
    try:
        rid, r, out = _victim_among(url, e, prompts, 30, {"prompt": [1, 9, 9], "max_tokens": 8, "temperature": 0},
                                    victim)
        assert r.status_code == 500, r.text
        err = _err(r)
        assert err["code"] == "request_failed" and err["type"] == "server_error" and "injected" in err["message"]
        assert [o.status_code for o in out] == [200, 200, 200]
        assert [o.json()["choices"][0]["text"] for o in out] == [_text(x) for x in refs]
        first, last = e.step_failure_events[0], e.step_failure_events[-1]
        assert len(first["isolating"]) == 4 and rid in first["isolating"] and last["failed"] == [rid]
        assert e.check_fatal() is None and _metric(url, "vramguard_step_failures_total") == len(e.step_failure_events)
        h = httpx.get(url + "/health").json()
        assert h["status"] == "ok" and h["isolating"] == 0 and h["in_flight"] == 0 and h["kv_blocks_used"] == 0
    finally:
        e.before_step = None
        s.stop()


@pytest.mark.parametrize("values,raised", [({"top_k": 2**31, "temperature": 1.0}, "int32"),
                                           ({"temperature": 1e-39}, "probability tensor")])
def test_a_value_that_breaks_the_engine_for_real_fails_only_its_request(folder, monkeypatch, values, raised):
    """With the sampling checks switched off, the report's values reach the engine and raise inside a step the real
    way (transformers' int32 top-k tensor; NaN probabilities in multinomial) beside two generating requests: the
    request fails alone, the two complete with exactly their tokens, the engine goes on."""
    from vramguard.serve import validate
    monkeypatch.setattr(validate, "_check_sampling", lambda req, limits: None)
    s = _build(folder)
    url = s.start_background()
    e = s.engine
    e.before_step = lambda i, ids: time.sleep(0.01)
    prompts = [[1, 60, 61], [1, 70]]
    refs = [_reference(s, p, 30) for p in prompts]
    try:
        rid, r, out = _victim_among(url, e, prompts, 30, {"prompt": [1, 80, 81], "max_tokens": 8, **values}, {})
        assert r.status_code == 500 and _err(r)["code"] == "request_failed", r.text
        assert raised in _err(r)["message"]
        assert [o.status_code for o in out] == [200, 200]
        assert [o.json()["choices"][0]["text"] for o in out] == [_text(x) for x in refs]
        assert rid in e.step_failure_events[0]["isolating"] + e.step_failure_events[0]["failed"]
        assert e.check_fatal() is None and httpx.get(url + "/health").json()["status"] == "ok"
    finally:
        e.before_step = None
        s.stop()


# ---------------------------------------------------------------------------------------------- slow bodies
def _open_without_body(url: str, n: int, partial: bool) -> list[socket.socket]:
    host, port = url.removeprefix("http://").split(":")
    socks = []
    for i in range(n):
        c = socket.create_connection((host, int(port)), timeout=10)
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\n"
                  b"content-length: 100\r\n\r\n" + (b'{"model": "tiny", ' if partial and i % 2 else b""))
        socks.append(c)
    return socks


def test_clients_that_send_no_body_hold_no_slot_and_time_out_once(folder, caplog):
    """2 x (running + queue) = 8 connections that send headers and no body (or half of one): a normal request still
    gets its 200 while they are open (had they held the 4 slots, it would get a 429 at once), that is before any
    of them is answered; each of the 8 gets one 408 when its body time is up, counted in /metrics and logged (no
    traceback), the count of the log lines adding up to 8."""
    import select
    s = _build(folder, max_running=2, max_queue=2, body_timeout_s=8.0)  # room for a loaded machine
    url = s.start_background()
    caplog.set_level(logging.WARNING, logger="vramguard.serve")
    socks = _open_without_body(url, 8, partial=True)
    try:
        time.sleep(0.3)
        r = _post(url, "/v1/completions", {"model": "tiny", "prompt": [1, 5], "max_tokens": 4, "temperature": 0,
                                           "ignore_eos": True})
        assert r.status_code == 200
        assert select.select(socks, [], [], 0)[0] == []  # no 408 sent yet: served while the 8 were waiting
        answers = []
        for c in socks:
            c.settimeout(10)
            answers.append(c.recv(65536).split(b"\r\n", 1)[0])
        assert answers == [b"HTTP/1.1 408 Request Timeout"] * 8, answers
        assert _metric(url, 'vramguard_refusals_total{code="request_timeout"}') == 8
        s.app.state.api.refusals.flush(force=True)
        lines = [rec for rec in caplog.records if "request_timeout" in rec.getMessage()]
        counted = sum(int(m.group(1)) if (m := re.search(r"refused (\d+) more", rec.getMessage())) else 1
                      for rec in lines)
        assert counted == 8 and all(rec.exc_info is None for rec in lines), [x.getMessage() for x in lines]
        assert not [rec for rec in caplog.records if rec.exc_info is not None]
    finally:
        for c in socks:
            c.close()
        s.stop()


class _Spy:
    """A tokenizer that records the thread each call runs in."""

    def __init__(self, tok, seen):
        self._tok, self._seen = tok, seen

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def __call__(self, *a, **kw):
        self._seen.append(threading.current_thread().name)
        return self._tok(*a, **kw)


def test_tokenization_and_parsing_run_off_the_event_loop(server, monkeypatch):
    from vramguard.serve import api as api_module
    s, url = server
    api = s.app.state.api
    seen, parsed = [], []
    real_parse = api_module.parse_request

    def parse(*a):
        parsed.append(threading.current_thread().name)
        return real_parse(*a)
    monkeypatch.setattr(api_module, "parse_request", parse)
    monkeypatch.setattr(api.prompts, "tokenizer", _Spy(api.prompts.tokenizer, seen))
    monkeypatch.setattr(api.prompts, "long_tokenizer", _Spy(api.prompts.long_tokenizer, seen))
    r = _post(url, "/v1/completions", {"model": "tiny", "prompt": "w1 " * 100_000, "max_tokens": 4})
    assert r.status_code == 400 and _err(r)["code"] == "context_length_exceeded"
    r = _post(url, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "w1"}],
                                            "max_tokens": 2})
    assert r.status_code == 200
    # the 300,000-character prompt, in the long lane: its prefixes of 512, 1,024 and 2,048 characters (1, 2 and 4
    # per context token), the last already over the 512-token context; never the whole prompt
    assert seen == ["vramguard-tokenize-long_0"] * 3 + ["vramguard-tokenize_0"], seen
    assert len(parsed) == 2 and all(name.startswith("vramguard-parse") for name in parsed), parsed


# ---------------------------------------------------------------------------------------------- stops, Retry-After
def test_stop_text_never_sends_part_of_a_stop_sequence():
    st, sent, text = StopText(["hll9ve"]), "", ""
    for piece in ["a", "b h", "ll", "9", "v", "e", "zz"]:
        text += piece
        delta, stopped = st.feed(text, False)
        sent += delta
        if stopped:
            break
    assert (sent, stopped) == ("ab ", True)
    st = StopText(["hll9ve"])
    assert st.feed("x hll9", False) == ("x ", False) and st.feed("x hll9 w", True) == ("hll9 w", False)
    assert StopText(["ab"]).feed("w\ufffd", False) == ("w", False)  # an incomplete UTF-8 sequence waits


def test_a_stop_sequence_across_tokens_is_cut_in_streamed_and_whole_text(server):
    s, url = server
    ids = [1, 100, 101, 102]
    words = _text(_reference(s, ids, 16)).split()
    k = next(i for i in range(2, 14) if len(words[i]) >= 3 and len(words[i + 1]) >= 3 and words[i] != words[i + 1])
    stop = words[k][-2:] + " " + words[k + 1][:2]  # ends one token and begins the next
    full = " ".join(words)
    expect = full[:full.index(stop)]
    body = {"model": "tiny", "prompt": ids, "max_tokens": 16, "temperature": 0, "ignore_eos": True, "stop": stop}
    whole = _post(url, "/v1/completions", body).json()["choices"][0]
    assert (whole["text"], whole["finish_reason"]) == (expect, "stop")
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=30) as r:
        data = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    deltas = [d["choices"][0]["text"] for d in data]
    assert "".join(deltas) == expect and data[-1]["choices"][0]["finish_reason"] == "stop"  # nothing of the stop


@pytest.mark.parametrize("step_s,max_tokens", [(0.02, 60), (0.08, 50)])
def test_retry_after_follows_the_engine_drain_rate(folder, step_s, max_tokens):
    """One slot (1 running, no queue) held by a request of ``max_tokens``: the 429's Retry-After is its remaining
    tokens at the engine's measured step rate, rounded up, not a constant. The rule is checked, not the clock: the
    engine is held between two steps while the 429 is answered, so the remaining tokens are known exactly, and the
    rate is the one the server read; a step that sleeps ``step_s`` caps that rate at ``1 / step_s`` however busy the
    machine is, so the wait is at least the remaining tokens times ``step_s``."""
    s = _build(folder, max_running=1, max_queue=0)
    url = s.start_background()
    e = s.engine
    go, held = threading.Event(), threading.Event()
    go.set()

    def step(i, ids):
        time.sleep(step_s)
        if not go.is_set():
            held.set()
            go.wait(60)
    e.before_step = step
    rates = []
    steps_per_s = e.steps_per_s
    e.steps_per_s = lambda: rates.append(steps_per_s()) or rates[-1]
    try:
        t = threading.Thread(target=_post, args=(url, "/v1/completions", {
            "model": "tiny", "prompt": [1, 7], "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}))
        t.start()
        deadline = time.time() + 60
        while not any(h.generated >= 5 for h in list(e.handles.values())) and time.time() < deadline:
            time.sleep(0.005)
        go.clear()
        assert held.wait(60)  # the engine waits before its next step: the tokens generated no longer change
        (h,) = [h for h in e.handles.values() if not h.finished]
        left = max_tokens - h.generated
        r = _post(url, "/v1/completions", {"model": "tiny", "prompt": [1, 8], "max_tokens": 4})
        go.set()
        assert r.status_code == 429 and _err(r)["code"] == "queue_full"
        retry = int(r.headers["Retry-After"])
        assert rates and rates[0] <= 1 / step_s * 1.001, rates  # the 429 read it first; each step slept step_s
        assert retry == max(1, math.ceil(left / rates[0])), (retry, left, rates)
        assert retry >= math.ceil(left * step_s * 0.999) and retry >= 2
        assert f"retry after {retry} s" in _err(r)["message"]
        t.join(timeout=60)
    finally:
        go.set()
        e.before_step = None
        e.steps_per_s = steps_per_s
        s.stop()


def test_finish_reason_is_stop_for_an_end_token_or_an_end_before_the_limit():
    """``stop`` where the last token is an end token or the request ended before its limit (an engine that leaves
    the end token out of what it returns), ``length`` at the limit."""
    from vramguard.serve.streaming import finish_reason
    assert finish_reason([5, 6, 2], {2}, 64) == "stop"
    assert finish_reason([5, 6], {2}, 64) == "stop"  # ended early: only an end token does that
    assert finish_reason([5] * 64, {2}, 64) == "length"
    assert finish_reason([5] * 63 + [2], {2}, 64) == "stop"
