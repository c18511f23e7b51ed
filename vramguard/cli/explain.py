"""``vramguard explain`` and ``vramguard oom-log``: what a CUDA out-of-memory message and the kernel's OOM kills
mean (over :func:`vramguard.explain.explain` and :func:`vramguard.oomlog.oom_log`)."""

from __future__ import annotations

import os
import sys
from typing import Optional

import typer

from vramguard.cli.common import run_guarded, say, write_json
from vramguard.cli.options import (Attn, Format, Quant, attn_option, batch_option, format_option, max_new_tokens_option,
                                   prompt_tokens_option, quant_option, revision_option, say_fetched)
from vramguard.cli.render import console, explanation_to_json, oomlog_to_json, print_explanation, print_oomlog
from vramguard.errors import InvalidValue
from vramguard.resolve import resolve_model
from vramguard.settings import Settings


def oom_log(
    since: Optional[str] = typer.Option(None, help="only kills after: 30m, 2h, 1d, boot, or 2026-11-30T17:00"),
    file: Optional[str] = typer.Option(None, "--file", help="a log file to read, or - for stdin"),
    year: Optional[int] = typer.Option(None, help="year of syslog-style timestamps that omit it (default: now)"),
    fmt: Format = format_option(),
) -> None:
    """Read the kernel OOM killer's records and explain each kill ("Killed" -> which process, how much memory, why).
    Exits 1 when no kernel log could be read."""
    from vramguard.oomlog import oom_log as oom_log_fn  # loaded when the command runs
    r = run_guarded(oom_log_fn, file, since, year, as_json=fmt == Format['json'])
    if fmt == Format['json']:
        write_json(oomlog_to_json(r))
    else:
        print_oomlog(r, console(stderr=r.source is None))
    if r.source is None:
        raise typer.Exit(1)


def _looks_like_a_path(text: str) -> bool:
    """One word that names a file (a directory part or a log/text suffix) and no OOM message: no spaces, no colon
    after the first character (``torch.OutOfMemoryError: ...``)."""
    return (" " not in text and "\n" not in text and ":" not in text[1:]
            and ("/" in text or text.endswith((".txt", ".log", ".out", ".err"))))


def read_message(message: str | None, stdin=None) -> str:
    """The message argument, or stdin for none or ``-``; on a terminal, first say what is awaited (on stderr). An
    argument naming an existing file is that file's text, said on stderr.

    Raises:
        InvalidValue: the file cannot be read, or the argument is one path-like word that names no file.
    """
    stdin = stdin or sys.stdin
    if message not in (None, "-") and "\n" not in message and os.path.isfile(message):
        try:
            with open(message, encoding="utf-8", errors="replace") as f:
                text = f.read()
        except OSError as e:
            raise InvalidValue("MESSAGE", message, "a message, or a readable file that holds one",
                               f"check the file ({e.strerror or e}), or pass - and pipe the message in") from None
        say(f"reading the message from the file {message}")
        return text
    if message not in (None, "-") and _looks_like_a_path(message):
        raise InvalidValue("MESSAGE", message, "a message, or a readable file that holds one",
                           f"no such file: {os.path.abspath(os.path.expanduser(message))}; check the path, or pass "
                           "the message itself (quoted), or - and pipe it in")
    if message not in (None, "-"):
        return message
    if stdin.isatty():
        say("paste the out-of-memory message, then press Ctrl-D on a new line (Ctrl-Z, Enter on Windows); "
            "or pass it as an argument, or pipe it in: ... 2>&1 | vramguard explain -")
    return stdin.read()


def explain(
    message: Optional[str] = typer.Argument(None, help="the OOM message, a file that holds it, or - to read it from "
                                                         "stdin"),
    model: Optional[str] = typer.Option(None, help="the model that ran, to name the allocation that failed"),
    revision: Optional[str] = revision_option(),
    quant: Quant = quant_option("its weight format"),
    attn: Attn = attn_option("its attn_implementation"),
    batch: int = batch_option("its batch"),
    prompt_tokens: int = prompt_tokens_option("its prompt length in tokens"),
    max_new_tokens: int = max_new_tokens_option("its new tokens"),
    fmt: Format = format_option(),
) -> None:
    """Classify a CUDA out-of-memory message: fragmentation, one allocation too large (algorithmic), memory held
    by other processes, or steady growth; also CUDA's own 'CUDA error: out of memory' (cuBLAS, NCCL, kernels), cuBLAS,
    MPS and accelerate offload errors; with the evidence and the fix."""
    from vramguard.explain import explain as explain_fn, plan_candidates  # loaded when the command runs

    def build():
        text = read_message(message)
        cands = None
        if model:
            spec = resolve_model(model, revision)
            say_fetched(spec)
            cands = plan_candidates(spec, Settings(quant=quant.value, attn=attn.value, batch=batch,
                                                                   prompt_tokens=prompt_tokens,
                                                                   max_new_tokens=max_new_tokens))
        return explain_fn(text, os.environ.get("PYTORCH_CUDA_ALLOC_CONF"), cands)

    e = run_guarded(build, as_json=fmt == Format['json'])
    if fmt == Format['json']:
        write_json(explanation_to_json(e))
    else:
        print_explanation(e, console())
