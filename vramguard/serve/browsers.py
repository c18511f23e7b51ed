"""What a web page can reach on a server without an API key: nothing it was not meant to.

A page in a browser can send requests to a server on this machine: a "simple" cross-site POST (``text/plain``,
form types: no CORS preflight), or, by DNS rebinding, requests under its own domain name that resolve to 127.0.0.1,
which the browser then lets it read. Local model servers refuse both when no key guards them: the ``Host`` header
must be a name of this machine (Ollama's ``allowedHost``: loopback names and IP addresses; llama.cpp and vLLM ask
for a key instead), an ``Origin`` header must be this machine or a name the operator allowed, and a POST body must
be declared JSON. A rebinding page cannot send an IP address as ``Host`` (it reaches the server under its own name),
so an IP address is accepted; ``Origin`` is stricter (an IP address elsewhere on the network is another site).

Knows nothing about generation: it reads the request's headers only (pure ASGI, before the body is read).
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

from vramguard.serve.apierrors import ApiError, shown

LOOPBACK_NAMES = ("localhost",)  # and every name under .localhost (RFC 6761: always this machine)
JSON_TYPES = ("application/json",)  # and every ``+json`` suffix type


def host_of(value: str) -> str:
    """The host part of a ``Host`` header (``name:port``, ``[v6]:port``), lower case, without a final dot."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:value.find("]")] if "]" in value else value[1:]
    if value.count(":") == 1:
        value = value.split(":", 1)[0]
    return value.rstrip(".")


def _ip(name: str):
    try:
        return ipaddress.ip_address(name)
    except ValueError:
        return None


def is_loopback(name: str) -> bool:
    """``localhost``, a name under ``.localhost``, or a loopback address (127.0.0.0/8, ::1)."""
    ip = _ip(name)
    return name in LOOPBACK_NAMES or name.endswith(".localhost") or (ip is not None and ip.is_loopback)


def named(name: str, allowed: tuple[str, ...]) -> bool:
    """``name`` is one of ``allowed``: an exact name, every name under a ``.suffix``, or ``*`` (any)."""
    return any(a == "*" or name == a or (a.startswith(".") and name.endswith(a)) for a in allowed)


class BrowserGuard:
    """Pure ASGI middleware for a server without an API key: refuses a ``Host`` that is not a loopback name, an IP
    address or one of ``allowed_hosts`` (403 forbidden_host), an ``Origin`` that is not a loopback name or one of
    ``allowed_hosts`` (403 forbidden_origin), and a POST whose ``Content-Type`` is present and not JSON (415
    unsupported_media_type). A request without these headers (curl, scripts) passes. ``on_refuse(err)`` counts
    and logs each refusal (:class:`vramguard.serve.admission.RefusalLog`)."""

    def __init__(self, app, allowed_hosts: tuple[str, ...] = (), on_refuse=None):
        self.app = app
        self.allowed = tuple(h.strip().lower().rstrip(".") for h in allowed_hosts if h.strip())
        self.on_refuse = on_refuse

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        err = self.refusal(scope)
        if err is None:
            await self.app(scope, receive, send)
            return
        if self.on_refuse is not None:
            self.on_refuse(err)
        await err.response()(scope, receive, send)

    def refusal(self, scope) -> ApiError | None:
        """Why a request with these headers is refused, or None."""
        headers = {}
        for k, v in scope.get("headers", []):
            headers.setdefault(k, v.decode("latin-1"))
        fix = "allowed_hosts=NAME (a name clients use for this server), or set api_key="
        host = headers.get(b"host")
        if host is not None:
            name = host_of(host)
            if not (is_loopback(name) or _ip(name) is not None or named(name, self.allowed)):
                return ApiError.of("forbidden_host", f"Host: {shown(host)} is not a name of this server; without an "
                                   "API key only localhost" + self._and() + " and IP addresses are accepted (against "
                                   f"DNS rebinding); start it with {fix}", param="Host")
        origin = headers.get(b"origin")
        if origin is not None:
            name = host_of(urlsplit(origin).netloc) if "://" in origin else ""
            if not (name and (is_loopback(name) or named(name, self.allowed))):
                return ApiError.of("forbidden_origin", f"Origin: {shown(origin)} is another site; without an API "
                                   "key only pages of localhost" + self._and() + " may call this server; start it "
                                   f"with {fix}", param="Origin")
        ctype = headers.get(b"content-type")
        if scope.get("method") == "POST" and ctype is not None:
            media = ctype.split(";", 1)[0].strip().lower()
            if media not in JSON_TYPES and not media.endswith("+json"):
                return ApiError.of("unsupported_media_type", f"Content-Type: {shown(ctype)} is not JSON; the body "
                                   "must be sent as application/json (curl: -H 'Content-Type: application/json')",
                                   param="Content-Type")
        return None

    def _and(self) -> str:
        return f", {', '.join(self.allowed)}" if self.allowed else ""
