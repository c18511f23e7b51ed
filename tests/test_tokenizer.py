"""A model folder without a tokenizer: transformers may build an empty one for it (a GPT-2 folder of config and
weights gives a GPT2Tokenizer of 1 token); vramguard treats that as no tokenizer, as it does a folder whose
tokenizer cannot be loaded at all."""

import json

import pytest

transformers = pytest.importorskip("transformers")

from conftest import run_cli

from vramguard.runtime.tokenizer import MIN_VOCAB_TOKENS, folder_tokenizer

GPT2 = dict(n_embd=32, n_layer=1, n_head=2, vocab_size=100, n_positions=64, bos_token_id=0, eos_token_id=0)


@pytest.fixture
def tinygpt2(tmp_path):
    import torch
    torch.manual_seed(0)
    folder = tmp_path / "tinygpt2"
    transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2)).save_pretrained(folder)
    return folder


def test_transformers_builds_an_empty_tokenizer_which_is_no_tokenizer(tinygpt2):
    built = transformers.AutoTokenizer.from_pretrained(str(tinygpt2), local_files_only=True)
    assert len(built) <= MIN_VOCAB_TOKENS and built("hi")["input_ids"] == []  # what transformers gives
    tok, why = folder_tokenizer(tinygpt2)
    assert tok is None
    assert "none of the files GPT2Tokenizer reads its vocabulary from (merges.txt, tokenizer.json, vocab.json)" in why


def test_a_folder_with_vocabulary_files_keeps_its_tokenizer(tinygpt2):
    # a byte-level BPE of 26 letters and one merge ("h i" -> "hi"), plus <|endoftext|>: 28 tokens
    vocab = {c: i for i, c in enumerate("abcdefghijklmnopqrstuvwxyz")} | {"hi": 26, "<|endoftext|>": 27}
    (tinygpt2 / "vocab.json").write_text(json.dumps(vocab))
    (tinygpt2 / "merges.txt").write_text("#version: 0.2\nh i\n")
    transformers.GPT2Tokenizer(str(tinygpt2 / "vocab.json"), str(tinygpt2 / "merges.txt")).save_pretrained(tinygpt2)
    tok, why = folder_tokenizer(tinygpt2)
    assert why == "" and len(tok) == 28 and tok("hi")["input_ids"] == [26]


def test_run_says_the_folder_has_no_tokenizer_not_that_the_prompt_is_empty(tinygpt2):
    r = run_cli("run", str(tinygpt2), "--prompt", "hi")
    err = " ".join(r.stderr.split())
    assert r.returncode == 3 and "at least one token" not in err
    assert "a model folder with tokenizer files" in err and ".save_pretrained(folder)" in err


def test_load_model_returns_no_tokenizer_with_the_note(tinygpt2):
    from vramguard.runtime.load import load_model
    model, tok, report = load_model(str(tinygpt2), quant="fp32", verify=False)
    assert tok is None
    note = next(n for n in report.notes if n.startswith("no tokenizer loaded"))
    assert "GPT2Tokenizer" in note and "1 token(s)" in note
