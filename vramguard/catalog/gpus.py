"""Embedded catalog of common GPUs: the memory total their driver reports, compute capability and bandwidth.

``total_bytes`` is what CUDA reports as the card's total (``torch.cuda.get_device_properties(i).total_memory``,
the "total capacity" of PyTorch's out-of-memory message): the marketed size less the driver's own reservation
(and less the ECC share where ECC is on by default), never the marketed size itself. Each card names where its
figure comes from in ``total_source``. A report printed as GiB with two decimals (``23.64 GiB``) is taken at the
low end of what rounds to it, floored to a whole MiB (:func:`reported_gib`), so a plan never counts memory that
the card may not have; ``_CudaDeviceProperties``' ``total_memory=16049MB`` is ``totalGlobalMem // 2**20``
(torch/csrc/cuda/Module.cpp), so it is taken as that many whole MiB, 1 MiB tight where two decimals of GiB are
10.24 MiB wide; a report of the exact bytes (``total_memory / 2**20`` printed whole, ``11864.3125``) is taken as
those bytes. nvidia-smi's ``memory.total`` is not used: it is above CUDA's total by an amount that differs per
card and driver (about 251 MiB on a T4, 615 MiB on an H200, 476 MiB on an L4); Windows (WDDM) reports about
nvidia-smi's figure to CUDA as well, so where a Linux report is found it is the one kept. Drivers differ too (an
RTX 4090 reports 23.49 to 23.64 GiB): a card's source names the reports found, and its figure is the lowest of
them unless the source says otherwise (the T4's is a measurement). The CUDA context is modelled separately in
:mod:`vramguard.memory.runtime`. ``bandwidth_bytes_per_s`` is the datasheet memory bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass

from vramguard.units import GB, GiB, MiB

AMPERE = (8, 0)  # the compute capability from which bfloat16 is native and FlashAttention-2 runs


@dataclass(frozen=True)
class GpuSpec:
    """A GPU as the planner sees it.

    Attributes:
        name: canonical name (``rtx-4090``).
        label: vendor name.
        total_bytes: memory in bytes, as the driver reports it (CUDA's total).
        compute_capability: (major, minor); FlashAttention-2 needs >= (8, 0), native bf16 needs >= (8, 0).
        bandwidth_bytes_per_s: datasheet memory bandwidth, for decode-speed bounds.
        used_by_others_bytes: memory held by other processes (detected GPUs only; 0 for catalog cards).
        source: ``catalog``, ``detected`` or ``--vram``.
        total_source: where ``total_bytes`` comes from (catalog cards: a public report or a measurement).
        marketed_bytes: the memory the card is sold with (catalog cards; 0 when not known).
        total_estimated: True for a catalog card whose total is not a report of its own driver but derived from a
            like card (``total_source`` says which): a plan against it is approximate; a ``--vram`` of the card's
            own ``torch.cuda.mem_get_info()[1]`` is exact.
    """

    name: str
    label: str
    total_bytes: int
    compute_capability: tuple[int, int] | None
    bandwidth_bytes_per_s: int | None = None
    used_by_others_bytes: int = 0
    source: str = "catalog"
    total_source: str = ""
    marketed_bytes: int = 0
    total_estimated: bool = False

    @property
    def usable_bytes(self) -> int:
        """The card's memory this process may plan with: ``total_bytes - used_by_others_bytes`` (the one
        definition; the planner's CUDA context and reserve come out of it)."""
        return self.total_bytes - self.used_by_others_bytes

    @property
    def supports_bf16(self) -> bool | None:
        """Native bfloat16 arithmetic: compute capability >= 8.0 (None: unknown)."""
        cc = self.compute_capability
        return None if cc is None else cc >= AMPERE

    @property
    def supports_flash_attn2(self) -> bool | None:
        """FlashAttention-2's kernels: compute capability >= 8.0 (flash-attention's README; None: unknown)."""
        cc = self.compute_capability
        return None if cc is None else cc >= AMPERE


def reported_gib(text: str) -> int:
    """Bytes of a total reported as GiB with two decimals, at the low end of what prints as ``text``, floored to a
    whole MiB: ``"23.64"`` covers [23.635, 23.645) GiB, so 23.635 x 2**30 = 25,377,919,877 B -> 25,377,636,352 B
    (24,202 MiB)."""
    whole, _, frac = text.partition(".")
    hundredths = int(whole) * 100 + int((frac + "00")[:2])
    low = (2 * hundredths - 1) * GiB // 200  # (hundredths - 0.5) / 100 GiB
    return low // MiB * MiB


def _g(name: str, label: str, total: int | str, marketed_gib: int, cc: tuple[int, int], bw_gbs: int,
       source: str) -> GpuSpec:
    total_bytes = reported_gib(total) if isinstance(total, str) else total
    return GpuSpec(name, label, total_bytes, cc, bw_gbs * GB, total_source=source, marketed_bytes=marketed_gib * GiB,
                   total_estimated=source.startswith("no "))


_PROPS = "torch's device properties ('total_memory={}MB', whole MiB rounded down) in "


def _props(name: str, label: str, mib: int, marketed_gib: int, cc: tuple[int, int], bw_gbs: int, where: str,
           also: str = "") -> GpuSpec:
    """A card whose total is the ``total_memory=<mib>MB`` that ``torch.cuda.get_device_properties`` printed in the
    report ``where``: ``mib`` x 2**20 B, the low end of the MiB it names."""
    return _g(name, label, mib * MiB, marketed_gib, cc, bw_gbs, _PROPS.format(mib) + where + also)


_OOM = "PyTorch's out-of-memory message ('{} GiB total capacity') in "


def _reported(name: str, label: str, gib: str, marketed_gib: int, cc: tuple[int, int], bw_gbs: int,
              where: str) -> GpuSpec:
    """A card whose total is the ``gib`` that PyTorch's out-of-memory message printed in the report ``where``
    (the figure is written once: it is both the total and the cited text)."""
    return _g(name, label, gib, marketed_gib, cc, bw_gbs, _OOM.format(gib) + where)


_ROUNDED = "Ultralytics' device line ('({}, {}MiB)', total_memory / 2**20 rounded to a whole MiB) in "


def _rounded(name: str, label: str, mib: int, marketed_gib: int, cc: tuple[int, int], bw_gbs: int,
             where: str) -> GpuSpec:
    """A card whose total is the ``CUDA:0 (<label>, <mib>MiB)`` that Ultralytics (YOLOv5, ultralytics) printed in the
    report ``where``: ``total_memory / 2**20`` rounded, so taken at the low end of what rounds to it, ``mib - 0.5``
    MiB, floored to ``mib - 1`` whole MiB (ultralytics/utils/torch_utils.py ``get_gpu_info``, YOLOv5's
    utils/torch_utils.py ``select_device``: ``f"{p.total_memory / (1 << 20):.0f}MiB"``)."""
    return _g(name, label, (mib - 1) * MiB, marketed_gib, cc, bw_gbs, _ROUNDED.format(label, mib) + where)


GPUS: dict[str, GpuSpec] = {g.name: g for g in [
    _reported("gtx-1080-ti", "NVIDIA GeForce GTX 1080 Ti", "10.91", 11, (6, 1), 484,
              "github.com/ktorch/examples/blob/master/docs/gpt.rst (a GTX 1080 Ti; 10.92 GiB in other reports)"),
    _reported("rtx-2080-ti", "NVIDIA GeForce RTX 2080 Ti", "10.76", 11, (7, 5), 616,
              "github.com/JDAI-CV/image-captioning/issues/11 and github.com/ispc-lab/TMA/issues/5"),
    _g("t4", "NVIDIA T4", 15_843_721_216, 16, (7, 5), 320,
       "torch total_memory measured on a T4 (15,109 MiB, as _CudaDeviceProperties prints it on Colab); other drivers "
       "report down to 14.75 GiB (github.com/hpcaitech/Open-Sora/issues/697)"),
    _props("v100-16gb", "NVIDIA V100 16GB", 16_130, 16, (7, 0), 900,
           "github.com/ultralytics/yolov3's README of 2019 (a Tesla V100-SXM2-16GB, the lowest found; "
           "16,160 MB in most other reports, and 15.77 GiB on Azure's NC6s_v3, a V100 PCIe: "
           "github.com/stanford-futuredata/ARES/blob/main/README.md)"),
    _reported("v100-32gb", "NVIDIA V100 32GB", "31.74", 32, (7, 0), 900,
              "github.com/liucongg/ChatGLM-Finetuning/issues/73 and github.com/haotian-liu/LLaVA/issues/812"),
    _reported("rtx-3060-12gb", "NVIDIA GeForce RTX 3060 12GB", "11.75", 12, (8, 6), 360,
              "github.com/smy20011/dreambooth-gui/issues/78 (11.76 GiB in github.com/TencentARC/PhotoMaker/issues/47)"),
    _reported("rtx-3070", "NVIDIA GeForce RTX 3070", "7.76", 8, (8, 6), 448,
              "github.com/sshan-zhao/GASDA/issues/19 (7.78 GiB in github.com/akshitac8/OW-DETR/issues/46)"),
    _reported("rtx-3080-10gb", "NVIDIA GeForce RTX 3080 10GB", "9.78", 10, (8, 6), 760,
              "github.com/zai-org/CogVideo/issues/34"),
    _rounded("rtx-3080-ti", "NVIDIA GeForce RTX 3080 Ti", 12_054, 12, (8, 6), 912,
             "github.com/UnderOC/CS4302YOLO-Project/blob/main/README.md (YOLOv5, Ubuntu 20.04, driver 515.48.07)"),
    _reported("rtx-3090", "NVIDIA GeForce RTX 3090", "23.70", 24, (8, 6), 936,
              "github.com/GaoLii/DSP/issues/10; torch prints total_memory=24268MB (transformers' GPU docs)"),
    _reported("rtx-4060", "NVIDIA GeForce RTX 4060", "7.75", 8, (8, 9), 272,
              "github.com/ESRSchao/EdgeRegNet/issues/2"),
    _reported("rtx-4060-ti-16gb", "NVIDIA GeForce RTX 4060 Ti 16GB", "15.55", 16, (8, 9), 288,
              "github.com/boson-ai/higgs-audio/issues/48 (an RTX 4060 Ti 16GB, no other process on the card)"),
    _g("rtx-4070", "NVIDIA GeForce RTX 4070", 12_440_633_344, 12, (8, 9), 504,
       "torch total_memory of 12,440,633,344 B ('total_mb': 11864.3125, total_memory / 2**20) in "
       "github.com/korayguzel/bio-inference-bench/blob/main/results/raw/capacity_compare_20260406T225314.json (the "
       "lowest found; cuDeviceTotalMem 11,874 MiB with driver 575.51.03 in "
       "github.com/reindertpelsma/nvkvm-pv/blob/main/tests/BOOT_MATRIX.md; Windows reports 12,877,955,072 B, "
       "about nvidia-smi's 12,282 MiB: github.com/Lightricks/ComfyUI-LTXVideo/issues/337)"),
    _reported("rtx-4070-ti", "NVIDIA GeForce RTX 4070 Ti", "11.70", 12, (8, 9), 504,
              "github.com/Kwai-Kolors/Kolors/issues/11 (an RTX 4070 Ti, driver 545.23.08, nvidia-smi 12,282 MiB; "
              "11.73 GiB in github.com/OpenLMLab/LOMO/issues/17)"),
    _props("rtx-4070-ti-super", "NVIDIA GeForce RTX 4070 Ti SUPER", 15_974, 16, (8, 9), 672,
           "github.com/mathisweil/minihack-ReMDM-planner/blob/c957115fbbfb502502aab7b5d28b6731bb2b83f4/"
           "PERF_EXPERIMENTS_RESULTS_MINIHACK.md (driver 560.35.03; nvidia-smi 16,376 MiB)"),
    _props("rtx-4080", "NVIDIA GeForce RTX 4080", 16_049, 16, (8, 9), 717,
           "github.com/brainglobe/brainglobe.github.io/blob/main/docs/source/documentation/cellfinder/"
           "troubleshooting/speed-up.md (Windows reports 15.99 GiB: "
           "github.com/aigc-apps/sd-webui-EasyPhoto/issues/281)"),
    _reported("rtx-4090", "NVIDIA GeForce RTX 4090", "23.49", 24, (8, 9), 1008,
              "github.com/Sautenich/UAV-VLA/issues/7 (Ubuntu 22.04, driver 575; 23.52 GiB with driver 560 in "
              "github.com/pytorch/torchchat/issues/1341, 23.64 GiB in github.com/ali-vilab/VGen/issues/104)"),
    _rounded("rtx-4090-d", "NVIDIA GeForce RTX 4090 D", 24_111, 24, (8, 9), 1008,
             "github.com/Vaenix/CVLearning/blob/main/Yolo/README.md (torch 2.8.0+cu128 on AutoDL)"),
    _rounded("rtx-5080", "NVIDIA GeForce RTX 5080", 15_840, 16, (12, 0), 960,
             "github.com/neoluxis/anti-detr-x/blob/main/docs/rtdetr-nan_repair.md"),
    _reported("rtx-5090", "NVIDIA GeForce RTX 5090", "31.36", 32, (12, 0), 1792,
              "github.com/TrajectoryCrafter/TrajectoryCrafter/issues/20 (31.37 GiB in "
              "github.com/Wan-Video/Wan2.1/issues/465)"),
    _props("rtx-a6000", "NVIDIA RTX A6000", 48_676, 48, (8, 6), 768,
           "github.com/pytorch/ao/blob/main/torchao/prototype/hqq/README.md (ECC off, its default; with ECC on it "
           "has about 1/16 less, as the RTX 6000 Ada below: plan with its own total then)"),
    _reported("rtx-6000-ada", "NVIDIA RTX 6000 Ada Generation", "44.43", 48, (8, 9), 960,
              "github.com/DINGYANB/MTVCrafter/issues/21 (ECC on; nvidia-smi 46,068 MiB)"),
    _reported("a10", "NVIDIA A10", "21.99", 24, (8, 6), 600,
              "github.com/zai-org/CogVLM/issues/236 (Lambda's A10 instance, ECC on; the lowest found: 22.18 GiB in "
              "github.com/OpenBMB/MiniCPM-V/issues/640)"),
    _g("a10g", "NVIDIA A10G", "22.00", 24, (8, 6), 600,
       "about 22 GB with ECC on by default (github.com/huggingface/local-gemma/pull/25); 22.49 GiB with ECC off "
       "(github.com/AUTOMATIC1111/stable-diffusion-webui/issues/1259); planned at 22.00 GiB, the low end"),
    _reported("l4", "NVIDIA L4", "22.03", 24, (8, 9), 300,
              "github.com/ArcInstitute/evo2/issues/190 (an L4; nvidia-smi shows 23,034 MiB: "
              "github.com/modal-labs/modal-client/pull/2797)"),
    _reported("l40s", "NVIDIA L40S", "44.53", 48, (8, 9), 864,
              "github.com/Wan-Video/Wan2.1/issues/205"),
    _reported("a100-40gb", "NVIDIA A100 40GB", "39.50", 40, (8, 0), 1555,
              "github.com/TianheWu/CoSeR/issues/10"),
    _reported("a100-80gb", "NVIDIA A100 80GB", "79.25", 80, (8, 0), 2039,
              "github.com/levihsu/OOTDiffusion/issues/235 and github.com/HiDream-ai/VAREdit/issues/6"),
    _reported("h100-80gb", "NVIDIA H100 80GB", "79.11", 80, (9, 0), 3350,
              "github.com/vllm-project/vllm/issues/27508 (an H100 80GB HBM3)"),
    _reported("h100-nvl", "NVIDIA H100 NVL", "93.00", 94, (9, 0), 3900,
              "github.com/ali-vilab/VACE/issues/56 (an H100 NVL 94GB on RunPod; its NVML total, 99,961,274,368 B, "
              "in github.com/fastfetch-cli/fastfetch/issues/1658)"),
    _g("h200", "NVIDIA H200", 150_109_880_320, 141, (9, 0), 4800,
       "torch total_memory measured on an H200 (143,156 MiB; benchmarks/results/h200_matrix; nvidia-smi shows "
       "143,771 MiB)"),
]}

# short names of one card only; a name sold with several memory sizes is in SEVERAL_MEMORY_SIZES instead
GPU_ALIASES = {"4090": "rtx-4090", "3090": "rtx-3090", "4080": "rtx-4080", "h100": "h100-80gb", "5090": "rtx-5090",
               "5080": "rtx-5080"}

# Names sold with several memory sizes, which nvidia-smi and torch print alike for each size (both RTX 4060 Ti
# print "NVIDIA GeForce RTX 4060 Ti"): such a name alone never picks one. Marketed GB -> the catalog card of that
# size, None where the catalog has none. Sizes from the vendor's spec pages:
#   rtx-4060-ti: nvidia.com/en-us/geforce/graphics-cards/40-series/rtx-4060-4060ti/ (8 GB or 16 GB GDDR6)
#   rtx-3060: nvidia.com/en-us/geforce/graphics-cards/30-series/rtx-3060-3060ti/ (12 GB or 8 GB GDDR6)
#   rtx-3080: nvidia.com/en-us/geforce/graphics-cards/30-series/rtx-3080-3080ti/ (10 GB or 12 GB GDDR6X)
#   rtx-2060: nvidia.com/en-us/geforce/graphics-cards/rtx-2060/ (6 GB; the 12 GB model of December 2021)
#   a100: nvidia.com/en-us/data-center/a100/ (40 GB HBM2 or 80 GB HBM2e)
#   v100: nvidia.com/en-us/data-center/v100/ (16 GB or 32 GB HBM2)
# nvidia-smi's command line that prints each card's name and memory: it tells the sizes of one name apart
NVIDIA_SMI_MEMORY_QUERY = "nvidia-smi --query-gpu=name,memory.total --format=csv"
SEVERAL_MEMORY_SIZES: dict[str, dict[int, str | None]] = {
    "rtx-4060-ti": {8: None, 16: "rtx-4060-ti-16gb"},
    "rtx-3060": {8: None, 12: "rtx-3060-12gb"},
    "rtx-3080": {10: "rtx-3080-10gb", 12: None},
    "rtx-2060": {6: None, 12: None},
    "a100": {40: "a100-40gb", 80: "a100-80gb"},
    "v100": {16: "v100-16gb", 32: "v100-32gb"},
}

# cards planned against when no GPU is detected and none is named
DEFAULT_CARD_SIZES_GIB = (8, 12, 16, 24)
