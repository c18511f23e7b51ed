"""``vramguard run``: generate text without running out of memory (over :func:`vramguard.run.generate.generate`)."""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass
from typing import Optional

import typer

from vramguard.allocconf import prefer_expandable_segments
from vramguard.cli.common import err, run_guarded, say, size_option, working, write_json
from vramguard.cli.options import Format, Quant, format_option, max_new_tokens_option
from vramguard.cli.render import to_jsonable
from vramguard.cli.render_run import print_generation_summary
from vramguard.diskcache import environment_version
from vramguard.errors import InvalidValue
from vramguard.inputs import read_text, regular_file
from vramguard.resolve import local_model_folder
from vramguard.run.context import context_prompt
from vramguard.run.generate import GenerationInterrupted
from vramguard.run.generate import generate as generate_fn
from vramguard.run.kernels import warm_triton
from vramguard.run.prompt import preflight_prompt, prepare_prompt
from vramguard.run.sampling import check_generation_args
from vramguard.run.timing import process_age_s
from vramguard.runtime.load import default_quant, load_model
from vramguard.runtime.tokenizer import no_tokenizer_error
from vramguard.units import plural


def run(
    ctx: typer.Context,
    model: str = typer.Argument(..., metavar="MODEL",
                                 help="model folder or cached model id (weights and tokenizer needed)"),
    prompt: Optional[str] = typer.Option(None, help="the prompt text"),
    prompt_file: Optional[str] = typer.Option(None, help="read the prompt from this file (- for stdin)"),
    max_new_tokens: int = max_new_tokens_option(),
    vram_budget: Optional[str] = typer.Option(None, help="memory PyTorch may use, e.g. 12GiB (default: what is free)"),
    auto: bool = typer.Option(True, "--auto/--no-auto", help="pick the strategy that fits (else refuse)"),
    quant: Optional[Quant] = typer.Option(None, help="weight format (default: nf4 on a CUDA device; float32 "
                                                       "without one: exact; the summary says which and why)"),
    do_sample: bool = typer.Option(False, help="sample instead of greedy decoding"),
    temperature: Optional[float] = typer.Option(None, help="sampling temperature"),
    top_p: Optional[float] = typer.Option(None, help="nucleus sampling"),
    top_k: Optional[int] = typer.Option(None, help="top-k sampling"),
    seed: Optional[int] = typer.Option(None, help="random seed for sampling"),
    context: Optional[list[str]] = typer.Option(None, help="files to answer from (repeat the option); the prompt is "
                                                           "the question"),
    summarize: bool = typer.Option(False, help="when the context cannot fit, summarize it chunk by chunk first"),
    fast_decode: Optional[bool] = typer.Option(None, "--fast-decode/--no-fast-decode",
                                               help="decode by replaying one captured CUDA graph per token on a "
                                                    "static cache (default: on where the model can run it on one "
                                                    "CUDA device; falls back to eager steps and says why)"),
    chunk_tokens: int = typer.Option(256, help="tokens per context chunk"),
    chat_template: Optional[bool] = typer.Option(None, "--chat-template/--raw",
                                                 help="wrap the prompt as a user turn in the tokenizer's chat "
                                                      "template, or send it raw (default: the template when the "
                                                      "tokenizer has one)"),
    ignore_eos: bool = typer.Option(False, "--ignore-eos",
                                    help="generate exactly --max-new-tokens, past the model's end of turn (for "
                                         "measuring decode speed; default: stop where the model stops, as "
                                         "transformers' generate does)"),
    fmt: Format = format_option("human: text on stdout; json: one object"),
) -> None:
    """Generate text without running out of memory: plan first, pick a strategy that fits, recover from OOM.
    Stops at the model's end of turn (or --max-new-tokens). The text streams to stdout; a summary (what was loaded
    and why, strategy and why, why it stopped, time per phase: import, load, plan, one-time, prefill, decode) goes
    to stderr."""
    t_entry = time.perf_counter()
    startup_s = process_age_s()
    req = RunRequest(**{k: getattr(v, "value", v) for k, v in ctx.params.items()})
    try:
        r, interrupted = run_guarded(lambda: _generate(req, t_entry, startup_s), as_json=req.as_json), False
    except GenerationInterrupted as stop:  # Ctrl-C while generating: the summary of what came, then exit 130
        r, interrupted = stop.result, True
    r.timings.startup_s = startup_s
    r.timings.total_s = startup_s + time.perf_counter() - t_entry if startup_s is not None else None
    if req.as_json:
        write_json(to_jsonable(r))
    else:
        sys.stdout.write("\n")
        print_generation_summary(r, err)
    if interrupted:
        raise typer.Exit(130)


@dataclass(frozen=True)
class RunRequest:
    """What ``vramguard run`` was asked: each option's value as parsed (a choice as its string), by the command's
    parameter names, built once from its parameters; the steps below the command read it."""

    model: str
    prompt: str | None
    prompt_file: str | None
    max_new_tokens: int
    vram_budget: str | None
    auto: bool
    quant: str | None
    do_sample: bool
    temperature: float | None
    top_p: float | None
    top_k: int | None
    seed: int | None
    context: list[str] | None
    summarize: bool
    fast_decode: bool | None
    chunk_tokens: int
    chat_template: bool | None
    ignore_eos: bool
    fmt: str

    @property
    def as_json(self) -> bool:
        return self.fmt == Format['json'].value


def _generate(req: RunRequest, t_entry: float, startup_s: float | None):
    """Check what can be refused without loading anything (before anything is printed), load, build the prompt
    (with its context files), and generate, the text streamed to stdout unless the output is JSON."""
    check_generation_args(req.max_new_tokens, req.do_sample, req.temperature, req.top_p, req.top_k, req.seed)
    text = _read_prompt(req.prompt, req.prompt_file)
    for f in req.context or ():  # a missing file, a FIFO or a device is said before the model loads
        regular_file(f, "--context", "text file", InvalidValue, "pass a regular text file")
    local_model_folder(req.model)
    budget = size_option(req.vram_budget, "vram_budget") if req.vram_budget else None
    loaded, prepared, weights, why, times = _load_for_run(req, text)
    stream = None if req.as_json else (lambda t: (sys.stdout.write(t), sys.stdout.flush()))
    if req.context:
        text = _with_context(loaded, text, req, budget)
        prepared = prepare_prompt(loaded.tokenizer, text, req.chat_template)
    say(f"prompt: {plural(len(prepared.ids), 'token')}, {prepared.reason}")
    t_call = time.perf_counter()
    def with_load(r):  # the result, with what was loaded and the command's phases
        if r.loaded is not None:
            r.loaded["why"].insert(0, f"weights {weights}: {why}")
        _clock(r.timings, times, startup_s, t_call - t_entry)
        return r
    try:
        r = generate_fn(loaded, loaded.tokenizer, prepared.ids, req.max_new_tokens, budget_bytes=budget,
                        auto=req.auto, on_text=stream, do_sample=req.do_sample, temperature=req.temperature,
                        top_p=req.top_p, top_k=req.top_k, seed=req.seed, fast_decode=req.fast_decode,
                        ignore_eos=req.ignore_eos)
    except GenerationInterrupted as stop:
        with_load(stop.result)
        raise
    return with_load(r)


def _key_caches_meanwhile() -> None:
    """Compute, in a daemon thread while torch and transformers import, what keys every cache on disk (the
    libraries' versions and vramguard's source: :func:`vramguard.diskcache.environment_version`, about 0.1 s of
    reading metadata and hashing files); the plan and the kernel check read it later without waiting."""
    threading.Thread(target=_quietly, args=(environment_version,), name="vramguard-cache-key", daemon=True).start()


def _key_triton_meanwhile() -> None:
    """On a CUDA device, Triton's own cache key and the kernels' source keys
    (:func:`vramguard.run.kernels.warm_triton`, 0.2 to 0.6 s) in a daemon thread while the weights load, so that
    the graph decoder's first kernel launch does not wait for them."""
    threading.Thread(target=_quietly, args=(warm_triton,), name="vramguard-triton-key", daemon=True).start()


def _quietly(fn) -> None:
    """Run ``fn`` ahead of need; an error is not printed from the thread: the step that needs the value computes it
    again on its own path, where the error is reported as that step's."""
    try:
        fn()
    except Exception:  # noqa: BLE001, S110 -- see the docstring: computed again, and reported, where it is needed
        pass


def _clock(t, times: tuple, startup_s: float | None, call_s: float) -> None:
    """The command's phases into ``t`` (:class:`vramguard.run.timing.RunTimings`): import, tokenizer and load
    seconds (``times``), and the first token's time since the interpreter started (``startup_s`` before the
    command's first line, ``call_s`` from there to the call of ``generate``)."""
    t.import_s, t.prepare_s, t.load_s = times
    if startup_s is not None and t.first_token_s is not None:
        t.command_first_token_s = startup_s + call_s + t.first_token_s


def _load_for_run(req: RunRequest, text: str):
    """Import torch and transformers, read the tokenizer and check the prompt against the context (before any
    weight is read), then load the weights: ``(loaded, prepared prompt, weight format, why, (import_s, prepare_s,
    load_s))``. Without ``--quant`` the format is the device's default
    (:func:`vramguard.runtime.load.default_quant`)."""
    t0 = time.perf_counter()
    _key_caches_meanwhile()
    _allocator_note()  # imports torch; before CUDA starts
    import torch
    import transformers
    # transformers imports its modules at first use: import the tokenizer and model classes here, so the
    # summary's import time holds them and the tokenizer and load times are their own work
    from transformers import AutoTokenizer, PreTrainedModel  # noqa: F401

    import_s = time.perf_counter() - t0
    transformers.utils.logging.disable_progress_bar()
    on_cuda = torch.cuda.is_available()
    if on_cuda:
        _key_triton_meanwhile()
    t0 = time.perf_counter()
    model = req.model
    tokenizer, prepared, _ = preflight_prompt(model, text, req.max_new_tokens, req.chat_template)
    prepare_s = time.perf_counter() - t0
    weights, why = (req.quant, "--quant was given") if req.quant is not None else default_quant(on_cuda)
    t0 = time.perf_counter()
    with working(f"loading {model}"):
        loaded = load_model(model, quant=weights, verify=on_cuda, tokenizer=tokenizer)
    load_s = time.perf_counter() - t0
    if loaded.tokenizer is None:
        raise no_tokenizer_error(model, "the loaded model has no tokenizer")
    return loaded, prepared, weights, why, (import_s, prepare_s, load_s)


def _read_prompt(prompt: str | None, prompt_file: str | None) -> str:
    """The prompt: ``--prompt`` or the text of ``--prompt-file`` (stdin for ``-``), exactly one of the two."""
    if (prompt is None) == (prompt_file is None):
        raise InvalidValue("--prompt/--prompt-file", "both" if prompt else "neither", "exactly one of the two",
                           "pass --prompt TEXT or --prompt-file FILE")
    if prompt_file is None:
        if not prompt.strip():
            raise InvalidValue("--prompt", prompt, "text with at least one character other than white space",
                               "pass the text to answer, e.g. --prompt 'Hello'")
        return prompt
    text = sys.stdin.read() if prompt_file == "-" else read_text(
        prompt_file, "--prompt-file", instead="to stream a prompt, pass --prompt-file - and pipe it in")
    if not text.strip():
        raise InvalidValue("--prompt-file", prompt_file, "a file holding text other than white space",
                           "write the prompt into the file, or pass --prompt TEXT")
    return text


def _with_context(loaded, question: str, req: RunRequest, budget: int | None) -> str:
    """:func:`vramguard.run.context.context_prompt` over ``req.context`` (the prompt counted as it is sent, with
    ``req.chat_template``), its summary line on stderr."""
    packed, limit = context_prompt(loaded, loaded.tokenizer, question, req.context, chunk_tokens=req.chunk_tokens,
                                   max_new_tokens=req.max_new_tokens, budget_bytes=budget, auto=req.auto,
                                   summarize=req.summarize, chat=req.chat_template)
    say(f"context: {len(packed.used)} of {packed.total_chunks} chunks"
        + (" (summarized)" if packed.summarized else "") + f", prompt {packed.prompt_tokens:,} of "
        f"{limit:,} tokens the plan allows" + ("; " + "; ".join(packed.notes) if packed.notes else ""))
    return packed.prompt


def _allocator_note() -> None:
    """Expandable segments for this process unless the user set the allocator (see :mod:`vramguard.allocconf`)."""
    note = prefer_expandable_segments()
    if note:
        say(note)
