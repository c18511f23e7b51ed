"""The OpenAI-compatible HTTP API over one :class:`~vramguard.serve.engine.Engine`: routes wired to the parts
(:mod:`~vramguard.serve.validate`, :mod:`~vramguard.serve.admission`, :mod:`~vramguard.serve.streaming`, the error
table :mod:`~vramguard.serve.apierrors`).

Order of the checks on a generation request, each answered with an OpenAI-shaped error body
(``{"error": {"message", "type", "param", "code"}}``): API key (401) -> a quick overload check before the body is
read (429 with Retry-After or 503; nothing is reserved) -> the body within its size (413) and time (408) -> JSON,
numbers, text, nesting, field types, unknown fields, unsupported values and sampling ranges (400) -> model name (404)
-> a slot is reserved (429 when full) -> the prompt tokenized, token ids in range, prompt shorter than the context,
prompt + max_tokens within the context, one request within the KV pool (400) -> admitted. Parsing and tokenization
run in worker threads, never on the event loop; a prompt that cannot fit is refused after a prefix, and long
prompts have a tokenizer thread of their own (:mod:`vramguard.serve.prompts`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from sse_starlette.sse import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from vramguard.serve.access import AccessLog, throughput_loop
from vramguard.serve.admission import Admission, BodyPacer, RefusalLog, read_body, shutting_down
from vramguard.serve.apierrors import ApiError, shown  # ApiError: also imported from here by the router
from vramguard.serve.browsers import BrowserGuard
from vramguard.serve.config import BODY_TIMEOUT_S  # also imported from here by the router
from vramguard.serve.engine import Engine, EngineStopped, Sampling
from vramguard.serve.metrics import Metrics
from vramguard.serve.prompts import PromptEncoder
from vramguard.serve.sampler import choice_seed
from vramguard.serve.schemas import ChatRequest, CompletionRequest
from vramguard.serve.streaming import Outputs
from vramguard.serve.validate import Limits, check_tokens, parse_request

SHUTDOWN_GRACE_S = 5.0  # seconds open requests get to end on Ctrl-C/SIGTERM (uvicorn's graceful timeout too)


@dataclass
class ServeOptions:
    """Settings of the API layer. Sizes in bytes, counts in tokens/requests, times in seconds.

    Attributes:
        model_id: the name clients send as ``model`` (and that /v1/models lists).
        context_length: the model's context (prompt + generated tokens).
        api_key: when set, every route but /health needs ``Authorization: Bearer <api_key>``; when not, pages of
            other sites are refused (:class:`~vramguard.serve.browsers.BrowserGuard`, with ``allowed_hosts``).
        max_body_bytes: larger bodies get 413. body_timeout_s: a body slower than this gets 408.
        n_max: the largest ``n``. default_max_tokens: when a request gives none.
        chat_template_note: set when the tokenizer has no chat template and the fallback format is used.
    """

    model_id: str
    context_length: int
    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    body_timeout_s: float = BODY_TIMEOUT_S
    n_max: int = 4
    default_max_tokens: int = 256
    chat_template_note: str | None = None
    notes: list[str] = field(default_factory=list)
    model_aliases: tuple[str, ...] = ()  # other names accepted as ``model`` (the folder's path and name)
    allowed_hosts: tuple[str, ...] = ()  # without api_key: Host / Origin names accepted beyond loopback
                                         # (:mod:`vramguard.serve.browsers`)
    log_every_s: float = 10.0  # seconds between throughput lines on stderr (vramguard.serve.access)
    created: int = field(default_factory=lambda: int(time.time()))  # /v1/models' created: when the model loaded


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
                resp = ApiError.of("invalid_api_key", "missing or wrong API key: send the header 'Authorization: "
                                                      "Bearer <key>' with the key the server was started with "
                                                      "(api_key=)").response()
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


_COMPLETION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


class _OverloadGate:
    """Pure ASGI, first thing for a completion request (after the API key): a full or stopping server answers before
    routing and before the body is read. Nothing is reserved here (a slot is taken once the body is checked), so a
    client that sends no body holds no slot. A passed request yields once, so every request of a burst that has
    already arrived gets this decision (a 429 costs a few tens of microseconds) before any spends time on its body."""

    def __init__(self, app, api: _Api):
        self.app, self.api = app, api

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in _COMPLETION_PATHS:
            await self.app(scope, receive, send)
            return
        t_arrival = time.perf_counter()
        err = self.api.admission.refusal(1)
        if err is not None:
            if err.status == 429:
                self.api.metrics.rejection_seconds.observe(time.perf_counter() - t_arrival)
            self.api.refused(err)
            await err.response()(scope, receive, send)
            return
        await asyncio.sleep(0)
        await self.app(scope, receive, send)


def _chars(req, chat: bool) -> int:
    """The characters of a request's prompt text (0 for token ids): picks its tokenizer lane."""
    if chat:
        return sum(len(m.text()) for m in req.messages)
    p = req.prompt
    return len(p) if isinstance(p, str) else len(p[0]) if p and isinstance(p, list) and isinstance(p[0], str) else 0


def _fallback_template(messages) -> str:
    return "".join(f"{m.role}: {m.text()}\n" for m in messages) + "assistant:"


async def _disconnected(request: Request) -> None:
    """Return when the client has gone (the request body was read before: the next ASGI message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class _Api:
    """The parts of one app: limits, admission, the worker threads, the engine's outputs."""

    def __init__(self, engine: Engine, tokenizer, options: ServeOptions, metrics: Metrics, on_fatal):
        self.engine, self.tokenizer, self.options, self.metrics, self.on_fatal = (engine, tokenizer, options,
                                                                                  metrics, on_fatal)
        self.limits = Limits(context_length=options.context_length, vocab_size=engine.vocab_size,
                             n_max=options.n_max, default_max_tokens=options.default_max_tokens,
                             model_names=(options.model_id, *options.model_aliases), greedy_only=engine.greedy_only,
                             pool_tokens=engine.pool.pool_tokens, budget_refusal=engine.budget_refusal)
        self.refusals = RefusalLog(metrics)
        self.admission = Admission(engine, metrics, self.refusals)
        self.pacer = BodyPacer()  # large bodies take at most a quarter of the time in a row
        eos = tokenizer.eos_token_id if tokenizer is not None else None
        eos_ids = set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()
        self.outputs = Outputs(engine, metrics, self._decode, eos_ids, options.model_id)
        self.parse_pool = ThreadPoolExecutor(2, thread_name_prefix="vramguard-parse")
        self.prompts = PromptEncoder(tokenizer, options.context_length)  # two lanes, each its own tokenizer

    @contextlib.asynccontextmanager
    async def lifespan(self, _app):
        task = asyncio.create_task(self._watch())
        throughput = asyncio.create_task(throughput_loop(self.engine, self.metrics, self.options.log_every_s))
        try:
            yield
        finally:
            task.cancel()
            throughput.cancel()
            self.refusals.flush(force=True)
            self.parse_pool.shutdown(wait=False, cancel_futures=True)
            self.prompts.shutdown()

    async def _watch(self):
        fired = False
        while True:
            await asyncio.sleep(0.2)
            self.engine.sweep()
            self.refusals.flush()
            err = self.engine.check_fatal()
            if err is not None and not fired:
                fired = True
                if self.on_fatal is not None:
                    self.on_fatal(err)

    def refused(self, e: ApiError) -> None:
        """Count and log a request answered with an error before it was admitted."""
        outcome = ("rejected_overload" if e.status == 429 else "rejected_invalid" if e.status < 500 else "failed")
        self.metrics.requests.labels(outcome).inc()
        self.refusals.refused(e)

    def serves(self, name: str) -> bool:
        return name.rstrip("/") in {n.rstrip("/") for n in self.limits.model_names}

    def model_card(self) -> dict:
        return {"id": self.options.model_id, "object": "model", "created": self.options.created,
                "owned_by": "vramguard",
                "context_length": self.options.context_length, "kv_pool_tokens": self.engine.pool.pool_tokens,
                "engine": self.engine.name}

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True) if self.tokenizer is not None else ""

    # ------------------------------------------------------------------ a generation request
    async def handle(self, request: Request, schema, chat: bool):
        held = 0  # admission slots this request holds until its handles exist (or it is refused)
        try:
            t_arrival = time.perf_counter()
            if self.pacer.large(request):
                await self.pacer.wait()
            raw = await read_body(request, self.options.max_body_bytes, self.options.body_timeout_s)
            loop = asyncio.get_running_loop()
            try:
                req = await loop.run_in_executor(self.parse_pool, parse_request, raw, schema, self.limits)
            finally:
                self.pacer.charge(len(raw))
            held = self.admission.reserve(req.n, t_arrival)
            ids, max_new = await loop.run_in_executor(self.prompts.pool(_chars(req, chat)), self._prompt, req, chat)
            handles = self._submit(req, ids, max_new)
            self.admission.release(held)
            held = 0
            return await self._respond(request, req, handles, len(ids), chat)
        except ClientDisconnect:  # the client left while sending its body
            self.metrics.requests.labels("cancelled").inc()
            return Response(status_code=499)
        except ApiError as e:
            self.refused(e)
            return e.response()
        finally:
            self.admission.release(held)

    def _prompt(self, req, chat: bool) -> tuple[list[int], int]:
        """(token ids, new-token limit) of a checked request; runs in the tokenizer's thread."""
        ids = self._chat_ids(req) if chat else self._completion_ids(req)
        limit = req.limit() if chat else req.max_tokens
        limit_field = req.limit_field() if chat else "max_tokens"
        return ids, check_tokens(ids, limit, limit_field, "messages" if chat else "prompt", self.limits)

    def _chat_ids(self, req: ChatRequest) -> list[int]:
        tok = self.tokenizer
        if tok is None:
            raise ApiError.of("no_tokenizer", "this model has no tokenizer: use /v1/completions with token ids",
                              param="messages")
        if not getattr(tok, "chat_template", None):
            return self.prompts.encode(_fallback_template(req.messages), "messages")
        msgs = [{"role": m.role if m.role != "developer" else "system", "content": m.text()} for m in req.messages]
        try:
            text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # noqa: BLE001 - the template's own refusal (jinja raise_exception), kept as its text
            raise ApiError.of("invalid_value", f"messages: the model's chat template refused them: "
                                               f"{type(e).__name__}: {str(e)[:200]}", param="messages") from None
        return self.prompts.encode(text, "messages", add_special_tokens=False)

    def _completion_ids(self, req: CompletionRequest) -> list[int]:
        p = req.prompt
        if isinstance(p, list) and p and isinstance(p[0], str):
            if len(p) != 1:
                raise ApiError.of("invalid_value", f"prompt: {len(p)} prompts in one request; send one prompt per "
                                                   "request", param="prompt")
            p = p[0]
        if isinstance(p, str):
            if self.tokenizer is None:
                raise ApiError.of("no_tokenizer", "this model has no tokenizer: send the prompt as a list of token "
                                                  "ids", param="prompt")
            return self.prompts.encode(p, "prompt")
        return list(p)

    def _submit(self, req, ids: list[int], max_new: int) -> list:
        e = self.engine
        handles = []
        try:
            for i in range(req.n):
                seed = None if req.seed is None else choice_seed(req.seed, i)  # each choice its own stream
                sampling = (Sampling(temperature=0) if e.greedy_only
                            else Sampling(req.temperature, req.top_p, req.top_k, seed))
                handles.append(e.submit(ids, max_new, sampling, eos_token_id=-1 if req.ignore_eos else None))
        except EngineStopped:  # the stop began while this request's body was read and checked
            for h in handles:
                e.cancel(h.request_id)
            raise shutting_down() from None
        self.metrics.prompt_tokens.inc(len(ids) * req.n)
        return handles

    async def _respond(self, request: Request, req, handles: list, n_prompt: int, chat: bool):
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": self.options.model_id}
        stops = req.stops()
        if req.stream:
            # on SIGTERM sse-starlette would cut every open stream at once; the server's own shutdown ends each
            # with an error event (Served._drain), so the streams get the grace period to send it
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return EventSourceResponse(self.outputs.sse(handles, head, stops, chat, include_usage, n_prompt),
                                       ping=15, send_timeout=30, shutdown_grace_period=SHUTDOWN_GRACE_S)
        gone = asyncio.ensure_future(_disconnected(request))  # one waiter per request, no polling
        try:
            results = await asyncio.gather(*[self.outputs.consume(gone, h, stops) for h in handles])
        finally:
            gone.cancel()
        for r in results:
            if r["error"] is not None:
                return r["error"].response()
            if r["cancelled"]:
                return Response(status_code=499)
        completion = sum(r["tokens"] for r in results)
        usage = {"prompt_tokens": n_prompt, "completion_tokens": completion, "total_tokens": n_prompt + completion}
        if chat:
            choices = [{"index": i, "message": {"role": "assistant", "content": r["text"]},
                        "finish_reason": r["finish"], "logprobs": None} for i, r in enumerate(results)]
        else:
            choices = [{"index": i, "text": r["text"], "finish_reason": r["finish"], "logprobs": None}
                       for i, r in enumerate(results)]
        return {**head, "object": "chat.completion" if chat else "text_completion", "choices": choices,
                "usage": usage}


def create_app(engine: Engine, tokenizer, options: ServeOptions, metrics: Metrics | None = None,
               on_fatal=None) -> FastAPI:
    """The FastAPI app. ``on_fatal(error)`` is called once when the engine dies (the runner then exits non-zero)."""
    metrics = metrics or Metrics(engine.stats)
    metrics.model_name = metrics.model_name or options.model_id  # the label vLLM's gauges carry: the served name
    engine.metrics = metrics
    api = _Api(engine, tokenizer, options, metrics, on_fatal)
    app = FastAPI(title="vramguard", docs_url=None, redoc_url=None, openapi_url=None, lifespan=api.lifespan)
    app.state.engine, app.state.metrics, app.state.options, app.state.api = engine, metrics, options, api
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_middleware(_OverloadGate, api=api)
    if not options.api_key:  # a page in a browser may neither rebind a name to this server nor post to it
        app.add_middleware(BrowserGuard, allowed_hosts=options.allowed_hosts, on_refuse=api.refused)
    if options.api_key:  # added last: the outermost layer, so a request without the key never reaches the gate
        app.add_middleware(_ApiKey, key=options.api_key, on_reject=lambda: metrics.requests.labels(
            "rejected_auth").inc())
    app.add_middleware(AccessLog)  # outermost: every request gets its line, refused ones too
    _routes(app, api)
    return app


async def _http_error(request: Request, exc: StarletteHTTPException):
    if exc.status_code == 404:
        return ApiError.of("not_found", f"{request.url.path}: no such route; this server has /v1/chat/completions, "
                                        "/v1/completions, /v1/models, /health and /metrics").response()
    if exc.status_code == 405:  # Allow header kept
        return ApiError.of("method_not_allowed", f"{request.method} {request.url.path}: method not allowed",
                           headers=dict(exc.headers or {})).response()
    return ApiError(exc.status_code, str(exc.detail), code="http_error", headers=dict(exc.headers or {})).response()


def _routes(app: FastAPI, api: _Api) -> None:
    engine, options = api.engine, api.options

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
        return Response(api.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [api.model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if not api.serves(model_id):
            return ApiError.of("model_not_found", f"model: {shown(model_id)} is not served here; this server "
                                                  f"serves {shown(options.model_id)}", param="model").response()
        return api.model_card()

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await api.handle(request, CompletionRequest, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await api.handle(request, ChatRequest, chat=True)
