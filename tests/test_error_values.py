"""Errors that repeat what the user gave: a long value (a whole prompt) is shown by its start and its length,
and a tokenizer that turns a non-empty prompt into no token is named, not taken for an empty prompt."""

import pytest

from vramguard.errors import InvalidValue


def test_a_long_value_is_shown_by_its_start_and_its_length():
    text = " ".join(f"w{i}" for i in range(30000))
    e = InvalidValue("prompt", text, "at most 100 tokens", "pass a shorter prompt")
    first = str(e).splitlines()[0]
    assert first.startswith("prompt: 'w0 w1 w2") and f"... ({len(text):,} characters) is not valid" in first
    assert len(first) < 200
    assert str(InvalidValue("batch", 0, "1 or more")) == "batch: 0 is not valid; accepted: 1 or more."


class _DropsEverything:
    chat_template = None

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": []}


def test_a_tokenizer_that_gives_no_token_is_named():
    from vramguard.run.prompt import prepare_prompt
    with pytest.raises(InvalidValue) as e:
        prepare_prompt(_DropsEverything(), "w0 w1 w2")
    assert "text the tokenizer turns into at least one token" in str(e.value)
    assert "_DropsEverything" in e.value.fix and "8 characters" in e.value.fix
