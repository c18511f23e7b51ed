"""Finding the GPU to plan against: detected (NVML), named from the catalog, or a given size.

Detection returns a value and the reason (the exception text it caught), never a bare ``None``; tests force each
branch through :data:`DETECT_OVERRIDE`.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass

from vramguard.catalog.gpus import (DEFAULT_CARD_SIZES_GIB, GPUS, GPU_ALIASES, NVIDIA_SMI_MEMORY_QUERY,
                                    SEVERAL_MEMORY_SIZES, GpuSpec)
from vramguard.errors import InvalidValue, UnknownGpu
from vramguard.units import GiB, parse_card_size

# Tests set this to a callable returning a DetectedGpus to force a branch without hardware.
DETECT_OVERRIDE = None


@dataclass(frozen=True)
class DetectedGpus:
    """GPUs found on this machine (possibly none) and the reason when none were found."""

    gpus: tuple[GpuSpec, ...]
    reason: str


def _norm(name: str) -> str:
    return re.sub(r"[^a-z0-9.]+", "-", name.lower()).strip("-")


# words in the names nvidia-smi and torch print that say nothing about which catalog card it is
_NOISE_WORDS = {"nvidia", "geforce", "tesla", "sxm", "sxm2", "sxm4", "sxm5", "pcie", "hbm2", "hbm2e", "hbm3",
                "hbm3e", "gddr6", "gddr6x"}


def _driver_key(name: str) -> str | None:
    """A catalog key from a name as the driver prints it: ``Tesla T4`` -> ``t4``, ``NVIDIA A100-SXM4-80GB`` ->
    ``a100-80gb``, ``NVIDIA H100 80GB HBM3`` -> ``h100-80gb``, ``Tesla V100-SXM2-16GB`` -> ``v100-16gb``; None
    when nothing is left once the vendor, form-factor and memory-type words are dropped."""
    words = [w for w in _norm(name).split("-") if w and w not in _NOISE_WORDS]
    if not words:
        return None
    mem = [w for w in words if re.fullmatch(r"\d+gb?", w)]
    rest = [w for w in words if w not in mem]
    for key in ("-".join(rest + [m.rstrip("b") + "b" for m in mem]), "-".join(rest)):
        if key in GPUS:
            return key
    return "-".join(words)


def _flat(s: str) -> str:
    return s.replace("-", "").replace(".", "")


def _sizes_of(name: str) -> tuple[str, dict[int, str | None], int | None] | None:
    """(the name of :data:`~vramguard.catalog.gpus.SEVERAL_MEMORY_SIZES`, its sizes, the GB the name gives or
    None) when ``name`` is one sold with several memory sizes (``NVIDIA GeForce RTX 4060 Ti``, ``3060``,
    ``a100-pcie``, ``NVIDIA A100-SXM4-80GB``); None for any other name."""
    words = [w for w in _norm(name).split("-") if w and w not in _NOISE_WORDS]
    mem = [w for w in words if re.fullmatch(r"\d+gb?", w)]
    rest = _flat("".join(w for w in words if w not in mem))
    for family, sizes in SEVERAL_MEMORY_SIZES.items():
        if rest and rest in (_flat(family), _flat(family).removeprefix("rtx")) and len(mem) <= 1:
            return family, sizes, int(mem[0].rstrip("gb")) if mem else None
    return None


def _one_size(name: str, family: str, sizes: dict[int, str | None], gb: int | None) -> GpuSpec:
    """The catalog card of ``family`` with ``gb`` GB; raises UnknownGpu naming the sizes when ``gb`` is None (the
    name alone does not tell) or the catalog has no card of that size."""
    listed = [k for k in sizes.values() if k]
    missing = [f"{g} GB" for g, k in sizes.items() if not k]
    accepted = (", ".join(listed) or "no catalog card") + (
        f"; not in the catalog: the {' and '.join(missing)} {family}" if missing else "")
    if gb is not None and sizes.get(gb):
        return GPUS[sizes[gb]]
    by_size = " and ".join(f"{g} GB" for g in sizes)
    tell = f"`{NVIDIA_SMI_MEMORY_QUERY}` shows the card's memory"
    exact = "pass its total as vram= (what torch.cuda.mem_get_info()[1] gives on the card)"
    if gb is not None:  # a size the catalog does not hold
        raise UnknownGpu("gpu", name, accepted, f"the {gb} GB {family} is not in the catalog"
                         + (f" ({family} is sold with {by_size})" if gb not in sizes else "") + f": {exact}")
    example = f"name one of them, e.g. gpu={listed[-1]}, or " if listed else ""
    raise UnknownGpu("gpu", name, accepted, f"{name.strip()!r} is sold with {by_size} under one name "
                     f"({tell}): {example}{exact}")


def gpu_from_catalog(name: str) -> GpuSpec:
    """A catalog GPU by name (``rtx-4090``, ``rtx4090``, ``4090``, ``NVIDIA GeForce RTX 4090``...), by the name
    nvidia-smi and torch print (``Tesla T4``, ``NVIDIA A100-SXM4-80GB``, ``NVIDIA H100 80GB HBM3``), or by the
    start of one name (``a100-40``).

    Raises:
        UnknownGpu: no catalog card has that name, or it names several (``a100``: 40 GB and 80 GB), or a name sold
            with several memory sizes without the size (``NVIDIA GeForce RTX 4060 Ti``: 8 GB or 16 GB,
            :data:`~vramguard.catalog.gpus.SEVERAL_MEMORY_SIZES`); the message lists the accepted names (or the
            matching ones) and how to tell the sizes apart.
    """
    several = _sizes_of(name)
    if several is not None:
        return _one_size(name, *several)
    key = _norm(name)
    key = GPU_ALIASES.get(key, key)
    if key in GPUS:
        return GPUS[key]
    flat = _flat
    for g in GPUS.values():
        short = _norm(g.label).replace("nvidia-", "").replace("geforce-", "")
        if key in (_norm(g.label), short) or flat(key) in (flat(g.name), flat(short)):
            return g
    driver = _driver_key(name)
    if driver is not None and driver != key:
        driver = GPU_ALIASES.get(driver, driver)
        if driver in GPUS:
            return GPUS[driver]
        key = driver
    starts = [g for g in GPUS.values() if flat(g.name).startswith(flat(key)) or flat(g.name) == "rtx" + flat(key)]
    if len(starts) == 1:
        return starts[0]
    if starts:
        raise _several_start(name, starts)
    near = close_card_names(name)
    meant = f"did you mean {' or '.join(near)}? " if near else ""
    raise UnknownGpu("gpu", name, ", ".join(GPUS), f"{meant}pick a catalog card (vramguard.catalog.gpus.GPUS lists "
                     "them); a plan also takes the memory of any card: vram=24GiB")


def _several_start(name: str, starts: list[GpuSpec]) -> UnknownGpu:
    """The error for a name that starts several catalog names, listed in catalog order: the shortest of them is the
    one most likely meant (the fewest characters left over: ``RTX 409`` is ``rtx-4090``, not ``rtx-4090-d``) and is
    suggested by itself when no other is as short; else the first of the shortest is an example (``a100``:
    ``a100-40gb`` or ``a100-80gb``)."""
    ordered = sorted(starts, key=lambda g: len(_flat(g.name)))  # stable: catalog order among names of one length
    best, second = ordered[0].name, ordered[1].name
    accepted = ", ".join(g.name for g in starts)
    if len(_flat(best)) < len(_flat(second)):
        return UnknownGpu("gpu", name, accepted, f"did you mean gpu={best}? Or name another of them")
    return UnknownGpu("gpu", name, accepted, f"name one of them, e.g. gpu={best}")


def close_card_names(name: str, n: int = 2) -> list[str]:
    """Up to ``n`` catalog cards whose names are spelt nearly as ``name`` (a typo: ``rtx4900`` -> ``rtx-4090``):
    :func:`difflib.get_close_matches` over the names without dashes and dots, vendor words dropped (cutoff 0.75)."""
    words = [w for w in _norm(name).split("-") if w and w not in _NOISE_WORDS]
    key = _flat("-".join(words))
    flat = {}
    for card in GPUS:
        flat.setdefault(_flat(card), card)
        flat.setdefault(_flat(card).removeprefix("rtx"), card)
    for alias, card in GPU_ALIASES.items():
        flat.setdefault(_flat(alias), card)
    near = difflib.get_close_matches(key, list(flat), n=4, cutoff=0.75) if key else []
    return list(dict.fromkeys(flat[k] for k in near))[:n]


MIN_CARD_BYTES = 2**20  # a --vram below 1 MiB is a unit mistyped ("1B": one byte), not a card


def gpu_from_vram(text: str) -> GpuSpec:
    """A card of the given memory (``24GiB``), compute capability unknown.

    Raises:
        InvalidValue: the size is malformed, above any card (:func:`~vramguard.units.parse_card_size`), or below
            :data:`MIN_CARD_BYTES` (``1B`` is one byte: a unit mistyped).
    """
    size = parse_card_size(text, "vram")
    if size < MIN_CARD_BYTES:
        digits = str(text).strip()[:-1] if str(text).strip()[-1:] in "bB" else ""
        number = digits if digits.replace(".", "", 1).isdigit() else "24"  # "1B": 1 GiB meant
        raise InvalidValue("vram", text, f"at least {MIN_CARD_BYTES // 2**20} MiB (a card's memory): "
                           f"{str(text).strip()} is {size:,} B", f"give the card's memory with its unit, e.g. "
                           f"{number}GiB")
    label = f"{size / 2**30:g} GiB card" if size % 2**20 == 0 else f"{text.strip()} card"
    return GpuSpec(label.replace(" ", "-").lower(), label, size, None, source="vram")


def _match_catalog(label: str, total: int, cc: tuple[int, int] | None, used: int) -> GpuSpec:
    """A detected GPU: its own total and capability, the bandwidth of the catalog card of that name (if any)."""
    try:
        base = gpu_from_catalog(label)
    except UnknownGpu:
        base = _by_total(label, total)
    key = base.name if base else _norm(label).replace("nvidia-", "").replace("geforce-", "")
    bw = base.bandwidth_bytes_per_s if base else None
    return GpuSpec(key, label, total, cc, bw, used, "detected", "reported by the driver (NVML)")


def _by_total(label: str, total: int) -> GpuSpec | None:
    """The catalog card of a name sold with several memory sizes that ``total`` bytes belong to: the smallest
    marketed size not below it (a driver reports less than the marketed size); None when it is not in the
    catalog."""
    several = _sizes_of(label)
    if several is None:
        return None
    fitting = [g for g in sorted(several[1]) if g * GiB >= total]
    key = several[1][fitting[0]] if fitting else None
    return GPUS[key] if key else None


def detect_gpus() -> DetectedGpus:
    """GPUs visible through NVML (nvidia-ml-py), with memory used by every process.

    No torch import and no CUDA context is created. Returns an empty tuple with the reason (NVML missing,
    no driver, no device) when nothing is found.
    """
    if DETECT_OVERRIDE is not None:
        return DETECT_OVERRIDE()
    try:
        import pynvml
    except ImportError as e:
        return DetectedGpus((), f"nvidia-ml-py is not installed ({e})")
    try:
        pynvml.nvmlInit()
    except Exception as e:  # NVMLError_LibraryNotFound, DriverNotLoaded...: no NVIDIA driver here
        return DetectedGpus((), f"no NVIDIA driver/GPU found by NVML ({type(e).__name__}: {e})")
    try:
        found = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            name = name.decode() if isinstance(name, bytes) else name
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            try:
                cc = tuple(pynvml.nvmlDeviceGetCudaComputeCapability(h))
            except Exception:  # older drivers lack the call; capability is then unknown, not guessed
                cc = None
            found.append(_match_catalog(name, int(mem.total), cc, int(mem.used)))
        return DetectedGpus(tuple(found), f"{len(found)} GPU(s) found by NVML" if found else "NVML found 0 GPUs")
    finally:
        pynvml.nvmlShutdown()


def require_gpu_specs(gpus: object, fewest: int = 1) -> None:
    """Raise InvalidValue unless ``gpus`` is a list (or tuple) of at least ``fewest`` :class:`GpuSpec`: a card
    name or a size is what ``gpu`` / ``vram`` take, and :func:`gpu_from_catalog` / :func:`gpu_from_vram` make a
    GpuSpec of either."""
    fix = "pass e.g. gpus=[gpu_from_catalog('h100')] (vramguard.hardware), or a card name as gpu"
    if not isinstance(gpus, (list, tuple)) or isinstance(gpus, str):
        raise InvalidValue("gpus", gpus, "a list of GpuSpec", fix)
    wrong = [g for g in gpus if not isinstance(g, GpuSpec)]
    if wrong:
        raise InvalidValue("gpus", gpus, f"a list of GpuSpec; {wrong[0]!r} is of type {type(wrong[0]).__name__}", fix)
    if len(gpus) < fewest:
        raise InvalidValue("gpus", gpus, f"a list of at least {fewest} GpuSpec", fix)


def require_card_name(gpu: object) -> None:
    """Raise InvalidValue unless ``gpu`` is None or a card name: a str that is not blank."""
    fix = "pass a catalog name such as gpu='h100' (vramguard.catalog.gpus.GPUS lists them), or leave gpu None"
    if gpu is not None and not isinstance(gpu, str):
        raise InvalidValue("gpu", gpu, f"a card name (a str), not type {type(gpu).__name__}", fix)
    if isinstance(gpu, str) and not gpu.strip():
        raise InvalidValue("gpu", gpu, "a card name (an empty name names no card)", fix)


def resolve_gpus(gpu: str | None = None, vram: str | None = None) -> tuple[list[GpuSpec], str]:
    """The cards to plan against and why: ``--gpu``, ``--vram``, the detected GPU, or the default sizes.

    Raises:
        InvalidValue: both ``gpu`` and ``vram`` given, a ``gpu`` that is not a card name (not a str, or empty), or
            a malformed size.
        UnknownGpu: an unknown card name.
    """
    require_card_name(gpu)
    if gpu and vram is not None:
        raise InvalidValue("gpu/vram", f"{gpu} and {vram}", "one of the two: they conflict (a catalog card has its "
                           "own memory, vram= sets the memory)", f"pass one: gpu={gpu} or vram={vram}")
    if gpu:
        card = gpu_from_catalog(gpu)
        named = "" if gpu.strip().lower() == card.name else f": {gpu.strip()!r} is the catalog card {card.name}"
        if card.total_estimated:
            return [card], (f"named with gpu={named} ({card.label}, {card.total_bytes:,} B: an estimate, as no driver "
                            "report of this card was found; for an exact plan pass vram= with what "
                            "`python -c 'import torch; print(torch.cuda.mem_get_info()[1])'` prints on the card)")
        return [card], f"named with gpu={named} ({card.label}, {card.total_bytes:,} B as its driver reports)"
    if vram is not None:  # an empty --vram "" is a size to refuse, not "no size given"
        return [gpu_from_vram(vram)], "given with vram="
    det = detect_gpus()
    if det.gpus:
        return [det.gpus[0]], f"detected: {det.reason}"
    cards = [gpu_from_vram(f"{n}GiB") for n in DEFAULT_CARD_SIZES_GIB]
    return cards, f"no GPU detected ({det.reason}); planning against common card sizes"


def card_defaults(gpu: str | None, attn: str | None, dtype: str | None,
                  compute_dtype_given: bool) -> tuple[str, str | None, list[str]]:
    """Attention implementation and dtype for planning on the catalog card ``gpu`` when the user gave none: what
    vramguard's loader would run there. FlashAttention-2 and native bf16 need compute capability >= 8.0 (the
    FlashAttention-2 README; CUDA's bf16 arithmetic), so below it the defaults are sdpa and fp16; on a card of 8.0
    or more, flash_attention_2 (the loader's choice where flash_attn is installed). With no card named (``gpu``
    None) the attention is sdpa, transformers' default, and a note says why. A value the user passed is kept (the
    plan's findings flag it if it cannot run).

    Returns:
        (attn, dtype or None for the default, notes naming each default chosen for the card).

    Raises:
        UnknownGpu: ``gpu`` is not a catalog card.
    """
    if gpu is None:  # no card named: its compute capability is unknown, so is whether FlashAttention-2 runs
        if attn is not None:
            return attn, dtype, []
        return "sdpa", dtype, ["note: attention sdpa (transformers' default): no card named, so FlashAttention-2 "
                               "is not assumed; gpu=NAME plans the card's default, attn=flash_attention_2 plans it"]
    card = None
    if attn is None or (dtype is None and not compute_dtype_given):
        card = gpu_from_catalog(gpu)
    if card is None or card.supports_flash_attn2:
        return attn or "flash_attention_2", dtype, []
    chosen = []
    if attn is None:
        attn = "sdpa"
        chosen.append("attn=sdpa (FlashAttention-2 needs compute capability >= 8.0)")
    if dtype is None and not compute_dtype_given:
        dtype = "fp16"
        chosen.append("dtype=fp16, and a 4-bit compute dtype with it (no native bf16 below compute capability 8.0)")
    cc = ".".join(map(str, card.compute_capability))
    notes = [f"defaults for the {card.label} (compute capability {cc}): " + "; ".join(chosen)] if chosen else []
    return attn, dtype, notes
