"""Every check of a generation request before admission, each failure an :class:`ApiError` naming the field, the
limit and the value. Pure functions of the body and the server's :class:`Limits`; no engine, no event loop (the API
runs them in a worker thread, so a large body never stalls the loop).

The limits are those of the code that consumes each value: the engine keeps temperature, top-p and top-k in
float32/int32 tensors per request and samples with ``torch.multinomial``, which raises on NaN probabilities.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass

from pydantic import ValidationError

from vramguard.run.generate import MAX_SEED, SEED_ACCEPTED
from vramguard.serve.apierrors import ApiError, json_kind, shown

MAX_JSON_DEPTH = 16  # the deepest accepted body is messages[i].content[j].text (4); tools schemas get room
MAX_STOPS = 4  # OpenAI's limit
# scores / temperature stays finite in float32 (max 3.4e38) for logits up to 3.4e34 at this temperature, and the
# temperature itself stays a normal float32; smaller positive temperatures overflow to inf and the softmax to NaN
MIN_TEMPERATURE = 1e-4
INT32_MAX = 2**31 - 1


@dataclass
class Limits:
    """What one server accepts. ``budget_refusal(prompt_tokens, max_new_tokens, limit_field)``: why one request of
    that shape can never run in the server's memory (the engine's text, naming ``limit_field``), or None."""

    context_length: int
    vocab_size: int
    n_max: int
    default_max_tokens: int
    model_names: tuple[str, ...]
    greedy_only: bool = False
    pool_tokens: int = 0
    budget_refusal: Callable[[int, int, str], str | None] = lambda prompt_tokens, max_new_tokens, limit_field: None


def parse_json(raw: bytes) -> dict:
    """The body as a JSON object of UTF-8 text: every number finite (no NaN/Infinity literals, no 1e999) and within
    a 64-bit integer when whole, no lone surrogates, nesting at most ``MAX_JSON_DEPTH``; a failure names the field."""
    if not raw or not raw.strip():
        raise ApiError.of("invalid_json", f"request body is empty; {OBJECT_BODY}")
    try:
        data = _loads(raw)
    except RecursionError:
        raise ApiError.of("invalid_json", f"request body: nested deeper than this server reads; the limit is "
                                          f"{MAX_JSON_DEPTH} levels") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError (broken UTF-8)
        raise ApiError.of("invalid_json", f"request body is not valid JSON: {str(e)[:200]}") from None
    if not isinstance(data, dict):
        raise ApiError.of("invalid_json", f"request body is {json_kind(data)}; {OBJECT_BODY}")
    _walk(data)
    return data


OBJECT_BODY = "accepted: a JSON object of the request's fields"


class LongInteger:
    """A JSON integer of more digits than Python reads (``sys.get_int_max_str_digits``): kept as its digit count,
    so that the field it is in can be named (:func:`_walk` refuses it as beyond a 64-bit integer)."""

    def __init__(self, text: str):
        self.digits = len(text.lstrip("-"))


def _int_or_long(text: str):
    try:
        return int(text)
    except ValueError:
        return LongInteger(text)


def _loads(raw: bytes):
    """``json.loads``; a body it refuses is read again keeping integers too long for Python as :class:`LongInteger`
    (the first read stays the fast one, the C parser's own integers)."""
    try:
        return json.loads(raw)
    except ValueError:
        pass
    return json.loads(raw, parse_int=_int_or_long)


def _beyond_int64(path: str, value) -> ApiError:
    """The 400 of a whole number outside a signed 64-bit integer: ``value`` an int or a :class:`LongInteger`."""
    what = f"a number of {value.digits:,} digits" if isinstance(value, LongInteger) else shown(value)
    return ApiError.of("invalid_value", f"{path}: {what} is beyond a 64-bit integer [-2**63, 2**63 - 1]; send an "
                                        "integer in that range", param=path)


def _walk(data: dict) -> None:
    """Depth, number and text checks over the whole body, without recursion."""
    stack = [(data, "", 1)]
    while stack:
        node, path, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise ApiError.of("invalid_value", f"{path}: nested {depth} levels deep; the limit is {MAX_JSON_DEPTH}",
                              param=path)
        for key, value in (node.items() if isinstance(node, dict) else enumerate(node)):
            here = f"{path}.{key}" if path else str(key)
            _text(here, key, value)
            if isinstance(value, float) and not math.isfinite(value):
                raise ApiError.of("invalid_value", f"{_printable(here)}: {value} is not a finite number (NaN and "
                                                   "Infinity are not JSON numbers, and 1e309 overflows a 64-bit "
                                                   "float); send a finite number", param=_printable(here))
            elif isinstance(value, LongInteger) or (isinstance(value, int) and not isinstance(value, bool)
                                                    and not -2**63 <= value < 2**63):
                raise _beyond_int64(_printable(here), value)
            if isinstance(value, (dict, list)):
                stack.append((value, here, depth + 1))


def _text(here: str, *texts) -> None:
    for text in texts:
        if isinstance(text, str):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ApiError.of("invalid_value", f"{_printable(here)}: contains a lone UTF-16 surrogate "
                                                   f"({shown(text[e.start:e.end])}); send valid Unicode text",
                                  param=_printable(here)) from None


def _printable(path: str) -> str:
    """A field path safe to put in a UTF-8 error body (lone surrogates escaped), at most 80 characters."""
    text = path.encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= 80 else text[:77] + "..."


_TYPE_TAGS = ("str", "int", "float", "bool", "list", "dict", "none")


def _param(loc) -> str | None:
    """The field path of a pydantic error location, without the union-branch tags pydantic adds
    (``("prompt", "str")`` -> ``prompt``; ``("messages", 0, "content", "str")`` -> ``messages.0.content``)."""
    parts = []
    for p in loc:
        text = str(p)
        if isinstance(p, str) and (text.split("[")[0] in _TYPE_TAGS or "[" in text or "-" in text):
            break
        parts.append(text)
    return ".".join(parts) or None


def to_request(data: dict, schema):
    """The pydantic request of ``schema``; the first error as a 400 naming the field and the value."""
    p = data.get("prompt")
    if isinstance(p, list) and any(isinstance(x, list) for x in p):
        raise ApiError.of("invalid_value", "prompt: a batch of prompts (a list of token-id lists) is not accepted; "
                                           "send one prompt per request", param="prompt")
    if "messages" in schema.model_fields:
        _check_content_parts(data.get("messages"))
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        errors = e.errors()
        # an unknown name is said before a missing one: a misspelt field ("promt") is both, and its name is the fix
        first = next((x for x in errors if x["type"] == "extra_forbidden"), errors[0])
        param = _param(first["loc"])
        if first["type"] == "extra_forbidden":  # the unknown name as sent ("max-tokens" holds a tag's "-")
            head = _param(first["loc"][:-1])
            raise _unknown_parameter(_printable(f"{head}.{first['loc'][-1]}" if head else str(first["loc"][-1])),
                                     schema, errors) from None
        if first["type"] in _JSON_TYPES:  # pydantic says "a valid dictionary or instance of Message": Python's words
            raise ApiError.of("invalid_value", f"{param}: {json_kind(first.get('input'))} "
                                               f"({shown(first.get('input'))}); accepted: {_JSON_TYPES[first['type']]}",
                              param=param) from None
        raise ApiError.of("invalid_value", f"{param}: {first['msg']} (got {shown(first.get('input'))})",
                          param=param) from None


_JSON_TYPES = {"model_type": "a JSON object", "dict_type": "a JSON object", "list_type": "a JSON array"}

# OpenAI's chat content parts other than text: what each carries
NOT_TEXT_PARTS = {"image_url": "image", "input_audio": "audio", "file": "file"}


def _check_content_parts(messages) -> None:
    """Refuse a chat message's image, audio or file content part by name: this server reads text parts only (the
    schema would call the part's fields unknown, and they are OpenAI's)."""
    for i, message in enumerate(messages if isinstance(messages, list) else ()):
        content = message.get("content") if isinstance(message, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else ()):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind in NOT_TEXT_PARTS:
                param = f"messages.{i}.content.{j}"
                raise ApiError.of("unsupported_parameter", f"{param}: {NOT_TEXT_PARTS[kind]} content parts "
                                                           f"({shown(kind)}) are not supported by this server, only "
                                                           'text parts; send the text as a {"type": "text", "text": '
                                                           "...} part or as a plain string", param=param)


def _unknown_parameter(param: str | None, schema, errors: list[dict]) -> ApiError:
    """The 400 of a field the schema does not have: its name, the field it most likely meant (a missing required
    field, else a close name: :func:`difflib.get_close_matches`) and, at the top level, the accepted names, apart
    from those accepted only at their "off" value (the schema's ``OFF_ONLY``)."""
    import difflib
    top = bool(param) and "." not in param
    missing = [_param(x["loc"]) for x in errors if x["type"] == "missing"]
    names = [m for m in missing if m and "." not in m] if top else []
    near = difflib.get_close_matches(param, names or list(schema.model_fields), n=1) if top else []
    meant = f" (did you mean {shown(near[0])}?)" if near else ""
    off = getattr(schema, "OFF_ONLY", ())
    known = ", ".join(f for f in schema.model_fields if f not in off) if top else "OpenAI's fields"
    also = f"; not implemented, so accepted only at their off value (null, 0, false): {', '.join(off)}" \
        if top and off else ""
    return ApiError.of("unknown_parameter", f"{shown(param)}: unknown parameter{meant}; accepted: {known}{also}",
                       param=param)


def check_fields(req, limits: Limits) -> None:
    """The checks a schema cannot express: unsupported values, ``n``, the model, stops, sampling ranges."""
    bad = req.unsupported()
    if bad is not None:
        raise ApiError.of("unsupported_parameter", bad[1], param=bad[0])
    if req.n > limits.n_max:
        raise ApiError.of("invalid_value", f"n: {shown(req.n)} is over this server's limit of {limits.n_max}; send "
                                           f"n <= {limits.n_max} (or several requests)", param="n")
    if req.model.rstrip("/") not in {m.rstrip("/") for m in limits.model_names}:
        raise ApiError.of("model_not_found", f"model: {shown(req.model)} is not served here; this server serves "
                                             f"{shown(limits.model_names[0])}", param="model")
    stops = req.stops()
    if len(stops) > MAX_STOPS:
        raise ApiError.of("invalid_value", f"stop: {len(stops)} sequences; at most {MAX_STOPS}", param="stop")
    if any(s == "" for s in stops):
        raise ApiError.of("invalid_value", "stop: an empty string would stop before the first token; send "
                                           "sequences of at least one character", param="stop")
    _check_sampling(req, limits)


def _check_sampling(req, limits: Limits) -> None:
    if req.seed is not None and not 0 <= req.seed <= MAX_SEED:
        raise ApiError.of("invalid_value", f"seed: {shown(req.seed)} is outside the seeds PyTorch takes; accepted: "
                                           f"{SEED_ACCEPTED}; send a seed in that range or leave it out", param="seed")
    t = req.temperature
    if limits.greedy_only and "temperature" in req.model_fields_set and t > 0:
        raise ApiError.of("unsupported_parameter", f"temperature: {shown(t)} asks for sampling, and this server "
                                                   "decodes greedily (started with greedy=True); send temperature 0 "
                                                   "or leave it out", param="temperature")
    if 0 < t < MIN_TEMPERATURE:
        raise ApiError.of("invalid_value", f"temperature: {shown(t)} is below the smallest positive temperature "
                                           f"{MIN_TEMPERATURE} (smaller ones overflow the float32 logits to NaN); "
                                           "send 0 for greedy decoding or a value in [1e-4, 2]",
                          param="temperature")
    if req.top_k > limits.vocab_size:
        raise ApiError.of("invalid_value", f"top_k: {shown(req.top_k)} is over this model's vocabulary of "
                                           f"{limits.vocab_size:,} tokens; send 0 (off) to {limits.vocab_size:,}",
                          param="top_k")


def check_tokens(ids: list[int], limit: int | None, limit_field: str, prompt_field: str, limits: Limits) -> int:
    """The prompt's token ids against the vocabulary, the context and the KV pool; returns the new-token limit."""
    vocab = limits.vocab_size
    bad = next((t for t in ids if t < 0 or t >= vocab), None)
    if bad is not None:
        raise ApiError.of("invalid_value", f"{prompt_field}: token id {shown(bad)} is outside the vocabulary "
                                           f"[0, {vocab - 1}]", param=prompt_field)
    if not ids:
        raise ApiError.of("invalid_value", f"{prompt_field}: empty; send at least one token", param=prompt_field)
    ctx = limits.context_length
    if len(ids) >= ctx:
        raise ApiError.of("context_length_exceeded", f"{prompt_field}: {len(ids):,} tokens; this model's maximum "
                                                     f"context length is {ctx:,} tokens, and at least one must be "
                                                     "left to generate: shorten the prompt", param=prompt_field)
    max_new = limit if limit is not None else min(limits.default_max_tokens, ctx - len(ids))
    if len(ids) + max_new > ctx:
        raise ApiError.of("context_length_exceeded", f"{limit_field}: {shown(max_new)} + {len(ids):,} prompt "
                                                     f"tokens is over this model's maximum context length of "
                                                     f"{ctx:,} tokens; set {limit_field} <= {ctx - len(ids):,}",
                          param=limit_field)
    refusal = limits.budget_refusal(len(ids), max_new, limit_field)
    if refusal is not None:
        raise ApiError.of("kv_budget_exceeded", refusal, param=limit_field)
    return max_new


def parse_request(raw: bytes, schema, limits: Limits):
    """Body bytes to a checked request of ``schema`` (everything but the prompt's tokens)."""
    req = to_request(parse_json(raw), schema)
    check_fields(req, limits)
    return req
