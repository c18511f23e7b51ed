"""Embedded catalog of common GPUs: memory and compute capability from the vendors' published specifications.

``total_bytes`` is the nominal memory (marketed GiB x 2**30, or the H200's 150,109,880,320 B that CUDA reports,
shared/reference). The driver's own reservation and the CUDA context are modelled separately in
:mod:`vramguard.memory.runtime`. ``bandwidth_bytes_per_s`` is the datasheet memory bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass

from vramguard.units import GB, GiB


@dataclass(frozen=True)
class GpuSpec:
    """A GPU as the planner sees it.

    Attributes:
        name: canonical name (``rtx-4090``).
        label: vendor name.
        total_bytes: memory in bytes.
        compute_capability: (major, minor); FlashAttention-2 needs >= (8, 0), native bf16 needs >= (8, 0).
        bandwidth_bytes_per_s: datasheet memory bandwidth, for decode-speed bounds.
        used_by_others_bytes: memory held by other processes (detected GPUs only; 0 for catalog cards).
        source: ``catalog``, ``detected`` or ``--vram``.
    """

    name: str
    label: str
    total_bytes: int
    compute_capability: tuple[int, int] | None
    bandwidth_bytes_per_s: int | None = None
    used_by_others_bytes: int = 0
    source: str = "catalog"

    @property
    def supports_bf16(self) -> bool | None:
        cc = self.compute_capability
        return None if cc is None else cc >= (8, 0)

    @property
    def supports_flash_attn2(self) -> bool | None:
        cc = self.compute_capability
        return None if cc is None else cc >= (8, 0)


def _g(name: str, label: str, gib: float, cc: tuple[int, int], bw_gbs: int) -> GpuSpec:
    return GpuSpec(name, label, int(gib * GiB), cc, bw_gbs * GB)


GPUS: dict[str, GpuSpec] = {g.name: g for g in [
    _g("gtx-1080-ti", "NVIDIA GeForce GTX 1080 Ti", 11, (6, 1), 484),
    _g("rtx-2080-ti", "NVIDIA GeForce RTX 2080 Ti", 11, (7, 5), 616),
    _g("t4", "NVIDIA T4", 16, (7, 5), 320),
    _g("v100-16gb", "NVIDIA V100 16GB", 16, (7, 0), 900),
    _g("v100-32gb", "NVIDIA V100 32GB", 32, (7, 0), 900),
    _g("rtx-3060", "NVIDIA GeForce RTX 3060 12GB", 12, (8, 6), 360),
    _g("rtx-3070", "NVIDIA GeForce RTX 3070", 8, (8, 6), 448),
    _g("rtx-3080", "NVIDIA GeForce RTX 3080 10GB", 10, (8, 6), 760),
    _g("rtx-3090", "NVIDIA GeForce RTX 3090", 24, (8, 6), 936),
    _g("rtx-4060", "NVIDIA GeForce RTX 4060", 8, (8, 9), 272),
    _g("rtx-4060-ti-16gb", "NVIDIA GeForce RTX 4060 Ti 16GB", 16, (8, 9), 288),
    _g("rtx-4070", "NVIDIA GeForce RTX 4070", 12, (8, 9), 504),
    _g("rtx-4080", "NVIDIA GeForce RTX 4080", 16, (8, 9), 717),
    _g("rtx-4090", "NVIDIA GeForce RTX 4090", 24, (8, 9), 1008),
    _g("rtx-5090", "NVIDIA GeForce RTX 5090", 32, (12, 0), 1792),
    _g("rtx-a6000", "NVIDIA RTX A6000", 48, (8, 6), 768),
    _g("rtx-6000-ada", "NVIDIA RTX 6000 Ada Generation", 48, (8, 9), 960),
    _g("a10", "NVIDIA A10", 24, (8, 6), 600),
    _g("a10g", "NVIDIA A10G", 24, (8, 6), 600),
    _g("l4", "NVIDIA L4", 24, (8, 9), 300),
    _g("l40s", "NVIDIA L40S", 48, (8, 9), 864),
    _g("a100-40gb", "NVIDIA A100 40GB", 40, (8, 0), 1555),
    _g("a100-80gb", "NVIDIA A100 80GB", 80, (8, 0), 2039),
    _g("h100-80gb", "NVIDIA H100 80GB", 80, (9, 0), 3350),
    GpuSpec("h200", "NVIDIA H200", 150_109_880_320, (9, 0), 4800 * GB),
]}

# short names of one card only; "a100" and "v100" name two memory sizes each and are refused with both
GPU_ALIASES = {"4090": "rtx-4090", "3090": "rtx-3090", "4080": "rtx-4080", "3060": "rtx-3060",
               "h100": "h100-80gb", "4060-ti": "rtx-4060-ti-16gb", "5090": "rtx-5090"}

# cards planned against when no GPU is detected and none is named
DEFAULT_CARD_SIZES_GIB = (8, 12, 16, 24)
