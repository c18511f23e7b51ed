"""Which attention kernel actually ran: a short forward under the PyTorch profiler, classified by op and kernel
names.

ATen op names (CPU side of the profile) name the SDPA backend that dispatched; CUDA kernel names tell the rest
(flash_attn's own ``flash::flash_fwd_kernel`` against PyTorch's copy ``pytorch_flash::flash_fwd_kernel``; cuDNN's
``cudnn_generated_fort_native_sdpa_*``; the memory-efficient ``fmha_cutlassF_*``). A softmax kernel with no fused
attention op means the score matrix was materialized (eager, or SDPA's math backend). Reference names seen on an
H200 with torch 2.11: ``cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128_...`` for
plain sdpa and ``softmax_warp_forward<float, float, float, ...>`` for eager (measured on an H200).
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from dataclasses import dataclass, field

# kind -> (label, flash-class, ATen op patterns, CUDA kernel patterns); checked in this order
KINDS: list[tuple[str, str, bool, tuple[str, ...], tuple[str, ...]]] = [
    ("flash_attn_fa2", "flash_attn FlashAttention-2", True,
     (r"^flash_attn::", r"_flash_attn_forward", r"flash_attn_2_cuda", r"FlashAttnFunc"),
     (r"(?<!pytorch_)flash::flash_fwd", r"^flash_fwd_kernel")),
    ("sdpa_flash", "SDPA flash (PyTorch's FlashAttention-2 kernel)", True,
     (r"aten::_scaled_dot_product_flash_attention$", r"aten::_flash_attention_forward"),
     (r"pytorch_flash::",)),
    ("sdpa_cudnn", "SDPA cuDNN fused flash attention", True,
     (r"aten::_scaled_dot_product_cudnn_attention",), (r"cudnn.*sdpa", r"cudnn.*fprop.*flash")),
    ("sdpa_efficient", "SDPA memory-efficient attention", True,
     (r"aten::_scaled_dot_product_efficient_attention", r"aten::_efficient_attention_forward"),
     (r"fmha_cutlassF", r"efficient_attention")),
    ("sdpa_cpu_flash", "SDPA flash attention for CPU", True,
     (r"aten::_scaled_dot_product_flash_attention_for_cpu",), ()),
    ("sdpa_math", "SDPA math backend (score matrix materialized, float32)", False,
     (r"aten::_scaled_dot_product_attention_math",), ()),
    ("eager_softmax", "eager attention: float32 softmax over the full score matrix", False,
     (r"^aten::_softmax$",), (r"softmax_warp_forward", r"cunn_SoftMaxForward", r"SoftMax")),
]
LABELS = {k: label for k, label, *_ in KINDS}
FLASH_CLASS = {k for k, _, fc, *_ in KINDS if fc}
EXPECTED = {"flash_attention_2": {"flash_attn_fa2"},
            "sdpa": {"sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "sdpa_cpu_flash", "sdpa_math"},
            "eager": {"eager_softmax"}}
PINNED = {"flash": {"sdpa_flash"}, "cudnn": {"sdpa_cudnn"}, "efficient": {"sdpa_efficient"}, "math": {"sdpa_math"}}


@dataclass(frozen=True)
class AttentionKernel:
    """The attention path that ran: ``kind`` (a key of :data:`LABELS`), its label and the names that show it."""

    kind: str | None
    label: str
    flash_class: bool
    evidence: tuple[str, ...] = field(default=())
    requested: str = ""
    matches_request: bool = True
    reason: str = ""


def classify(op_names: list[str], kernel_names: list[str], requested: str = "",
             pinned: str | None = None) -> AttentionKernel:
    """Name the attention path from profiler op and kernel names, and compare with what was requested.

    ``requested`` is the attn_implementation (eager / sdpa / flash_attention_2); ``pinned`` an SDPA backend the
    caller forced (flash / cudnn / efficient / math). A fused kernel wins over a softmax: a softmax alone means
    the scores were materialized.
    """
    found: list[tuple[str, tuple[str, ...]]] = []
    for kind, _label, _fc, op_pats, k_pats in KINDS:
        ev = tuple(sorted({n for n in op_names if any(re.search(p, n) for p in op_pats)}
                          | {n[:120] for n in kernel_names if any(re.search(p, n) for p in k_pats)}))
        if ev:
            found.append((kind, ev))
    kinds = [k for k, _ in found]
    fused = [k for k in kinds if k != "eager_softmax"]
    kind = fused[0] if fused else (kinds[0] if kinds else None)
    # SDPA's math backend also runs aten::_softmax; name it math, not eager
    if kind == "sdpa_math" or (kind == "eager_softmax" and "sdpa_math" in kinds):
        kind = "sdpa_math"
    ev = dict(found).get(kind, ())
    if kind is None:
        return AttentionKernel(None, "no attention kernel seen", False, (), requested, False,
                               "the profile holds no attention op or kernel")
    expected = PINNED.get(pinned or "", EXPECTED.get(requested, set()))
    ok = not expected or kind in expected
    if requested == "sdpa" and not pinned and kind == "sdpa_math":
        ok, why = False, "SDPA fell back to its math backend: the score matrix is materialized"
    elif ok:
        why = f"{LABELS[kind]} ran, as requested ({requested}{f', pinned to {pinned}' if pinned else ''})"
    else:
        want = ", ".join(LABELS[k] for k in sorted(expected))
        why = f"asked for {requested}{f' pinned to {pinned}' if pinned else ''} ({want}) but {LABELS[kind]} ran"
    return AttentionKernel(kind, LABELS[kind], kind in FLASH_CLASS, ev, requested, ok, why)


_KINETO_LINE = re.compile(r"^(USDT|STAGE):\d{4}-\d\d-\d\d [\d:]+ \d+:\d+ \w*ActivityProfiler\w*\.cpp:\d+\]")


@contextlib.contextmanager
def kineto_lines_filtered():
    """PyTorch's profiler backend (Kineto) prints ``USDT: ... profiler_start`` / ``profiler_stop`` lines straight
    to the process's stderr (file descriptor 2) at each profile, which the verification of every load would show
    the user. For the duration, fd 2 goes to a temporary file; afterwards everything written there except those
    lines is written back to stderr, in order."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no usable fd 2: nothing to filter
        yield
        return
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            try:
                sys.stderr.flush()
            finally:
                os.dup2(saved, 2)
                os.close(saved)
            tmp.seek(0)
            kept = [ln for ln in tmp.read().splitlines(keepends=True)
                    if not _KINETO_LINE.match(ln.decode("utf-8", "replace"))]
            if kept:
                os.write(2, b"".join(kept))


def profile_attention(model, requested: str, pinned: str | None = None, seq_len: int = 256) -> AttentionKernel:
    """Run one forward of ``seq_len`` random tokens under the profiler and classify the attention path.

    The model stays as it is (no setting is changed); the input goes to the device of its first parameter.
    Raises whatever the forward raises (a kernel that cannot run is the finding the caller reports).
    """
    import torch
    from torch.profiler import ProfilerActivity, profile

    device = next(model.parameters()).device
    vocab = int(getattr(model.config, "vocab_size", 1000) or 1000)
    ids = torch.randint(0, max(vocab - 1, 1), (1, seq_len), device=device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with kineto_lines_filtered(), torch.no_grad(), profile(activities=activities) as prof:
        model(input_ids=ids, use_cache=False)
        if device.type == "cuda":
            torch.cuda.synchronize()
    ops, kernels = set(), set()
    for e in prof.events():
        dev = str(getattr(e, "device_type", "")).lower()
        (kernels if "cuda" in dev else ops).add(e.name)
    return classify(sorted(ops), sorted(kernels), requested, pinned)
