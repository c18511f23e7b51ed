"""One process per GPU behind one router: ``vramguard serve MODEL --gpus 0,1``.

Each worker is a full ``vramguard serve`` process pinned to one GPU (``CUDA_VISIBLE_DEVICES``), listening on a
loopback port and protected by an internal key. The router polls every worker's /health (KV tokens in the pool and
promised to admitted requests, admission slots left) and sends each request to the worker with the most free KV
capacity among those with admission slots left. The router is the workers' only client, so it knows exactly how
many requests each one holds: when every worker is full it answers 429 itself, before reading the body, in a
process whose event loop never waits on a model step (the engine thread of a worker shares its GIL with that
worker's HTTP loop). As in a worker (:mod:`vramguard.serve.admission`), a request takes a worker's slot only once
its whole body arrived, within the workers' size and time limits: a client that sends no body holds nothing.
Other responses, streamed or not, are relayed unchanged (status, body, Retry-After).
A worker that dies makes /health fail and the router exit non-zero.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from starlette.requests import ClientDisconnect

from vramguard.serve.access import AccessLog
from vramguard.serve.admission import RefusalLog, read_body
from vramguard.serve.api import BODY_TIMEOUT_S, SHUTDOWN_GRACE_S, ApiError, _ApiKey
from vramguard.serve.browsers import BrowserGuard
from vramguard.serve.metrics import GatewayGauges, combined_stats
from vramguard.serve.server import EXIT_DEVICE_ERROR, make_server

log = logging.getLogger("vramguard.serve")

POLL_S = 0.1
TOKENS_PER_UNREPORTED_REQUEST = 512  # assumed size of a request sent since the last poll


@dataclass
class Worker:
    """A backend: its base URL, the internal key, the process (None when not spawned here), the last /health."""

    name: str
    url: str
    key: str | None = None
    process: subprocess.Popen | None = None
    stats: dict = field(default_factory=dict)
    healthy: bool = False
    sent_since_poll: int = 0
    relaying: int = 0  # requests the router sent to this worker and has not finished relaying
    stopping: bool = False  # the router is stopping it: its exit is not a failure

    def capacity(self) -> int:
        """Requests the worker admits at once (``max_running + max_queue`` from its /health)."""
        return self.stats.get("max_running", 0) + self.stats.get("max_queue", 0)

    def free_tokens(self) -> int:
        """KV tokens not promised to admitted requests at the last poll, minus an estimate for those sent since."""
        s = self.stats
        free = s.get("kv_tokens_total", 0) - s.get("kv_tokens_reserved", 0)
        return free - self.sent_since_poll * TOKENS_PER_UNREPORTED_REQUEST

    def slots(self) -> int:
        """Admission slots left. The router is the workers' only client (they need its internal key), so its own
        count of requests being relayed is exact, and no poll is needed to decide."""
        return self.capacity() - self.relaying


def pick(workers: list[Worker]) -> Worker | None:
    """The healthy worker with admission slots left that has the most free KV tokens; None when every healthy
    worker is full (the router then answers 429 itself) or none is healthy."""
    up = [w for w in workers if w.healthy and w.slots() > 0]
    if not up:
        return None
    return max(up, key=lambda w: (w.free_tokens(), w.slots()))


class _Router:
    """The router's state and its parts: the /health poll, the 429 it answers itself, and the relay. ``fatal``
    holds the first worker failure; ``mean_s`` the running mean of a relayed request's time (for Retry-After)."""

    def __init__(self, workers: list[Worker], on_fatal=None, max_body_bytes: int = 1 << 20,
                 body_timeout_s: float = BODY_TIMEOUT_S):
        self.workers = workers
        self.on_fatal = on_fatal
        self.max_body_bytes, self.body_timeout_s = max_body_bytes, body_timeout_s
        self.registry = CollectorRegistry()
        refusals = Counter("vramguard_refusals", "Requests the router refused, by error code", ["code"],
                           registry=self.registry)
        self.refusals = RefusalLog(SimpleNamespace(refusals=refusals))  # counted, logged once per interval
        self.routed = Counter("vramguard_router_requests", "Requests relayed, by worker", ["worker"],
                              registry=self.registry)
        self.up_g = Gauge("vramguard_worker_up", "1 when the worker's /health is ok", ["worker"],
                          registry=self.registry)
        self.free_g = Gauge("vramguard_worker_kv_free_tokens", "KV tokens not promised to requests", ["worker"],
                            registry=self.registry)
        self.rejected = Counter("vramguard_router_rejected", "Requests answered 429 by the router (every worker "
                                "full)", registry=self.registry)
        self.gateway = GatewayGauges(self.registry)  # the pod as one model server, for an inference gateway
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5),
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=1024))
        self.fatal: str | None = None
        self.mean_s = 1.0

    async def poll_once(self) -> None:
        """Every worker's /health; the first worker that died or reports itself unhealthy is fatal."""
        for w in self.workers:
            try:
                r = await self.client.get(w.url + "/health", timeout=2)
                w.stats, w.healthy = r.json(), r.status_code == 200
            except (httpx.HTTPError, ValueError):
                w.healthy = False
            w.sent_since_poll = 0
            dead = w.process is not None and w.process.poll() is not None
            if w.stopping:
                continue
            if (dead or w.stats.get("status") == "unhealthy") and self.fatal is None:
                self.fatal = f"worker {w.name} " + (f"exited with code {w.process.returncode}" if dead
                                                    else f"unhealthy: {w.stats.get('error')}")
                if self.on_fatal is not None:
                    self.on_fatal(self.fatal)
            self.up_g.labels(w.name).set(1 if w.healthy else 0)
            self.free_g.labels(w.name).set(max(w.free_tokens(), 0))

    async def poll(self) -> None:
        while True:
            await asyncio.sleep(POLL_S)
            await self.poll_once()
            self.refusals.flush()

    @contextlib.asynccontextmanager
    async def lifespan(self, _app):
        await self.poll_once()  # the workers' state is known before the first request
        task = asyncio.create_task(self.poll())
        try:
            yield
        finally:
            task.cancel()
            self.refusals.flush(force=True)
            await self.client.aclose()

    async def health(self):
        workers = self.workers
        ok = self.fatal is None and all(w.healthy for w in workers)
        body = {"status": "ok" if ok else "unhealthy", "workers": {w.name: {"url": w.url, "healthy": w.healthy,
                                                                            **w.stats} for w in workers}}
        if self.fatal:
            body["error"] = self.fatal
        return JSONResponse(body, status_code=200 if ok else 503)

    async def metrics(self):
        """The router's counters, and the Model Server Protocol's gauges of all healthy workers together (as of
        the last /health poll)."""
        up = [w for w in self.workers if w.healthy]
        name = next((str(w.stats.get("model")) for w in up if w.stats.get("model")), "vramguard")
        self.gateway.set(combined_stats([w.stats for w in up]), name)
        return Response(generate_latest(self.registry), media_type="text/plain; version=0.0.4")

    async def models(self, request: Request):
        w = next((x for x in self.workers if x.healthy), None)  # any healthy worker can answer, full or not
        if w is None:
            return ApiError(503, "no worker is healthy", type_="server_error", code="no_worker").response()
        try:
            r = await self.client.get(w.url + request.url.path, headers=_headers(w, request), timeout=10)
        except httpx.HTTPError as e:
            return self.refused(ApiError(503, f"worker {w.name} did not answer ({type(e).__name__}); retry",
                                         type_="server_error", code="no_worker", headers={"Retry-After": "1"}))
        return Response(r.content, status_code=r.status_code, media_type="application/json")

    def refuse(self):
        """The answer when no worker can take a request: 503 when none is healthy, else 429 with a Retry-After
        from the mean request time, decided here, before the body is read: no worker is asked."""
        workers = self.workers
        if not any(x.healthy for x in workers):
            return self.refused(ApiError(503, "no worker is healthy", type_="server_error", code="no_worker",
                                         headers={"Retry-After": "1"}))
        self.rejected.inc()
        cap = sum(x.capacity() for x in workers if x.healthy)
        running = sum(x.stats.get("max_running", 0) for x in workers if x.healthy) or 1
        retry = max(1, round(self.mean_s * cap / running))
        return self.refused(ApiError(429, f"server busy: {cap} requests in flight on {len(workers)} worker(s), "
                                          f"every queue full; retry after {retry} s", type_="rate_limit_error",
                                     code="queue_full", headers={"Retry-After": str(retry)}))

    def refused(self, err: ApiError):
        """Count and log ``err`` (:class:`~vramguard.serve.admission.RefusalLog`: one line per code and interval,
        no traceback) and return its response."""
        self.refusals.refused(err)
        return err.response()

    async def relay(self, request: Request, path: str):
        """Send the request to the worker :func:`pick` chooses and stream its answer back unchanged. Every worker
        full is answered before the body is read (nothing is reserved); the body is then read within the size and
        time limits (413, 408), and only then is a worker's slot taken."""
        if pick(self.workers) is None:
            return self.refuse()
        await asyncio.sleep(0)  # every request of a burst already here gets its decision before this one reads
        try:
            body = await read_body(request, self.max_body_bytes, self.body_timeout_s)
        except ApiError as e:
            return self.refused(e)
        except ClientDisconnect:  # the client left while sending its body: nothing was reserved
            return Response(status_code=499)
        w = pick(self.workers)
        if w is None:
            return self.refuse()
        w.sent_since_poll += 1
        w.relaying += 1
        self.routed.labels(w.name).inc()
        t0 = time.perf_counter()
        try:
            req = self.client.build_request("POST", w.url + path, content=body, headers=_headers(w, request))
            upstream = await self.client.send(req, stream=True)
        except httpx.HTTPError as e:  # the worker went away: its /health poll says so; this client gets a 503
            w.relaying -= 1
            return self.refused(ApiError(503, f"worker {w.name} did not answer ({type(e).__name__}); retry",
                                         type_="server_error", code="no_worker", headers={"Retry-After": "1"}))
        except BaseException:
            w.relaying -= 1
            raise
        keep = {k: v for k, v in upstream.headers.items() if k.lower() in ("retry-after", "content-type")}
        keep["x-vramguard-worker"] = w.name
        return StreamingResponse(self._stream(w, upstream, t0), status_code=upstream.status_code, headers=keep)

    async def _stream(self, w: Worker, upstream: httpx.Response, t0: float):
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        except httpx.HTTPError as e:  # the worker's stream broke off: end the client's too, in one log line
            log.warning("worker %s: its answer broke off (%s: %s)", w.name, type(e).__name__, e)
        finally:
            w.relaying -= 1
            if upstream.status_code == 200:
                self.mean_s = 0.9 * self.mean_s + 0.1 * (time.perf_counter() - t0)
            with contextlib.suppress(Exception):  # a client that left closes the worker's stream: it cancels
                await upstream.aclose()


def _headers(w: Worker, request: Request) -> dict:
    """The headers of a request relayed to ``w``: its content type and the worker's internal key."""
    h = {"content-type": request.headers.get("content-type", "application/json")}
    if w.key:
        h["authorization"] = f"Bearer {w.key}"
    return h


def create_router(workers: list[Worker], api_key: str | None = None, on_fatal=None, *,
                  max_body_bytes: int = 1 << 20, body_timeout_s: float = BODY_TIMEOUT_S,
                  allowed_hosts: tuple[str, ...] = ()) -> FastAPI:
    """The router app over ``workers`` (already listening). ``max_body_bytes`` and ``body_timeout_s``: the
    workers' limits, applied here before a worker is chosen; ``allowed_hosts``: as
    :func:`vramguard.serve.server.build`'s (without ``api_key``, :class:`~vramguard.serve.browsers.BrowserGuard`)."""
    router = _Router(workers, on_fatal, max_body_bytes, body_timeout_s)
    app = FastAPI(title="vramguard router", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=router.lifespan)
    app.state.workers, app.state.router = workers, router
    if api_key:
        app.add_middleware(_ApiKey, key=api_key, on_reject=lambda: None)
    else:
        app.add_middleware(BrowserGuard, allowed_hosts=allowed_hosts, on_refuse=router.refusals.refused)
    app.add_middleware(AccessLog)
    app.get("/health")(router.health)
    app.get("/metrics")(router.metrics)
    app.get("/v1/models/{model_id:path}")(router.models)
    app.get("/v1/models")(router.models)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await router.relay(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await router.relay(request, "/v1/chat/completions")

    return app


def spawn_workers(model: str, gpus: list[int], worker_args: list[str], timeout_s: float = 900) -> list[Worker]:
    """Start one ``vramguard serve`` per GPU on loopback and wait until each listens.

    Raises:
        RuntimeError: a worker exited before listening (its stderr tail is in the message) or did not start in time.
    """
    workers = []
    tmp = tempfile.mkdtemp(prefix="vramguard-router-")
    for g in gpus:
        key = secrets.token_hex(16)
        ready = os.path.join(tmp, f"worker{g}.url")
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(g), "VRAMGUARD_API_KEY": key}
        # each worker's host-side tensor work gets its share of the cores (N processes x all cores of OpenMP
        # threads spin against each other); a value the user set is kept
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // len(gpus))))
        log = open(os.path.join(tmp, f"worker{g}.log"), "w")
        p = subprocess.Popen([sys.executable, "-m", "vramguard", "serve", model, "--host", "127.0.0.1", "--port", "0",
                              "--ready-file", ready, *worker_args], env=env, stdout=log, stderr=subprocess.STDOUT)
        workers.append(Worker(name=f"gpu{g}", url="", key=key, process=p))
        workers[-1]._ready, workers[-1]._log = ready, log.name
    deadline = time.time() + timeout_s
    for w in workers:
        while not os.path.exists(w._ready) or not open(w._ready).read().strip():
            if w.process.poll() is not None:
                tail = open(w._log).read()[-2000:]
                stop_workers(workers)
                raise RuntimeError(f"worker {w.name} exited with code {w.process.returncode}:\n{tail}")
            if time.time() > deadline:
                stop_workers(workers)
                raise RuntimeError(f"worker {w.name} did not start within {timeout_s:.0f} s (log: {w._log})")
            time.sleep(0.2)
        w.url = open(w._ready).read().strip()
    return workers


def stop_workers(workers: list[Worker]) -> None:
    """SIGTERM every worker (each ends its open requests with a 503 and exits 0 within its grace), then wait for
    them together, up to the grace and one second more; one still running then is killed."""
    for w in workers:
        w.stopping = True
    for w in workers:
        if w.process is not None and w.process.poll() is None:
            w.process.terminate()
    deadline = time.monotonic() + SHUTDOWN_GRACE_S + 1
    for w in workers:
        if w.process is not None:
            try:
                w.process.wait(timeout=max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                w.process.kill()
                w.process.wait()


def run_router(model: str, gpus: list[int], worker_args: list[str], host: str, port: int,
               api_key: str | None = None, on_listen=None, max_body_bytes: int = 1 << 20,
               allowed_hosts: tuple[str, ...] = ()) -> int:
    """Spawn the workers, serve the router until interrupted; returns 0, or 3 when a worker died.
    ``max_body_bytes``: the workers' limit (their ``--max-body-size``); ``allowed_hosts``: see
    :func:`create_router`."""
    workers = spawn_workers(model, gpus, worker_args)
    code = {"rc": 0}
    server = None

    def fatal(msg):
        code["rc"] = EXIT_DEVICE_ERROR
        print(f"error: {msg}; stopping the router", file=sys.stderr)
        if server is not None:
            server.should_exit = True

    async def drain():  # workers end their open requests with 503s, which are relayed before the router stops
        await asyncio.get_running_loop().run_in_executor(None, stop_workers, workers)

    try:
        app = create_router(workers, api_key, on_fatal=fatal, max_body_bytes=max_body_bytes,
                            allowed_hosts=allowed_hosts)
        server = make_server(app, host, port, on_listen, on_shutdown=drain)
        server.run()
    finally:
        stop_workers(workers)
    return code["rc"]
