"""The optional packages: for each import name, the extra of ``pyproject.toml`` that installs it and what needs
it. The one list: the CLI's missing-package message, serve's start check and the multi-card planner's check all
read it."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import sys

# import name -> (the extra that installs it, what needs it): "load" is every verb that builds or loads a model
# (plan's multi-card split, check's kernel, run, profile, fit, serve), "serve" the HTTP server; None is one feature
# that imports it where it runs (NF4 through bitsandbytes, a quantized KV cache through hqq, charts)
OPTIONAL_PACKAGES: dict[str, tuple[str, str | None]] = {
    "torch": ("gpu", "load"), "transformers": ("gpu", "load"), "accelerate": ("gpu", "load"),
    "safetensors": ("gpu", None), "bitsandbytes": ("gpu", None), "matplotlib": ("gpu", None),
    "hqq": ("gpu", None),
    "fastapi": ("serve", "serve"), "uvicorn": ("serve", "serve"), "sse_starlette": ("serve", "serve"),
    "prometheus_client": ("serve", "serve"), "httpx": ("serve", "serve"), "pydantic": ("serve", None),
}


def extra_of(module: str) -> str | None:
    """The extra that installs the top-level package of ``module`` (``"torch.cuda"`` -> ``"gpu"``), None when it
    is no optional package of vramguard's."""
    entry = OPTIONAL_PACKAGES.get(module.split(".")[0])
    return entry[0] if entry else None


def needed_by(use: str) -> tuple[str, ...]:
    """The import names ``use`` needs, in table order: ``"load"`` those of loading a model; ``"serve"`` those and
    the server's (``torch, transformers, accelerate, fastapi, uvicorn, sse_starlette, prometheus_client, httpx``).

    Raises:
        ValueError: ``use`` is neither ``"load"`` nor ``"serve"``.
    """
    if use not in ("load", "serve"):
        raise ValueError(f"use={use!r}: 'load' or 'serve'")
    wanted = ("load",) if use == "load" else ("load", "serve")
    return tuple(m for m, (_, need) in OPTIONAL_PACKAGES.items() if need in wanted)


def missing(use: str) -> list[str]:
    """The import names of :func:`needed_by` ``(use)`` that are not installed (found by
    ``importlib.util.find_spec``, nothing imported)."""
    return [m for m in needed_by(use) if importlib.util.find_spec(m) is None]


@contextlib.contextmanager
def _deferred_torch_compile():
    """``torch.compile`` replaced, inside the block, by one that makes the real call at the compiled function's first
    call (the function's own errors and torch.compile's reach the caller of that call); restored on exit."""
    import torch  # optional and heavy: only for a bitsandbytes import
    real = torch.compile

    def deferred(model=None, **options):
        if model is None:  # used as @torch.compile(...)
            return lambda fn: deferred(fn, **options)
        compiled = None

        @functools.wraps(model)
        def call(*args, **kwargs):
            nonlocal compiled
            if compiled is None:
                compiled = real(model, **options)
            return compiled(*args, **kwargs)
        return call

    torch.compile = deferred
    try:
        yield
    finally:
        torch.compile = real


def import_bitsandbytes():
    """``import bitsandbytes`` (the module; once imported, the one in ``sys.modules``) with its ``torch.compile``
    calls deferred to the compiled functions' first call, and its import-time notice about optional CPU kernels
    (logger ``bitsandbytes``) held back.

    bitsandbytes 0.45-0.50 wraps the PyTorch versions of its kernels in ``torch.compile`` as its module is imported
    (``bitsandbytes/backends/default/ops.py``, ``_try_torch_compile``), and ``torch.compile`` imports TorchDynamo and
    Inductor on the spot: most of the import's seconds (``benchmarks/cpu_import_bnb.py``), for kernels that run on
    the CPU only. ``torch.compile`` compiles nothing before the first call, so deferring the call itself changes only
    when those modules are imported; an error then reaches bitsandbytes' own fallback (the uncompiled function) as
    it would have at the call.

    Raises:
        ImportError: bitsandbytes is not installed (or fails to import).
    """
    if "bitsandbytes" in sys.modules:
        return sys.modules["bitsandbytes"]
    log = logging.getLogger("bitsandbytes")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        with _deferred_torch_compile():
            import bitsandbytes
    finally:
        log.setLevel(level)
    return bitsandbytes
