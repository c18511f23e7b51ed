"""run's prompt: the chat template by default when the tokenizer has one, raw on request; the context check and
the missing-folder error come before any weights are loaded."""

from pathlib import Path

import pytest

from conftest import run_cli, save_tiny_llama, save_word_tokenizer
from vramguard.errors import InvalidValue, UnknownModel
from vramguard.run.prompt import preflight_prompt, prepare_prompt

TEMPLATE = ("{% for m in messages %}[BOS] w1 {{ m['content'] }} [EOS] {% endfor %}"
            "{% if add_generation_prompt %}w2 w3{% endif %}")


def _with_template(folder):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(folder)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)


def test_the_chat_template_is_applied_when_the_tokenizer_has_one(tmp_path):
    save_word_tokenizer(tmp_path)
    from transformers import AutoTokenizer
    plain = AutoTokenizer.from_pretrained(tmp_path)
    raw = prepare_prompt(plain, "w7 w8")
    assert not raw.chat_template and "no chat template" in raw.reason and raw.ids == [plain.convert_tokens_to_ids(w)
                                                                                      for w in ("w7", "w8")]
    with pytest.raises(InvalidValue) as e:
        prepare_prompt(plain, "w7 w8", chat=True)
    assert "chat=False" in str(e.value)
    tok = _with_template(tmp_path)
    chat = prepare_prompt(tok, "w7 w8")
    # [BOS] w1 w7 w8 [EOS] w2 w3: the user turn and the generation prompt
    want = tok.convert_tokens_to_ids(["[BOS]", "w1", "w7", "w8", "[EOS]", "w2", "w3"])
    assert chat.chat_template and chat.ids == want
    assert not prepare_prompt(tok, "w7 w8", chat=False).chat_template


def test_the_context_is_checked_from_the_folder_without_weights(tmp_path):
    from transformers import LlamaConfig
    LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=300, max_position_embeddings=64).save_pretrained(tmp_path)
    save_word_tokenizer(tmp_path)
    _, p, spec = preflight_prompt(str(tmp_path), "w1 w2 w3", 60)
    assert len(p.ids) == 3 and spec.max_position_embeddings == 64
    with pytest.raises(InvalidValue) as e:
        preflight_prompt(str(tmp_path), "w1 w2 w3 w4 w5", 60)
    assert "max_position_embeddings=64" in str(e.value) and "at most 59 new tokens" in str(e.value)
    # the CLI refuses it the same way although the folder has no weights: nothing was loaded
    r = run_cli("run", str(tmp_path), "--prompt", "w1 w2 w3 w4 w5", "--max-new-tokens", "60")
    assert r.returncode == 2 and "max_position_embeddings=64" in r.stderr, r.stderr


def test_a_path_that_does_not_exist_is_named(tmp_path):
    with pytest.raises(UnknownModel) as e:
        preflight_prompt("./no-such-typo", "hi", 4)
    assert "no such file or folder" in str(e.value) and str(Path("no-such-typo").absolute()) in str(e.value)
    r = run_cli("run", "./no-such-typo", "--prompt", "hi")
    assert r.returncode == 3 and "no such file or folder" in r.stderr and "download" not in r.stderr, r.stderr


def test_cli_run_says_which_prompt_form_it_used(tmp_path):
    folder = save_tiny_llama(tmp_path / "m", hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                             num_attention_heads=4, num_key_value_heads=2, vocab_size=300)
    _with_template(folder)

    def run(*extra):
        return run_cli("run", str(folder), "--prompt", "w7 w8", "--max-new-tokens", "2", *extra)
    r = run()
    assert r.returncode == 0, r.stderr
    assert "prompt: 7 tokens, the tokenizer's chat template applied" in r.stderr
    r = run("--raw")
    assert r.returncode == 0 and "prompt: 2 tokens, raw text (--raw)" in r.stderr, r.stderr


def test_run_with_context_counts_the_prompt_as_sent_in_both_lines(tmp_path):
    """The context line's prompt and the prompt line count the same ids: those after the chat template (the
    template adds [BOS] w1 ... [EOS] w2 w3: 5 tokens), or the raw text with --raw."""
    import re
    folder = save_tiny_llama(tmp_path / "m", hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                             num_attention_heads=4, num_key_value_heads=2, vocab_size=300)
    _with_template(folder)
    doc = tmp_path / "doc.txt"
    doc.write_text("\n\n".join(" ".join(f"w{(i * 5 + j) % 290 + 3}" for j in range(20)) for i in range(4)))
    counts = {}
    for extra in ((), ("--raw",)):
        r = run_cli("run", str(folder), "--prompt", "w7 w8", "--context", str(doc), "--max-new-tokens", "2", *extra,
                    columns="300")
        assert r.returncode == 0, r.stderr
        packed = int(re.search(r"context: \d+ of \d+ chunks, prompt ([\d,]+) of", r.stderr).group(1).replace(",", ""))
        sent = int(re.search(r"prompt: ([\d,]+) tokens, ", r.stderr).group(1).replace(",", ""))
        assert packed == sent, r.stderr
        counts[extra] = sent
    assert counts[()] == counts[("--raw",)] + 5  # the same chunks, with the template's 5 tokens around them
