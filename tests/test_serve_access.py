"""serve's small things: a log line per request and a throughput line, /v1/models' created, the fields current
OpenAI clients send, /health without the key (no folder path) and HEAD /health, the log's width on a terminal, and
the unknown-parameter error's list of what is accepted."""

from __future__ import annotations

import re
import time

import httpx
import pytest

from conftest import save_tiny_llama

CFG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           vocab_size=300, max_position_embeddings=512, bos_token_id=1, eos_token_id=2)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("serve-access") / "tiny-llama", **CFG)


def _build(folder, **kw):
    from vramguard.serve.server import build
    return build(str(folder), quant="fp32", page_size=16, max_batch_tokens=64, max_running=4, max_queue=4,
                 max_kv_blocks=20, verify=False, **kw)


_THROUGHPUT = re.compile(r"throughput: (\d+) tokens in \d+\.\d s \(\d+\.\d tokens/s\); \d running, \d waiting; "
                         r"KV blocks \d+ of 20")


def test_log_lines_created_new_fields_and_health(folder, capsys):
    t0 = int(time.time())
    s = _build(folder, api_key="k")
    s.options.log_every_s = 0.2
    url = s.start_background()
    auth = {"Authorization": "Bearer k"}
    seen = []
    try:
        body = {"model": str(folder), "prompt": "w1 w2", "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                "store": False, "metadata": {"user": "a"}, "service_tier": "auto"}
        r = httpx.post(url + "/v1/completions", json=body, headers=auth, timeout=60)
        assert r.status_code == 200, r.text
        bad = httpx.post(url + "/v1/completions", json={**body, "best_friend": 1}, headers=auth, timeout=60)
        msg = bad.json()["error"]["message"]
        assert bad.status_code == 400 and "README" not in msg and "service_tier" in msg and "prompt" in msg
        models = httpx.get(url + "/v1/models", headers=auth).json()["data"][0]
        missing = httpx.get(url + "/v1/models/it's-gpt-4", headers=auth)  # quoted as JSON, as every error is
        from vramguard.serve.apierrors import shown  # a long folder path is cut to 60 characters
        assert missing.status_code == 404 and missing.json()["error"]["message"] == (
            f'model: "it\'s-gpt-4" is not served here; this server serves {shown(models["id"])}')
        assert t0 - 5 <= models["created"] <= int(time.time())
        open_health = httpx.get(url + "/health").json()  # no key: no folder path, no notes
        assert open_health["status"] == "ok" and open_health["model"] == "tiny-llama" and open_health["notes"] == []
        assert httpx.get(url + "/health", headers=auth).json()["model"] == "tiny-llama"  # a name, never a path
        head = httpx.head(url + "/health")
        assert head.status_code == 200 and head.content == b""
        deadline = time.time() + 60
        while sum(map(int, _THROUGHPUT.findall("".join(seen)))) < 4 and time.time() < deadline:
            time.sleep(0.05)  # a throughput line comes within log_every_s of the tokens (later on a busy machine)
            seen.append(capsys.readouterr().err)
    finally:
        s.stop()
    err = "".join(seen) + capsys.readouterr().err
    assert re.search(r"\d\d:\d\d:\d\d 127\.0\.0\.1 POST /v1/completions 200 \d+\.\d{3} s", err), err
    assert re.search(r"POST /v1/completions 400 ", err) and re.search(r"HEAD /health 200 ", err)
    lines = _THROUGHPUT.findall(err)
    assert lines and sum(map(int, lines)) == 4, err  # the 4 generated tokens, in one line or split over two


def test_serve_log_lines_wrap_at_the_terminals_width_on_a_terminal(monkeypatch):
    import io
    import logging
    import sys

    from vramguard.serve.access import LOG_COLUMNS, WrappedFormatter, log_columns

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    words = ", ".join(f"field_{i}" for i in range(40))  # 398 characters
    record = logging.LogRecord("vramguard.serve", logging.WARNING, __file__, 1, "refused: %s", (words,), None)
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.setattr(sys, "stderr", Terminal())
    assert log_columns() == 80
    lines = WrappedFormatter().format(record).splitlines()
    assert max(len(x) for x in lines) <= 80 and max(len(x) for x in lines) > 70 and len(lines) == 6
    monkeypatch.setenv("COLUMNS", "20")  # a very narrow terminal: lines of 40
    assert log_columns() == 40
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # a file or a pipe: 120, whatever COLUMNS says
    assert log_columns() == LOG_COLUMNS == 120
    assert max(len(x) for x in WrappedFormatter().format(record).splitlines()) > 80
    monkeypatch.delenv("COLUMNS")  # a terminal whose size cannot be read (no file descriptor): 120
    assert log_columns(Terminal()) == 120


OFF_VALUES = {"seed": 1, "presence_penalty": 0.5, "frequency_penalty": 0.5, "logit_bias": {"1": 1.0}, "logprobs": True,
              "echo": True, "suffix": "x", "best_of": 2, "tools": [{"type": "function"}], "tool_choice": "auto",
              "top_logprobs": 2}


@pytest.mark.parametrize("schema_name,body", [
    ("CompletionRequest", {"model": "tiny", "prompt": "hi"}),
    ("ChatRequest", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}),
])
def test_the_unknown_parameter_error_lists_as_accepted_only_what_is(schema_name, body):
    pytest.importorskip("fastapi")
    from vramguard.serve import schemas
    from vramguard.serve.apierrors import ApiError
    from vramguard.serve.validate import check_fields, to_request
    schema = getattr(schemas, schema_name)
    with pytest.raises(ApiError) as e:
        to_request({**body, "zzz": 1}, schema)
    accepted, off = e.value.message.split("; accepted: ", 1)[1].split("; not implemented, ")
    accepted = accepted.split(", ")
    assert "seed" in accepted and "logprobs" not in accepted and "model" in accepted and "stop" in accepted
    assert not set(accepted) & set(schema.OFF_ONLY) and off.endswith(": " + ", ".join(schema.OFF_ONLY))
    # each field said "off only" is refused at any other value, and accepted at its default
    for name in schema.OFF_ONLY:
        with pytest.raises(ApiError) as e:
            check_fields(to_request({**body, name: OFF_VALUES[name]}, schema), None)
        assert (e.value.code, e.value.param) == ("unsupported_parameter", name)
    assert to_request(body, schema).unsupported() is None
