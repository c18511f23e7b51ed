"""Serve's refusals in the project's words, on a tiny random Llama on the CPU: a JSON integer longer than Python
reads names its field, a body that is not a JSON object says what it is in JSON's words (no Python type names),
and an image, audio or file content part is refused as a part this server does not read, not an unknown field."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from conftest import save_tiny_llama, serving
from test_serve import CFG, _build, _err

from vramguard.serve.schemas import ChatRequest
from vramguard.serve.validate import parse_json, to_request

PYTHON_WORDS = ("NoneType", "(got list", "(got str", "(got int", "(got float", "(got bool", "(got dict",
                "dictionary", "instance of", "sys.set_int_max_str_digits", "4300")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder: Path = save_tiny_llama(tmp_path_factory.mktemp("msgs") / "tiny-llama", **CFG)
    yield from serving(_build(folder))


def _raw(url: str, path: str, body: bytes):
    return httpx.post(url + path, content=body, headers={"content-type": "application/json"}, timeout=30)


def _no_python_words(message: str) -> None:
    assert not any(w in message for w in PYTHON_WORDS), message
    assert len(message.splitlines()) <= 2


# ------------------------------------------------------------------------------------- integers Python cannot read
@pytest.mark.parametrize("path,body,param", ids=lambda v: str(v)[:40], argvalues=[
    ("/v1/completions", b'{"model": "tiny", "prompt": [1, 2], "max_tokens": 1' + b"0" * 5000 + b"}", "max_tokens"),
    ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "w1"}], '
                             b'"max_tokens": 1' + b"0" * 5000 + b"}", "max_tokens"),
    ("/v1/completions", b'{"model": "tiny", "prompt": [1, -2' + b"0" * 5000 + b"], \"max_tokens\": 2}", "prompt.1"),
])
def test_an_integer_of_5001_digits_names_its_field_and_the_64_bit_limit(server, path, body, param):
    r = _raw(server[1], path, body)
    assert r.status_code == 400, r.text
    e = _err(r)
    # "1" + 5,000 zeros: 5,001 digits, reported like 2**63 is ("... is beyond a 64-bit integer [-2**63, 2**63 - 1]")
    assert e["param"] == param and e["code"] == "invalid_value" and e["type"] == "invalid_request_error", e
    assert e["message"].startswith(f"{param}: a number of 5,001 digits is beyond a 64-bit integer "
                                   "[-2**63, 2**63 - 1]"), e
    _no_python_words(e["message"])


def test_2_to_the_63_keeps_its_wording():
    from vramguard.serve.apierrors import ApiError
    with pytest.raises(ApiError) as e:
        parse_json(b'{"max_tokens": 9223372036854775808}')
    assert e.value.message.startswith("max_tokens: 9223372036854775808 is beyond a 64-bit integer")


def test_a_long_integer_before_broken_json_says_the_json_error_not_python_s():
    from vramguard.serve.apierrors import ApiError
    with pytest.raises(ApiError) as e:
        parse_json(b'{"max_tokens": 1' + b"0" * 5000 + b', }')
    assert e.value.code == "invalid_json" and "not valid JSON" in e.value.message
    _no_python_words(e.value.message)


# --------------------------------------------------------------------------------- bodies that are not JSON objects
@pytest.mark.parametrize("body,said", ids=lambda v: str(v)[:40], argvalues=[
    (b"", "request body is empty"),
    (b"  \n", "request body is empty"),
    (b"null", "request body is JSON null"),
    (b"[1, 2]", "request body is a JSON array"),
    (b'"hi"', "request body is a JSON string"),
    (b"3", "request body is a JSON number"),
    (b"2.5", "request body is a JSON number"),
    (b"true", "request body is JSON true"),
    (b"1" + b"0" * 5000, "request body is a JSON number"),
])
def test_a_body_that_is_not_an_object_says_what_it_is_in_json_words(server, body, said):
    r = _raw(server[1], "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    e = _err(r)
    assert e["code"] == "invalid_json" and e["type"] == "invalid_request_error", e
    assert e["message"] == f"{said}; accepted: a JSON object of the request's fields", e
    _no_python_words(e["message"])


@pytest.mark.parametrize("value,kind", [(None, "JSON null"), (True, "JSON true"), (False, "JSON false"),
                                        (0, "a JSON number"), (1.5, "a JSON number"), ("", "a JSON string"),
                                        ([], "a JSON array"), ({}, "a JSON object")])
def test_json_kind(value, kind):
    from vramguard.serve.apierrors import json_kind
    assert json_kind(value) == kind


@pytest.mark.parametrize("extra,param,accepted", [
    ({"messages": "w1"}, "messages", "a JSON array"),
    ({"messages": ["w1"]}, "messages.0", "a JSON object"),
    ({"stream_options": []}, "stream_options", "a JSON object"),
    ({"response_format": "json"}, "response_format", "a JSON object"),
    ({"metadata": [1]}, "metadata", "a JSON object"),
])
def test_a_field_of_the_wrong_json_type_says_json_types(server, extra, param, accepted):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "w1"}], **extra}
    r = httpx.post(server[1] + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    e = _err(r)
    assert e["param"] == param and e["message"].endswith(f"; accepted: {accepted}"), e
    assert e["message"].startswith(f"{param}: a JSON ")
    _no_python_words(e["message"])


# ------------------------------------------------------------------------------ image, audio and file content parts
@pytest.mark.parametrize("part,kind", [
    ({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}, "image"),
    ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, "audio"),
    ({"type": "file", "file": {"file_id": "file-abc"}}, "file"),
])
def test_non_text_content_parts_are_said_unsupported_with_the_fix(server, part, kind):
    content = [{"type": "text", "text": "w1 w2"}, part]
    body = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": content}]}
    r = httpx.post(server[1] + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    e = _err(r)
    assert e["param"] == "messages.0.content.1" and e["code"] == "unsupported_parameter", e
    assert e["type"] == "invalid_request_error"
    m = e["message"]
    assert f"{kind} content parts (\"{part['type']}\") are not supported by this server, only text parts" in m, m
    assert '{"type": "text", "text": ...}' in m and "plain string" in m and "unknown parameter" not in m
    _no_python_words(m)


def test_text_parts_still_serve(server):
    body = {"model": "tiny", "max_tokens": 2, "temperature": 0, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "w1"}, {"type": "text", "text": " w2"}]}]}
    r = httpx.post(server[1] + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text


def test_content_part_check_ignores_what_is_not_a_part():
    """Odd shapes are left to the schema's own errors (no crash on an unhashable type, no chat check on
    completions)."""
    from vramguard.serve.apierrors import ApiError
    from vramguard.serve.schemas import CompletionRequest
    with pytest.raises(ApiError) as e:
        to_request({"model": "t", "messages": [{"role": "user", "content": [{"type": ["image_url"]}]}]}, ChatRequest)
    assert e.value.code == "invalid_value"
    with pytest.raises(ApiError) as e:
        to_request({"model": "t", "prompt": "x", "messages": [{"content": [{"type": "image_url"}]}]},
                   CompletionRequest)
    assert e.value.code == "unknown_parameter" and e.value.param == "messages"
