"""Prompt text to token ids without letting one client's prompt cost the others: a prompt that cannot fit the
context is refused after tokenizing a prefix, and long prompts are tokenized in a lane of their own.

Tokenizing a megabyte of text takes about a second; a prompt that long can never fit a small context, and clients
that send such prompts in a loop should neither cost that second each nor hold the one tokenizer thread that every
other request waits for. Two rules:

* with a byte-level tokenizer that drops no character (no normalizer, no pre-tokenizer that removes text: GPT-2,
  Llama 3, Qwen, SmolLM), every token covers at most its vocabulary entry's length in bytes of UTF-8 (each character
  of an entry stands for one byte), so a prompt of more bytes than the context times the longest entry cannot fit:
  it is refused before any tokenization (a megabyte of CJK text, three bytes a character, as well as of ASCII);
* a longer prompt is tokenized first in prefixes of 1, 2, 4 and 8 characters per context token
  (:data:`PREFIX_STAGES`, each cut at a space, where pre-tokenizers split); when a prefix alone already has more
  tokens than the context (less :data:`BOUNDARY_TOKENS` for the cut), the prompt is refused (400
  context_length_exceeded) without tokenizing the rest; when a prefix's rate of tokens says the whole prompt
  fits with room, it is tokenized at once. A prefix never has many more tokens than the same text inside the
  whole prompt, so a prompt that fits is never refused;
* prompts of more than :data:`SHORT_PROMPT_CHARS` characters are tokenized in their own thread, with their own
  copy of the tokenizer (a fast tokenizer is not safe to share between threads), so short prompts never wait
  behind them. The Rust tokenizer releases the GIL while it encodes.

Knows nothing about HTTP but the error it raises.
"""

from __future__ import annotations

import copy
import threading
from concurrent.futures import ThreadPoolExecutor

from vramguard.serve.apierrors import ApiError

PREFIX_STAGES = (1, 2, 4, 8)  # prefixes tried, in characters per context token (CJK: ~1 per token, English ~4)
BOUNDARY_TOKENS = 16  # tokens a cut at a space may add at the prefix's end (a word split in two, a lone space)
SHORT_PROMPT_CHARS = 32_768  # prompts up to this many characters are tokenized in the short lane


class PromptEncoder:
    """Token ids of prompt text for a context of ``context_length`` tokens, in two lanes (see the module)."""

    def __init__(self, tokenizer, context_length: int):
        self.tokenizer, self.context_length = tokenizer, context_length
        self.long_tokenizer = copy.deepcopy(tokenizer) if tokenizer is not None else None
        self.max_token_chars = max_token_chars(tokenizer)
        self._lane = threading.local()  # .long: this thread is the long lane's
        self.short_pool = ThreadPoolExecutor(1, thread_name_prefix="vramguard-tokenize")
        self.long_pool = ThreadPoolExecutor(1, thread_name_prefix="vramguard-tokenize-long",
                                            initializer=lambda: setattr(self._lane, "long", True))

    def pool(self, chars: int) -> ThreadPoolExecutor:
        """The lane for a prompt of ``chars`` characters."""
        return self.short_pool if chars <= SHORT_PROMPT_CHARS else self.long_pool

    def encode(self, text: str, field: str, add_special_tokens: bool = True) -> list[int]:
        """``text``'s token ids, with ``add_special_tokens`` as the tokenizer's call takes it; in a lane's thread.

        Raises:
            ApiError: 400 context_length_exceeded when a prefix of ``text`` already has more tokens than the
                context.
        """
        tok = self.long_tokenizer if getattr(self._lane, "long", False) else self.tokenizer
        most = self.max_token_chars
        if most and len(text) * 4 > self.context_length * most:  # a character is 1 to 4 bytes of UTF-8
            size = len(text.encode("utf-8", "surrogatepass"))
            if size > self.context_length * most:
                raise ApiError.of("context_length_exceeded", f"{field}: {size:,} bytes of UTF-8 are at least "
                                  f"{-(-size // most):,} tokens (no token of this tokenizer covers more than {most} "
                                  f"bytes); this model's maximum context length is {self.context_length:,} "
                                  "tokens: shorten the prompt", param=field)
        for per_token in PREFIX_STAGES:
            cut = self.context_length * per_token
            if len(text) <= cut:
                break
            space = text.rfind(" ", cut // 2, cut)
            prefix = text[:space if space > 0 else cut]
            n = len(tok(prefix, add_special_tokens=add_special_tokens)["input_ids"])
            if n - BOUNDARY_TOKENS >= self.context_length:
                raise ApiError.of("context_length_exceeded", f"{field}: more than {n - BOUNDARY_TOKENS:,} tokens "
                                  f"in its first {len(prefix):,} of {len(text):,} characters; this model's maximum "
                                  f"context length is {self.context_length:,} tokens: shorten the prompt",
                                  param=field)
            if n * len(text) < len(prefix) * self.context_length // 2:  # at this rate it fits: no more stages
                break
        return tok(text, add_special_tokens=add_special_tokens)["input_ids"]

    def shutdown(self) -> None:
        self.short_pool.shutdown(wait=False, cancel_futures=True)
        self.long_pool.shutdown(wait=False, cancel_futures=True)


def max_token_chars(tokenizer) -> int | None:
    """The longest vocabulary entry (added tokens included) of a byte-level fast tokenizer that drops no character
    of the text: no normalizer, a ``ByteLevel`` pre-tokenizer and none that removes what it splits on. Each token
    then covers at most that many bytes of the text's UTF-8 (an entry's characters are bytes), hence at most that many
    characters. An added token is matched on the text itself: its length is counted in bytes of UTF-8.
    None for any other tokenizer (a normalizer or a whitespace split may drop characters)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.normalizer is not None or backend.pre_tokenizer is None:
        return None
    try:
        state = backend.pre_tokenizer.__getstate__()
    except (AttributeError, TypeError):
        return None
    if b'"ByteLevel"' not in state or b'"Removed"' in state:
        return None
    model = backend.get_vocab(with_added_tokens=False)
    added = set(backend.get_vocab(with_added_tokens=True)) - set(model)
    return max([len(k) for k in model] + [len(k.encode("utf-8")) for k in added], default=None)
