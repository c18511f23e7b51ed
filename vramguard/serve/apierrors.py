"""The server's one error table: each error code with its HTTP status and OpenAI error type, and the OpenAI-shaped
body ``{"error": {"message", "type", "param", "code"}}`` every refusal carries."""

from __future__ import annotations

from fastapi.responses import JSONResponse

INVALID, RATE, SERVER = "invalid_request_error", "rate_limit_error", "server_error"

ERRORS: dict[str, tuple[int, str]] = {  # code: (HTTP status, OpenAI error type)
    "invalid_api_key": (401, INVALID),
    "forbidden_host": (403, INVALID),      # no API key and a Host that is not this machine (DNS rebinding)
    "forbidden_origin": (403, INVALID),    # no API key and a page of another site
    "not_found": (404, INVALID),
    "model_not_found": (404, INVALID),
    "method_not_allowed": (405, INVALID),
    "request_timeout": (408, INVALID),
    "request_too_large": (413, INVALID),
    "unsupported_media_type": (415, INVALID),
    "invalid_json": (400, INVALID),
    "invalid_value": (400, INVALID),
    "unknown_parameter": (400, INVALID),
    "unsupported_parameter": (400, INVALID),
    "context_length_exceeded": (400, INVALID),
    "kv_budget_exceeded": (400, INVALID),
    "no_tokenizer": (400, INVALID),
    "queue_full": (429, RATE),
    "request_failed": (500, SERVER),       # the engine could not compute this request (the others went on)
    "generation_failed": (503, SERVER),    # out of memory too often for this request
    "shutting_down": (503, SERVER),
    "engine_unavailable": (503, SERVER),   # the engine stopped after a device fault
    "no_worker": (503, SERVER),            # the router has no healthy worker
}


_WORDING: list = []  # the function the process that started the server words messages with (at most one)


def word_messages_with(fn):
    """Word every error message through ``fn`` from now on (None: as the library writes them) and return the
    function used until now (None if none): the library's messages name its parameters (``vram_budget=``), and the
    CLI that starts a server passes the function that names its options instead, for as long as it serves."""
    previous = _WORDING[0] if _WORDING else None
    _WORDING[:] = [fn] if fn is not None else []
    return previous


class ApiError(Exception):
    """An HTTP error with OpenAI's body and optional headers. Build it from the table with :meth:`of`."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type_: str = INVALID, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_
        self.headers = headers or {}

    @classmethod
    def of(cls, code: str, message: str, param: str | None = None, headers: dict | None = None) -> ApiError:
        """The error ``code`` of :data:`ERRORS` (its status and type) with ``message`` naming field, limit, value."""
        status, type_ = ERRORS[code]
        return cls(status, message, param=param, code=code, type_=type_, headers=headers)

    def body(self) -> dict:
        """The OpenAI error object."""
        message = _WORDING[0](self.message) if _WORDING else self.message
        return {"error": {"message": message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        """The JSON response with this status and headers."""
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def shown(value, limit: int = 60) -> str:
    """A value as an error message shows it: JSON-like, ASCII, at most ``limit`` characters."""
    import json
    try:
        text = json.dumps(value, ensure_ascii=True)
    except (TypeError, ValueError):
        text = ascii(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def json_kind(value) -> str:
    """What a JSON value is, in JSON's words rather than Python's: ``"JSON null"``, ``"JSON true"``,
    ``"a JSON number"``, ``"a JSON string"``, ``"a JSON array"``, ``"a JSON object"``."""
    if value is None:
        return "JSON null"
    if isinstance(value, bool):
        return "JSON true" if value else "JSON false"
    if isinstance(value, str):
        return "a JSON string"
    if isinstance(value, list):
        return "a JSON array"
    if isinstance(value, dict):
        return "a JSON object"
    return "a JSON number"
