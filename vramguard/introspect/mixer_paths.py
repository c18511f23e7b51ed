"""The path the meta-device replay follows through a model's kernel-backed mixers (:mod:`vramguard.introspect.mixers`
says which those are and which path transformers takes): the reference PyTorch functions, their loops over chunks
cut once they repeat (:mod:`vramguard.introspect.loop_trim`), or the package kernels' memory on meta tensors.
Needs torch."""

from __future__ import annotations

import contextlib
import inspect

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_map

from vramguard.introspect.loop_trim import steady
from vramguard.introspect.mixers import KernelPath, kernel_functions, takes_kernel
from vramguard.introspect.tracker import StorageTracker


@contextlib.contextmanager
def replayed_paths(model, kernels: str | None):
    """While open, every kernel-backed function of ``model``'s modeling modules runs the path ``kernels`` names (see
    the module docstring): the reference PyTorch function, or its package kernel's memory model on meta tensors
    (:func:`_as_kernel`), its loops over chunks cut once they repeat
    (:func:`vramguard.introspect.loop_trim.steady`); restored on exit."""
    found = kernel_functions(model)
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
    replay's tracker (the shapes of its results; one with a loop, under a tracker of its own, so that its loop over
    chunks ends once it repeats: :mod:`vramguard.introspect.loop_trim`), then the kernel's own allocations are made
    under the tracker: the workspace of :data:`WORKSPACE` where the kernel has one there, else fresh outputs of the
    reference's shapes and dtypes (a kernel that writes its outputs and nothing else: ``causal_conv1d_fn``,
    ``selective_state_update``)."""
    reference, kernel = state["torch_function"], str(state["func_name"])
    signature = inspect.signature(reference)
    shapes = steady(reference)
    own = StorageTracker if shapes is not reference else contextlib.nullcontext  # a tracker costs each operator

    def run(*args, **kwargs):
        with _disable_current_modes(), own():
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
