"""Admission: who gets a slot (running + queued requests), when, and what a refusal says and costs. A slot is taken
only once a request's body has been read and checked, so a client that never sends its body holds nothing; the
body read itself is bounded in time and size. Knows the engine's counts, not the request's fields."""

from __future__ import annotations

import asyncio
import logging
import time

from vramguard.serve.apierrors import ApiError

log = logging.getLogger("vramguard.serve")

REFUSAL_LOG_EVERY_S = 10.0  # at most one log line per refusal code in this many seconds (the rest are summed)


class RefusalLog:
    """Counts every refusal in ``vramguard_refusals_total{code}`` and logs it in one line without a traceback: the
    first of a code at once, later ones of that code summed into one line per ``REFUSAL_LOG_EVERY_S``."""

    def __init__(self, metrics, every_s: float = REFUSAL_LOG_EVERY_S):
        self.metrics, self.every_s = metrics, every_s
        self._last: dict[str, float] = {}
        self._pending: dict[str, tuple[int, str]] = {}

    def refused(self, err: ApiError) -> None:
        code = err.code or str(err.status)
        self.metrics.refusals.labels(code).inc()
        now = time.monotonic()
        if now - self._last.get(code, -1e9) >= self.every_s and code not in self._pending:
            self._last[code] = now
            log.warning("refused (%d %s): %s", err.status, code, err.message)
            return
        n, _ = self._pending.get(code, (0, ""))
        self._pending[code] = (n + 1, err.message)

    def flush(self, force: bool = False) -> None:
        """Log the summed refusals whose interval is over (all with ``force``); called by the server's watchdog."""
        now = time.monotonic()
        for code, (n, last) in list(self._pending.items()):
            if force or now - self._last.get(code, -1e9) >= self.every_s:
                self._last[code] = now
                del self._pending[code]
                log.warning("refused %d more request(s) (%s) in the last %.0f s; the last: %s", n, code,
                            self.every_s, last)


class Admission:
    """Slots of one engine: ``max_running + max_queue`` admitted requests, counting those reserved by requests
    between their checks and their submission (``engine.reserved``)."""

    def __init__(self, engine, metrics, refusals: RefusalLog):
        self.engine, self.metrics, self.refusals = engine, metrics, refusals

    def refusal(self, need: int) -> ApiError | None:
        """Why ``need`` more requests cannot be admitted now (503 when stopping or stopped, 429 when full)."""
        e = self.engine
        if e.check_fatal() is not None:
            return ApiError.of("engine_unavailable", "the engine has stopped after a device error; the server is "
                                                     "shutting down")
        if not e.running:
            return shutting_down()
        if e.capacity_left() < need:
            retry = e.retry_after_s(need)
            return ApiError.of("queue_full", f"server busy: {e.in_flight() + e.reserved} generations admitted (at "
                                             f"most {e.max_running} running and {e.max_queue} queued); retry after "
                                             f"{retry} s (when the running ones are expected to have finished)",
                               headers={"Retry-After": str(retry)})
        return None

    def reserve(self, need: int, t_arrival: float) -> int:
        """Take ``need`` slots; returns ``need`` (give it back with :meth:`release`).

        Raises:
            ApiError: 429 queue_full with Retry-After, or 503 when the engine stops.
        """
        err = self.refusal(need)
        if err is not None:
            if err.status == 429:
                self.metrics.rejection_seconds.observe(time.perf_counter() - t_arrival)
            raise err
        self.engine.reserved += need
        return need

    def release(self, held: int) -> None:
        self.engine.reserved -= held


LARGE_BODY_BYTES = 64 * 1024  # bodies over this many bytes are paced (a chat turn of ~16,000 words is under it)
LARGE_BODY_SHARE = 0.25  # of the server's time, at most, that reading and parsing large bodies may take in a row
# about twice the CPU a byte of body costs to receive and parse (a refused 1 MB prompt: 6.8 ms of ASCII, 10.4 ms of
# CJK on 2 cores: benchmarks/results/cpu_serve_attack_tiny_s40; 10 ns still let the CJK flood lift the normal median
# from 89 to 360 ms)
LARGE_BODY_S_PER_BYTE = 20e-9


class BodyPacer:
    """Large bodies take at most :data:`LARGE_BODY_SHARE` of the server's time in a row, so that clients sending
    megabytes in a loop (a prompt that can never fit, refused only once received and parsed) leave the event loop
    and the GIL to the other requests. A large body waits, before it is read, until the time the bodies before it
    were charged is over: each body read is charged its bytes' cost times ``1 / share - 1`` after it was read (the
    bytes that arrived, so a client that sends no body charges nothing and holds nothing). One large body after a
    pause never waits; a body of at most :data:`LARGE_BODY_BYTES` never waits."""

    def __init__(self, share: float = LARGE_BODY_SHARE, s_per_byte: float = LARGE_BODY_S_PER_BYTE, clock=None):
        self.rest_per_byte = s_per_byte * (1 / share - 1)
        self.clock = clock or time.monotonic
        self.next_at = 0.0  # the clock's time from which the next large body may be read
        self.waited = 0  # large bodies that waited

    @staticmethod
    def large(request) -> bool:
        """A body of more than :data:`LARGE_BODY_BYTES` by its Content-Length (a chunked one counts as large)."""
        size = request.headers.get("content-length")
        return not (size is not None and size.isdigit() and int(size) <= LARGE_BODY_BYTES)

    def wait_s(self) -> float:
        return max(self.next_at - self.clock(), 0.0)

    async def wait(self) -> None:
        rest = self.wait_s()
        if rest > 0:
            self.waited += 1
            await asyncio.sleep(rest)

    def charge(self, nbytes: int) -> None:
        """``nbytes`` of a body were read and parsed: the large bodies after it wait their share."""
        if nbytes > LARGE_BODY_BYTES:
            self.next_at = max(self.next_at, self.clock()) + nbytes * self.rest_per_byte


def shutting_down() -> ApiError:
    return ApiError.of("shutting_down", "the server is shutting down; send the request to another instance or retry "
                                        "after it restarts", headers={"Retry-After": "5"})


async def read_body(request, max_bytes: int, timeout_s: float) -> bytes:
    """The request body, at most ``max_bytes`` and within ``timeout_s`` of the headers.

    Raises:
        ApiError: 413 request_too_large, 408 request_timeout.
    """
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > max_bytes:
        raise ApiError.of("request_too_large", f"request body: {int(size):,} bytes is over the limit of "
                                               f"{max_bytes:,} bytes; send a shorter prompt")
    raw = bytearray()

    async def read():
        async for chunk in request.stream():
            raw.extend(chunk)
            if len(raw) > max_bytes:
                raise ApiError.of("request_too_large", f"request body: over the limit of {max_bytes:,} bytes; "
                                                       "send a shorter prompt")

    try:
        await asyncio.wait_for(read(), timeout_s)  # not asyncio.timeout: Python 3.10 is supported
    except asyncio.TimeoutError:
        raise ApiError.of("request_timeout", f"request body: {len(raw):,} bytes arrived in {timeout_s:g} s, the "
                                             "limit for the whole body; send the body with the headers") from None
    return bytes(raw)
