"""From the engine's outputs to what a client receives: text deltas with stop sequences cut (no part of a stop string
is ever sent), one whole response, or an SSE stream; cancel on disconnect. Knows the engine's handles, not HTTP
routing or validation."""

from __future__ import annotations

import asyncio
import json
import time

from vramguard.serve.apierrors import ApiError


class StopText:
    """The text of one choice as tokens arrive. :meth:`feed` returns the part that may be sent: never a stop
    sequence, nor the tail that could still become one (held back until the next tokens say), nor an incomplete
    UTF-8 sequence at the end (decoded as U+FFFD)."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.sent = 0  # characters of the text already returned

    def _held(self, text: str) -> int:
        """Length of the longest tail of the unsent text that is a proper prefix of a stop sequence."""
        held, last = 0, text[-1:]
        for s in self.stops:
            for n in range(min(len(s) - 1, len(text) - self.sent), held, -1):
                if s[n - 1] == last and text.endswith(s[:n]):
                    held = n
                    break
        return held

    def feed(self, text: str, finished: bool) -> tuple[str, bool]:
        """(the new text to send, whether a stop sequence was found: the choice ends there)."""
        longest = max((len(s) for s in self.stops), default=0)
        start = max(0, self.sent - longest + 1)
        hits = [k for k in (text.find(s, start) for s in self.stops) if k != -1]
        if hits:
            end = max(min(hits), self.sent)
            delta, self.sent = text[self.sent:end], end
            return delta, True
        end = len(text)
        if not finished:
            end -= self._held(text)
            while end > self.sent and text[end - 1] == "\ufffd":
                end -= 1  # an incomplete UTF-8 sequence: wait for the next token
        delta, self.sent = text[self.sent:end], max(end, self.sent)
        return delta, False


def finish_reason(tokens: list[int], eos_ids: set, max_new_tokens: int) -> str:
    """OpenAI's ``finish_reason`` of a request that finished without a stop string: ``"stop"`` where it ended on an
    end token, or before its token limit (only an end token ends it earlier: an engine may leave the end token out of
    the tokens it returns), else ``"length"``."""
    return "stop" if tokens and (tokens[-1] in eos_ids or len(tokens) < max_new_tokens) else "length"


class Outputs:
    """Reads the handles of one server's engine. ``decode(tokens) -> str``; ``eos_ids``: the tokens that end with
    finish_reason "stop"."""

    def __init__(self, engine, metrics, decode, eos_ids: set, model_id: str):
        self.engine, self.metrics, self.decode = engine, metrics, decode
        self.eos_ids, self.model_id = eos_ids, model_id

    def error(self, message: str, h) -> ApiError:
        """The error a failed choice ends with (from the one table)."""
        if not self.engine.accepting and self.engine.check_fatal() is None:
            return ApiError.of("shutting_down", message, headers={"Retry-After": "5"})
        return ApiError.of(h.error_code or "generation_failed", message)

    async def events(self, h, stops: list[str]):
        """Yield (delta_text, done, finish_reason, error, n_tokens) from one handle's outputs."""
        text_state = StopText(stops)
        tokens: list[int] = []
        seen_first = False
        while True:
            out = await h.queue.get()
            status = getattr(out.status, "name", str(out.status))
            if out.error or status == "FAILED":
                yield "", True, None, self.error(out.error or "generation failed", h), len(tokens)
                return
            tokens = list(out.generated_tokens)
            now = time.perf_counter()
            if tokens and h.first_token_at is not None and not seen_first:
                self.metrics.ttft.observe(h.first_token_at - h.submitted)
                seen_first = True
            finished = status == "FINISHED"
            delta, stopped = text_state.feed(self.decode(tokens), finished)
            if stopped:
                self.engine.cancel(h.request_id)
                reason, finished = "stop", True
            else:
                reason = finish_reason(tokens, self.eos_ids, h.max_new_tokens) if finished else None
            if finished:
                n = len(tokens)
                if n > 1 and h.first_token_at is not None:
                    self.metrics.tpot.observe((now - h.first_token_at) / (n - 1))
                self.metrics.generation_tokens.inc(n)
                yield delta, True, reason, None, n
                return
            if delta:
                yield delta, False, None, None, len(tokens)

    async def consume(self, gone: asyncio.Future, h, stops: list[str]) -> dict:
        """One whole choice; cancelled (its blocks freed) when ``gone`` completes first (the client left)."""
        result = {"text": "", "tokens": 0, "finish": None, "error": None, "cancelled": False}
        text = ""
        agen = self.events(h, stops)
        try:
            while True:
                nxt = asyncio.ensure_future(agen.__anext__())
                await asyncio.wait({nxt, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not nxt.done():
                    nxt.cancel()
                    self.engine.cancel(h.request_id)
                    self.metrics.requests.labels("cancelled").inc()
                    result["cancelled"] = True
                    return result
                try:
                    delta, done, reason, err, n = nxt.result()
                except StopAsyncIteration:
                    break
                text += delta
                if done:
                    result.update(text=text, tokens=n, finish=reason, error=err)
                    self.metrics.requests.labels("failed" if err else "completed").inc()
                    break
        finally:
            self.engine.finish(h.request_id)
        return result

    def _chunk(self, head: dict, chat: bool, i: int, delta=None, text=None, finish=None) -> str:
        if chat:
            choice = {"index": i, "delta": delta or {}, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": i, "text": text or "", "finish_reason": finish, "logprobs": None}
        return json.dumps({**head, "choices": [choice]})

    async def sse(self, handles, head: dict, stops: list[str], chat: bool, include_usage: bool, n_prompt: int):
        """The SSE events of a streamed response (``head``: id, object, created, model), ending with [DONE]."""
        queue: asyncio.Queue = asyncio.Queue()
        done_flags, total = [False] * len(handles), [0] * len(handles)

        async def pump(i, h):
            async for ev in self.events(h, stops):
                await queue.put((i, ev))

        tasks = [asyncio.create_task(pump(i, h)) for i, h in enumerate(handles)]
        finished_ok = False
        try:
            if chat:
                for i in range(len(handles)):
                    yield {"data": self._chunk(head, chat, i, delta={"role": "assistant", "content": ""})}
            while not all(done_flags):
                i, (delta, done, reason, err, n) = await queue.get()
                total[i], done_flags[i] = n, done
                if err is not None:
                    self.metrics.requests.labels("failed").inc()
                    yield {"data": json.dumps(err.body())}
                    continue
                if delta:
                    yield {"data": self._chunk(head, chat, i, delta={"content": delta}, text=delta)}
                if done:
                    self.metrics.requests.labels("completed").inc()
                    yield {"data": self._chunk(head, chat, i, delta={}, text="", finish=reason)}
            if include_usage:
                usage = {"prompt_tokens": n_prompt, "completion_tokens": sum(total),
                         "total_tokens": n_prompt + sum(total)}
                yield {"data": json.dumps({**head, "choices": [], "usage": usage})}
            yield {"data": "[DONE]"}
            finished_ok = True
        finally:
            for t in tasks:
                t.cancel()
            for i, h in enumerate(handles):
                if not finished_ok and not done_flags[i]:
                    self.engine.cancel(h.request_id)
                    self.metrics.requests.labels("cancelled").inc()
                self.engine.finish(h.request_id)
