"""The ``vramguard`` command: a thin layer that parses options, calls one library function and prints.

Errors from the library are mapped to a message on stderr and an exit code in one table (:data:`EXIT_CODES`);
no traceback reaches the user (set ``VRAMGUARD_DEBUG=1`` to see one for an internal error).
"""

from __future__ import annotations

import json
import os
import sys
from enum import Enum
from typing import Optional

import typer

from vramguard.errors import (ConfigError, Infeasible, InvalidValue, UnknownGpu, UnknownModel,
                              VramguardError)
from vramguard.settings import ATTNS, CACHES, DTYPES, KV_DTYPES, LOGITS, QUANTS, SDPA_KERNELS
from vramguard.units import plural

# 1: a check failed; 2: bad option value; 3: unknown model / card or unreadable config; 4: infeasible request;
# 70: internal error
EXIT_CODES: dict[type, int] = {InvalidValue: 2, ConfigError: 3, UnknownModel: 3, UnknownGpu: 3, Infeasible: 4}
EXIT_INTERNAL = 70
# optional packages and the extra that installs each (pyproject.toml); a missing one is exit 3, not an internal error
OPTIONAL_PACKAGES = {m: "gpu" for m in ("torch", "transformers", "accelerate", "safetensors", "bitsandbytes",
                                        "matplotlib", "optimum", "hqq")} | {
    m: "serve" for m in ("fastapi", "uvicorn", "sse_starlette", "prometheus_client", "httpx", "pydantic")}

from vramguard.render import console as _console  # noqa: E402  (rich only: no torch import)

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False, rich_markup_mode=None,
                  help="vramguard: plan, verify and guard GPU memory for Hugging Face transformers inference.")
err = _console(stderr=True)


def _version(value: bool) -> None:
    if value:
        import importlib.metadata

        import vramguard
        try:
            torch_v = importlib.metadata.version("torch")
        except importlib.metadata.PackageNotFoundError:
            torch_v = "not installed"
        try:
            tf_v = importlib.metadata.version("transformers")
        except importlib.metadata.PackageNotFoundError:
            tf_v = "not installed"
        print(f"vramguard {vramguard.__version__} (torch {torch_v}, transformers {tf_v})")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="print the version (and torch's, transformers') and exit")) -> None:
    """vramguard: plan, verify and guard GPU memory for Hugging Face transformers inference."""


# one line per command in `vramguard --help`, each short enough for 80 columns (click cuts longer ones with "...")
SHORT_HELP = {
    "plan": "Predict memory by component and what fits, before loading.",
    "check": "Check the environment and load settings; name the kernel.",
    "oom-log": "Explain kernel OOM kills ('Killed'): process, memory, why.",
    "explain": "Classify a CUDA out-of-memory message, with the fix.",
    "profile": "Measure a run beside the plan; memory timeline picture.",
    "fit": "Real runs: the largest prompt/new tokens/batch that fits.",
    "run": "Generate text without running out of memory.",
    "serve": "Serve an OpenAI-compatible API with admission control.",
}


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


# library field name -> the CLI option that sets it
FIELD_FLAGS = {"batch": "--batch", "num_beams": "--num-beams", "num_return_sequences": "--num-return-sequences",
               "prompt_tokens": "--prompt-tokens", "max_new_tokens": "--max-new-tokens",
               "prefill_chunk": "--prefill-chunk", "kv_dtype": "--kv-dtype", "compute_dtype": "--compute-dtype",
               "dtype": "--dtype", "quant": "--quant", "attn": "--attn", "cache": "--cache", "context": "--context",
               "max_cache_len": "--max-cache-len", "temperature": "--temperature", "top_p": "--top-p",
               "top_k": "--top-k", "max_queue": "--max-queue", "max_running": "--max-running",
               "max_batch_tokens": "--max-batch-tokens", "page_size": "--page-size", "n_max": "--n-max",
               "default_max_tokens": "--default-max-tokens", "max_kv_blocks": "--max-kv-blocks", "gpus": "--gpus",
               "vram_budget": "--vram-budget", "port": "--port", "host": "--host", "model": "MODEL"}


def _fail(e: VramguardError, as_json: bool = False) -> None:
    code = EXIT_CODES.get(type(e), getattr(e, "exit_code", 2))
    flag = " + ".join(FIELD_FLAGS.get(part.strip(), part.strip()) for part in e.field.split("+"))
    err.print("error " + e.render(flag), markup=False, highlight=False)
    if as_json:
        sys.stdout.write(json.dumps({"error": {**e.as_dict(), "field": flag}}) + "\n")
    raise typer.Exit(code)


TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"  # PyTorch's index of CPU-only wheels


def install_fix(extra: str, torch_missing: bool) -> str:
    """The install command for a missing optional package: with torch missing and no NVIDIA GPU found, the CPU
    build of torch first (plain ``pip install torch`` resolves to the CUDA build and its CUDA packages)."""
    cmd = f"pip install 'vramguard[{extra}]'"
    if not torch_missing:
        return cmd
    from vramguard.hardware import detect_gpus
    det = detect_gpus()
    if det.gpus:
        return cmd + " (installs the CUDA build of torch)"
    return (f"pip install torch --index-url {TORCH_CPU_INDEX} (the CPU build: {det.reason}), then {cmd}")


def run_guarded(fn, *args, as_json: bool = False, **kwargs):
    """Call ``fn``; map vramguard errors to their exit code and anything else to an internal-error message."""
    try:
        return fn(*args, **kwargs)
    except VramguardError as e:
        _fail(e, as_json)
    except (typer.Exit, KeyboardInterrupt):
        raise
    except ModuleNotFoundError as e:  # an optional dependency of this command is missing: name it and the extra
        top = (e.name or "").split(".")[0]
        if top not in OPTIONAL_PACKAGES or os.environ.get("VRAMGUARD_DEBUG"):
            raise
        err.print(f"error {top} not installed: this command needs it.\nfix: "
                  + install_fix(OPTIONAL_PACKAGES[top], top == "torch"), markup=False, highlight=False)
        raise typer.Exit(3) from None
    except Exception as e:  # an internal error: say so plainly, keep the traceback for debugging only
        if os.environ.get("VRAMGUARD_DEBUG"):
            raise
        err.print(f"[red]internal error[/red] {type(e).__name__}: {e}\n"
                  "please report it with the command line; VRAMGUARD_DEBUG=1 shows the traceback")
        raise typer.Exit(EXIT_INTERNAL)


DEFAULT_PROMPT_TOKENS = 128  # a short chat prompt: system prompt, one user turn and the chat template


@app.command(short_help=SHORT_HELP["plan"])
def plan(
    model: str = typer.Argument("llama-2-7b", metavar="MODEL",
                                 help="model folder, config.json, catalog name or cached model id"),
    quant: Quant = typer.Option(Quant['nf4'], help="weight format"),
    double_quant: bool = typer.Option(True, "--double-quant/--no-double-quant", help="4-bit double quantization"),
    compute_dtype: Optional[Dtype] = typer.Option(None, help="4-bit compute dtype (default: the model dtype)"),
    dtype: Optional[Dtype] = typer.Option(None, help="model dtype (default bf16; fp16/fp32 for those quants)"),
    attn: Optional[Attn] = typer.Option(None, help="attn_implementation (default: flash_attention_2; sdpa on a "
                                        "--gpu card below compute capability 8.0, which cannot run it)"),
    kv_dtype: Optional[KvDtype] = typer.Option(None, help="KV cache type (int8/int4: quantized cache)"),
    cache: Cache = typer.Option(Cache['dynamic'], help="KV cache kind"),
    batch: int = typer.Option(1, help="prompts decoded together"),
    num_beams: int = typer.Option(1, help="beams per prompt"),
    num_return_sequences: int = typer.Option(1, help="sequences returned per prompt"),
    prompt_tokens: int = typer.Option(DEFAULT_PROMPT_TOKENS, help="prompt length in tokens"),
    max_new_tokens: int = typer.Option(256, help="tokens to generate"),
    prefill_chunk: Optional[int] = typer.Option(None, help="chunked prefill: tokens per forward"),
    logits: Logits = typer.Option(Logits['last'], help="last: generate(); all: a forward over every position"),
    output_attentions: bool = typer.Option(False, help="attention maps requested (forces eager)"),
    padded: bool = typer.Option(False, help="prompts of different lengths in one batch"),
    do_sample: bool = typer.Option(False, help="sampling (allows --num-return-sequences > 1 without beams)"),
    context: Optional[int] = typer.Option(None, help="context length to allow (RoPE-scaled models beyond config)"),
    gpu: Optional[str] = typer.Option(None, help="a catalog card (see --list-gpus)"),
    vram: Optional[str] = typer.Option(None, help="card memory, e.g. 24GiB, 24GB, 24000MiB"),
    fmt: Format = typer.Option(Format['human'], "--format", help="human or json"),
    list_models: bool = typer.Option(False, "--list-models", help="list the catalog architectures and exit"),
    list_gpus: bool = typer.Option(False, "--list-gpus", help="list the catalog cards and exit"),
    exit_code: bool = typer.Option(False, "--exit-code", help="exit 1 when the run fits none of the cards"),
) -> None:
    """Predict memory by component, say whether it fits, solve for what fits, and rank the fixes."""
    from vramguard.plan import plan as plan_fn
    from vramguard.render import plan_to_json, print_plan
    from vramguard.settings import Settings

    if list_models or list_gpus:
        _print_catalog(list_models, list_gpus)
        return

    def build():
        from vramguard.hardware import card_defaults
        chosen_attn, chosen_dtype, notes = card_defaults(gpu, attn.value if attn else None,
                                                         dtype.value if dtype else None, compute_dtype is not None)
        for note in notes:
            err.print(note, markup=False, highlight=False)
        from vramguard.units import decimal_size_note
        if vram and decimal_size_note(vram):
            err.print("note: " + decimal_size_note(vram), markup=False, highlight=False)
        s = Settings(quant=quant.value, double_quant=double_quant,
                     compute_dtype=compute_dtype.value if compute_dtype else None,
                     dtype=chosen_dtype, attn=chosen_attn,
                     kv_dtype=kv_dtype.value if kv_dtype else None, cache=cache.value, batch=batch,
                     num_beams=num_beams, num_return_sequences=num_return_sequences, prompt_tokens=prompt_tokens,
                     max_new_tokens=max_new_tokens, prefill_chunk=prefill_chunk, logits=logits.value,
                     output_attentions=output_attentions, padded=padded, do_sample=do_sample)
        return plan_fn(model, s, gpu=gpu, vram=vram, context=context)

    p = run_guarded(build, as_json=fmt == Format['json'])
    if fmt == Format['json']:
        sys.stdout.write(json.dumps(plan_to_json(p), indent=2) + "\n")
    else:
        print_plan(p, _console())
    if exit_code and not any(c.fits for c in p.cards):
        raise typer.Exit(1)


@app.command(short_help=SHORT_HELP["check"])
def check(
    model: Optional[str] = typer.Argument(None, metavar="MODEL",
                                 help="model folder, config.json, catalog name or cached model id"),
    quant: CheckQuant = typer.Option(CheckQuant['nf4'], help="weight format; none: no quantization config, the "
                                     "dtype then decides"),
    double_quant: bool = typer.Option(True, "--double-quant/--no-double-quant", help="4-bit double quantization"),
    compute_dtype: Optional[Dtype] = typer.Option(None, help="bnb_4bit_compute_dtype you pass (unset: what "
                                                             "vramguard run/serve pass, bf16 where supported else "
                                                             "fp16)"),
    dtype: Optional[DtypeArg] = typer.Option(None, help="dtype you pass to from_pretrained (unset: what vramguard "
                                                         "run/serve pass)"),
    transformers_defaults: bool = typer.Option(False, "--transformers-defaults",
                                               help="check plain from_pretrained's defaults for what you leave "
                                                    "unset (bitsandbytes computes in float32) instead of "
                                                    "vramguard's"),
    attn: Attn = typer.Option(Attn['sdpa'], help="attn_implementation you pass"),
    sdpa_kernel: SdpaKernel = typer.Option(SdpaKernel['auto'], help="SDPA backend you pin (torch.nn.attention."
                                                                 "sdpa_kernel)"),
    output_attentions: bool = typer.Option(False, help="attention maps requested"),
    device_map: Optional[str] = typer.Option(None, help="device_map you pass (auto is checked for offload)"),
    batch: int = typer.Option(1, help="prompts decoded together"),
    prompt_tokens: int = typer.Option(DEFAULT_PROMPT_TOKENS, help="prompt length in tokens"),
    max_new_tokens: int = typer.Option(256, help="tokens to generate"),
    gpu: Optional[str] = typer.Option(None, help="check against a catalog card instead of the detected one"),
    verify: bool = typer.Option(True, "--verify/--no-verify", help="on a GPU: load and name the kernel that runs"),
    fmt: Format = typer.Option(Format['human'], "--format", help="human or json"),
) -> None:
    """Check the environment and the load settings; name the attention kernel that really runs (GPU).
    Exits 1 when a finding fails."""
    from vramguard.check import check as check_fn
    from vramguard.render import check_to_json, print_check
    from vramguard.settings import Settings

    def build():
        q = "bf16" if quant == CheckQuant['none'] else quant.value
        s = Settings(quant=q, double_quant=double_quant, attn=attn.value, sdpa_kernel=sdpa_kernel.value, batch=batch,
                     prompt_tokens=prompt_tokens, max_new_tokens=max_new_tokens,
                     output_attentions=output_attentions)
        if compute_dtype is not None and not s.is_4bit:
            raise InvalidValue("--compute-dtype", compute_dtype.value, f"unset with --quant {quant.value}",
                               "the compute dtype applies to 4-bit weights only (--quant nf4 or fp4)")
        return check_fn(model, s, dtype=dtype.value if dtype else None,
                        compute_dtype=compute_dtype.value if compute_dtype else None, device_map=device_map,
                        gpu=gpu, verify=verify, unquantized=quant == CheckQuant['none'],
                        loader_defaults=not transformers_defaults)

    r = run_guarded(build, as_json=fmt == Format['json'])
    if fmt == Format['json']:
        sys.stdout.write(json.dumps(check_to_json(r), indent=2) + "\n")
    else:
        print_check(r, _console())
    if r.failed:
        raise typer.Exit(1)


@app.command("oom-log", short_help=SHORT_HELP["oom-log"])
def oom_log(
    since: Optional[str] = typer.Option(None, help="only kills after: 30m, 2h, 1d, boot, or 2026-11-30T17:00"),
    file: Optional[str] = typer.Option(None, "--file", help="a log file to read, or - for stdin"),
    year: Optional[int] = typer.Option(None, help="year of syslog-style timestamps that omit it (default: now)"),
    fmt: Format = typer.Option(Format['human'], "--format", help="human or json"),
) -> None:
    """Read the kernel OOM killer's records and explain each kill ("Killed" -> which process, how much memory, why).
    Exits 1 when no kernel log could be read."""
    from vramguard.oomlog import oom_log as oom_log_fn
    from vramguard.render import oomlog_to_json, print_oomlog

    r = run_guarded(oom_log_fn, file, since, year, as_json=fmt == Format['json'])
    if fmt == Format['json']:
        sys.stdout.write(json.dumps(oomlog_to_json(r), indent=2) + "\n")
    else:
        print_oomlog(r, _console(stderr=r.source is None))
    if r.source is None:
        raise typer.Exit(1)


def read_message(message: str | None, stdin=None) -> str:
    """The message argument, or stdin for none or ``-``; on a terminal, first say what is awaited (on stderr)."""
    stdin = stdin or sys.stdin
    if message not in (None, "-"):
        return message
    if stdin.isatty():
        err.print("paste the out-of-memory message, then press Ctrl-D on a new line (Ctrl-Z, Enter on Windows); "
                  "or pass it as an argument, or pipe it in: ... 2>&1 | vramguard explain -", markup=False,
                  highlight=False)
    return stdin.read()


@app.command(short_help=SHORT_HELP["explain"])
def explain(
    message: Optional[str] = typer.Argument(None, help="the OOM message, or - to read it from stdin"),
    model: Optional[str] = typer.Option(None, help="the model that ran, to name the allocation that failed"),
    quant: Quant = typer.Option(Quant['nf4'], help="its weight format"),
    attn: Attn = typer.Option(Attn['sdpa'], help="its attn_implementation"),
    batch: int = typer.Option(1, help="its batch"),
    prompt_tokens: int = typer.Option(DEFAULT_PROMPT_TOKENS, help="its prompt length in tokens"),
    max_new_tokens: int = typer.Option(256, help="its new tokens"),
    fmt: Format = typer.Option(Format['human'], "--format", help="human or json"),
) -> None:
    """Classify a CUDA out-of-memory message: fragmentation, one allocation too large (algorithmic), memory held
    by other processes, or steady growth; with the evidence and the fix."""
    import os

    from vramguard.explain import explain as explain_fn
    from vramguard.explain import plan_candidates
    from vramguard.render import print_explanation, to_jsonable

    def build():
        text = read_message(message)
        cands = None
        if model:
            from vramguard.resolve import resolve_model
            from vramguard.settings import Settings
            cands = plan_candidates(resolve_model(model), Settings(quant=quant.value, attn=attn.value, batch=batch,
                                                                   prompt_tokens=prompt_tokens,
                                                                   max_new_tokens=max_new_tokens))
        return explain_fn(text, os.environ.get("PYTORCH_CUDA_ALLOC_CONF"), cands)

    e = run_guarded(build, as_json=fmt == Format['json'])
    if fmt == Format['json']:
        sys.stdout.write(json.dumps(to_jsonable(e), indent=2) + "\n")
    else:
        print_explanation(e, _console())


@app.command(short_help=SHORT_HELP["profile"])
def profile(
    model: str = typer.Argument(..., metavar="MODEL",
                                 help="model folder or cached model id (weights needed)"),
    quant: Quant = typer.Option(Quant['nf4'], help="weight format"),
    attn: Attn = typer.Option(Attn['sdpa'], help="attn_implementation"),
    batch: int = typer.Option(1, help="prompts decoded together"),
    prompt_tokens: int = typer.Option(DEFAULT_PROMPT_TOKENS, help="prompt length in tokens (random ids)"),
    max_new_tokens: int = typer.Option(256, help="tokens to generate"),
    out: Optional[str] = typer.Option(None, help="folder for timeline.png, timeline.html (and the snapshot)"),
    memory_snapshot: bool = typer.Option(False, help="also dump a PyTorch memory snapshot for memory_viz"),
    fmt: Format = typer.Option(Format['human'], "--format", help="human or json"),
) -> None:
    """A measured run beside the plan: weights, prefill peak, KV growth per token, decode peak, reserved vs
    allocated, fragmentation, memory outside PyTorch, TTFT and decode ms/token; a memory timeline picture."""
    from vramguard.profile import profile as profile_fn
    from vramguard.render import print_profile, to_jsonable
    from vramguard.settings import Settings

    def build():
        s = Settings(quant=quant.value, attn=attn.value, batch=batch, prompt_tokens=prompt_tokens,
                     max_new_tokens=max_new_tokens)
        return profile_fn(model, s, out_dir=out, memory_snapshot=memory_snapshot)

    r = run_guarded(build, as_json=fmt == Format['json'])
    if fmt == Format['json']:
        d = to_jsonable(r)
        d["rows"] = [{**to_jsonable(x), "diff": x.diff} for x in r.rows]
        sys.stdout.write(json.dumps(d, indent=2) + "\n")
    else:
        print_profile(r, _console())


@app.command(short_help=SHORT_HELP["fit"])
def fit(
    model: str = typer.Argument(..., metavar="MODEL",
                                 help="model folder or cached model id (weights needed)"),
    vary: Vary = typer.Option(..., help="the value to vary"),
    vram_budget: Optional[str] = typer.Option(None, help="memory PyTorch may use, e.g. 24GiB (default: the card)"),
    quant: Quant = typer.Option(Quant['nf4'], help="weight format"),
    attn: Attn = typer.Option(Attn['sdpa'], help="attn_implementation"),
    batch: int = typer.Option(1, help="prompts decoded together"),
    prompt_tokens: int = typer.Option(DEFAULT_PROMPT_TOKENS, help="prompt length in tokens"),
    max_new_tokens: int = typer.Option(256, help="tokens to generate"),
    max_runs: int = typer.Option(8, help="at most this many real runs"),
    out: Optional[str] = typer.Option(None, help="folder for the fit picture"),
    fmt: Format = typer.Option(Format['human'], "--format", help="human or json"),
) -> None:
    """Real runs that find the largest prompt / new tokens / batch that completes under a budget, seeded by the
    plan; emulates a smaller card with a per-process memory fraction."""
    from vramguard.fit import fit as fit_fn
    from vramguard.render import print_fit, to_jsonable
    from vramguard.settings import Settings
    from vramguard.units import parse_size

    def build():
        import torch
        s = Settings(quant=quant.value, attn=attn.value, batch=batch, prompt_tokens=prompt_tokens,
                     max_new_tokens=max_new_tokens)
        budget = parse_size(vram_budget, "--vram-budget") if vram_budget else (
            torch.cuda.mem_get_info()[1] if torch.cuda.is_available() else 0)
        if max_runs < 1:
            raise InvalidValue("--max-runs", max_runs, "an integer >= 1", "allow at least one run")
        return fit_fn(model, s, vary.value, budget, out_dir=out, max_runs=max_runs)

    r = run_guarded(build, as_json=fmt == Format['json'])
    if fmt == Format['json']:
        sys.stdout.write(json.dumps(to_jsonable(r), indent=2) + "\n")
    else:
        print_fit(r, _console())


@app.command(short_help=SHORT_HELP["run"])
def run(
    model: str = typer.Argument(..., metavar="MODEL",
                                 help="model folder or cached model id (weights and tokenizer needed)"),
    prompt: Optional[str] = typer.Option(None, help="the prompt text"),
    prompt_file: Optional[str] = typer.Option(None, help="read the prompt from this file (- for stdin)"),
    max_new_tokens: int = typer.Option(256, help="tokens to generate"),
    vram_budget: Optional[str] = typer.Option(None, help="memory PyTorch may use, e.g. 12GiB (default: what is free)"),
    auto: bool = typer.Option(True, "--auto/--no-auto", help="pick the strategy that fits (else refuse)"),
    quant: Quant = typer.Option(Quant['nf4'], help="weight format"),
    do_sample: bool = typer.Option(False, help="sample instead of greedy decoding"),
    temperature: Optional[float] = typer.Option(None, help="sampling temperature"),
    top_p: Optional[float] = typer.Option(None, help="nucleus sampling"),
    top_k: Optional[int] = typer.Option(None, help="top-k sampling"),
    seed: Optional[int] = typer.Option(None, help="random seed for sampling"),
    context: Optional[list[str]] = typer.Option(None, help="files to answer from (repeat the option); the prompt is "
                                                           "the question"),
    summarize: bool = typer.Option(False, help="when the context cannot fit, summarize it chunk by chunk first"),
    fast_decode: bool = typer.Option(False, help="decode by replaying one captured CUDA graph per token on a static "
                                                 "cache (batch 1; falls back to eager steps and says why)"),
    chunk_tokens: int = typer.Option(256, help="tokens per context chunk"),
    chat_template: Optional[bool] = typer.Option(None, "--chat-template/--raw",
                                                 help="wrap the prompt as a user turn in the tokenizer's chat "
                                                      "template, or send it raw (default: the template when the "
                                                      "tokenizer has one)"),
    fmt: Format = typer.Option(Format['human'], "--format", help="human: text on stdout; json: one object"),
) -> None:
    """Generate text without running out of memory: plan first, pick a strategy that fits, recover from OOM.
    The text streams to stdout; a summary (strategy and why, peak memory, TTFT, tokens/s) goes to stderr."""
    from vramguard.generate import generate as generate_fn
    from vramguard.load import load_model
    from vramguard.render import print_generation_summary, to_jsonable
    from vramguard.units import parse_size

    def build():
        if (prompt is None) == (prompt_file is None):
            raise InvalidValue("--prompt/--prompt-file", "both" if prompt else "neither", "exactly one of the two",
                               "pass --prompt TEXT or --prompt-file FILE")
        text = prompt
        if prompt_file is not None:
            try:
                text = sys.stdin.read() if prompt_file == "-" else open(prompt_file, encoding="utf-8").read()
            except OSError as e:
                raise InvalidValue("--prompt-file", prompt_file, "a readable text file",
                                   f"check the path ({e.strerror or e}), or pass - and pipe the prompt in") from None
        budget = parse_size(vram_budget, "--vram-budget") if vram_budget else None
        import torch
        import transformers

        from vramguard.prompt import prepare_prompt, preflight_prompt
        transformers.utils.logging.disable_progress_bar()
        # the tokenizer and config alone: a prompt over the context is refused before minutes of loading
        _, prepared, _ = preflight_prompt(model, text, max_new_tokens, chat_template)
        loaded = load_model(model, quant=quant.value, verify=torch.cuda.is_available())
        if loaded.tokenizer is None:
            raise ConfigError("MODEL", model, "a model folder with tokenizer files", "save the tokenizer with the "
                              "model (tokenizer.save_pretrained(folder))")
        stream = None if fmt == Format['json'] else (lambda t: (sys.stdout.write(t), sys.stdout.flush()))
        if context:
            text = _with_context(loaded, text, context, summarize, chunk_tokens, max_new_tokens, budget, auto)
            prepared = prepare_prompt(loaded.tokenizer, text, chat_template)
        err.print(f"prompt: {plural(len(prepared.ids), 'token')}, {prepared.reason}", markup=False,
                  highlight=False)
        return generate_fn(loaded.model, loaded.tokenizer, prepared.ids, max_new_tokens, budget_bytes=budget,
                           auto=auto,
                           on_text=stream, do_sample=do_sample, temperature=temperature, top_p=top_p, top_k=top_k,
                           seed=seed, fast_decode=fast_decode)

    r = run_guarded(build, as_json=fmt == Format['json'])
    if fmt == Format['json']:
        sys.stdout.write(json.dumps(to_jsonable(r), indent=2) + "\n")
    else:
        sys.stdout.write("\n")
        print_generation_summary(r, err)


@app.command(short_help=SHORT_HELP["serve"])
def serve(
    model: str = typer.Argument(..., metavar="MODEL",
                                 help="model folder or cached model id (weights and tokenizer needed)"),
    host: str = typer.Option("127.0.0.1", help="address to bind (loopback unless you choose otherwise)"),
    port: int = typer.Option(8000, help="TCP port (0 picks a free one)"),
    gpus: Optional[str] = typer.Option(None, help="GPU indices, e.g. 0 or 0,1: one worker process per GPU behind a "
                                                  "front process that balances them and answers 429 itself "
                                                  "(default: one process on the current device)"),
    vram_budget: Optional[str] = typer.Option(None, help="memory PyTorch may use per GPU, e.g. 20GiB, enforced as a "
                                                         "hard cap on this process (default: what is free after "
                                                         "loading); without a GPU, host memory for the model and its "
                                                         "KV pool (default 2GiB)"),
    max_queue: int = typer.Option(64, help="requests that may wait beyond those running; more get 429"),
    max_running: int = typer.Option(64, help="requests computed together in one step"),
    max_batch_tokens: int = typer.Option(2048, help="tokens computed in one step (prefill chunks + decodes)"),
    page_size: int = typer.Option(256, help="tokens per KV block"),
    max_kv_blocks: Optional[int] = typer.Option(None, help="cap the KV pool below what the budget allows"),
    api_key: Optional[str] = typer.Option(None, envvar="VRAMGUARD_API_KEY",
                                          help="require 'Authorization: Bearer KEY' on every route but /health "
                                               "(or set VRAMGUARD_API_KEY)"),
    quant: Quant = typer.Option(Quant['nf4'], help="weight format"),
    dtype: Optional[DtypeArg] = typer.Option(None, help="parameter/activation dtype (default: bf16 where supported)"),
    attn: LoadAttn = typer.Option(LoadAttn['auto'], help="attention implementation (auto: the best that runs here)"),
    trust_remote_code: bool = typer.Option(False, help="allow the model's own Python code (off: never run it)"),
    allow_pickle: bool = typer.Option(False, help="allow pickle (.bin) weights (off: safetensors only)"),
    seed: int = typer.Option(0, help="sampling seed of the engine"),
    served_model_name: Optional[str] = typer.Option(None, help="the model name clients send (default: MODEL)"),
    n_max: int = typer.Option(4, help="largest n (choices per request)"),
    default_max_tokens: int = typer.Option(256, help="max_tokens of a request that gives none"),
    max_body_size: str = typer.Option("1MiB", help="largest request body; more gets 413"),
    greedy: bool = typer.Option(False, help="decode every request greedily (no sampling work in the step); requests "
                                            "asking for temperature > 0 are refused"),
    ready_file: Optional[str] = typer.Option(None, hidden=True, help="write the URL here once listening"),
) -> None:
    """Serve the model over an OpenAI-compatible API (/v1/chat/completions, /v1/completions, /v1/models, /health,
    /metrics) with a KV pool sized for the budget, a bounded queue, and recovery from out-of-memory errors."""
    from vramguard.units import parse_size
    import importlib.util
    missing = [m for m in ("torch", "transformers", "accelerate", "fastapi", "uvicorn", "sse_starlette",
                           "prometheus_client", "httpx") if importlib.util.find_spec(m) is None]
    if missing:
        err.print(f"error serve: {', '.join(missing)} not installed.\nfix: "
                  + install_fix("serve,gpu", "torch" in missing), markup=False, highlight=False)
        raise typer.Exit(3)

    def listening(url: str) -> None:
        if ready_file:
            with open(ready_file + ".tmp", "w") as f:
                f.write(url)
            os.replace(ready_file + ".tmp", ready_file)
        err.print(f"serving {served_model_name or model} on {url}/v1", markup=False, highlight=False)

    def start() -> int:
        budget = parse_size(vram_budget, "--vram-budget") if vram_budget else None
        body = parse_size(max_body_size, "--max-body-size", example="1MiB")
        from vramguard.serve.server import check_bind
        check_bind(host, port)  # before minutes of loading: a bad or busy port is known now
        if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
            err.print(f"warning: binding {host} without --api-key: anyone who can reach this address can use the "
                      "model", markup=False, highlight=False)
        if gpus is not None:
            try:
                ids = [int(x) for x in gpus.split(",") if x.strip()]
            except ValueError:
                raise InvalidValue("gpus", gpus, "comma-separated GPU indices, e.g. 0,1", "pass --gpus 0,1") from None
            import torch
            n = torch.cuda.device_count()
            if not ids or any(i < 0 or i >= n for i in ids) or len(set(ids)) != len(ids):
                raise InvalidValue("gpus", gpus, f"distinct indices in 0..{n - 1}" if n else "none: no CUDA GPU "
                                   "is visible", "pass indices of GPUs this machine has (nvidia-smi -L lists them)")
            from vramguard.serve.router import run_router
            args = [a for a in sys.argv[sys.argv.index("serve") + 2:]]
            args = _strip_options(args, ("--gpus", "--host", "--port", "--api-key", "--ready-file"))
            return run_router(model, ids, args, host, port, api_key, on_listen=listening)
        import transformers

        from vramguard.serve.server import build
        transformers.utils.logging.disable_progress_bar()
        served = build(model, vram_budget=budget, max_queue=max_queue, max_running=max_running,
                       max_batch_tokens=max_batch_tokens, page_size=page_size, max_kv_blocks=max_kv_blocks,
                       api_key=api_key, quant=quant.value, dtype=dtype.value if dtype and dtype.value != "auto"
                       else None, attn=attn.value, trust_remote_code=trust_remote_code, allow_pickle=allow_pickle,
                       seed=seed, served_name=served_model_name, n_max=n_max,
                       default_max_tokens=default_max_tokens, max_body_bytes=body, greedy=greedy,
                       hard_cap=True)
        a = served.report.active if served.report is not None else {}
        err.print("loaded: " + ", ".join(f"{k} {a[k]}" for k in ("quant", "compute_dtype", "dtype", "attn", "device")
                                          if a.get(k) not in (None, "None") and (k, a[k]) != ("quant", "none")),
                  markup=False, highlight=False)
        err.print(served.pool.summary(), markup=False, highlight=False)
        for note in served.engine.notes + served.options.notes:
            err.print("note: " + note, markup=False, highlight=False)
        return served.run(host, port, on_listen=listening)

    rc = run_guarded(start)
    if rc:
        err.print(f"stopped after an unrecoverable error (exit code {rc})", markup=False, highlight=False)
    raise typer.Exit(rc or 0)


def _strip_options(args: list[str], names: tuple[str, ...]) -> list[str]:
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


def _with_context(loaded, question, files, summarize, chunk_tokens, max_new_tokens, budget, auto) -> str:
    """:func:`vramguard.context.context_prompt`, its summary line on stderr."""
    from vramguard.context import context_prompt
    packed, limit = context_prompt(loaded.model, loaded.tokenizer, question, files, chunk_tokens=chunk_tokens,
                                   max_new_tokens=max_new_tokens, budget_bytes=budget, auto=auto,
                                   summarize=summarize)
    err.print(f"context: {len(packed.used)} of {packed.total_chunks} chunks"
              + (" (summarized)" if packed.summarized else "") + f", prompt {packed.prompt_tokens:,} of "
              f"{limit:,} tokens the plan allows" + ("; " + "; ".join(packed.notes) if packed.notes else ""),
              markup=False, highlight=False)
    return packed.prompt


def _print_catalog(models: bool, gpus: bool) -> None:
    from vramguard.catalog.gpus import GPUS
    from vramguard.catalog.models import MODELS
    out = _console()
    if models:
        for name, cfg in MODELS.items():
            out.print(f"{name:18} {cfg['source']}")
    if gpus:
        for g in GPUS.values():
            cc = ".".join(map(str, g.compute_capability)) if g.compute_capability else "?"
            out.print(f"{g.name:18} {g.label:34} {g.total_bytes / 2**30:7.2f} GiB  cc {cc}")


# library warnings a vramguard command triggers but the user can do nothing about, matched by their start only:
# torch.profiler's note on schedules (check's kernel probe runs one cycle) and the deprecation of
# torch.distributed.reduce_op, read by libraries that scan torch.distributed's attributes
QUIET_WARNINGS = ((r"Warning: Profiler clears events at the end of each cycle", UserWarning),
                  (r"`torch\.distributed\.reduce_op` is deprecated", FutureWarning))


def quiet_known_warnings() -> None:
    """Ignore exactly the warnings in :data:`QUIET_WARNINGS`; every other warning still reaches stderr."""
    import warnings
    for message, category in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)


SIZE_OPTIONS = ("--vram", "--vram-budget", "--max-body-size")


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


def main() -> None:
    """Entry point: click's own usage errors (a wrong type, an unknown choice or option) are printed in the same
    two-line form as vramguard's errors, with exit code 2."""
    quiet_known_warnings()
    split = split_size(sys.argv[1:])
    if split:
        err.print("error " + split, markup=False, highlight=False)
        sys.exit(2)
    try:  # typer >= 0.20 vendors click as typer._click; older typer uses the click package
        import typer._click.exceptions as cx
    except ImportError:
        import click.exceptions as cx
    no_args, usage, abort = (getattr(cx, n, ()) for n in ("NoArgsIsHelpError", "UsageError", "Abort"))
    try:
        rc = app(standalone_mode=False)  # click returns the code of typer.Exit instead of raising it here
    except no_args as e:
        print(e.ctx.get_help() if e.ctx else str(e))
        rc = 0
    except usage as e:
        where = f"`vramguard {e.ctx.info_name} --help`" if e.ctx and e.ctx.info_name != "vramguard" else \
            "`vramguard --help`"
        msg = e.format_message().replace("Value error, ", "")
        err.print(f"error {msg}\nfix: see {where} for the accepted values", markup=False, highlight=False)
        rc = 2
    except typer.Exit as e:
        rc = e.exit_code
    except abort:
        rc = 130
    except BrokenPipeError:  # the reader (e.g. `| head`) went away: stop quietly
        import os
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        rc = 1
    sys.exit(rc if isinstance(rc, int) else 0)


if __name__ == "__main__":
    main()
