"""Which implementation each mixer with several of them runs, as transformers decides it, and the path the meta-device
replay follows. Knows nothing about the plan's components.

transformers picks a Mamba / Mamba-2 scan, a causal convolution or a linear-attention (gated delta rule) kernel once,
when the modeling module is imported (``use_kernel_func_from_hub_with_fallback`` in
``transformers/integrations/hub_kernels.py``): the package's kernel (``mamba_ssm``, ``causal_conv1d``, ``fla``) where
that package imports, else the module's own reference PyTorch function, which ``generate`` then runs on the GPU too.
The two differ in memory by orders of magnitude: the reference Mamba-2 chunked scan materializes float32 tensors of
``tokens x chunk x heads x d_state`` (transformers 5.17: ``(C[..., None, :, :] * B[..., None, :, :, :]).sum(-1)``)
where the fused kernel keeps one chunk's state.

The replay follows one of three paths (:data:`KERNELS`, the settings' ``kernels``): ``torch``, every reference
function traced op by op; ``fast``, every package kernel, whose memory is modelled on meta tensors
(:func:`vramguard.introspect.mixer_paths._as_kernel`: its outputs, and for ``mamba_chunk_scan_combined`` its
workspace, as mamba_ssm allocates them);
``installed`` (or None), what transformers bound in this process (a kernel where its package imports here, else the
reference). A CUDA kernel itself cannot run on meta tensors, so a bound kernel is always replaced for the replay
(:func:`vramguard.introspect.mixer_paths.replayed_paths`, which needs torch: this module does not).
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass

from vramguard.settings import KERNELS  # noqa: F401 - the paths named in the module docstring

# the packages whose kernels transformers binds in place of its reference functions
KERNEL_PACKAGES = ("mamba_ssm", "causal_conv1d", "fla")


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


def kernel_functions(model) -> list[tuple[object, str, dict]]:
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
                            bool(state["is_new_implementation"])) for _, name, state in kernel_functions(model))


def installed_packages() -> tuple[str, ...]:
    """The packages of :data:`KERNEL_PACKAGES` importable in this process (found, not imported: about 1 ms)."""
    return tuple(p for p in KERNEL_PACKAGES if importlib.util.find_spec(p) is not None)


def takes_kernel(path: KernelPath, kernels: str | None) -> bool:
    """Whether the replay for the settings' ``kernels`` models ``path``'s package kernel (else its reference)."""
    return kernels == "fast" or (kernels in (None, "installed") and path.kernel_installed)


def describe(paths: tuple[KernelPath, ...], transformers_version: str, kernels: str | None,
             why: str) -> str | None:
    """The plan's words for ``paths`` replayed on the path ``kernels`` (None without any path), and ``why``."""
    if not paths:
        return None
    by_package: dict[str, list[KernelPath]] = {}
    for p in paths:
        by_package.setdefault(p.package, []).append(p)
    kernel: list[str] = []
    reference: list[str] = []
    for package, ps in by_package.items():
        names = f"{', '.join(dict.fromkeys(p.kernel for p in ps))} ({package})"
        (kernel if any(takes_kernel(p, kernels) for p in ps) else reference).append(names)
    parts = []
    if reference:
        parts.append(f"transformers {transformers_version}'s reference PyTorch path of {'; '.join(reference)}, which "
                     "generate runs where those packages are missing; its memory changes with the transformers "
                     "version (5.17's Mamba-2 chunked scan holds float32 products of tokens x chunk x heads x d_state, "
                     "which 5.24 contracts with einsum)")
    if kernel:
        parts.append(f"the package kernels {'; '.join(kernel)}, modelled on meta tensors (their outputs, and the "
                     "workspace mamba_ssm allocates in mamba_chunk_scan_combined)")
    return f"replayed {' and '.join(parts)}: {why}"
