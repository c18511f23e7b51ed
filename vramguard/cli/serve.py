"""``vramguard serve``: an OpenAI-compatible server on one device, or one worker per GPU behind a router (over
:func:`vramguard.serve.server.build` and :func:`vramguard.serve.router.run_router`)."""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from enum import Enum
from typing import List, Optional

import typer

from vramguard.allocconf import prefer_expandable_segments
from vramguard.cli.common import install_fix, run_guarded, say, size_option
from vramguard.cli.flags import as_flags
from vramguard.cli.options import DtypeArg, LoadAttn, Quant, strip_options
from vramguard.errors import InvalidValue
from vramguard.extras import missing as missing_packages
from vramguard.resolve import local_model_folder
from vramguard.runtime.load import default_quant
from vramguard.serve.config import ENGINES, ServeConfig
from vramguard.units import parse_size, plural

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
ServeEngine = Enum("ServeEngine", {v: v for v in ENGINES}, type=str)
# options the router sets for its workers itself; the rest of the command line is passed on to each worker
ROUTER_OPTIONS = ("--gpus", "--host", "--port", "--api-key", "--ready-file", "--allowed-host")


# the longer option texts of serve (--help)
HELP = {
    "gpus": ('GPU indices, e.g. 0 or 0,1: one worker process per GPU behind a front process that balances them and '
             'answers 429 itself (default: one process on the current device)'),
    "vram_budget": ('memory PyTorch may use per GPU, e.g. 20GiB, enforced as a hard cap on this process (default: what'
                    ' is free after loading); without a GPU, host memory for the model and its KV pool (default: '
                    '2GiB for the pool, the weights on top)'),
    "allowed_host": ('without --api-key: a name clients reach this server by, beyond localhost and IP addresses '
                     '(.example.com: every name under it); repeat for several. Other Host and Origin values are '
                     'refused (against DNS rebinding)'),
    "engine": ("continuous: transformers' continuous batching (paged KV pool, many requests per step); generate: the "
               "model's own generate, one request at a time, for any architecture; auto: continuous where it runs the "
               'model, else generate (the start log says which and why)'),
    "deterministic": ("one request per step: a request's text does not depend on the others in the batch (throughput "
                      'falls with the requests running; temperature 0 is reproducible without it)'),
    "api_key": ("require 'Authorization: Bearer KEY' on every route but /health (or set VRAMGUARD_API_KEY)"),
    "greedy": ('decode every request greedily (no sampling work in the step); requests asking for temperature > 0 are '
               'refused'),
}


def serve(
    model: str = typer.Argument(..., metavar="MODEL",
                                 help="model folder or cached model id (weights and tokenizer needed)"),
    host: str = typer.Option("127.0.0.1", help="address to bind (loopback unless you choose otherwise)"),
    port: int = typer.Option(8000, help="TCP port (0 picks a free one)"),
    gpus: Optional[str] = typer.Option(None, help=HELP["gpus"]),
    vram_budget: Optional[str] = typer.Option(None, help=HELP["vram_budget"]),
    max_queue: int = typer.Option(64, help="requests that may wait beyond those running; more get 429"),
    max_running: int = typer.Option(64, help="requests computed together in one step"),
    max_batch_tokens: int = typer.Option(2048, help="tokens computed in one step (prefill chunks + decodes)"),
    page_size: int = typer.Option(256, help="tokens per KV block"),
    max_kv_blocks: Optional[int] = typer.Option(None, help="cap the KV pool below what the budget allows"),
    api_key: Optional[str] = typer.Option(None, envvar="VRAMGUARD_API_KEY",
                                          help=HELP["api_key"]),
    allowed_host: Optional[List[str]] = typer.Option(None, help=HELP["allowed_host"]),
    quant: Optional[Quant] = typer.Option(None, help="weight format (default: nf4 on a CUDA device; float32 "
                                                       "without one: exact)"),
    dtype: Optional[DtypeArg] = typer.Option(None, help="parameter/activation dtype (default: bf16 where supported)"),
    attn: LoadAttn = typer.Option(LoadAttn['auto'], help="attention implementation (auto: the best that runs here)"),
    trust_remote_code: bool = typer.Option(False, help="allow the model's own Python code (off: never run it)"),
    allow_pickle: bool = typer.Option(False, help="allow pickle (.bin) weights (off: safetensors only)"),
    seed: int = typer.Option(0, help="sampling seed of the engine"),
    served_model_name: Optional[str] = typer.Option(None, help="the model name clients send and see (default: the "
                                                               "folder's name, or MODEL's id)"),
    n_max: int = typer.Option(4, help="largest n (choices per request)"),
    default_max_tokens: int = typer.Option(256, help="max_tokens of a request that gives none"),
    max_body_size: str = typer.Option("1MiB", help="largest request body; more gets 413"),
    engine: ServeEngine = typer.Option(ServeEngine["auto"], help=HELP["engine"]),
    greedy: bool = typer.Option(False, help=HELP["greedy"]),
    deterministic: bool = typer.Option(False, help=HELP["deterministic"]),
    ready_file: Optional[str] = typer.Option(None, hidden=True, help="write the URL here once listening"),
) -> None:
    """Serve the model over an OpenAI-compatible API (/v1/chat/completions, /v1/completions, /v1/models, /health,
    /metrics) with a KV pool sized for the budget, a bounded queue, and recovery from out-of-memory errors."""
    require_serve_packages()
    listening = announcer(ready_file, served_model_name or model)

    def start() -> int:
        from vramguard.serve.apierrors import word_messages_with  # fastapi: loaded when serve runs
        previous = word_messages_with(as_flags)  # the clients of a server started here read its options
        try:
            return serve_from_here()
        finally:
            word_messages_with(previous)

    def serve_from_here() -> int:
        budget = size_option(vram_budget, "vram_budget") if vram_budget else None
        body = parse_size(max_body_size, "--max-body-size", example="1MiB")
        check_address(host, port, api_key)
        local_model_folder(model)  # a missing or unreadable model is said before torch is imported
        _allocator_note()
        if gpus is not None:
            return serve_router(model, gpu_ids(gpus), host, port, api_key, listening, max_body_bytes=body,
                                allowed_hosts=tuple(allowed_host or ()))
        config = ServeConfig(vram_budget=budget, max_queue=max_queue, max_running=max_running,
                             max_batch_tokens=max_batch_tokens, page_size=page_size, max_kv_blocks=max_kv_blocks,
                             api_key=api_key, quant=quant.value if quant is not None else None,
                             dtype=dtype.value if dtype and dtype.value != "auto" else None, attn=attn.value,
                             trust_remote_code=trust_remote_code, allow_pickle=allow_pickle, seed=seed,
                             served_name=served_model_name, n_max=n_max, default_max_tokens=default_max_tokens,
                             max_body_bytes=body, greedy=greedy, hard_cap=True, engine_choice=engine.value,
                             deterministic=deterministic, allowed_hosts=tuple(allowed_host or ()))
        return serve_one(model, host, port, listening, config)

    rc = run_guarded(start)
    if rc:
        say(f"stopped after an unrecoverable error (exit code {rc})")
    raise typer.Exit(rc or 0)


def _served_counts(metrics) -> str:
    """``"; 3 completions, 8 refused, failed or cancelled, 120 tokens generated"`` from the server's
    :class:`~vramguard.serve.metrics.Metrics` (its request counter counts each choice of a request as one
    completion, each refusal once); empty without them."""
    if metrics is None:
        return ""
    by = metrics.requests_by_outcome()
    done = by.get("completed", 0)
    rest = sum(by.values()) - done
    return (f"; {plural(done, 'completion')}" + (f", {rest:,} refused, failed or cancelled" if rest else "")
            + f", {plural(metrics.generated_tokens(), 'token')} generated")


def require_serve_packages() -> None:
    """Exit 3 naming the packages serve imports (:func:`vramguard.extras.needed_by`) that are not installed, and
    the command that installs them; checked before anything is loaded."""
    missing = missing_packages("serve")
    if missing:
        say(f"error serve: {', '.join(missing)} not installed.\nfix: " + install_fix("serve,gpu", "torch" in missing))
        raise typer.Exit(3)


def announcer(ready_file: str | None, name: str):
    """The ``on_listen`` callback: writes the URL to ``ready_file`` (atomically) and says where ``name`` is
    served."""
    def listening(url: str) -> None:
        if ready_file:
            with open(ready_file + ".tmp", "w") as f:
                f.write(url)
            os.replace(ready_file + ".tmp", ready_file)
        say(f"serving {name} on {url}/v1")
    return listening


def check_address(host: str, port: int, api_key: str | None) -> None:
    """Before minutes of loading: a bad or busy port is known now; an open address without a key is warned of."""
    from vramguard.serve.connections import check_bind  # asyncio: loaded when serve runs, not at the CLI's start
    check_bind(host, port)
    if host not in LOOPBACK_HOSTS and not api_key:
        say(f"warning: binding {host} without --api-key: anyone who can reach this address can use the model")


def gpu_ids(gpus: str) -> list[int]:
    """The ``--gpus`` indices: distinct GPUs this machine has.

    Raises:
        InvalidValue: not comma-separated integers, repeated, or beyond the visible CUDA devices.
    """
    try:
        ids = [int(x) for x in gpus.split(",") if x.strip()]
    except ValueError:
        raise InvalidValue("gpus", gpus, "comma-separated GPU indices, e.g. 0,1", "pass --gpus 0,1") from None
    import torch
    n = torch.cuda.device_count()
    if not ids or any(i < 0 or i >= n for i in ids) or len(set(ids)) != len(ids):
        raise InvalidValue("gpus", gpus, f"distinct indices in 0..{n - 1}" if n else "none: no CUDA GPU "
                           "is visible", "pass indices of GPUs this machine has (nvidia-smi -L lists them)")
    return ids


def serve_router(model: str, ids: list[int], host: str, port: int, api_key: str | None, listening,
                 **limits) -> int:
    """One worker per GPU in ``ids``, each given this command line less :data:`ROUTER_OPTIONS`, behind the
    router (``limits``: :func:`~vramguard.serve.router.run_router`'s body size and allowed hosts); returns its
    exit code."""
    from vramguard.serve.router import run_router  # fastapi, httpx: loaded when serve runs
    args = [a for a in sys.argv[sys.argv.index("serve") + 2:]]
    args = strip_options(args, ROUTER_OPTIONS)
    return run_router(model, ids, args, host, port, api_key, on_listen=listening, **limits)


def serve_one(model: str, host: str, port: int, listening, config: ServeConfig) -> int:
    """Build the server of ``model`` in this process (:func:`vramguard.serve.server.build`), say what was loaded,
    and serve until stopped; returns its exit code. ``config.quant`` None: NF4 on a CUDA device, float32 weights
    without one (said)."""
    import transformers

    from vramguard.serve.server import build  # fastapi, uvicorn: loaded when serve runs
    transformers.utils.logging.disable_progress_bar()
    if config.quant is None:  # as run: NF4 on a CUDA device, float32 weights without one (said)
        import torch
        quant, why = default_quant(torch.cuda.is_available())
        config = replace(config, quant=quant)
        say(f"note: weights {quant}: {why}")
    served = build(model, config)
    a = served.report.active if served.report is not None else {}
    say("loaded: " + ", ".join(f"{k} {a[k]}" for k in ("quant", "compute_dtype", "dtype", "attn", "device")
                               if a.get(k) not in (None, "None") and (k, a[k]) != ("quant", "none")))
    say(served.pool.summary())
    for note in served.engine.notes + served.options.notes:
        say("note: " + note)
    rc = served.run(host, port, on_listen=listening)
    if rc == 0:  # an error stop says its own line (run_guarded)
        say("stopped: Ctrl-C or SIGTERM" + _served_counts(getattr(served.engine, "metrics", None)))
    # the interpreter's exit collects every object of the loaded model and libraries (seconds on a busy machine,
    # past SIGTERM's 5 s grace); they are about to be freed with the process, so the collector skips them
    import gc
    gc.freeze()
    return rc


def _allocator_note() -> None:
    """Expandable segments for this process unless the user set the allocator (see :mod:`vramguard.allocconf`)."""
    note = prefer_expandable_segments()
    if note:
        say(note)
