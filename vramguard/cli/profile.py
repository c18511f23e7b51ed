"""``vramguard profile`` and ``vramguard fit``: real runs measured beside the plan (over
:func:`vramguard.profile.profile` and :func:`vramguard.profile.fit.fit`)."""

from __future__ import annotations

from typing import Optional

import typer

from vramguard.allocconf import prefer_expandable_segments
from vramguard.cli.common import run_guarded, say, size_option, write_json
from vramguard.cli.options import (Attn, Format, Quant, Vary, attn_option, batch_option, format_option,
                                   max_new_tokens_option, prompt_tokens_option, quant_option)
from vramguard.errors import InvalidValue
from vramguard.cli.render import console, print_fit, print_profile, to_jsonable
from vramguard.runtime.device import total_bytes
from vramguard.settings import Settings


def profile(
    model: str = typer.Argument(..., metavar="MODEL",
                                 help="model folder or cached model id (weights needed)"),
    quant: Quant = quant_option(),
    attn: Attn = attn_option(),
    batch: int = batch_option(),
    prompt_tokens: int = prompt_tokens_option("prompt length in tokens (random ids)"),
    max_new_tokens: int = max_new_tokens_option(),
    out: Optional[str] = typer.Option(None, help="folder for timeline.png, timeline.html (and the snapshot)"),
    memory_snapshot: bool = typer.Option(False, help="also dump a PyTorch memory snapshot for memory_viz"),
    fmt: Format = format_option(),
) -> None:
    """A measured run beside the plan: weights, prefill peak, KV growth per token, decode peak, reserved vs
    allocated, fragmentation, memory outside PyTorch, TTFT and decode ms/token; a memory timeline picture. Needs a
    CUDA GPU."""
    from vramguard.profile.profiler import profile as profile_fn  # loaded when the command runs

    def build():
        _allocator_note()
        s = Settings(quant=quant.value, attn=attn.value, batch=batch, prompt_tokens=prompt_tokens,
                     max_new_tokens=max_new_tokens)
        return profile_fn(model, s, out_dir=out, memory_snapshot=memory_snapshot)

    r = run_guarded(build, as_json=fmt == Format['json'], progress=f"profiling {model}")
    if fmt == Format['json']:
        d = to_jsonable(r)
        d["rows"] = [{**to_jsonable(x), "diff": x.diff} for x in r.rows]
        write_json(d)
    else:
        print_profile(r, console())


def fit(
    model: str = typer.Argument(..., metavar="MODEL",
                                 help="model folder or cached model id (weights needed)"),
    vary: Vary = typer.Option(..., help="the value to vary"),
    vram_budget: Optional[str] = typer.Option(None, help="memory PyTorch may use, e.g. 24GiB (default: the card)"),
    quant: Quant = quant_option(),
    attn: Attn = attn_option(),
    batch: int = batch_option(),
    prompt_tokens: int = prompt_tokens_option(),
    max_new_tokens: int = max_new_tokens_option(),
    max_runs: int = typer.Option(8, help="at most this many real runs"),
    out: Optional[str] = typer.Option(None, help="folder for the fit picture"),
    fmt: Format = format_option(),
) -> None:
    """Real runs that find the largest prompt / new tokens / batch that completes under a budget, seeded by the
    plan; emulates a smaller card with a per-process memory fraction. Needs a CUDA GPU."""
    from vramguard.profile.fit import fit as fit_fn  # loaded when the command runs

    def build():
        _allocator_note()
        import torch
        s = Settings(quant=quant.value, attn=attn.value, batch=batch, prompt_tokens=prompt_tokens,
                     max_new_tokens=max_new_tokens)
        budget = size_option(vram_budget, "vram_budget") if vram_budget else (
            total_bytes() if torch.cuda.is_available() else 0)
        if max_runs < 1:
            raise InvalidValue("--max-runs", max_runs, "an integer >= 1", "allow at least one run")
        return fit_fn(model, s, vary.value, budget, out_dir=out, max_runs=max_runs)

    r = run_guarded(build, as_json=fmt == Format['json'], progress=f"fitting {model}: real runs")
    if fmt == Format['json']:
        write_json(to_jsonable(r))
    else:
        print_fit(r, console())


def _allocator_note() -> None:
    """Expandable segments for this process unless the user set the allocator (see :mod:`vramguard.allocconf`)."""
    note = prefer_expandable_segments()
    if note:
        say(note)
