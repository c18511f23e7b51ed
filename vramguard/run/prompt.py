"""A user's prompt as token ids: the tokenizer's chat template when it has one (or raw text), and the context
check of prompt + new tokens, done from the tokenizer and config alone, before any weights are loaded."""

from __future__ import annotations

from dataclasses import dataclass

from vramguard.errors import InvalidValue
from vramguard.plan import check_context
from vramguard.resolve import local_model_folder, resolve_model
from vramguard.runtime.tokenizer import folder_tokenizer, no_tokenizer_error
from vramguard.settings import Settings


@dataclass(frozen=True)
class PreparedPrompt:
    """The prompt's token ids and how they were made: ``chat_template`` True when the tokenizer's chat template
    wrapped the text as one user turn, False for the raw text; ``reason`` says why, in words."""

    ids: list[int]
    chat_template: bool
    reason: str


def prepare_prompt(tokenizer, text: str, chat: bool | None = None) -> PreparedPrompt:
    """Token ids of ``text``: as one user message through the tokenizer's chat template when ``chat`` is True, or
    None (the default) and the tokenizer has a template; else the raw text with the tokenizer's special tokens.

    Raises:
        InvalidValue: the text is empty or white space only (a chat template would wrap it into a prompt of its
            own); ``chat`` is True and the tokenizer has no chat template; the text gives no tokens.
    """
    if not isinstance(text, str) or not text.strip():
        raise InvalidValue("prompt", text, "text with at least one character other than white space",
                           "pass the text to answer, e.g. prompt='Hello'")
    template = getattr(tokenizer, "chat_template", None)
    if chat and not template:
        raise InvalidValue("chat", True, "a tokenizer with a chat_template",
                           "pass chat=None (this tokenizer has none), or chat=False for the raw text")
    if template and chat is not False:
        text_in = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                tokenize=False)
        ids = tokenizer(text_in, add_special_tokens=False)["input_ids"]
        why = "the tokenizer's chat template applied (chat=False sends the text as is)"
        used = True
    else:
        ids = tokenizer(text, add_special_tokens=True)["input_ids"]
        why = "raw text (chat=False)" if chat is False else "raw text (the tokenizer has no chat template)"
        used = False
    if not ids:  # the text is not empty (checked above): the tokenizer dropped all of it
        raise InvalidValue("prompt", text, "text the tokenizer turns into at least one token",
                           f"the folder's tokenizer ({type(tokenizer).__name__}) gave no token for these "
                           f"{len(text):,} characters: check that it is the model's own tokenizer")
    return PreparedPrompt(list(ids), used, why)


def preflight_prompt(model: str, text: str, max_new_tokens: int, chat: bool | None = None):
    """Tokenizer, prepared prompt and model spec of the model folder ``model``, read without loading weights; the
    prompt + new tokens are checked against the model's context.

    Returns:
        (tokenizer, PreparedPrompt, ModelSpec).

    Raises:
        UnknownModel: no local folder for ``model``. ConfigError: the folder has no tokenizer.
        InvalidValue: prompt + new tokens over the context (with the room that is left).
    """
    folder = local_model_folder(model)
    spec = resolve_model(str(folder))  # first: a config transformers refuses is said as such, not as a tokenizer's
    tokenizer, no_tokenizer = folder_tokenizer(folder)
    if tokenizer is None:
        raise no_tokenizer_error(model, no_tokenizer)
    prepared = prepare_prompt(tokenizer, text, chat)
    check_context(spec, Settings(prompt_tokens=len(prepared.ids), max_new_tokens=max_new_tokens), beyond=None,
                  field="prompt + max_new_tokens")
    return tokenizer, prepared, spec
