"""Which implementation each mixer with several of them runs, as transformers decides it, and the path the meta-device
replay follows. Knows nothing about memory.

transformers picks a Mamba / Mamba-2 scan, a causal convolution or a linear-attention (gated delta rule) kernel once,
when the modeling module is imported (``use_kernel_func_from_hub_with_fallback`` in
``transformers/integrations/hub_kernels.py``): the package's kernel (``mamba_ssm``, ``causal_conv1d``, ``fla``) where
that package imports, else the module's own reference PyTorch function, which ``generate`` then runs on the GPU too.
The two differ in memory by orders of magnitude: the reference Mamba-2 chunked scan materializes float32 tensors of
``tokens x chunk x heads x d_state`` (transformers 5.17: ``(C[..., None, :, :] * B[..., None, :, :, :]).sum(-1)``)
where the fused kernel keeps one chunk's state.

The replay traces the reference path (a kernel cannot run on meta tensors; where one is installed,
:func:`reference_paths` swaps the reference function in for the replay), so a plan is the reference path's, of the
transformers version installed where it runs, and says so (:func:`kernel_paths`, the plan's ``mixer_path``
finding).
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class KernelPath:
    """One kernel-backed function of a model's forward.

    ``function``: its name in transformers' modeling module (``mamba2_chunk_scan``); ``kernel``: the kernel's name in
    its package (``mamba_chunk_scan_combined``); ``package``: that package (``mamba_ssm``); ``kernel_installed``:
    whether transformers bound the package's kernel here (else its reference PyTorch function runs)."""

    function: str
    kernel: str
    package: str
    kernel_installed: bool


def _closure(fn) -> dict:
    """The free variables of ``fn`` that transformers' fallback wrapper closes over, by name ({} for another
    function)."""
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None)
    if code is None or not cells:
        return {}
    try:
        return {name: cell.cell_contents for name, cell in zip(code.co_freevars, cells)}
    except ValueError:  # an empty cell
        return {}


def _wrapped(fn) -> dict | None:
    """The fallback wrapper's state (``package``, ``func_name``, ``torch_function``, ``is_new_implementation``) of
    ``fn`` or of a function it wraps; None for a function transformers did not wrap so."""
    for _ in range(4):
        cells = _closure(fn)
        if {"package", "func_name", "torch_function", "is_new_implementation"} <= cells.keys():
            return cells
        fn = getattr(fn, "__wrapped__", None)
        if fn is None:
            return None
    return None


def _modules(model) -> list:
    """The modeling modules of ``model``'s classes (its own and its submodules'), each once."""
    names = dict.fromkeys(type(m).__module__ for m in model.modules())
    return [sys.modules[n] for n in names if n.startswith("transformers.") and n in sys.modules]


def _functions(model) -> list[tuple[object, str, dict]]:
    """(module, global name, wrapper state) of every kernel-backed function in ``model``'s modeling modules."""
    found = []
    for module in _modules(model):
        for name, value in list(vars(module).items()):
            if callable(value) and (state := _wrapped(value)) is not None:
                found.append((module, name, state))
    return found


def kernel_paths(model) -> tuple[KernelPath, ...]:
    """Every kernel-backed function of ``model``'s forward (see the module docstring), in module order; () for a
    model without one (attention and MLP only)."""
    return tuple(KernelPath(name, str(state["func_name"]), str(state["package"]),
                            bool(state["is_new_implementation"])) for _, name, state in _functions(model))


@contextlib.contextmanager
def reference_paths(model):
    """While open, the modeling modules of ``model`` call the reference PyTorch function wherever transformers bound
    a package's kernel (which cannot run on meta tensors); restored on exit."""
    swapped = [(module, name, vars(module)[name]) for module, name, state in _functions(model)
               if state["is_new_implementation"]]
    try:
        for module, name, state in ((m, n, _wrapped(f)) for m, n, f in swapped):
            setattr(module, name, state["torch_function"])
        yield
    finally:
        for module, name, fn in swapped:
            setattr(module, name, fn)


def describe(paths: tuple[KernelPath, ...], transformers_version: str) -> str | None:
    """The plan's words for ``paths`` (None without any): which path was replayed and what runs where."""
    if not paths:
        return None
    by_package: dict[str, list[KernelPath]] = {}
    for p in paths:
        by_package.setdefault(p.package, []).append(p)
    parts = []
    for package, ps in by_package.items():
        kernels = ", ".join(dict.fromkeys(p.kernel for p in ps))
        state = "installed here" if any(p.kernel_installed for p in ps) else "not installed here"
        parts.append(f"{kernels} ({package}, {state})")
    return (f"replayed transformers {transformers_version}'s reference PyTorch path of {'; '.join(parts)}, which "
            "generate runs where those packages are missing (with them, their CUDA kernels run: less memory); its "
            "memory changes with the transformers version (5.17's Mamba-2 chunked scan holds float32 products of "
            "tokens x chunk x heads x d_state, which 5.24 contracts with einsum)")
