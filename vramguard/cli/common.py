"""What every command shares: the one table from library errors to exit codes, the guard that applies it, the
stderr console, and JSON output. Imports neither torch nor transformers.

A vramguard error becomes a two-line message on stderr and its exit code (:data:`EXIT_CODES`), and where the
command line asked for ``--format json``, a JSON object on stdout too (:func:`report_error`, the one place both are
said); no traceback reaches the user (set ``VRAMGUARD_DEBUG=1`` to see one for an internal error).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import textwrap
import threading

import typer
from rich.console import Console

from vramguard.errors import (EXIT_CLOSED_PIPE, EXIT_INTERNAL, ConfigError, Infeasible, InvalidValue, NoCudaGpu,
                              UnknownGpu, UnknownModel, VramguardError)
from vramguard.cli.render import console  # rich only: no torch import
from vramguard.extras import extra_of
from vramguard.cli.flags import FIELD_FLAGS, as_flags
from vramguard.hardware import detect_gpus
from vramguard.units import decimal_size_note, parse_card_size

# each error's exit code, as its class defines it (vramguard.errors says what each code means)
EXIT_CODES: dict[type, int] = {c: c.exit_code for c in (InvalidValue, ConfigError, UnknownModel, UnknownGpu,
                                                        NoCudaGpu, Infeasible)}
err = console(stderr=True)

def say(text: str) -> None:
    """``text`` on stderr in the CLI's words (:func:`~vramguard.cli.flags.as_flags`: a library field becomes its
    option), with no rich markup or highlighting; a line indented by 4 spaces is code, printed whole (never
    wrapped: it can be copied as one line). Other lines wrap at the terminal's width between words only: a word
    longer than the width (a path) stays whole on a line of its own, so that it can be copied."""
    for line in as_flags(text).split("\n"):
        if line.startswith("    "):
            err.print(line, markup=False, highlight=False, soft_wrap=True)
            continue
        for part in textwrap.wrap(line, err.width, break_long_words=False, break_on_hyphens=False) or [""]:
            err.print(part, markup=False, highlight=False, soft_wrap=True)


def write_json(data) -> None:
    """``data`` on stdout as indented JSON, one trailing newline."""
    sys.stdout.write(json.dumps(data, indent=2) + "\n")


_JSON_ERRORS = {"on": False}  # the command line asked for --format json (set by vramguard.cli.main)


def json_errors(on: bool) -> None:
    """Say every error of this command line as JSON on stdout too (``--format json`` was given), whichever call
    site reports it: click's usage errors, a refused option, the library's errors, a missing package."""
    _JSON_ERRORS["on"] = on


def error_json(e: dict) -> None:
    """``{"error": e}`` on stdout, one line."""
    sys.stdout.write(json.dumps({"error": e}) + "\n")


def report_error(e: VramguardError, as_json: bool = False) -> int:
    """Print ``e`` on stderr naming the CLI option of its field, and as JSON on stdout (``{"error": {type, field,
    value, accepted, fix, exit_code}}``) with ``as_json`` or where the command line asked for ``--format json``
    (:func:`json_errors`); return its exit code (:data:`EXIT_CODES`: the class's)."""
    code = e.exit_code
    flag = " + ".join(FIELD_FLAGS.get(part.strip(), part.strip()) for part in e.field.split("+"))
    say("error " + as_flags(e.render(flag)))
    if as_json or _JSON_ERRORS["on"]:
        d = e.as_dict()
        accepted = d.get("accepted")
        error_json({**d, "field": flag, "fix": as_flags(e.fix) if e.fix else e.fix,
                    **({"accepted": as_flags(accepted)} if isinstance(accepted, str) else {})})
    return code


def fail(e: VramguardError, as_json: bool = False) -> None:
    """:func:`report_error`, then exit with its code."""
    raise typer.Exit(report_error(e, as_json))


def closed_pipe() -> int:
    """The reader of stdout went away (``| head``): point stdout at the null device, so that nothing more is
    written and the interpreter's final flush cannot fail, and return :data:`~vramguard.errors.EXIT_CLOSED_PIPE`.
    Nothing is printed: the reader asked for no more."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # stdout is no file (a buffer), or already closed
        pass
    return EXIT_CLOSED_PIPE


TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"  # PyTorch's index of CPU-only wheels


def install_fix(extra: str, torch_missing: bool) -> str:
    """The install command for a missing optional package: with torch missing and no NVIDIA GPU found, the CPU
    build of torch first (plain ``pip install torch`` resolves to the CUDA build and its CUDA packages)."""
    cmd = f"pip install 'vramguard[{extra}]'"
    if not torch_missing:
        return cmd
    det = detect_gpus()
    if det.gpus:
        return cmd + " (installs the CUDA build of torch)"
    return (f"pip install torch --index-url {TORCH_CPU_INDEX} (the CPU build: {det.reason}), then {cmd}")


_TEARDOWN = {"needed": True}  # False once a command has left nothing for the interpreter's exit to do


def no_teardown_needed() -> None:
    """Say that this command's process has nothing left to do at its exit: its output is written and every file
    closed, so the interpreter's teardown (a second with torch and transformers imported: their modules, objects
    and operator registrations freed one by one) can be skipped (:func:`vramguard.cli.main`)."""
    _TEARDOWN["needed"] = False


def teardown_needed() -> bool:
    return _TEARDOWN["needed"]


PROGRESS_DELAY_S = 1.0  # work that ends sooner shows no progress line
_DRAWING: list = []  # the locks under which progress lines draw: held across a fork (none draws in the child)
_held: list = []


def _hold_drawing() -> None:
    _held[:] = list(_DRAWING)
    for lk in _held:
        lk.acquire()


def _let_drawing() -> None:
    for lk in reversed(_held):
        lk.release()
    _held.clear()


os.register_at_fork(before=_hold_drawing, after_in_parent=_let_drawing, after_in_child=_let_drawing)


@contextlib.contextmanager
def working(what: str, delay_s: float = PROGRESS_DELAY_S):
    """A progress line on stderr (rich's spinner and ``what``, e.g. "planning MODEL") while the block runs, shown
    once it has run ``delay_s`` seconds and removed when it ends; only when stderr is a terminal (a log or a pipe
    gets nothing). Lines printed on stderr meanwhile appear above it.

    Its threads (the timer, rich's refresh) are marked ``fork_safe``: they only draw, under locks held across a
    fork, so a plan may fork its card searches beside them (:func:`vramguard.plan.allocator._can_fork`)."""
    if not sys.stderr.isatty():
        yield
        return
    status = Console(stderr=True).status(what)
    lock, state = threading.Lock(), {"shown": False, "done": False}

    def show() -> None:
        with lock:
            if not state["done"]:
                before = set(threading.enumerate())
                status.start()
                _DRAWING.append(status._live._lock)  # rich's Live draws under it
                for t in set(threading.enumerate()) - before:
                    t.fork_safe = True  # type: ignore[attr-defined]
                state["shown"] = True
    timer = threading.Timer(delay_s, show)
    timer.daemon = True
    timer.fork_safe = True  # type: ignore[attr-defined]
    _DRAWING.append(lock)
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        with lock:
            state["done"] = True
            if state["shown"]:
                status.stop()
                _DRAWING.remove(status._live._lock)
        _DRAWING.remove(lock)


def run_guarded(fn, *args, as_json: bool = False, progress: str | None = None, **kwargs):
    """Call ``fn`` (under a :func:`working` line saying ``progress``, when given); map vramguard errors to their
    exit code and anything else to an internal-error message."""
    try:
        if progress is None:
            return fn(*args, **kwargs)
        with working(progress):
            return fn(*args, **kwargs)
    except VramguardError as e:
        fail(e, as_json)
    except (typer.Exit, KeyboardInterrupt, BrokenPipeError):  # a closed stdout ends the command in main()
        raise
    except ModuleNotFoundError as e:  # an optional dependency of this command is missing: name it and the extra
        top = (e.name or "").split(".")[0]
        if extra_of(top) is None or os.environ.get("VRAMGUARD_DEBUG"):
            raise
        fix = install_fix(extra_of(top), top == "torch")
        say(f"error {top} not installed: this command needs it.\nfix: " + fix)
        if as_json or _JSON_ERRORS["on"]:
            error_json({"type": "MissingPackage", "field": top, "value": top, "accepted": "installed",
                        "fix": fix, "exit_code": 3})
        raise typer.Exit(3) from None
    except Exception as e:  # an internal error: say so plainly, keep the traceback for debugging only
        if os.environ.get("VRAMGUARD_DEBUG"):
            raise
        first = (str(e).strip().splitlines() or [""])[0][:300]  # C++ errors append pages of stack frames
        err.print(f"[red]internal error[/red] {type(e).__name__}: {first}\n"
                  "please report it with the command line; VRAMGUARD_DEBUG=1 shows the traceback")
        if as_json or _JSON_ERRORS["on"]:
            error_json({"type": "internal", "exception": type(e).__name__, "message": first,
                        "exit_code": EXIT_INTERNAL})
        raise typer.Exit(EXIT_INTERNAL) from None


# library warnings a vramguard command triggers but the user can do nothing about, matched by their start only:
# torch.profiler's note on schedules (check's kernel probe runs one cycle) and the deprecation of
# torch.distributed.reduce_op, read by libraries that scan torch.distributed's attributes
QUIET_WARNINGS = ((r"Warning: Profiler clears events at the end of each cycle", UserWarning),
                  (r"`torch\.distributed\.reduce_op` is deprecated", FutureWarning))


def quiet_known_warnings() -> None:
    """Ignore exactly the warnings in :data:`QUIET_WARNINGS`; every other warning still reaches stderr, vramguard's
    own (a message starting ``vramguard: ``, such as a setting a load replaced) as a ``note:`` line in the CLI's
    words, not Python's warning format with a source line."""
    import warnings
    for message, category in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    shown = warnings.showwarning
    if getattr(shown, "vramguard_notes", False):
        return

    def show(message, category, filename, lineno, file=None, line=None):
        text = str(message)
        if text.startswith("vramguard: "):
            return say("note: " + text[len("vramguard: "):])
        return shown(message, category, filename, lineno, file, line)
    show.vramguard_notes = True
    warnings.showwarning = show


def size_option(text: str, field: str) -> int:
    """A size option parsed into bytes; a decimal GB/TB size gets a note on stderr saying what it was read as and
    what a card sold as that size has (:func:`vramguard.units.decimal_size_note`); a size above any card is
    refused (:func:`vramguard.units.parse_card_size`)."""
    value = parse_card_size(text, field)
    note = decimal_size_note(text, field)
    if note:
        say("note: " + note)
    return value
