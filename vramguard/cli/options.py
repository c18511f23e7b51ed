"""Option parsing shared by the commands: the choice types (from :mod:`vramguard.settings`), the defaults several
commands share, and the checks of the raw argument list that click cannot make."""

from __future__ import annotations

from enum import Enum

import typer

from vramguard.cli.common import say
from vramguard.errors import UsageError
from vramguard.hub import fetched_line
from vramguard.settings import ATTNS, CACHES, DTYPES, KERNELS, KV_DTYPES, LOGITS, QUANTS, SDPA_KERNELS
from vramguard.units import UNIT_WORDS

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
Kernels = _choices("Kernels", KERNELS)
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
    line = fetched_line(spec)
    if line:
        say(line)


def format_option(text: str = "human or json"):
    return typer.Option(Format['human'], "--format", help=text)


SIZE_OPTIONS = ("--vram", "--vram-budget", "--max-body-size", "--max-memory")


def split_size(args: list[str]) -> UsageError | None:
    """The error for a size typed as two words (``--vram 24 GiB``: the shell passes ``GiB`` as the next argument,
    which would be read as a model name), or None."""
    for i, a in enumerate(args[:-2]):
        number, unit = args[i + 1], args[i + 2]
        if a in SIZE_OPTIONS and number.replace(".", "", 1).isdigit() and unit.lower() in UNIT_WORDS | {"b"}:
            accepted = "a number and a unit in one word"
            fix = f"write {a} {number}{unit} (or quote it: {a} '{number} {unit}')"
            return UsageError(a, f"{number} {unit}", accepted, fix,
                              f"{a}: {number!r} {unit!r} is two arguments; accepted: {accepted}.\nfix: {fix}")
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


# the options whose value may name several cards at once, by command: a repeat points to that comma list
COMMA_LISTS = {"plan": {"--gpu": "name several cards in one", "--vram": "give the sizes of several cards in one",
                        "--max-memory": "give the memory of several cards in one"}}
_TIMES = {2: "twice", 3: "three times"}


def repeated_option(group, args: list[str]) -> UsageError | None:
    """The usage error of an option of one value given more than once (click keeps the last one, silently
    dropping the others), or of a switch given with its negation (``--padded --no-padded``), or None. ``group``
    is the click group of the commands; ``args`` the command line after the program's name, read as click reads
    it: an option of one value takes the next word, whatever it looks like, or its ``=value``; ``--`` ends the
    options. A switch repeated alone (``--freed-before --freed-before``) is kept: it says the same thing twice.
    Options taken several times (``multiple``, or counted) are not checked."""
    name = next((a for a in args if not a.startswith("-")), None)
    command = getattr(group, "commands", {}).get(name) if name else None
    if command is None:  # no command, or an unknown one: click says so
        return None
    by_opt = {o: p for p in command.params if getattr(p, "param_type_name", "") == "option"
              for o in [*p.opts, *getattr(p, "secondary_opts", [])]}
    seen: dict[str, list[tuple[str, str | None]]] = {}
    words = iter(args[args.index(name) + 1:])
    for a in words:
        if a == "--":
            break
        opt, eq, value = a.partition("=") if a.startswith("--") else (a, "", "")
        param = by_opt.get(opt)
        if param is None:  # a positional argument, or an unknown option (click names it)
            continue
        if not param.is_flag and not eq:
            value = next(words, None)
        if param.is_flag or not (getattr(param, "multiple", False) or getattr(param, "count", False)):
            seen.setdefault(param.name, []).append((opt, None if param.is_flag else value))
    for uses in seen.values():
        if len({opt for opt, _ in uses}) > 1:  # a switch and its negation
            opts = " then ".join(dict.fromkeys(opt for opt, _ in uses))
            fix = f"keep the one you mean: {uses[-1][0]} or {uses[0][0]}, not both"
            return UsageError(uses[0][0], opts, "one of them", fix,
                              f"{uses[0][0]}: given as {opts}; accepted: one of them.\nfix: {fix}")
        if len(uses) > 1 and uses[0][1] is not None:
            return _repeat_error(name, uses[0][0], [v for _, v in uses])
    return None


def _repeat_error(command: str, opt: str, values: list[str | None]) -> UsageError:
    """The error of ``opt`` given once per value of ``values`` (a value None: the command line ended)."""
    shown = [repr(v) if v is not None else "none" for v in values]
    given = ", ".join(shown[:-1]) + ", then " + shown[-1]
    first = (f"{opt}: given {_TIMES.get(len(values), f'{len(values)} times')} ({given}); accepted: one {opt}.\n")
    how = COMMA_LISTS.get(command, {}).get(opt)
    fix = f"{how}: {opt} {','.join(values)}" if how and None not in values else f"give {opt} once"
    return UsageError(opt, given, f"one {opt}", fix, first + f"fix: {fix}")


def json_asked(group, args: list[str]) -> bool:
    """Whether the command line ``args`` (after the program's name) asks a command that has ``--format`` for
    ``--format json`` (``--format json`` or ``--format=json``, before ``--``): its errors are then JSON on stdout
    too. ``group`` is the click group of the commands."""
    name = next((a for a in args if not a.startswith("-")), None)
    command = getattr(group, "commands", {}).get(name) if name else None
    if command is None or not any("--format" in getattr(p, "opts", ()) for p in command.params):
        return False
    words = args[args.index(name) + 1:]
    words = words[:words.index("--")] if "--" in words else words
    return any(a == "--format=json" or (a == "--format" and words[i + 1:i + 2] == ["json"])
               for i, a in enumerate(words))
