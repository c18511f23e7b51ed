"""Request bodies of the OpenAI-compatible routes (pydantic, unknown fields refused).

Fields OpenAI defines that this server does not implement are accepted only at their "off" value (e.g.
``logprobs: null``, ``presence_penalty: 0``); anything else is a 400 that names the field, so a client never gets
a response computed without a setting it asked for. ``store``, ``metadata`` and ``service_tier``, which current
OpenAI clients send, are accepted with any value and have no effect: nothing is stored and there is one tier.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

Stop = str | list[str] | None


class StreamOptions(BaseModel):
    """OpenAI's ``stream_options``: ``include_usage`` adds a last chunk with the token counts."""

    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # "3" is not 3 and true is not 1: JSON types as sent
    # the fields accepted only at their "off" value (:meth:`unsupported` refuses any other)
    OFF_ONLY: ClassVar[tuple[str, ...]] = ("presence_penalty", "frequency_penalty", "logit_bias", "logprobs")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Stop = None
    user: str | None = None
    ignore_eos: bool = False  # extension (as in vLLM): generate exactly max_tokens tokens
    # sent by current OpenAI clients; accepted and without effect here (nothing is stored, one service tier)
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    # OpenAI's (and vLLM's) per-request seed: the same seed and request draw the same tokens; a signed 64-bit integer
    seed: int | None = None
    # accepted only at their "off" values (see the module docstring)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict | None = None
    logprobs: bool | int | None = None

    def unsupported(self) -> tuple[str, str] | None:
        """(field, why) for the first field set to a value this server does not implement, else None."""
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) != 0:
                return name, f"{name} is not supported by this server: send 0 or leave it out"
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported by this server"
        if self.logprobs not in (None, False, 0):
            return "logprobs", "logprobs are not returned by this server: leave logprobs out"
        return None

    def stops(self) -> list[str]:
        """The stop sequences as a list (empty when none)."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_Common):
    """Body of POST /v1/completions: ``prompt`` is one string, a list of one string, or a list of token ids."""

    OFF_ONLY: ClassVar[tuple[str, ...]] = ("echo", "suffix", "best_of") + _Common.OFF_ONLY
    prompt: str | list[int] | list[str]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self):
        if self.echo:
            return "echo", "echo is not supported by this server"
        if self.suffix:
            return "suffix", "suffix (insertion) is not supported by this server"
        if self.best_of not in (None, 1):
            return "best_of", "best_of is not supported by this server: use n"
        return super().unsupported()


class ContentPart(BaseModel):
    """A text part of a chat message's content (images and audio are not accepted)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class Message(BaseModel):
    """One chat message; ``developer`` is treated as ``system`` for the chat template."""

    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart]
    name: str | None = None

    def text(self) -> str:
        """The message's text, parts joined."""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ResponseFormat(BaseModel):
    """Only ``{"type": "text"}``: structured output is not supported."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]


class ChatRequest(_Common):
    """Body of POST /v1/chat/completions. ``max_completion_tokens`` wins over ``max_tokens`` when both are given."""

    OFF_ONLY: ClassVar[tuple[str, ...]] = ("tools", "tool_choice", "top_logprobs") + _Common.OFF_ONLY
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None

    def unsupported(self):
        if self.tools:
            return "tools", "tool calling is not supported by this server"
        if self.tool_choice not in (None, "none"):
            return "tool_choice", "tool calling is not supported by this server"
        if self.top_logprobs:
            return "top_logprobs", "logprobs are not returned by this server"
        return super().unsupported()

    def limit(self) -> int | None:
        """The new-token limit the client asked for, or None."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def limit_field(self) -> str:
        """The name of the field that set the limit, for error messages."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"
