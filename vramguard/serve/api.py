"""The OpenAI-compatible HTTP API over one :class:`~vramguard.serve.engine.Engine`.

Order of the checks on a generation request, each answered with an OpenAI-shaped error body
(``{"error": {"message", "type", "param", "code"}}``): API key (401) -> body size (413) -> JSON and field types,
unknown fields, unsupported values (400) -> model name (404) -> overload: the bounded queue is full (429 with
Retry-After; decided before tokenization) -> token ids in range, prompt shorter than the context, prompt +
max_tokens within the context, one request within the KV pool (400) -> admitted.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import math
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from sse_starlette.sse import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from vramguard.serve.engine import Engine, EngineStopped, Sampling
from vramguard.serve.metrics import Metrics
from vramguard.serve.schemas import ChatRequest, CompletionRequest

SHUTDOWN_GRACE_S = 5.0  # seconds open requests get to end on Ctrl-C/SIGTERM (uvicorn's graceful timeout too)


@dataclass
class ServeOptions:
    """Settings of the API layer. Sizes in bytes, counts in tokens/requests.

    Attributes:
        model_id: the name clients send as ``model`` (and that /v1/models lists).
        context_length: the model's context (prompt + generated tokens).
        api_key: when set, every route but /health needs ``Authorization: Bearer <api_key>``.
        max_body_bytes: larger bodies get 413. n_max: the largest ``n``. default_max_tokens: when a request gives none.
        chat_template_note: set when the tokenizer has no chat template and the fallback format is used.
    """

    model_id: str
    context_length: int
    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    n_max: int = 4
    default_max_tokens: int = 256
    chat_template_note: str | None = None
    notes: list[str] = field(default_factory=list)
    model_aliases: tuple[str, ...] = ()  # other names accepted as ``model`` (the folder's path and name)
    log_every_s: float = 10.0  # seconds between throughput lines on stderr (vramguard.serve.access)
    created: int = field(default_factory=lambda: int(time.time()))  # /v1/models' created: when the model loaded


class ApiError(Exception):
    """An HTTP error with OpenAI's body ``{"error": {"message", "type", "param", "code"}}`` and optional headers."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_
        self.headers = headers or {}

    def body(self) -> dict:
        """The OpenAI error object."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        """The JSON response with this status and headers."""
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class _ApiKey:
    """ASGI middleware: every HTTP route but /health needs ``Authorization: Bearer <key>`` (401 otherwise).
    Pure ASGI, so the routes still see the client's disconnect."""

    def __init__(self, app, key: str, on_reject):
        self.app, self.key, self.on_reject = app, key.encode(), on_reject

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/health":
            header = dict(scope["headers"]).get(b"authorization", b"")
            given = header[7:] if header[:7].lower() == b"bearer " else b""
            if not hmac.compare_digest(given, self.key):
                self.on_reject()
                resp = ApiError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>' with "
                                     "the key the server was started with (--api-key)",
                                code="invalid_api_key").response()
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


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


async def _disconnected(request: Request) -> None:
    """Return when the client has gone (the request body was read before: the next ASGI message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


_COMPLETION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


def _fallback_template(messages) -> str:
    return "".join(f"{m.role}: {m.text()}\n" for m in messages) + "assistant:"


class _Latency:
    """Moving average of request durations (seconds), for Retry-After."""

    def __init__(self):
        self.mean = 1.0

    def add(self, seconds: float) -> None:
        self.mean = 0.9 * self.mean + 0.1 * seconds


def create_app(engine: Engine, tokenizer, options: ServeOptions, metrics: Metrics | None = None,
               on_fatal=None) -> FastAPI:
    """The FastAPI app. ``on_fatal(error)`` is called once when the engine dies (the runner then exits non-zero)."""
    metrics = metrics or Metrics(engine.stats)
    engine.metrics = metrics
    watchdog: dict = {}

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        from vramguard.serve.access import throughput_loop
        watchdog["task"] = asyncio.create_task(_watch())
        watchdog["throughput"] = asyncio.create_task(throughput_loop(engine, metrics, options.log_every_s))
        try:
            yield
        finally:
            watchdog["task"].cancel()
            watchdog["throughput"].cancel()

    app = FastAPI(title="vramguard", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.engine, app.state.metrics, app.state.options = engine, metrics, options

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        msg = {404: f"{request.url.path}: no such route; this server has /v1/chat/completions, /v1/completions, "
                    "/v1/models, /health and /metrics",
               405: f"{request.method} {request.url.path}: method not allowed"}.get(exc.status_code, str(exc.detail))
        return ApiError(exc.status_code, msg, code=code, headers=dict(exc.headers or {})).response()  # 405: Allow
    latency = _Latency()
    eos = tokenizer.eos_token_id if tokenizer is not None else None
    vocab = engine.vocab_size
    async def _watch():
        fired = False
        while True:
            await asyncio.sleep(0.2)
            engine.sweep()
            err = engine.check_fatal()
            if err is not None and not fired:
                fired = True
                if on_fatal is not None:
                    on_fatal(err)

    class _OverloadGate:
        """Pure ASGI, first thing for a completion request (after the API key): overload is decided here, before
        routing and before the body is read. An admitted request holds its slot (``engine.reserved``) and then
        yields once, so every request of a burst that has already arrived gets its decision (a 429 costs a few
        tens of microseconds) before any admitted one spends time on its body, validation and submission."""

        def __init__(self, app):
            self.app = app

        async def __call__(self, scope, receive, send):
            if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in _COMPLETION_PATHS:
                await self.app(scope, receive, send)
                return
            t_arrival = time.perf_counter()
            try:
                _admit_or_429(1)
            except ApiError as e:
                if e.status == 429:
                    metrics.rejection_seconds.observe(time.perf_counter() - t_arrival)
                    metrics.requests.labels("rejected_overload").inc()
                else:
                    metrics.requests.labels("failed").inc()
                await e.response()(scope, receive, send)
                return
            engine.reserved += 1
            slot = scope["vramguard.slot"] = {"held": True}  # the handler takes it over (see _handle)
            try:
                await asyncio.sleep(0)
                await self.app(scope, receive, send)
            finally:
                if slot["held"]:
                    engine.reserved -= 1

    app.add_middleware(_OverloadGate)
    if options.api_key:  # added last: the outermost layer, so a request without the key never reaches the gate
        app.add_middleware(_ApiKey, key=options.api_key, on_reject=lambda: metrics.requests.labels(
            "rejected_auth").inc())
    from vramguard.serve.access import AccessLog
    app.add_middleware(AccessLog)  # outermost: every request gets its line, refused ones too

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health(request: Request):
        err = engine.check_fatal()
        # /health needs no key: without it, the model is named by its last path part (no folder path shown)
        header = request.headers.get("authorization", "").encode()
        given = header[7:] if header[:7].lower() == b"bearer " else b""
        keyed = not options.api_key or hmac.compare_digest(given, options.api_key.encode())
        name = options.model_id if keyed else Path(options.model_id).name
        body = {"status": "ok" if err is None and engine.running else "unhealthy", "model": name,
                **engine.stats(), "pool": engine.pool.as_dict(),
                "notes": engine.notes + options.notes if keyed else []}
        if err is not None:
            body["error"] = f"{type(err).__name__}: {err}"
        return JSONResponse(body, status_code=200 if body["status"] == "ok" else 503)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    def _serves(name: str) -> bool:
        names = {n.rstrip("/") for n in (options.model_id, *options.model_aliases)}
        return name.rstrip("/") in names

    def _model_card() -> dict:
        return {"id": options.model_id, "object": "model", "created": options.created, "owned_by": "vramguard",
                "context_length": options.context_length, "kv_pool_tokens": engine.pool.pool_tokens}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if not _serves(model_id):
            return ApiError(404, f"model: {model_id!r} is not served here; this server serves "
                                 f"{options.model_id!r}", param="model", code="model_not_found").response()
        return _model_card()

    async def _body(request: Request, schema):
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > options.max_body_bytes:
            raise ApiError(413, f"request body: {int(size):,} bytes is over the limit of {options.max_body_bytes:,} "
                                "bytes; send a shorter prompt", code="request_too_large")
        raw = bytearray()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > options.max_body_bytes:
                raise ApiError(413, f"request body: over the limit of {options.max_body_bytes:,} bytes; send a "
                                    "shorter prompt", code="request_too_large")
        try:
            data = json.loads(raw or b"null")
        except ValueError as e:
            raise ApiError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None
        if not isinstance(data, dict):
            raise ApiError(400, "request body must be a JSON object", code="invalid_json")
        p = data.get("prompt")
        if isinstance(p, list) and any(isinstance(x, list) for x in p):
            raise ApiError(400, "prompt: a batch of prompts (a list of token-id lists) is not accepted; send one "
                                "prompt per request", param="prompt", code="invalid_value")
        try:
            req = schema.model_validate(data)
        except ValidationError as e:
            first = e.errors()[0]
            param = _param(first["loc"])
            if first["type"] == "extra_forbidden":
                known = ", ".join(schema.model_fields) if param and "." not in param else "OpenAI's fields"
                raise ApiError(400, f"{param}: unknown parameter; accepted: {known}", param=param,
                               code="unknown_parameter") from None
            given = first.get("input")
            raise ApiError(400, f"{param}: {first['msg']} (got {json.dumps(given)[:80]})", param=param,
                           code="invalid_value") from None
        bad = req.unsupported()
        if bad is not None:
            raise ApiError(400, bad[1], param=bad[0], code="unsupported_parameter")
        if req.n > options.n_max:
            raise ApiError(400, f"n: {req.n} is over this server's limit of {options.n_max}; send n <= "
                                f"{options.n_max} (or several requests)", param="n", code="invalid_value")
        if not _serves(req.model):
            raise ApiError(404, f"model: {req.model!r} is not served here; this server serves {options.model_id!r}",
                           param="model", code="model_not_found")
        if len(req.stops()) > 4:
            raise ApiError(400, "stop: at most 4 sequences", param="stop", code="invalid_value")
        return req

    def _shutting_down() -> ApiError:
        return ApiError(503, "the server is shutting down; send the request to another instance or retry after it "
                             "restarts", type_="server_error", code="shutting_down", headers={"Retry-After": "5"})

    def _admit_or_429(n: int):
        left = engine.capacity_left()
        if engine.check_fatal() is not None:
            raise ApiError(503, "the engine has stopped after a device error; the server is shutting down",
                           type_="server_error", code="engine_unavailable")
        if not engine.running:
            raise _shutting_down()
        if left < n:
            waiting = engine.waiting()
            retry = max(1, math.ceil(latency.mean * (waiting + n) / max(engine.max_running, 1)))
            raise ApiError(429, f"server busy: {engine.in_flight() + engine.reserved} generations admitted (at most "
                                f"{engine.max_running} running and {engine.max_queue} queued); retry after {retry} s",
                           type_="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(retry)})

    def _check_tokens(ids: list[int], limit: int | None, limit_field: str, prompt_field: str) -> int:
        bad = next((t for t in ids if not isinstance(t, int) or t < 0 or t >= vocab), None)
        if bad is not None:
            raise ApiError(400, f"{prompt_field}: token id {bad} is outside the vocabulary [0, {vocab - 1}]",
                           param=prompt_field, code="invalid_value")
        ctx = options.context_length
        if len(ids) >= ctx:
            raise ApiError(400, f"{prompt_field}: {len(ids):,} tokens; this model's maximum context length is "
                                f"{ctx:,} tokens, and at least one must be left to generate: shorten the prompt",
                           param=prompt_field, code="context_length_exceeded")
        max_new = limit if limit is not None else min(options.default_max_tokens, ctx - len(ids))
        if len(ids) + max_new > ctx:
            raise ApiError(400, f"{limit_field}: {max_new:,} + {len(ids):,} prompt tokens = {len(ids) + max_new:,} "
                                f"is over this model's maximum context length of {ctx:,} tokens; set {limit_field} "
                                f"<= {ctx - len(ids):,}", param=limit_field, code="context_length_exceeded")
        if not engine.fits_pool(len(ids) + max_new):
            pool = engine.pool.pool_tokens
            raise ApiError(400, f"{limit_field}: {len(ids):,} prompt + {max_new:,} new tokens needs more KV cache than "
                                f"this server's whole pool ({pool:,} tokens, sized for its --vram-budget); it can "
                                f"never run here: keep prompt + {limit_field} <= {pool:,}", param=limit_field,
                           code="kv_budget_exceeded")
        return max_new

    def _sampling(req) -> Sampling:
        if engine.greedy_only:
            return Sampling(temperature=0)
        return Sampling(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k)

    async def _generate(request: Request, req, ids: list[int], max_new: int, chat: bool):
        handles = []
        try:
            for _ in range(req.n):
                handles.append(engine.submit(ids, max_new, _sampling(req),
                                             eos_token_id=-1 if req.ignore_eos else None))
        except EngineStopped:  # the stop began while this request's body was read and checked
            for h in handles:
                engine.cancel(h.request_id)
            raise _shutting_down() from None
        metrics.prompt_tokens.inc(len(ids) * req.n)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        stops = req.stops()
        if req.stream:
            # on SIGTERM sse-starlette would cut every open stream at once; the server's own shutdown ends each
            # with an error event (Served._drain), so the streams get the grace period to send it
            return EventSourceResponse(_stream(request, handles, rid, created, stops, chat, req, len(ids)),
                                       ping=15, send_timeout=30, shutdown_grace_period=SHUTDOWN_GRACE_S)
        results = await asyncio.gather(*[_consume(request, h, stops) for h in handles])
        for r in results:
            if r["error"] is not None:
                stopping = not engine.accepting and engine.check_fatal() is None
                raise ApiError(503, r["error"], type_="server_error",
                               code="shutting_down" if stopping else "generation_failed",
                               headers={"Retry-After": "5"} if stopping else None)
            if r["cancelled"]:
                return Response(status_code=499)
        usage = {"prompt_tokens": len(ids), "completion_tokens": sum(r["tokens"] for r in results),
                 "total_tokens": len(ids) + sum(r["tokens"] for r in results)}
        if chat:
            choices = [{"index": i, "message": {"role": "assistant", "content": r["text"]},
                        "finish_reason": r["finish"], "logprobs": None} for i, r in enumerate(results)]
            obj = "chat.completion"
        else:
            choices = [{"index": i, "text": r["text"], "finish_reason": r["finish"], "logprobs": None}
                       for i, r in enumerate(results)]
            obj = "text_completion"
        return {"id": rid, "object": obj, "created": created, "model": options.model_id, "choices": choices,
                "usage": usage}

    def _decode(tokens: list[int]) -> str:
        return tokenizer.decode(tokens, skip_special_tokens=True) if tokenizer is not None else ""

    async def _events(h, stops):
        """Yield (delta_text, done, finish_reason, error, n_tokens) from one handle's outputs."""
        sent = ""
        tokens: list[int] = []
        eos_ids = set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()
        last_t = None
        while True:
            out = await h.queue.get()
            status = getattr(out.status, "name", str(out.status))
            if out.error or status == "FAILED":
                yield "", True, None, out.error or "generation failed", len(tokens)
                return
            tokens = list(out.generated_tokens)
            now = time.perf_counter()
            if tokens and h.first_token_at is not None and last_t is None:
                metrics.ttft.observe(h.first_token_at - h.submitted)
                last_t = now
            finished = status == "FINISHED"
            text = _decode(tokens)
            hit = None
            for s in stops:
                k = text.find(s, max(0, len(sent) - len(s)))
                if k != -1 and (hit is None or k < hit):
                    hit = k
            if hit is not None:
                text, finished = text[:hit], True
                reason = "stop"
                engine.cancel(h.request_id)
            else:
                reason = ("stop" if tokens and tokens[-1] in eos_ids else "length") if finished else None
            if not finished and text.endswith("\ufffd"):
                continue  # an incomplete UTF-8 sequence: wait for the next token
            delta, sent = text[len(sent):], text
            if finished:
                n = len(tokens)
                if n > 1 and h.first_token_at is not None:
                    metrics.tpot.observe((now - h.first_token_at) / (n - 1))
                metrics.generation_tokens.inc(n)
                latency.add(now - h.submitted)
                yield delta, True, reason, None, n
                return
            if delta:
                yield delta, False, None, None, len(tokens)

    async def _consume(request: Request, h, stops) -> dict:
        result = {"text": "", "tokens": 0, "finish": None, "error": None, "cancelled": False}
        text = ""
        agen = _events(h, stops)
        gone = asyncio.ensure_future(_disconnected(request))  # one waiter per request, no polling
        try:
            while True:
                nxt = asyncio.ensure_future(agen.__anext__())
                await asyncio.wait({nxt, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not nxt.done():
                    nxt.cancel()
                    engine.cancel(h.request_id)
                    metrics.requests.labels("cancelled").inc()
                    result["cancelled"] = True
                    return result
                try:
                    delta, done, reason, err, n = nxt.result()
                except StopAsyncIteration:
                    break
                text += delta
                if done:
                    result.update(text=text, tokens=n, finish=reason, error=err)
                    metrics.requests.labels("failed" if err else "completed").inc()
                    break
        finally:
            gone.cancel()
            engine.finish(h.request_id)
        return result

    async def _stream(request, handles, rid, created, stops, chat, req, n_prompt):
        obj = "chat.completion.chunk" if chat else "text_completion"
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(i, delta=None, text=None, finish=None):
            if chat:
                choice = {"index": i, "delta": delta or {}, "finish_reason": finish, "logprobs": None}
            else:
                choice = {"index": i, "text": text or "", "finish_reason": finish, "logprobs": None}
            return json.dumps({"id": rid, "object": obj, "created": created, "model": options.model_id,
                               "choices": [choice]})

        queue: asyncio.Queue = asyncio.Queue()
        done_flags = [False] * len(handles)
        total = [0] * len(handles)

        async def pump(i, h):
            async for ev in _events(h, stops):
                await queue.put((i, ev))

        tasks = [asyncio.create_task(pump(i, h)) for i, h in enumerate(handles)]
        finished_ok = False
        try:
            if chat:
                for i in range(len(handles)):
                    yield {"data": chunk(i, delta={"role": "assistant", "content": ""})}
            while not all(done_flags):
                i, (delta, done, reason, err, n) = await queue.get()
                total[i] = n
                if err is not None:
                    metrics.requests.labels("failed").inc()
                    stopping = not engine.accepting and engine.check_fatal() is None
                    yield {"data": json.dumps(ApiError(503, err, type_="server_error", code="shutting_down"
                                                       if stopping else "generation_failed").body())}
                    done_flags[i] = True
                    continue
                if delta:
                    yield {"data": chunk(i, delta={"content": delta}, text=delta)}
                if done:
                    done_flags[i] = True
                    metrics.requests.labels("completed").inc()
                    yield {"data": chunk(i, delta={}, text="", finish=reason)}
            if include_usage:
                yield {"data": json.dumps({"id": rid, "object": obj, "created": created, "model": options.model_id,
                                           "choices": [], "usage": {"prompt_tokens": n_prompt,
                                                                    "completion_tokens": sum(total),
                                                                    "total_tokens": n_prompt + sum(total)}})}
            yield {"data": "[DONE]"}
            finished_ok = True
        finally:
            for t in tasks:
                t.cancel()
            for i, h in enumerate(handles):
                if not finished_ok and not done_flags[i]:
                    engine.cancel(h.request_id)
                    metrics.requests.labels("cancelled").inc()
                engine.finish(h.request_id)

    def _chat_prompt(req: ChatRequest) -> list[int]:
        if tokenizer is None:
            raise ApiError(400, "this model has no tokenizer: use /v1/completions with token ids",
                           param="messages", code="no_tokenizer")
        if getattr(tokenizer, "chat_template", None):
            msgs = [{"role": m.role if m.role != "developer" else "system", "content": m.text()}
                    for m in req.messages]
            text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
            return tokenizer(text, add_special_tokens=False)["input_ids"]
        return tokenizer(_fallback_template(req.messages))["input_ids"]

    def _completion_prompt(req: CompletionRequest) -> list[int]:
        p = req.prompt
        if isinstance(p, list) and p and isinstance(p[0], str):
            if len(p) != 1:
                raise ApiError(400, f"prompt: {len(p)} prompts in one request; send one prompt per request",
                               param="prompt", code="invalid_value")
            p = p[0]
        if isinstance(p, str):
            if tokenizer is None:
                raise ApiError(400, "this model has no tokenizer: send the prompt as a list of token ids",
                               param="prompt", code="no_tokenizer")
            return tokenizer(p)["input_ids"]
        return list(p)

    async def _handle(request: Request, schema, chat: bool):
        held = 0  # admission slots this request holds until its handles exist (or it is refused)
        try:
            t_arrival = time.perf_counter()
            request.scope["vramguard.slot"]["held"] = False  # admitted by _OverloadGate: this handler holds it now
            held = 1
            req = await _body(request, schema)
            if req.n > 1:
                try:
                    _admit_or_429(req.n - 1)
                except ApiError as e:
                    if e.status == 429:
                        metrics.rejection_seconds.observe(time.perf_counter() - t_arrival)
                    raise
                engine.reserved += req.n - 1
                held = req.n
            if engine.greedy_only and "temperature" in req.model_fields_set and req.temperature > 0:
                raise ApiError(400, f"temperature: {req.temperature} asks for sampling, and this server decodes "
                                    "greedily (started with --greedy); send temperature 0 or leave it out",
                               param="temperature", code="unsupported_parameter")
            ids = _chat_prompt(req) if chat else _completion_prompt(req)
            if not ids:
                raise ApiError(400, "prompt: empty; send at least one token", param="prompt", code="invalid_value")
            limit = req.limit() if chat else req.max_tokens
            limit_field = req.limit_field() if chat else "max_tokens"
            max_new = _check_tokens(ids, limit, limit_field, "messages" if chat else "prompt")
            engine.reserved -= held
            held = 0
            return await _generate(request, req, ids, max_new, chat)
        except ApiError as e:
            if e.status == 429:
                metrics.requests.labels("rejected_overload").inc()
            elif e.status < 500:
                metrics.requests.labels("rejected_invalid").inc()
            else:
                metrics.requests.labels("failed").inc()
            return e.response()
        finally:
            engine.reserved -= held

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _handle(request, CompletionRequest, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _handle(request, ChatRequest, chat=True)

    return app
