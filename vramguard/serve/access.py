"""The server's log lines on stderr: one per HTTP request (method, path, status, seconds) and, while requests are
served, one every few seconds with the generation throughput, the requests running and waiting and the KV pool.

Knows nothing about validation or admission: it reads the ASGI messages and the engine's counters only.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time

log = logging.getLogger("vramguard.serve.access")
THROUGHPUT_EVERY_S = 10.0  # seconds between throughput lines (none while idle)


class _Stderr(logging.Handler):
    """Writes to the current ``sys.stderr`` (looked up at each record, so redirection and capture work)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
        except Exception:  # a closed stderr must not break a request
            self.handleError(record)


class WrappedFormatter(logging.Formatter):
    """``HH:MM:SS message``, wrapped at word boundaries to ``columns`` (default :func:`log_columns`, read at each
    record); each continuation line is indented past the time by two more spaces, so that it reads as part of the
    line above. A word longer than a line (a path, a URL) is kept whole. Characters Python does not print are
    written as their escapes (:func:`printable`); only the message's own newlines start new lines: a newline in
    one of its arguments (a client's text, an exception's) is written as ``\\n``."""

    def __init__(self, columns: int | None = None):
        super().__init__("%(asctime)s %(message)s", "%H:%M:%S")
        self.columns = columns

    def format(self, record: logging.LogRecord) -> str:
        import textwrap
        if record.args:  # a copy: the other handlers (a caller's, pytest's) see the record as it was logged
            record = logging.makeLogRecord({**record.__dict__, "args": _printable_args(record.args)})
        text = "\n".join(printable(part) for part in super().format(record).split("\n"))
        columns = self.columns or log_columns()
        if len(text) <= columns and "\n" not in text:
            return text
        indent = " " * (len(self.formatTime(record, self.datefmt)) + 3)
        lines = []
        for i, part in enumerate(text.splitlines()):
            lines += textwrap.wrap(part, columns, subsequent_indent=indent, initial_indent="" if i == 0 else
                                   indent, break_long_words=False, break_on_hyphens=False) or [""]
        return "\n".join(lines)


def _printable_args(args):
    """A log record's arguments (a tuple, or a mapping for ``%(name)s``) with every string :func:`printable`."""
    if isinstance(args, dict):
        return {k: printable(v) if isinstance(v, str) else v for k, v in args.items()}
    return tuple(printable(a) if isinstance(a, str) else a for a in args)


def log_columns(stream=None) -> int:
    """The width log lines wrap at: the terminal's when ``stream`` (default: the current ``sys.stderr``) is one
    (``COLUMNS`` first, as :func:`shutil.get_terminal_size` reads it; at least :data:`MIN_LOG_COLUMNS`), else
    :data:`LOG_COLUMNS` (a file or a pipe, read in a log viewer)."""
    import os
    stream = stream if stream is not None else sys.stderr
    try:
        if not stream.isatty():
            return LOG_COLUMNS
        env = os.environ.get("COLUMNS", "")
        columns = int(env) if env.isdigit() and int(env) > 0 else os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):
        return LOG_COLUMNS
    return max(columns, MIN_LOG_COLUMNS)


LOG_COLUMNS = 120  # the widest log line off a terminal (the project's line limit, readable in a log viewer)
MIN_LOG_COLUMNS = 40  # a narrower terminal still gets lines of 40 (the time and a few words each)
SERVE_LOG = "vramguard.serve"  # the server's own lines (refusals, recovery, notes) log under it


def _ensure_handler() -> None:
    """One stderr handler on the server's loggers: the access and throughput lines (this module's, INFO) and the
    server's own (:data:`SERVE_LOG`: refusals, recovery, notes), each line with its time and wrapped
    (:class:`WrappedFormatter`). The server's records still propagate, so a caller's handlers see them too."""
    if not any(isinstance(h, _Stderr) for h in log.handlers):
        h = _Stderr()
        h.setFormatter(WrappedFormatter())
        log.addHandler(h)
        log.setLevel(logging.INFO)
        log.propagate = False
    serve = logging.getLogger(SERVE_LOG)
    if not any(isinstance(h, _Stderr) for h in serve.handlers):
        h = _Stderr()
        h.setFormatter(WrappedFormatter())
        serve.addHandler(h)
        if serve.level == logging.NOTSET:
            serve.setLevel(logging.INFO)


class AccessLog:
    """Pure ASGI middleware: after each HTTP response ends, one line ``client method path status seconds``
    (a stream ends with its last body message, so its line comes when the stream is done)."""

    def __init__(self, app):
        self.app = app
        _ensure_handler()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0, status = time.perf_counter(), {"code": 0}

        async def sending(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                _line(scope, status["code"], t0)
                status["logged"] = True

        try:
            await self.app(scope, receive, sending)
        finally:
            if not status.get("logged"):  # cancelled (client gone) or failed before the body ended
                _line(scope, status["code"] or 499, t0)


def printable(text: str) -> str:
    """``text`` with every character Python does not print (control characters such as newline and ESC, which
    start terminal escape sequences; line and paragraph separators) written as its backslash escape, so that a
    client's decoded URL path can neither forge a log line nor drive the terminal that shows the log."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else ch.encode("unicode_escape").decode("ascii") for ch in text)


def _line(scope, code: int, t0: float) -> None:
    client = scope.get("client") or ("-", 0)
    log.info("%s %s %s %d %.3f s", client[0], printable(scope["method"]), printable(scope["path"]), code,
             time.perf_counter() - t0)


async def throughput_loop(engine, metrics, every_s: float = THROUGHPUT_EVERY_S) -> None:
    """Every ``every_s`` seconds in which tokens were generated: tokens and tokens/s, requests running and
    waiting, KV blocks in use. Runs until cancelled."""
    _ensure_handler()
    last, t_last = metrics.generated_tokens(), time.perf_counter()
    while True:
        await asyncio.sleep(every_s)
        now, t = metrics.generated_tokens(), time.perf_counter()
        if now > last:
            st = engine.stats()
            log.info("throughput: %s tokens in %.1f s (%.1f tokens/s); %d running, %d waiting; KV blocks %d of %d",
                     f"{int(now - last):,}", t - t_last, (now - last) / (t - t_last), st["in_flight"], st["waiting"],
                     st["kv_blocks_used"], st["kv_blocks_total"])
        last, t_last = now, t
