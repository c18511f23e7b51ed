"""serve's small things: a log line per request and a throughput line, /v1/models' created, the fields current
OpenAI clients send, /health without the key (no folder path) and HEAD /health."""

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


def test_log_lines_created_new_fields_and_health(folder, capsys):
    t0 = int(time.time())
    s = _build(folder, api_key="k")
    s.options.log_every_s = 0.2
    url = s.start_background()
    auth = {"Authorization": "Bearer k"}
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
        assert missing.status_code == 404 and missing.json()["error"]["message"] == (
            f'model: "it\'s-gpt-4" is not served here; this server serves "{models["id"]}"')
        assert t0 - 5 <= models["created"] <= int(time.time())
        open_health = httpx.get(url + "/health").json()  # no key: no folder path, no notes
        assert open_health["status"] == "ok" and open_health["model"] == "tiny-llama" and open_health["notes"] == []
        assert httpx.get(url + "/health", headers=auth).json()["model"] == str(folder)
        head = httpx.head(url + "/health")
        assert head.status_code == 200 and head.content == b""
        time.sleep(0.6)  # a throughput line comes within log_every_s of the tokens
    finally:
        s.stop()
    err = capsys.readouterr().err
    assert re.search(r"\d\d:\d\d:\d\d 127\.0\.0\.1 POST /v1/completions 200 \d+\.\d{3} s", err), err
    assert re.search(r"POST /v1/completions 400 ", err) and re.search(r"HEAD /health 200 ", err)
    lines = re.findall(r"throughput: (\d+) tokens in \d+\.\d s \(\d+\.\d tokens/s\); \d running, \d waiting; "
                       r"KV blocks \d+ of 20", err)
    assert lines and sum(map(int, lines)) == 4, err  # the 4 generated tokens, in one line or split over two
