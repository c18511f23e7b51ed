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


@pytest.mark.parametrize("name", ["a" * 300, "owner/" + "a" * 300, "/tmp/" + "b" * 300 + "/config.json"])
def test_a_model_name_longer_than_a_path_or_a_repo_id_can_be_is_refused(name):
    """A name the file system cannot take (ENAMETOOLONG) or a Hub id over huggingface_hub's 96 characters is an
    unknown model with its value cut short, not an internal error."""
    from vramguard.errors import UnknownModel
    from vramguard.resolve import resolve_model
    with pytest.raises(UnknownModel) as e:
        resolve_model(name)
    assert e.value.field == "MODEL" and f"({len(name):,} characters)" in str(e.value)
