"""``explain``: read a CUDA out-of-memory message and say what kind of problem it is, with the evidence and the fix.

Message formats (c10/cuda/CUDACachingAllocator.cpp):

* PyTorch >= 2.1: ``CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 8.00 GiB of
  which 0 bytes is free. [Process 1234 has 1.20 GiB memory in use.] Including non-PyTorch memory, this process has
  7.29 GiB memory in use. [24.00 GiB allowed;] Of the allocated memory 6.63 GiB is allocated by PyTorch, and
  675.84 MiB is reserved by PyTorch but unallocated. ...`` (2.1 printed "capacty");
* PyTorch 1.x / 2.0: ``CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 8.00 GiB total capacity; 6.63 GiB
  already allocated; 0 bytes free; 7.29 GiB reserved in total by PyTorch)``; before 1.5 the last field was
  ``... MiB cached``.

Classification, in this order (a request larger than the whole card is never called fragmentation):

1. ``algorithmic``: the single request exceeds what the process may use (the card, or the per-process cap): an
   allocation that cannot fit on any state of the allocator (eager attention scores, full-prompt logits...).
2. ``fragmentation``: reserved-but-unallocated memory is at least the request, or at least half of it and,
   with the memory still free to the process (the card's free memory, under a per-process cap the cap less what
   PyTorch reserved), all of it: the bytes exist but not as one block (PyTorch frees its cached segments and
   retries ``cudaMalloc`` before it raises, ``CUDACachingAllocator.cpp`` ``release_cached_blocks``, so what stays
   unallocated is split inside segments still in use).
3. ``other_processes``: other processes hold at least the request and at least 1 GiB (the card's use minus
   what the message says this process holds).
4. ``algorithmic``: one request of at least a quarter of the usable memory.
5. ``steady_growth``: a small request on a full card: memory grew until it ran out (KV cache, activations).

Four other messages mean the same shortage and are recognised by their own text (:func:`_other_messages`):
an out-of-memory error from CUDA itself, outside PyTorch's caching allocator (``CUDA error: out of memory``,
NCCL's ``Cuda failure 'out of memory'``..., :data:`CUDA_ERROR_MARKERS`), which carries no memory figures;
cuBLAS failing to create its handle or workspace (``CUBLAS_STATUS_ALLOC_FAILED``, or
``CUBLAS_STATUS_NOT_INITIALIZED when calling cublasCreate(handle)``: the cuBLAS documentation of ``cublasCreate``
gives that status when the CUDA runtime's initialization for the handle failed, which a full card causes; a run
does not retry on it, see :data:`vramguard.runtime.device.OOM_MARKERS`), Apple's
MPS backend out of
memory (``MPS backend out of memory (MPS allocated: ..., other allocations: ..., max allowed: ...)``, sizes that
its allocator prints in 1024-based units), and accelerate/transformers refusing a quantized model whose
``device_map`` put modules on the CPU or the disk (``Some modules are dispatched on the CPU or the disk``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from vramguard.errors import InvalidValue
from vramguard.memory.forward import logits_bytes
from vramguard.memory.kv import kv_tensor_bytes
from vramguard.memory.runtime import CUDA_CONTEXT_BYTES
from vramguard.units import GiB, KiB, MiB, TiB, fmt_bytes, plural

_UNIT = {"bytes": 1, "B": 1, "KiB": KiB, "MiB": MiB, "GiB": GiB, "TiB": TiB}
_SIZE = r"(\d+(?:\.\d+)?) ?(bytes|B|KiB|MiB|GiB|TiB)"
PATTERNS = {
    "request": re.compile(r"Tried to allocate " + _SIZE),
    "total": re.compile(r"total capac(?:i)?ty of " + _SIZE + r"|; " + _SIZE + r" total capacity"),
    "free": re.compile(r"of which " + _SIZE + r" is free|; " + _SIZE + r" free"),
    "process": re.compile(r"this process has " + _SIZE + r" memory in use"),
    "allowed": re.compile(_SIZE + r" allowed"),
    "allocated": re.compile(r"Of the allocated memory " + _SIZE + r" is allocated by PyTorch|; " + _SIZE
                            + r" already allocated"),
    "unallocated": re.compile(r"and " + _SIZE + r" is reserved by PyTorch but unallocated"),
    "reserved": re.compile(_SIZE + r" reserved in total by PyTorch|" + _SIZE + r" cached\)"),
}
_OTHER = re.compile(r"Process (\d+) has " + _SIZE + r" memory in use")
_GPU = re.compile(r"GPU (\d+)")
ALGORITHMIC_FRACTION_DEN = 4  # one request of a quarter of the usable memory or more is algorithmic
OTHER_PROCESSES_MIN_BYTES = GiB  # less than this outside the process is a display or a driver, not a culprit


@dataclass
class OomMessage:
    """The numbers of an OOM message, in bytes (None when the message does not carry them)."""

    request_bytes: int | None = None
    total_bytes: int | None = None
    free_bytes: int | None = None
    process_in_use_bytes: int | None = None
    allowed_bytes: int | None = None
    allocated_bytes: int | None = None
    reserved_bytes: int | None = None
    reserved_unallocated_bytes: int | None = None
    other_processes: list[tuple[int, int]] = field(default_factory=list)
    gpu: int | None = None
    format: str = "unknown"


@dataclass
class Explanation:
    """What the message means: ``kind`` (fragmentation, algorithmic, other_processes, steady_growth, unknown),
    the evidence lines with numbers, the fixes, and the parsed numbers."""

    kind: str
    summary: str
    evidence: list[str]
    fixes: list[str]
    message: OomMessage
    matched_allocation: str | None = None
    context: str | None = None  # "training" or "generation" (traceback_context), None when the text cannot tell


def _ratio(a: int, b: int) -> str:
    """``a / b`` as a multiple: whole below (33x) from 10 up, one decimal under 10 (1.1x)."""
    return f"{a // b}x" if a >= 10 * b else f"{a / b:.1f}x"


def _size(n: int) -> str:
    """GiB with two decimals from 0.1 GiB up (as OOM messages are read), else the fitting binary unit."""
    return f"{n / GiB:.2f} GiB" if n >= GiB // 10 else fmt_bytes(n)


def _bytes(m: re.Match | None) -> int | None:
    if not m:
        return None
    g = [x for x in m.groups() if x is not None]
    return int(float(g[0]) * _UNIT[g[1]]) if len(g) >= 2 else None


def parse_oom_message(text: str) -> OomMessage:
    """Numbers of a CUDA OOM message of any PyTorch version (see the module docstring).

    Raises:
        InvalidValue: the text is not a CUDA out-of-memory message.
    """
    if "out of memory" not in text.lower() or "Tried to allocate" not in text:
        printable = sum(ch.isprintable() or ch in "\n\t" for ch in text[:4096]) >= 0.9 * len(text[:4096])
        flat = " ".join(text.split())  # a pasted traceback on one line, not with its newlines as \\n
        shown = ((flat[:80] + ("..." if len(flat) > 80 else "")) if printable
                 else f"{len(text):,} characters of binary data")
        if not text.strip():
            shown = "empty input" if not text else plural(len(text), "blank character")
        raise InvalidValue("MESSAGE", shown,
                           "a CUDA out-of-memory message (with 'out of memory' and 'Tried to allocate'), "
                           "'CUDA error: out of memory', CUBLAS_STATUS_ALLOC_FAILED or "
                           "CUBLAS_STATUS_NOT_INITIALIZED, an MPS out-of-memory message, or accelerate's "
                           "'Some modules are dispatched on the CPU or the disk'",
                           "paste the whole error, from 'CUDA out of memory' to its end, or pass - and pipe it in")
    t = " ".join(text.split())
    m = OomMessage(**{f"{k}_bytes" if k not in ("process",) else "process_in_use_bytes": _bytes(p.search(t))
                      for k, p in PATTERNS.items() if k not in ("unallocated", "allowed")})
    m.allowed_bytes = _bytes(PATTERNS["allowed"].search(t))
    m.reserved_unallocated_bytes = _bytes(PATTERNS["unallocated"].search(t))
    m.other_processes = [(int(pid), int(float(v) * _UNIT[u])) for pid, v, u in _OTHER.findall(t)]
    g = _GPU.search(t)
    m.gpu = int(g.group(1)) if g else None
    if m.reserved_unallocated_bytes is not None and m.allocated_bytes is not None:
        m.reserved_bytes = m.allocated_bytes + m.reserved_unallocated_bytes
        m.format = "torch>=2.1"
    elif m.reserved_bytes is not None and m.allocated_bytes is not None:
        m.reserved_unallocated_bytes = m.reserved_bytes - m.allocated_bytes
        m.format = "torch<2.1"
    return m


def explain(text: str, alloc_conf: str | None = None, candidates: dict[str, int] | None = None) -> Explanation:
    """Classify an OOM message (see the module docstring) and give the evidence and the fix.

    Args:
        text: the message (the whole error text is fine).
        alloc_conf: the PYTORCH_CUDA_ALLOC_CONF in force, so the fix does not repeat a setting already made.
        candidates: named allocation sizes of the run (from the plan of a model and settings), to name the
            allocation that failed.

    Raises:
        InvalidValue: the text is not a CUDA OOM message.
    """
    other = _other_messages(text)
    context = traceback_context(text)
    if other is not None:
        if context == "training" and other.kind != "offload":  # offload: refused at load, before any step
            other.evidence.append(TRAINING_EVIDENCE)
            other.fixes = _training_fixes(other.kind, other.fixes, None)
        other.context = context
        return other
    m = parse_oom_message(text)
    req = m.request_bytes or 0
    usable = m.allowed_bytes or m.total_bytes
    ev = _evidence(m, req, usable)
    matched = _match(req, candidates)
    attention = attention_in_traceback(text)
    kind, summary, fixes, more = _classify(m, req, usable, matched, alloc_conf, attention)
    ev += more
    if context == "training":
        ev.append(TRAINING_EVIDENCE)
        fixes = _training_fixes(kind, fixes, matched)
    if attention is False and kind == "algorithmic":
        ev.append("the traceback names no attention code (attn, attention, sdpa, softmax): the allocation is the "
                  "traceback's own tensor, so attention settings would not change it")
    if matched:
        ev.append(f"the request matches {matched}")
    elif candidates:
        ev.append("no single allocation of the planned run matches the request (it is a smaller tensor: an "
                  "activation, a KV cache block or a workspace)")
    return Explanation(kind, summary, ev, fixes, m, matched, context)


def _evidence(m: OomMessage, req: int, usable: int | None) -> list[str]:
    """The figures of the message that the classification reads: the request, what the process may use, memory
    outside PyTorch's pool, and reserved-but-unallocated memory."""
    ev: list[str] = []
    if m.request_bytes is not None:
        ev.append(f"the failed request: {fmt_bytes(m.request_bytes)}")
    if usable:
        ev.append(f"the process may use {fmt_bytes(usable)}" + (" (per-process cap)" if m.allowed_bytes else
                                                                   " (the card's capacity)"))
    if m.total_bytes is not None and m.free_bytes is not None and m.reserved_bytes is not None:
        outside = max(m.total_bytes - m.free_bytes - m.reserved_bytes, 0)
        if m.allowed_bytes is None:
            ev.append(f"used outside PyTorch's pool (CUDA context, display, other processes): {_size(outside)}")
    frag = m.reserved_unallocated_bytes
    if frag is not None:
        ev.append(f"reserved by PyTorch but unallocated: {_size(frag)}"
                  + (f" = {_ratio(frag, req)} the request" if req and frag >= req else ""))
    if m.other_processes:  # PyTorch >= 2.1 names each other process that holds memory on the card
        ev.append("other processes hold memory on this card: "
                  + ", ".join(f"pid {p} {fmt_bytes(b)}" for p, b in m.other_processes)
                  + " (nvidia-smi lists them)")
    return ev


def _foreign_bytes(m: OomMessage) -> int:
    """Memory of other processes: what the card uses minus this process (its context included when the message
    says how much the process holds; else this process's context is estimated); 0 when the message cannot tell."""
    if m.total_bytes is None or m.free_bytes is None:
        return 0
    if m.process_in_use_bytes is not None:
        return max(m.total_bytes - m.free_bytes - m.process_in_use_bytes, 0)
    if m.reserved_bytes is not None:
        return max(m.total_bytes - m.free_bytes - m.reserved_bytes - CUDA_CONTEXT_BYTES, 0)
    return 0


def _room(m: OomMessage) -> int | None:
    """What this process could still take from the driver: the card's free memory, under a per-process cap
    (``allowed``) at most the cap less what PyTorch reserved; None when the message lacks the figures."""
    if m.free_bytes is None:
        return None
    if m.allowed_bytes is not None:
        if m.reserved_bytes is None:
            return None
        return max(min(m.free_bytes, m.allowed_bytes - m.reserved_bytes), 0)
    return m.free_bytes


_TRACEBACK_FRAME = re.compile(r'File "[^"\n]+", line \d+')
_ATTENTION_CODE = re.compile(r"attn|attention|sdpa|scaled_dot_product|softmax", re.IGNORECASE)


def attention_in_traceback(text: str) -> bool | None:
    """Whether the Python traceback pasted with the message names attention code (a frame or a line of source
    with ``attn``, ``attention``, ``sdpa``, ``scaled_dot_product`` or ``softmax``); None when the text holds no
    traceback frame (``File "...", line N``), so nothing is known of where the allocation was made."""
    if not _TRACEBACK_FRAME.search(text):
        return None
    return bool(_ATTENTION_CODE.search(text))


# innermost frames last in a Python traceback: the later of the two kinds of marker says what the process was doing
_TRAINING_CODE = re.compile(r"\.backward\(|torch/autograd/|run_backward|optimizer\.step\(|torch/optim/|"
                            r"training_step|compute_loss|_inner_training_loop|zero_grad\(")
_GENERATION_CODE = re.compile(r"\.generate\(|generation/utils\.py|in generate\b|cache_utils\.py|in _sample\b|"
                              r"\bprefill|vramguard/run/|vllm/")
TRAINING_EVIDENCE = ("the traceback is of training (a backward pass, an optimizer step or a trainer's step): the "
                     "memory holds the weights, their gradients, the optimizer's states and the activations kept "
                     "for the backward pass, not a KV cache; vramguard plan models generation, not training")
TRAINING_FIXES = ("gradient checkpointing (model.gradient_checkpointing_enable()): the backward pass recomputes "
                  "activations instead of keeping every layer's",
                  "a smaller micro-batch (per_device_train_batch_size) with gradient accumulation for the same "
                  "effective batch, or shorter sequences",
                  "an 8-bit or paged optimizer (bitsandbytes.optim.AdamW8bit, optim='paged_adamw_8bit'): Adam's two "
                  "states in a quarter of float32's memory",
                  "train LoRA adapters (peft) instead of every weight, on NF4 weights for QLoRA, in bf16 mixed "
                  "precision")


_CAP_TORCH = "torch.cuda.set_per_process_memory_fraction"
_CAP = f"a vram_budget= (or {_CAP_TORCH})"  # vramguard's run and serve cap, or a script's own


def traceback_context(text: str) -> str | None:
    """What the process was doing when it ran out: ``training`` where the traceback names a backward pass
    (``loss.backward()``, ``torch/autograd/``), an optimizer step or a trainer's step (``training_step``,
    ``compute_loss``), ``generation`` where it names ``generate``, transformers' generation or cache code, a
    prefill, vramguard's run or vLLM; where it names both (an evaluation that generates inside a training loop),
    the kind named last, the innermost frame's; None where it names neither (or holds no traceback)."""
    last = {kind: max((m.end() for m in pattern.finditer(text)), default=-1)
            for kind, pattern in (("training", _TRAINING_CODE), ("generation", _GENERATION_CODE))}
    if max(last.values()) < 0:
        return None
    return max(last, key=lambda kind: last[kind])


def _training_fixes(kind: str, fixes: list[str], matched: str | None) -> list[str]:
    """The fixes of a training step's shortage of ``kind``, in place of generation's (a static or quantized KV
    cache, chunked prefill, ``vramguard plan``): fragmentation keeps the allocator setting and asks for steady
    shapes; one allocation too large keeps the attention fix and asks for a smaller micro-batch or shorter
    sequences first; other processes, CUDA's and cuBLAS's own errors and MPS keep theirs but the plan's, and add
    the two training fixes that lower the need most; a steady growth gets every training fix."""
    if kind in ("other_processes", "cuda_error", "cublas_alloc", "mps"):  # keep theirs, but for vramguard's
        return [f.replace(_CAP, _CAP_TORCH) for f in fixes if "vramguard plan" not in f] + list(TRAINING_FIXES[:2])
    if kind == "fragmentation":
        return [fixes[0], "keep tensor shapes steady from step to step: pad batches to one length or a few buckets "
                "(or pack sequences), so a freed block fits the next step's tensors", TRAINING_FIXES[0]]
    if kind == "algorithmic":
        attention = [f for f in fixes if "attn_implementation" in f or "eager attention" in f]
        return [TRAINING_FIXES[1], *attention, "the loss's logits (batch x sequence x vocabulary, in float32) are "
                "often the largest tensor: a fused or chunked cross-entropy (e.g. Liger Kernel's) never builds them "
                "whole", TRAINING_FIXES[0]]
    return list(TRAINING_FIXES)


def _classify(m: OomMessage, req: int, usable: int | None, matched: str | None,
              alloc_conf: str | None, attention: bool | None = None) -> tuple[str, str, list[str], list[str]]:
    """(kind, summary, fixes, further evidence) by the rules of the module docstring, in their order;
    ``attention``: :func:`attention_in_traceback`."""
    frag = m.reserved_unallocated_bytes
    others = sum(b for _, b in m.other_processes)
    foreign = _foreign_bytes(m)
    if usable and req > usable:
        summary = (f"one allocation of {fmt_bytes(req)} is larger than all the memory the process may use "
                   f"({fmt_bytes(usable)}): no allocator setting can fit it")
        return "algorithmic", summary, _algorithmic_fixes(matched, attention), []
    if frag is not None and req and frag >= req:
        summary = (f"{_size(frag)} are reserved but unallocated, {_ratio(frag, req)} the "
                   f"{fmt_bytes(req)} requested, but not as one block")
        return "fragmentation", summary, _fragmentation_fixes(alloc_conf), []
    room = _room(m)
    if frag and req and room is not None and frag * 2 >= req and frag + room >= req:
        summary = (f"{_size(frag)} reserved but unallocated and {_size(room)} still free to this process together "
                   f"cover the {fmt_bytes(req)} requested, but not as one block: the unallocated part is split "
                   "inside segments still in use")
        return "fragmentation", summary, _fragmentation_fixes(alloc_conf), []
    if (others and others >= req) or (foreign >= max(req, OTHER_PROCESSES_MIN_BYTES) and not m.allowed_bytes):
        held = others or foreign
        return "other_processes", f"{fmt_bytes(held)} of the card are held outside this process's PyTorch pool", [
            "close the other GPU processes (nvidia-smi lists them), or run on another GPU (CUDA_VISIBLE_DEVICES)",
            "plan with the memory that is left: vramguard plan MODEL with vram=SIZE"], []
    if usable and req * ALGORITHMIC_FRACTION_DEN >= usable:
        summary = f"one allocation of {fmt_bytes(req)} is {req / usable:.0%} of the usable memory: an algorithmic cost"
        return "algorithmic", summary, _algorithmic_fixes(matched, attention), []
    if m.allocated_bytes is not None and usable:
        summary = (f"a request of {fmt_bytes(req)} with {fmt_bytes(m.allocated_bytes)} already allocated of "
                   f"{fmt_bytes(usable)}: memory grew until it ran out")
        return "steady_growth", summary, ["plan the run (vramguard plan MODEL ...): a shorter generation, a "
                                          "quantized KV cache (kv_dtype=int8/int4), a smaller batch, or NF4 "
                                          "weights"], []
    return "unknown", "the message does not carry enough numbers to classify it", [
        "paste the whole message, including the memory figures"], []


def _fragmentation_fixes(alloc_conf: str | None) -> list[str]:
    """Expandable segments unless ``alloc_conf`` has them on already, then a static KV cache."""
    expandable = bool(alloc_conf and "expandable_segments:True" in alloc_conf)
    fixes = (["expandable segments are already on: free cached blocks between requests "
              "(torch.cuda.empty_cache()) and keep tensor sizes steady"] if expandable else
             ["export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (lets segments grow instead of "
              "stranding blocks)"])
    fixes.append("when generating: use a static KV cache (preallocated once) instead of a dynamic cache that grows "
                 "by concatenation")
    return fixes


_MPS_SIZE = r"(\d+(?:\.\d+)?) ?(bytes|KB|MB|GB|TB)"
_MPS_UNIT = {"bytes": 1, "KB": KiB, "MB": MiB, "GB": GiB, "TB": TiB}  # MPSAllocator's format_size is 1024-based
_MPS = {k: re.compile(p + _MPS_SIZE) for k, p in (("allocated", r"MPS allocated: "),
                                                    ("other", r"other allocations: "),
                                                    ("allowed", r"max allowed: "),
                                                    ("request", r"Tried to allocate "))}


def _other_messages(text: str) -> Explanation | None:
    """The cuBLAS, CUDA error, MPS and accelerate messages of the module docstring, explained; None for any other
    text."""
    t = " ".join(text.split())
    not_init = "CUBLAS_STATUS_NOT_INITIALIZED" in t
    if "CUBLAS_STATUS_ALLOC_FAILED" in t or not_init:
        why = ("CUBLAS_STATUS_NOT_INITIALIZED: cublasCreate could not initialize its handle, most often for want "
               "of memory (a card or driver that this CUDA build of torch does not support gives it too)"
               if not_init else "CUBLAS_STATUS_ALLOC_FAILED")
        return Explanation(
            "cublas_alloc", "cuBLAS could not allocate its handle or workspace: the card was full when the first "
            "matrix product (of this stream or thread) ran", [why + ": cuBLAS allocates outside PyTorch's pool, so "
                                                              "PyTorch's cache can hold what it needs"],
            [f"leave room outside PyTorch: {_CAP} below the card, or torch.cuda.empty_cache() before the first "
             "forward",
             "close other GPU processes (nvidia-smi lists them), or run on another GPU (CUDA_VISIBLE_DEVICES)",
             "vramguard plan MODEL with vram=SIZE, the memory that is free, shows what fits"],
            OomMessage(format="cublas"))
    if "Tried to allocate" not in t and any(m in t for m in CUDA_ERROR_MARKERS):
        return _cuda_error(t)
    if "MPS backend out of memory" in t:
        got = {}
        for k, pat in _MPS.items():
            hit = pat.search(t)
            got[k] = int(float(hit.group(1)) * _MPS_UNIT[hit.group(2)]) if hit else None
        ev = [f"{label}: {fmt_bytes(got[k])}" for k, label in (("request", "the failed request"),
                                                               ("allocated", "held by PyTorch's MPS pool"),
                                                               ("other", "other allocations"),
                                                               ("allowed", "the MPS limit")) if got[k] is not None]
        return Explanation(
            "mps", "Apple's MPS backend reached its memory limit (unified memory shared with the system)", ev,
            ["lower the memory the run needs: NF4 weights, a shorter prompt or generation, a smaller batch "
             "(vramguard plan MODEL with vram=SIZE, the limit above, shows what fits)",
             "PYTORCH_MPS_HIGH_WATERMARK_RATIO raises the limit (0.0 removes it), at the risk of the system "
             "running out of memory"],
            OomMessage(request_bytes=got["request"], allowed_bytes=got["allowed"], allocated_bytes=got["allocated"],
                       format="mps"))
    if "Some modules are dispatched on the CPU or the disk" in t:
        return Explanation(
            "offload", "the quantized model did not fit the GPU: device_map placed modules on the CPU or the disk, "
            "which bitsandbytes refuses", ["device_map='auto' (or max_memory) left part of the weights off the GPU"],
            ["vramguard plan MODEL with vram=SIZE: the weights against the card, and the changes that fit (NF4, a "
             "smaller model, a second card)", "free the GPU (other processes, a model loaded twice in one process)",
             "to run slowly with the rest on the CPU anyway: BitsAndBytesConfig(llm_int8_enable_fp32_cpu_offload="
             "True) and an explicit device_map"],
            OomMessage(format="accelerate"))
    return None


CUDA_ERROR_MARKERS = ("CUDA error: out of memory", "cudaErrorMemoryAllocation", "CUDA_ERROR_OUT_OF_MEMORY",
                      "Cuda failure 'out of memory'", "Cuda failure 2 'out of memory'", "CUDNN_STATUS_ALLOC_FAILED",
                      "Triton Error [CUDA]: out of memory")
"""Texts of an allocation failure reported by CUDA itself rather than by PyTorch's caching allocator: torch's
``C10_CUDA_CHECK`` (``CUDA error: out of memory``, c10/cuda/CUDAException.cpp), the runtime and driver API error
names, NCCL's ``Cuda failure 'out of memory'`` (its CUDACHECK macro, src/include/checks.h), cuDNN's status and
Triton's launcher."""
_ASYNC = "asynchronously reported"  # c10/cuda/CUDAException.cpp's note on a CUDA error without CUDA_LAUNCH_BLOCKING


def _cuda_error(t: str) -> Explanation:
    """An out-of-memory error from CUDA outside PyTorch's caching allocator (:data:`CUDA_ERROR_MARKERS`): what it
    means, what the message shows, and how to locate and fix it."""
    nccl = "NCCL" in t or "Cuda failure" in t
    ev = ["the message carries no allocated/reserved figures: the allocation was made outside PyTorch's caching "
          "allocator (cuBLAS workspace, cuDNN, NCCL buffers, a kernel launch or the CUDA context of a new process), "
          f"when PyTorch's cache may already hold the card (a CUDA context alone takes about "
          f"{fmt_bytes(CUDA_CONTEXT_BYTES)})"]
    if nccl:
        ev.append("NCCL could not allocate its communication buffers on the card (they are allocated at the first "
                  "collective, after the model is loaded)")
    if "CUDNN_STATUS_ALLOC_FAILED" in t:
        ev.append("CUDNN_STATUS_ALLOC_FAILED: cuDNN could not allocate its workspace")
    if _ASYNC in t:
        ev.append("CUDA reports kernel errors asynchronously: the line of the traceback may not be the call that "
                  "failed (any later CUDA call can raise it)")
    if "TORCH_USE_CUDA_DSA" in t:
        ev.append("'Compile with TORCH_USE_CUDA_DSA' is torch's footer on every CUDA error: device-side assertions "
                  "do not apply to out of memory")
    fixes = ["locate it: rerun with CUDA_LAUNCH_BLOCKING=1 (slower), so the traceback points at the call that failed"
             if _ASYNC in t else "rerun with CUDA_LAUNCH_BLOCKING=1 (slower) if the traceback does not name the call",
             f"leave headroom outside PyTorch: {_CAP} below the card, or torch.cuda.empty_cache() before the call "
             "that failed",
             "check other processes with nvidia-smi: close them, or run on another GPU (CUDA_VISIBLE_DEVICES)",
             "lower the batch or the prompt length; vramguard plan MODEL with vram=SIZE shows what fits"]
    if nccl:
        fixes.insert(1, "run a first collective (torch.distributed.barrier()) before loading the model, so NCCL's "
                        "buffers are allocated on an empty card; a smaller NCCL_BUFFSIZE (4 MiB per channel by "
                        "default) shrinks them")
    return Explanation("cuda_error", "CUDA could not allocate memory outside PyTorch's caching allocator: the card "
                       "was full when cuBLAS, cuDNN, NCCL or a kernel needed memory of its own", ev, fixes,
                       OomMessage(format="cuda_error"))


def _algorithmic_fixes(matched: str | None, attention: bool | None = None) -> list[str]:
    """The fixes of one allocation too large: attention's only where the matched allocation is eager attention's
    scores, or nothing says where it was made (``attention`` None); never for a traceback that names no attention
    code (``attention`` False: a plain ``torch.empty`` of the user's)."""
    fixes = []
    if matched and "eager" in matched:
        fixes.append("use attn_implementation='sdpa' (or flash_attention_2): no score matrix is materialized")
    if matched and "logits" in matched:
        fixes.append("keep logits for the positions you need (logits_to_keep), or score in chunks")
    if attention is False:
        if not matched:
            return ["make the tensor of the traceback's last frame smaller (a smaller batch or a shorter sequence), "
                    "or build it in chunks", "vramguard plan MODEL with your settings shows the largest allocation "
                    "of a generation and what fits"]
    elif not (matched and "eager" in matched):
        fixes.append("if the run uses eager attention (attn_implementation='eager', or output_attentions=True): use "
                     "sdpa or flash attention (eager holds batch x heads x q x k float32 scores)")
    fixes += ["chunked prefill (generation_config.prefill_chunk_size), a smaller batch, or a shorter prompt",
              "vramguard plan MODEL with your settings shows the largest allocation and what fits"]
    return list(dict.fromkeys(fixes))


def _match(req: int, candidates: dict[str, int] | None) -> str | None:
    """The named allocation within 1% of ``req`` (message sizes are rounded to 2 decimals)."""
    if not req or not candidates:
        return None
    best = min(candidates.items(), key=lambda kv: abs(kv[1] - req))
    return best[0] if abs(best[1] - req) <= max(req // 100, 2 * MiB) else None


def plan_candidates(spec, s) -> dict[str, int]:
    """Named single allocations of a run (bytes), to match against a failed request."""
    seqs, p = s.sequences, s.prompt_tokens
    scores = seqs * spec.num_heads * p * p
    native, fp32 = logits_bytes(spec, seqs, p, s.act_dtype)
    dt = 4 if s.act_dtype == "fp32" else 2
    return {
        f"eager attention scores in float32 ({seqs} x {spec.num_heads} heads x {p} x {p} x 4 B)": scores * 4,
        f"eager attention scores in {s.act_dtype} ({seqs} x {spec.num_heads} x {p} x {p} x {dt} B)": scores * dt,
        f"logits for all {p} positions in float32": fp32,
        f"logits for all {p} positions in {s.act_dtype}": native,
        f"the MLP intermediate ({seqs} x {p} x {spec.intermediate_size} x {dt} B)":
            seqs * p * spec.intermediate_size * dt,
        f"one layer's KV cache tensor at {s.total_tokens} tokens": kv_tensor_bytes(spec, s, s.total_tokens),
    }
