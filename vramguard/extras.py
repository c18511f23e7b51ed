"""The optional packages: for each import name, the extra of ``pyproject.toml`` that installs it and what needs
it. The one list: the CLI's missing-package message, serve's start check and the multi-card planner's check all
read it."""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.machinery
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


# modules that call torch.compile as they are imported, which imports TorchDynamo and Inductor on the spot (about
# 5 s of CPU on the 2-core machine, benchmarks/cpu_import_deferred.py): bitsandbytes 0.45-0.50's PyTorch kernels
# (``backends/default/ops.py``, ``_try_torch_compile``) and hqq's ``@torch.compile()`` methods, which
# transformers' ``cache_utils`` imports whenever hqq is installed, so every model load paid them
DEFERRED_COMPILE_MODULES = frozenset({"bitsandbytes.backends.default.ops", "hqq.core.quantize"})


@contextlib.contextmanager
def _deferred_torch_compile():
    """``torch.compile`` replaced, inside the block, by one that makes the real call at the compiled function's first
    call (the function's own errors and torch.compile's reach the caller of that call); restored on exit."""
    import torch  # the module being imported imports it first
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


class _DeferredCompileLoader(importlib.abc.Loader):
    """The loader of one of :data:`DEFERRED_COMPILE_MODULES`: the module's own, run with ``torch.compile`` deferred."""

    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:
        with _deferred_torch_compile():
            self.inner.exec_module(module)

    def __getattr__(self, name: str):  # get_source, get_filename...: the module's own loader's
        return getattr(self.inner, name)


class _DeferredCompileFinder(importlib.abc.MetaPathFinder):
    """Finds :data:`DEFERRED_COMPILE_MODULES` where Python's path finder does and gives them
    :class:`_DeferredCompileLoader`; every other module is left to the finders after it."""

    def find_spec(self, name, path, target=None):
        if name not in DEFERRED_COMPILE_MODULES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _DeferredCompileLoader(spec.loader)
        return spec


def defer_import_time_compiles() -> None:
    """Import :data:`DEFERRED_COMPILE_MODULES`, from now on in this process and by whoever imports them, with their
    ``torch.compile`` calls deferred to the compiled functions' first call (idempotent; imports nothing).

    ``torch.compile`` compiles nothing before that first call, so deferring the call itself changes only when
    TorchDynamo and Inductor are imported: at the first call of a compiled function, which on a CUDA device
    bitsandbytes (its CUDA kernels) and transformers' caches (hqq only for a quantized KV cache) may never make. An
    error then reaches the caller of that call, where bitsandbytes' own fallback runs the uncompiled function as it
    would have.
    """
    if not any(isinstance(f, _DeferredCompileFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _DeferredCompileFinder())


def import_bitsandbytes():
    """``import bitsandbytes`` (once imported, the module in ``sys.modules``) with its import-time notice about
    optional CPU kernels (logger ``bitsandbytes``) held back; its ``torch.compile`` calls are deferred by the finder
    that importing vramguard installs (:func:`defer_import_time_compiles`).

    Raises:
        ImportError: bitsandbytes is not installed (or fails to import).
    """
    if "bitsandbytes" in sys.modules:
        return sys.modules["bitsandbytes"]
    log = logging.getLogger("bitsandbytes")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        import bitsandbytes
    finally:
        log.setLevel(level)
    return bitsandbytes
