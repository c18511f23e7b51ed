"""click's own usage errors (a value of the wrong type, an unknown choice or option, a missing value or argument, a
switch given a value) in vramguard's two-line form: ``error FIELD: 'VALUE' is not valid; accepted: ...`` then
``fix: ...``, the form of :meth:`vramguard.errors.VramguardError.render`. Reads the exception's documented attributes
only (``param``, ``option_name``, ``possibilities``, ``ctx``; a missing parameter's choices from its command's
``callback``), each looked up with a default, so that the click typer vendors and the click package read the same;
anything else keeps click's own message. Each is an :class:`~vramguard.errors.InvalidValue` (field, value, accepted,
fix), said by :func:`vramguard.cli.common.report_error` as every other error is."""

from __future__ import annotations

import re

from vramguard.engines.vllm_quant import refused_quantization
from vramguard.errors import InvalidValue, UsageError
from vramguard.run.generate import SEED_ACCEPTED

# click's and pydantic's words for a value of the wrong type -> what is accepted
_TYPE_WORDS = (("valid integer", "an integer"), ("valid number", "a number"), ("valid float", "a number"),
               ("valid boolean", "true or false"))
_CHOICES = re.compile(r"'([^']*)' is not one of (.+?)\.?$")
# options whose refused values the library explains (why, and what to use instead), by option
_REFUSALS = {"--quantization": refused_quantization}


def usage_error(e, argv: list[str]) -> InvalidValue:
    """The error for click's usage error ``e`` of the command line ``argv``: its two lines are ``render()``."""
    ctx = getattr(e, "ctx", None)
    if ctx is not None and getattr(ctx, "parent", None) is not None:
        command = f"vramguard {ctx.info_name}"
    else:  # some errors carry no context (an option's missing value): the command is the first word of argv
        command = "vramguard" + next((f" {a}" for a in argv[:1] if not a.startswith("-")), "")
    help_hint = f"`{command} --help`"
    name = type(e).__name__
    message = e.format_message().replace("Value error, ", "")
    param = getattr(e, "param", None)
    m = re.match(r"No such command '([^']*)'\.?(?: Did you mean '([^']*)'\?)?", message)
    if m:
        names = ctx.command.list_commands(ctx) if ctx is not None and hasattr(ctx.command, "list_commands") else []
        fix = f"did you mean {m.group(2)}?" if m.group(2) else "see `vramguard --help` for what each does"
        return InvalidValue("COMMAND", m.group(1), ", ".join(names) or "a command `vramguard --help` lists",
                            fix)
    m = re.match(r"Got unexpected extra argument(?:s|\(s\))? \((.*)\)", message)
    if m:
        return InvalidValue("ARGUMENT", m.group(1), f"the arguments of {command} ({help_hint})",
                            "quote a value that holds spaces, and give each option its name")
    if name == "NoSuchOption":
        given = getattr(e, "option_name", None) or "?"
        near = _nearest(given, list(getattr(e, "possibilities", None) or []))
        fix = f"did you mean {' or '.join(near[:3])}?" if near else f"check the spelling in {help_hint}"
        return InvalidValue("OPTION", given, f"an option of {command} ({help_hint} lists them)", fix)
    if name == "BadOptionUsage" and "requires an argument" in message:
        flag = getattr(e, "option_name", None) or "the option"
        return InvalidValue(flag, "none given", "a value after the option",
                            f"pass {flag} VALUE ({help_hint} says which values)")
    if name == "BadOptionUsage" and "does not take a value" in message:  # a switch given one: --freed-before=yes
        flag = getattr(e, "option_name", None) or "the option"
        value = next((a[len(flag) + 1:] for a in reversed(argv) if a.startswith(flag + "=")), "?")
        return InvalidValue(flag, f"{flag}={value}", "the switch alone, without a value",
                            f"write {flag} alone, without ={value}: a switch takes no value")
    if name == "MissingParameter" and param is not None:
        field = _field(param)
        choices = _choices(param, ctx)
        if choices:
            return InvalidValue(field, "none given", ", ".join(choices),
                                f"pass one of them, e.g. {command} ... {field} {choices[0]}")
        return InvalidValue(field, "none given", f"a {field} ({help_hint} says which)",
                            f"pass it: {command} {field} ...")
    if name == "BadParameter" and param is not None:
        field = _field(param)
        detail = message.split(": ", 1)[1] if message.startswith("Invalid value for ") else message
        m = _CHOICES.search(detail)
        if m and field in _REFUSALS:
            return _REFUSALS[field](m.group(1), field)
        if m:
            choices = [c.strip().strip("'") for c in m.group(2).split(",")]
            return InvalidValue(field, m.group(1), ", ".join(choices), f"pass one of them, e.g. {field} "
                                f"{choices[0]}")
        accepted = next((words for key, words in _TYPE_WORDS if key in detail), detail.rstrip("."))
        value = _given(field, argv)
        value = value if value is not None else "?"
        if accepted == "an integer" and _integer_range(field):
            return InvalidValue(field, value, _integer_range(field),
                                f"pass a whole number in that range, e.g. {field} 0")
        return InvalidValue(field, value, accepted, f"pass {field} with {accepted} ({help_hint})")
    field = _field(param) if param is not None else "ARGUMENT"
    fix = f"see {help_hint} for the accepted values"
    return UsageError(field, _given(field, argv) or "?", message, fix, f"{message}\nfix: {fix}")


def edit_distance(a: str, b: str) -> int:
    """Edits (insert, delete, replace, swap of two neighbours) that turn ``a`` into ``b``: the optimal string
    alignment distance (Damerau-Levenshtein without repeated edits of a substring)."""
    d = [[i + j if i * j == 0 else 0 for j in range(len(b) + 1)] for i in range(len(a) + 1)]
    for i in range(1, len(a) + 1):
        for j in range(1, len(b) + 1):
            d[i][j] = min(d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] != b[j - 1]))
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                d[i][j] = min(d[i][j], d[i - 2][j - 2] + 1)
    return d[len(a)][len(b)]


def _nearest(given: str, possibilities: list[str]) -> list[str]:
    """Of click's close matches, those fewest edits away from ``given`` (``--vrma``: ``--vram``, one swap, and
    not ``--format``), in click's order."""
    if not possibilities:
        return []
    best = min(edit_distance(given, p) for p in possibilities)
    return [p for p in possibilities if edit_distance(given, p) == best]


def _choices(param, ctx) -> list[str]:
    """The values a parameter accepts, or []: its click ``Choice`` type's ``choices`` where it has one, else the
    members of the Enum its command's function is annotated with (``ctx.command.callback``, unwrapped; the
    parameter objects of typer >= 0.20 carry no click type)."""
    import enum
    import inspect
    import typing
    choices = getattr(getattr(param, "type", None), "choices", None)
    if choices:
        return [str(getattr(c, "value", c)) for c in choices]
    callback = getattr(getattr(ctx, "command", None), "callback", None)
    try:
        hint = typing.get_type_hints(inspect.unwrap(callback)).get(getattr(param, "name", None)) if callback else None
    except (NameError, TypeError):
        return []
    return [str(m.value) for m in hint] if isinstance(hint, type) and issubclass(hint, enum.Enum) else []


def _integer_range(field: str) -> str | None:
    """What an integer option accepts, where the library's own check has a range to say (the sampling seed's)."""
    if field == "--seed":
        return SEED_ACCEPTED
    return None


def _field(param) -> str:
    """The option (``--batch``) or argument (``MODEL``) a parameter is written as."""
    opts = [o for o in getattr(param, "opts", None) or [] if o.startswith("-")]
    if opts:
        return max(opts, key=len)
    return getattr(param, "metavar", None) or str(getattr(param, "name", "ARGUMENT")).upper()


def _given(flag: str, argv: list[str]) -> str | None:
    """The value given to ``flag`` on the command line (``--batch x`` or ``--batch=x``; the last one), or None."""
    value = None
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith(flag + "="):
            value = a[len(flag) + 1:]
    return value
