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
(:func:`_as_kernel`: its outputs, and for ``mamba_chunk_scan_combined`` its workspace, as mamba_ssm allocates them);
``installed`` (or None), what transformers bound in this process (a kernel where its package imports here, else the
reference). A CUDA kernel itself cannot run on meta tensors, so a bound kernel is always replaced for the replay
(:func:`replayed_paths`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
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


def installed_packages() -> tuple[str, ...]:
    """The packages of :data:`KERNEL_PACKAGES` importable in this process (found, not imported: about 1 ms)."""
    return tuple(p for p in KERNEL_PACKAGES if importlib.util.find_spec(p) is not None)


def takes_kernel(path: KernelPath, kernels: str | None) -> bool:
    """Whether the replay for the settings' ``kernels`` models ``path``'s package kernel (else its reference)."""
    return kernels == "fast" or (kernels in (None, "installed") and path.kernel_installed)


@contextlib.contextmanager
def replayed_paths(model, kernels: str | None):
    """While open, every kernel-backed function of ``model``'s modeling modules runs the path ``kernels`` names (see
    the module docstring): the reference PyTorch function, or its package kernel's memory model on meta tensors
    (:func:`_as_kernel`), its loops over chunks cut once they repeat
    (:func:`vramguard.introspect.loop_trim.steady`); restored on exit."""
    from vramguard.introspect.loop_trim import steady  # torch: kept off the plan's fast path, as below
    found = _functions(model)
    bound = [vars(module)[name] for module, name, _ in found]
    try:
        for module, name, state in found:
            path = KernelPath(name, str(state["func_name"]), str(state["package"]),
                              bool(state["is_new_implementation"]))
            setattr(module, name,
                    _as_kernel(state) if takes_kernel(path, kernels) else steady(state["torch_function"]))
        yield
    finally:
        for (module, name, _), fn in zip(found, bound):
            setattr(module, name, fn)


def reference_paths(model):
    """:func:`replayed_paths` on the reference PyTorch path (``kernels='torch'``)."""
    return replayed_paths(model, "torch")


def _as_kernel(state: dict):
    """A stand-in for the package kernel of ``state`` on meta tensors: the reference function runs apart from the
    replay's tracker (the shapes of its results; under a tracker of its own, so that its loop over chunks ends once
    it repeats: :mod:`vramguard.introspect.loop_trim`), then the kernel's own allocations are made under the tracker: the workspace of
    :data:`WORKSPACE` where the kernel has one there, else fresh outputs of the reference's shapes and dtypes (a
    kernel that writes its outputs and nothing else: ``causal_conv1d_fn``, ``selective_state_update``)."""
    import torch
    from torch.utils._python_dispatch import _disable_current_modes
    from torch.utils._pytree import tree_map

    from vramguard.introspect.loop_trim import steady
    from vramguard.introspect.tracker import StorageTracker
    reference, kernel = state["torch_function"], str(state["func_name"])
    signature = inspect.signature(reference)
    shapes = steady(reference)

    def run(*args, **kwargs):
        with _disable_current_modes(), StorageTracker():
            out = shapes(*args, **kwargs)
        if kernel in WORKSPACE:
            return WORKSPACE[kernel](signature.bind(*args, **kwargs).arguments, out)
        return tree_map(lambda t: torch.empty_like(t) if isinstance(t, torch.Tensor) else t, out)
    return run


def _mamba_chunk_scan_combined(arguments: dict, out):
    """mamba_ssm's ``_mamba_chunk_scan_combined_fwd`` (``mamba_ssm/ops/triton/ssd_combined.py``, v2.2) on meta
    tensors, allocation by allocation: ``dA_cumsum`` and ``dt`` (batch, heads, chunks, chunk) float32
    (``_chunk_cumsum_fwd``); the chunk states (batch, chunks, heads, head_dim, d_state) float32
    (``_chunk_state_fwd(states_in_fp32=True)``); the passed states in C's dtype and the final states float32
    (``_state_passing_fwd``), after which the float32 chunk states are dropped; ``CB`` (batch, chunks, groups, chunk,
    chunk) float32 (``_bmm_chunk_fwd``); the output (batch, tokens, heads, head_dim) in x's dtype
    (``_chunk_scan_fwd``). Returns what the reference returns (the output, with the final states where asked)."""
    import torch
    x, B, C, chunk = arguments["hidden_states"], arguments["B"], arguments["C"], int(arguments["chunk_size"])
    batch, tokens, heads, head_dim = x.shape
    groups, d_state = B.shape[2], B.shape[3]
    chunks = -(-tokens // chunk)
    meta, f32 = x.device, torch.float32
    d_a_cumsum = torch.empty((batch, heads, chunks, chunk), dtype=f32, device=meta)
    dt = torch.empty((batch, heads, chunks, chunk), dtype=f32, device=meta)
    states = torch.empty((batch, chunks, heads, head_dim, d_state), dtype=f32, device=meta)
    passed = torch.empty((batch, chunks, heads, head_dim, d_state), dtype=C.dtype, device=meta)
    final = torch.empty((batch, heads, head_dim, d_state), dtype=f32, device=meta)
    del states
    cb = torch.empty((batch, chunks, groups, chunk, chunk), dtype=f32, device=meta)
    y = torch.empty((batch, tokens, heads, head_dim), dtype=x.dtype, device=meta)
    del d_a_cumsum, dt, passed, cb
    return (y, final) if isinstance(out, tuple) else y


WORKSPACE = {"mamba_chunk_scan_combined": _mamba_chunk_scan_combined}


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
