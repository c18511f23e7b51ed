"""Connections that send nothing: a header timeout and a cap on open connections that keeps room for new clients.

uvicorn closes a keep-alive connection after ``timeout_keep_alive`` seconds, but not one that never sends a complete
request: a connection that sends nothing, or part of its headers, stays open, and enough of them use every file
descriptor of the process (``RLIMIT_NOFILE``, often 1,024), after which no client can connect. Here every
connection that is waiting for a request (just opened, or after its last response) must send complete headers within
:data:`HEADER_TIMEOUT_S` seconds; and the number of open connections is capped below the descriptor limit, the
oldest waiting connection being closed to make room for a new one. A connection with a request in progress is never
closed by either rule (its body has its own time limit, its generation its own admission). Each kind of closing is
logged once per :data:`LOG_EVERY_S` seconds, with the count.

Knows nothing about the API: it wraps uvicorn's HTTP protocol class (:func:`protocol_class`).
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from collections import OrderedDict

from vramguard.errors import InvalidValue

log = logging.getLogger("vramguard.serve")

HEADER_TIMEOUT_S = 10.0  # a waiting connection must send complete request headers within this many seconds
SWEEP_EVERY_S = 1.0  # how often waiting connections are checked against the header timeout
DESCRIPTOR_RESERVE = 128  # descriptors left free under the limit: model files, threads, logs, a burst of accepts
LOG_EVERY_S = 10.0  # at most one line per kind of closing in this many seconds (the rest are summed)


def connection_cap(reserve: int = DESCRIPTOR_RESERVE) -> int:
    """The most connections this process should hold open: its soft ``RLIMIT_NOFILE`` less the descriptors open
    now (files, pipes, sockets of the loaded process, counted in ``/proc/self/fd`` on Linux) less ``reserve``;
    at least 16. Without a limit (``RLIM_INFINITY``) 65,536."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 65536
    try:
        import os
        used = len(os.listdir("/proc/self/fd"))
    except OSError:  # not Linux: assume a loaded model's few dozen
        used = 64
    return max(soft - used - reserve, 16)


class _Closings:
    """Counts closed connections by kind and logs each kind at most once per :data:`LOG_EVERY_S`."""

    def __init__(self):
        self._last: dict[str, float] = {}
        self._pending: dict[str, int] = {}

    def closed(self, kind: str, line: str, n: int = 1) -> None:
        """Count ``n`` of ``kind``; log ``line`` (``{n}``: the count since the last line) when its interval is
        over."""
        now = time.monotonic()
        self._pending[kind] = self._pending.get(kind, 0) + n
        if now - self._last.get(kind, -1e9) >= LOG_EVERY_S:
            self._last[kind] = now
            log.warning(line.format(n=f"{self._pending.pop(kind):,}"))


class Registry:
    """The open connections of one server, oldest waiting first, the cap and the header timeout."""

    def __init__(self, cap: int, header_timeout_s: float = HEADER_TIMEOUT_S):
        self.cap, self.header_timeout_s = cap, header_timeout_s
        self.open: OrderedDict = OrderedDict()  # protocol -> monotonic time it began waiting for a request
        self.closings = _Closings()
        self._timer = None
        self.closed_idle = 0  # connections closed by the header timeout
        self.evicted = 0  # waiting connections closed to make room under the cap

    def opened(self, conn) -> None:
        self.open[conn] = time.monotonic()
        if len(self.open) > self.cap:
            self._evict(conn)
        if self._timer is None:
            self._timer = conn.loop.call_later(SWEEP_EVERY_S, self._sweep, conn.loop)

    def waiting(self, conn) -> None:
        """``conn`` finished a response: it waits for its next request from now."""
        if conn in self.open:
            self.open[conn] = time.monotonic()
            self.open.move_to_end(conn)

    def lost(self, conn) -> None:
        self.open.pop(conn, None)

    def _evict(self, new) -> None:
        victim = next((c for c in self.open if c is not new and _is_waiting(c)), None)
        if victim is None:  # every other connection has a request in progress: the new one cannot be held
            victim = new
        self.open.pop(victim, None)
        victim.transport.close()
        self.evicted += 1
        self.closings.closed("cap", "closed {n} connection(s) to stay under the cap of " f"{self.cap:,} open "
                             "connections (the descriptor limit, RLIMIT_NOFILE, less a reserve), those waiting "
                             "longest for a request first")

    def _sweep(self, loop) -> None:
        self._timer = None
        limit = time.monotonic() - self.header_timeout_s
        stale = [c for c, since in self.open.items() if since < limit and _is_waiting(c)]
        for c in stale:
            self.open.pop(c, None)
            c.transport.close()
        if stale:
            self.closed_idle += len(stale)
            self.closings.closed("idle", "closed {n} connection(s) that sent no complete request headers "
                                 f"within {self.header_timeout_s:g} s", len(stale))
        if self.open and not loop.is_closed():
            self._timer = loop.call_later(SWEEP_EVERY_S, self._sweep, loop)


def _is_waiting(conn) -> bool:
    """No request in progress: nothing or part of the headers received since the connection opened or since its
    last response."""
    cycle = getattr(conn, "cycle", None)
    return cycle is None or cycle.response_complete


def protocol_class(registry: Registry):
    """uvicorn's HTTP protocol class (httptools where installed, else h11, as its ``auto``) reporting each
    connection to ``registry``; pass it as ``uvicorn.Config(http=...)``."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class GuardedHTTP(AutoHTTPProtocol):
        def connection_made(self, transport):
            super().connection_made(transport)
            registry.opened(self)

        def connection_lost(self, exc):
            registry.lost(self)
            super().connection_lost(exc)

        def on_response_complete(self):
            super().on_response_complete()
            registry.waiting(self)

    return GuardedHTTP


class AcceptErrors:
    """The event loop's exception handler while serving: running out of descriptors in ``accept()`` (asyncio
    retries a second later) is one log line per :data:`LOG_EVERY_S`, without a traceback; anything else goes to
    the handler that was there before (asyncio's default: its message and traceback)."""

    def __init__(self, previous=None):
        self.previous = previous
        self.closings = _Closings()

    def __call__(self, loop, context) -> None:
        exc = context.get("exception")
        if isinstance(exc, OSError) and "accept" in str(context.get("message", "")):
            self.closings.closed("accept", "{n} new connection(s) waited: accept() failed " f"({exc.strerror}); "
                                 "the open connections use every file descriptor (RLIMIT_NOFILE); retrying")
            return
        if self.previous is not None:
            self.previous(loop, context)
        else:
            loop.default_exception_handler(context)


def install_accept_errors() -> None:
    """Put :class:`AcceptErrors` on the running loop (once)."""
    loop = asyncio.get_running_loop()
    current = loop.get_exception_handler()
    if not isinstance(current, AcceptErrors):
        loop.set_exception_handler(AcceptErrors(current))


def check_bind(host: str, port: int) -> None:
    """Raise :class:`InvalidValue` when ``port`` is out of range or ``host:port`` cannot be bound (in use, not an
    address of this machine), before the model is loaded."""
    import errno
    import socket
    if not 0 <= port <= 65535:
        raise InvalidValue("port", port, "0..65535 (0 picks a free port)", "pass e.g. port=8000")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise InvalidValue("host", host, "an address or name of this machine", f"check the name ({e.strerror}); "
                           "use 127.0.0.1 for this machine only, 0.0.0.0 for every interface") from None
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(addr)
        except OSError as e:
            if e.errno == errno.EADDRNOTAVAIL:
                raise InvalidValue("host", host, "an address of this machine", "use 127.0.0.1 for this machine only, "
                                   "0.0.0.0 for every interface, or an address `ip addr` lists") from None
            raise InvalidValue("port", port, f"a free port on {host}", f"{e.strerror}: choose another port=, or "
                               "stop the process that holds it (ss -ltnp shows it)") from None
