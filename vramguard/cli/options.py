"""Option parsing shared by the commands: the choice types (from :mod:`vramguard.settings`), the defaults several
commands share, and the checks of the raw argument list that click cannot make."""

from __future__ import annotations

from enum import Enum

import typer

from vramguard.settings import ATTNS, CACHES, DTYPES, KV_DTYPES, LOGITS, QUANTS, SDPA_KERNELS

DEFAULT_PROMPT_TOKENS = 128  # a short chat prompt: system prompt, one user turn and the chat template
DEFAULT_MAX_NEW_TOKENS = 256


def _choices(name: str, values) -> type[Enum]:
    """A str Enum of ``values`` for typer (choices come from :mod:`vramguard.settings`)."""
    return Enum(name, {v: v for v in values}, type=str)


Quant = _choices("Quant", QUANTS)
CheckQuant = _choices("CheckQuant", ("none",) + QUANTS)
Attn = _choices("Attn", ATTNS)
LoadAttn = _choices("LoadAttn", ("auto",) + ATTNS)
KvDtype = _choices("KvDtype", KV_DTYPES)
Dtype = _choices("Dtype", DTYPES)
DtypeArg = _choices("DtypeArg", ("auto",) + DTYPES)
Cache = _choices("Cache", CACHES)
Logits = _choices("Logits", LOGITS)
SdpaKernel = _choices("SdpaKernel", SDPA_KERNELS)
Format = _choices("Format", ("human", "json"))
Vary = _choices("Vary", ("prompt", "new-tokens", "batch"))



# the options of a run's settings that several commands take, each default defined once; ``text`` is the help
def quant_option(text: str = "weight format"):
    return typer.Option(Quant['nf4'], help=text)


def attn_option(text: str = "attn_implementation"):
    return typer.Option(Attn['sdpa'], help=text)


def batch_option(text: str = "prompts decoded together"):
    return typer.Option(1, help=text)


def prompt_tokens_option(text: str = "prompt length in tokens"):
    return typer.Option(DEFAULT_PROMPT_TOKENS, help=text)


def max_new_tokens_option(text: str = "tokens to generate"):
    return typer.Option(DEFAULT_MAX_NEW_TOKENS, help=text)


def revision_option():
    return typer.Option(None, help="Hub revision (branch, tag or commit) of a Hub id: read it from the Hub "
                                   "(config and safetensors headers, no weights)")


def say_fetched(spec) -> None:
    """On stderr, what was read to plan a Hub model and how many bytes (nothing for other models)."""
    from vramguard.cli.common import say
    from vramguard.hub import fetched_line
    line = fetched_line(spec)
    if line:
        say(line)


def format_option(text: str = "human or json"):
    return typer.Option(Format['human'], "--format", help=text)


SIZE_OPTIONS = ("--vram", "--vram-budget", "--max-body-size", "--max-memory")


def split_size(args: list[str]) -> str | None:
    """The error for a size typed as two words (``--vram 24 GiB``: the shell passes ``GiB`` as the next argument,
    which would be read as a model name), or None."""
    from vramguard.units import UNIT_WORDS
    for i, a in enumerate(args[:-2]):
        number, unit = args[i + 1], args[i + 2]
        if a in SIZE_OPTIONS and number.replace(".", "", 1).isdigit() and unit.lower() in UNIT_WORDS | {"b"}:
            return (f"{a}: {number!r} {unit!r} is two arguments; accepted: a number and a unit in one word.\n"
                    f"fix: write {a} {number}{unit} (or quote it: {a} '{number} {unit}')")
    return None


def strip_options(args: list[str], names: tuple[str, ...]) -> list[str]:
    """``args`` without ``names`` and their values (``--name value`` or ``--name=value``)."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
            continue
        if a in names:
            skip = True
            continue
        if any(a.startswith(n + "=") for n in names):
            continue
        out.append(a)
    return out
