"""The tokenizer of a model folder, or None with the reason when the folder has none.

``AutoTokenizer.from_pretrained`` does not always fail on a folder without tokenizer files: for some model types
(``gpt2``) transformers builds the config's tokenizer class with no vocabulary at all, a tokenizer of one or two
special tokens that turns any text into no ids. Such a tokenizer is no tokenizer: a folder counts as having one when
a file the tokenizer class reads its vocabulary from (``type(tokenizer).vocab_files_names``, transformers' own list,
or ``tokenizer.json``) is in the folder, and the tokenizer holds more than :data:`MIN_VOCAB_TOKENS` tokens.
"""

from __future__ import annotations

from pathlib import Path

from vramguard.errors import ConfigError

# a tokenizer of at most this many tokens holds its special tokens only (an empty GPT2Tokenizer has 1: <|endoftext|>)
MIN_VOCAB_TOKENS = 4
FULL_TOKENIZER_FILE = "tokenizer.json"  # transformers.tokenization_utils_base.FULL_TOKENIZER_FILE
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"  # transformers.tokenization_utils_base.TOKENIZER_CONFIG_FILE
# what transformers' tokenizers save besides those two: vocab.json/vocab.txt, merges.txt, tokenizer.model (the
# sentencepiece model), spiece.model
_VOCABULARY_PREFIXES = ("tokenizer", "vocab", "merges", "spiece", "sentencepiece")
ERROR_CHARS = 400  # the most of transformers' error kept in a reason (it can run to pages)


def vocabulary_files(tokenizer, folder: str | Path) -> list[str]:
    """Names of the files in ``folder`` that ``tokenizer``'s class reads its vocabulary from (``vocab.json``,
    ``merges.txt``, ``tokenizer.model``, ``tokenizer.json``...); empty when the folder has none of them."""
    names = {*getattr(type(tokenizer), "vocab_files_names", {}).values(), FULL_TOKENIZER_FILE}
    return sorted(n for n in names if isinstance(n, str) and (Path(folder) / n).is_file())


def load_failure(folder: str | Path, e: Exception) -> str:
    """Why ``AutoTokenizer.from_pretrained(folder)`` raised ``e``, in one line: the folder has no tokenizer files
    at all (no file named ``tokenizer*``, ``vocab*``, ``merges*``, ``spiece*`` or ``sentencepiece*``), or
    transformers' error on the files it has, on one line, whole up to :data:`ERROR_CHARS` characters and then cut
    at a word with `` ...``."""
    files = [p.name for p in Path(folder).iterdir() if p.is_file()] if Path(folder).is_dir() else []
    if not any(n.lower().startswith(_VOCABULARY_PREFIXES) for n in files):
        return (f"the folder has no tokenizer files (no {FULL_TOKENIZER_FILE}, {TOKENIZER_CONFIG_FILE} or "
                "vocabulary file)")
    text = " ".join(str(e).split())
    if len(text) > ERROR_CHARS:
        text = text[:ERROR_CHARS].rsplit(" ", 1)[0] + " ..."
    return f"transformers could not load the tokenizer files it has ({type(e).__name__}: {text})"


def no_tokenizer_error(model: str, reason: str):
    """The :class:`~vramguard.errors.ConfigError` of a model folder without a usable tokenizer: ``reason`` (from
    :func:`folder_tokenizer`) and the fix."""
    return ConfigError("MODEL", model, "a model folder with tokenizer files",
                       f"{reason}: save the tokenizer of the checkpoint these weights come from into the folder "
                       "(AutoTokenizer.from_pretrained(ID).save_pretrained(folder)); vramguard.generate takes "
                       "token ids without one")


def folder_tokenizer(folder: str | Path, trust_remote_code: bool = False) -> tuple[object | None, str]:
    """(the tokenizer of ``folder``, "") or (None, why there is none): transformers could not load one (its error
    kept), or what it built has no vocabulary file in the folder or at most :data:`MIN_VOCAB_TOKENS` tokens.
    Reads local files only; raises nothing for a folder without a tokenizer.

    Raises:
        ConfigError: the folder's config.json is one transformers' config validation refuses (huggingface_hub's
            ``StrictDataclassError``, e.g. a hidden size that is not a multiple of the heads), which the tokenizer
            loader reads first.
    """
    import huggingface_hub.errors as hub_errors
    import transformers
    refused = getattr(hub_errors, "StrictDataclassError", ())
    try:
        tok = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True,
                                                        trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError) as e:
        return None, load_failure(folder, e)
    except refused as e:
        raise ConfigError("config.json", str(folder), "a config transformers accepts",
                          f"transformers rejected it: {type(e).__name__}: {' '.join(str(e).split())[:240]}") from None
    if not vocabulary_files(tok, folder):
        wanted = sorted({*getattr(type(tok), "vocab_files_names", {}).values(), FULL_TOKENIZER_FILE})
        return None, (f"the folder has none of the files {type(tok).__name__} reads its vocabulary from "
                      f"({', '.join(wanted)}); transformers built it empty ({len(tok)} token(s))")
    if len(tok) <= MIN_VOCAB_TOKENS:
        return None, f"{type(tok).__name__} holds {len(tok)} token(s), no vocabulary"
    return tok, ""
