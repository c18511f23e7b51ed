"""Property-based fuzzing of ``vramguard serve`` (a real server on a socket, uvicorn in a thread of this process,
on a tiny random Llama on the CPU): random
values of every accepted field, of every JSON type, extreme numbers, NaN/Infinity literals, broken UTF-8, lone
surrogates, deep nesting and huge arrays, for completions and chat, streamed and not, sent a few at a time. Every
response is a 200 (a stream ending with [DONE] and no error event) or an OpenAI-shaped 4xx; never a 5xx, a reset
connection or a crash; afterwards the server answers a normal request, /metrics shows nothing leaked and no
traceback was logged.

``VRAMGUARD_FUZZ_EXAMPLES`` sets the number of examples (default 150 of 1-3 requests each, about 20 s on 2 CPU
cores);
``VRAMGUARD_FUZZ_REPORT`` names a JSON file for the tally (``benchmarks/cpu_serve_fuzz.py`` runs it longer).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from conftest import save_tiny_llama

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

EXAMPLES = int(os.environ.get("VRAMGUARD_FUZZ_EXAMPLES", "150"))
CFG = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
           vocab_size=300, max_position_embeddings=64, bos_token_id=1, eos_token_id=2)
RUNNING, QUEUE = 4, 4
TALLY: Counter = Counter()

# ------------------------------------------------------------------------------------------- values
EXTREME_INTS = [0, 1, -1, 2, 4, 63, 64, 299, 300, 2**31 - 1, 2**31, -2**31 - 1, 2**32, 2**53 + 1, 2**63 - 1, 2**63,
                -2**63 - 1, 2**64, 10**30, 10**400]
EXTREME_FLOATS = [0.0, -0.0, 1e-39, 5e-324, 1e-4, 9.99e-5, 1e-7, 0.5, 1.0, 2.0, 2.0000001, 1e308, -1e308, 1.7976931348623157e308,
                  float("nan"), float("inf"), float("-inf")]
texts = st.one_of(st.text(max_size=12), st.sampled_from(["", "w1 w2", "\ud800", "a\udfffb", "\x00", "w5\n\r\t",
                                                          "\u200b\ufeff", "\U0001f600", "w1 " * 40, "[EOS]", "<|im_end|>"]),
                  st.text(alphabet=st.characters(categories=["Cs", "Lu", "Nd", "Zs", "Cc", "So"]), max_size=6))
scalars = st.one_of(st.none(), st.booleans(), st.sampled_from(EXTREME_INTS), st.integers(-5, 400),
                    st.sampled_from(EXTREME_FLOATS), st.floats(allow_nan=True, allow_infinity=True), texts)
json_values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                           st.dictionaries(texts, inner, max_size=3)), max_leaves=8)
deep = st.integers(10, 3000).map(lambda n: "DEEP:" + str(n))  # replaced by n nested lists when serialized
huge = st.sampled_from(["HUGE:ints", "HUGE:strs", "HUGE:text"])
anything = st.one_of(json_values, json_values, deep, huge)


word_prompt = st.lists(st.integers(0, 299), min_size=1, max_size=8).map(lambda ids: " ".join(f"w{i}" for i in ids))
token_prompt = st.lists(st.integers(3, 299), min_size=1, max_size=12)
message = st.fixed_dictionaries({"role": st.sampled_from(["system", "developer", "user", "assistant"]),
                                 "content": st.one_of(word_prompt, st.just([{"type": "text", "text": "w3 w4"}]))},
                                optional={"name": st.text(max_size=5)})
COMMON = {  # a value a client would send, for every accepted field
    "model": st.just("tiny"), "max_tokens": st.integers(1, 12), "temperature": st.floats(0, 2),
    "top_p": st.floats(1e-3, 1, exclude_min=False), "top_k": st.integers(0, 300), "n": st.integers(1, 4),
    "stream": st.booleans(), "stream_options": st.just({"include_usage": True}),
    "stop": st.one_of(st.text(min_size=1, max_size=4), st.lists(st.sampled_from(["w1", " w", "7 w"]), max_size=4)),
    "user": st.text(max_size=8), "ignore_eos": st.booleans(), "seed": st.one_of(st.none(), st.integers(0, 2**63 - 1)), "presence_penalty": st.just(0),
    "frequency_penalty": st.just(0.0), "logit_bias": st.just({}), "logprobs": st.just(None),
}
COMPLETION = {**COMMON, "prompt": st.one_of(word_prompt, token_prompt, word_prompt.map(lambda p: [p])),
              "echo": st.just(False), "suffix": st.none(), "best_of": st.just(1)}
CHAT = {**COMMON, "messages": st.lists(message, min_size=1, max_size=4), "max_completion_tokens": st.integers(1, 12),
        "top_logprobs": st.none(), "response_format": st.just({"type": "text"}), "tools": st.just([]),
        "tool_choice": st.just("none"), "parallel_tool_calls": st.booleans()}


@st.composite
def bodies(draw, good: dict):
    """A body of valid values for the required and a random set of optional fields, then 0, 1 or 2 fields (or
    every one) replaced by anything at all, an unknown field or a missing required one among them."""
    required = [k for k in ("model", "prompt", "messages", "stream") if k in good]
    optional = draw(st.lists(st.sampled_from(sorted(set(good) - set(required))), unique=True, max_size=6))
    keys = required + optional
    body = {k: draw(good[k]) for k in keys}
    mode = draw(st.integers(0, 4))
    mutate = keys if mode == 4 else draw(st.lists(st.sampled_from(keys + ["unknown_field"]), unique=True,
                                                  max_size=min(mode, 2)))
    for k in mutate:
        body[k] = draw(anything)
    if mode == 3 and draw(st.booleans()):
        body.pop(draw(st.sampled_from(required[:2])), None)
    return body


def _encode(value) -> str:
    """JSON text with NaN/Infinity literals (allow_nan), escaped lone surrogates, and the DEEP/HUGE markers."""
    if isinstance(value, str) and value.startswith("DEEP:"):
        n = int(value[5:])
        return "[" * n + "]" * n
    if value == "HUGE:ints":
        return json.dumps(list(range(20_000)))
    if value == "HUGE:strs":
        return json.dumps(["w1"] * 20_000)
    if value == "HUGE:text":
        return json.dumps("w1 " * 50_000)
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)}: {_encode(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_encode(v) for v in value) + "]"
    return json.dumps(value)


def _wire(body: dict, mangle: int) -> bytes:
    raw = _encode(body).encode("utf-8")
    if mangle == 1:  # broken UTF-8 inside a string
        raw = raw.replace(b'"w', b'"\xff\xfew', 1)
    elif mangle == 2:  # a lone surrogate as raw (CESU-8) bytes
        raw = raw.replace(b'"w', b'"\xed\xa0\x80w', 1)
    elif mangle == 3:  # truncated
        raw = raw[: len(raw) // 2]
    return raw


requests_ = st.lists(st.tuples(st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
                               st.sampled_from([0] * 9 + [1, 2, 3])).flatmap(
    lambda t: st.tuples(st.just(t[0]), bodies(COMPLETION if t[0] == "/v1/completions" else CHAT), st.just(t[1]))),
    min_size=1, max_size=3)


# ------------------------------------------------------------------------------------------- the server
class _Log(logging.Handler):
    """Every record of the server's loggers, formatted with its traceback."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(logging.Formatter("%(levelname)s %(name)s %(message)s").format(record))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The server as ``vramguard serve`` builds it (the options of its command line), listening on a free port."""
    from vramguard.serve.server import build
    folder = save_tiny_llama(tmp_path_factory.mktemp("fuzz") / "tiny", **CFG)
    log = _Log()
    loggers = [logging.getLogger(n) for n in ("", "uvicorn", "uvicorn.error", "uvicorn.access", "vramguard")]
    for lg in loggers:
        lg.addHandler(log)
    s = build(str(folder), quant="fp32", page_size=16, max_batch_tokens=64, max_running=RUNNING, max_queue=QUEUE,
              max_kv_blocks=24, served_name="tiny", hard_cap=True)
    try:
        url = s.start_background()
        yield s, url, log
    finally:
        s.stop()
        for lg in loggers:
            lg.removeHandler(log)


def _check(url: str, path: str, body: dict, mangle: int) -> str:
    """Send one request; raise AssertionError unless the answer is a 200 or an OpenAI-shaped 4xx. Returns a tally
    key."""
    raw = _wire(body, mangle)
    stream = body.get("stream") is True
    headers = {"content-type": "application/json"}
    with httpx.Client(timeout=60) as c, c.stream("POST", url + path, content=raw, headers=headers) as r:
        data = r.read()
    if r.status_code == 200 and stream and r.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in data.decode().splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", data[-300:]
        for ev in events[:-1]:
            obj = json.loads(ev)
            assert "error" not in obj, obj  # an error event is a failure the client could not prevent
        return "200 stream"
    assert r.status_code == 200 or 400 <= r.status_code < 500, (r.status_code, data[:500], raw[:300])
    obj = json.loads(data)
    if r.status_code == 200:
        assert obj["choices"] and "usage" in obj, obj
        return "200"
    err = obj["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["type"], obj
    if r.status_code == 429:
        assert int(r.headers["Retry-After"]) >= 1
    return f"{r.status_code} {err['code']}"


def _metrics(url: str) -> dict:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_fuzzed_requests_never_hurt_the_server(served):
    s, url, log = served
    pool = ThreadPoolExecutor(3)

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(requests_)
    def one_round(reqs):
        keys = list(pool.map(lambda r: _check(url, *r), reqs))
        TALLY.update(keys)
        TALLY["requests"] += len(reqs)
        assert s.engine.check_fatal() is None and s._thread.is_alive(), "the server died"

    t0 = time.perf_counter()
    try:
        one_round()
    finally:
        pool.shutdown()
    TALLY["seconds"] = round(time.perf_counter() - t0, 1)
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "w1 w2", "max_tokens": 5,
                                                  "temperature": 0, "ignore_eos": True}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
    deadline = time.time() + 10
    while time.time() < deadline:
        m = _metrics(url)
        if (m["vramguard_requests_in_flight"], m["vramguard_queue_depth"], m["vramguard_kv_blocks_used"]) == (0, 0, 0):
            break
        time.sleep(0.1)
    assert (m["vramguard_requests_in_flight"], m["vramguard_queue_depth"], m["vramguard_kv_blocks_used"]) == (0, 0, 0)
    assert m["vramguard_step_failures_total"] == 0  # validation caught everything before the engine
    assert m['vramguard_requests_total{outcome="failed"}'] == 0
    text = "\n".join(log.lines)
    assert "Traceback" not in text, text[-3000:]
    report = os.environ.get("VRAMGUARD_FUZZ_REPORT")
    if report:
        Path(report).write_text(json.dumps({"examples": EXAMPLES, **TALLY, "metrics": {
            k: v for k, v in m.items() if k.startswith(("vramguard_requests_total", "vramguard_refusals_total",
                                                        "vramguard_generation_tokens_total"))}}, indent=1))
    print(dict(TALLY))
