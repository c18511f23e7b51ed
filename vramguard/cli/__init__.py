"""The ``vramguard`` command: a thin layer that parses options, calls one library function and prints.

One module per command group (:mod:`~vramguard.cli.plan`, :mod:`~vramguard.cli.check`, :mod:`~vramguard.cli.run`,
:mod:`~vramguard.cli.serve`, :mod:`~vramguard.cli.profile` for profile and fit, :mod:`~vramguard.cli.explain` for
explain and oom-log); errors from the library are mapped to a message on stderr and an exit code in one table
(:data:`vramguard.cli.common.EXIT_CODES`); no traceback reaches the user (set ``VRAMGUARD_DEBUG=1`` to see one for
an internal error).
"""

from __future__ import annotations

import os
import sys

import typer

from vramguard import __version__
from vramguard.cli import check as _check
from vramguard.cli import explain as _explain
from vramguard.cli import export as _export
from vramguard.cli import plan as _plan
from vramguard.cli import profile as _profile
from vramguard.cli import run as _run
from vramguard.cli import serve as _serve
from vramguard.cli.common import (EXIT_CODES, EXIT_INTERNAL, closed_pipe, install_fix, json_errors,
                                  quiet_known_warnings, report_error, run_guarded, say, teardown_needed)
from vramguard.cli.explain import read_message
from vramguard.cli.options import json_asked, repeated_option, split_size
from vramguard.cli.usage import usage_error

__all__ = ["app", "main", "EXIT_CODES", "EXIT_INTERNAL", "install_fix", "quiet_known_warnings", "read_message",
           "run_guarded"]

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False, rich_markup_mode=None,
                  help="vramguard: plan, verify and guard GPU memory for Hugging Face transformers inference.")


def _version(value: bool) -> None:
    if value:
        import importlib.metadata
        try:
            torch_v = importlib.metadata.version("torch")
        except importlib.metadata.PackageNotFoundError:
            torch_v = "not installed"
        try:
            tf_v = importlib.metadata.version("transformers")
        except importlib.metadata.PackageNotFoundError:
            tf_v = "not installed"
        print(f"vramguard {__version__} (torch {torch_v}, transformers {tf_v})")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="print the version (and torch's, transformers') and exit")) -> None:
    """vramguard: plan, verify and guard GPU memory for Hugging Face transformers inference."""


# the commands in the order `vramguard --help` lists them, each with one line short enough for 80 columns (click
# cuts longer ones with "...")
COMMANDS = (
    ("plan", _plan.plan, "Predict memory by component and what fits, before loading."),
    ("check", _check.check, "Check the environment and load settings; name the kernel."),
    ("oom-log", _explain.oom_log, "Explain kernel OOM kills ('Killed'): process, memory, why."),
    ("explain", _explain.explain, "Classify a CUDA out-of-memory message, with the fix."),
    ("profile", _profile.profile, "Measure a run beside the plan; memory timeline picture."),
    ("fit", _profile.fit, "Real runs: the largest prompt/new tokens/batch that fits."),
    ("run", _run.run, "Generate text without running out of memory."),
    ("serve", _serve.serve, "Serve an OpenAI-compatible API with admission control."),
    ("export", _export.export, "Write a vLLM deployment: command, Ray Serve, KServe, k8s."),
)
SHORT_HELP = {name: short for name, _, short in COMMANDS}
LONG_HELP = {"plan": _plan.HELP}  # where a command's --help says more than its docstring's line
for _name, _fn, _short in COMMANDS:
    app.command(_name, short_help=_short, help=LONG_HELP.get(_name))(_fn)
del _name, _fn, _short


def main() -> None:
    """Entry point: click's own usage errors (a wrong type, an unknown choice or option) are printed in the same
    two-line form as vramguard's errors, with exit code 2; a reader of stdout that went away (``| head``) ends the
    command quietly with :data:`~vramguard.errors.EXIT_CLOSED_PIPE`."""
    try:
        rc = _dispatch()
        sys.stdout.flush()  # what is still buffered: a reader gone before it is written ends the same way
    except BrokenPipeError:
        rc = closed_pipe()
    except SystemExit as e:  # click ends a write to a closed stdout with exit 1: not a check that failed
        if e.code != 1 or not _stdout_closed():
            raise
        rc = closed_pipe()
    code = rc if isinstance(rc, int) else 0
    if not teardown_needed() and _runs_the_process():
        _leave(code)
    sys.exit(code)


def _runs_the_process() -> bool:
    """Whether this call is the process's program (``python -m vramguard``, the ``vramguard`` script), which ends
    when it returns; not a caller that goes on after it (a test, a script of its own)."""
    top = sys.modules.get("__main__")
    spec = getattr(top, "__spec__", None)
    return (spec is not None and spec.name == "vramguard.__main__") or \
        os.path.basename(getattr(top, "__file__", None) or "") == "vramguard"


def _leave(code: int) -> None:
    """End the process with ``code`` now, its output flushed and its log handlers closed, without the interpreter's
    teardown (:func:`~vramguard.cli.common.no_teardown_needed`)."""
    import logging
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader gone (the code says so already) or a stream closed
            pass
    os._exit(code)


def _stdout_closed() -> bool:
    """Whether stdout's reader went away: click wraps stdout in its PacifyFlushWrapper when a write fails with
    EPIPE, then exits 1."""
    return type(sys.stdout).__name__ == "PacifyFlushWrapper"


def _dispatch() -> int | None:
    """Run the command line: its exit code. Its errors are JSON on stdout too where it asks for ``--format json``
    (:func:`~vramguard.cli.common.json_errors`, for this command line only)."""
    quiet_known_warnings()
    import typer.main
    group = typer.main.get_command(app)
    json_errors(json_asked(group, sys.argv[1:]))
    try:
        return _run_line(group)
    finally:
        json_errors(False)  # a later call in this process (the test suite's) asks for itself


INTERRUPTED = "interrupted: stopped at Ctrl-C (exit 130)"


def _run_line(group) -> int | None:
    """:func:`_dispatch` once the command line's error format is set."""
    refused = split_size(sys.argv[1:]) or repeated_option(group, sys.argv[1:])
    if refused:
        return report_error(refused)
    try:  # typer >= 0.20 vendors click as typer._click; older typer uses the click package
        import typer._click.exceptions as cx
    except ImportError:
        import click.exceptions as cx
    no_args, usage, abort = (getattr(cx, n, ()) for n in ("NoArgsIsHelpError", "UsageError", "Abort"))
    try:
        rc = app(standalone_mode=False)  # click returns the code of typer.Exit instead of raising it here
        if rc == 130:  # typer's answer to Ctrl-C (no vramguard command ends with 130 itself)
            say(INTERRUPTED)
        return rc
    except no_args as e:
        print(e.ctx.get_help() if e.ctx else str(e))
        return 0
    except usage as e:
        return report_error(usage_error(e, sys.argv[1:]))
    except typer.Exit as e:
        return e.exit_code
    except abort:  # click's (an older typer's) answer to Ctrl-C
        say(INTERRUPTED)
        return 130
