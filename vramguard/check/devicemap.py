"""Where ``device_map="auto"`` would put each module, computed by accelerate on an empty (meta) model.

transformers hands ``device_map="auto"`` to ``accelerate.infer_auto_device_map`` with about 90% of the free GPU
memory; whatever does not fit goes to CPU RAM or disk, silently. This module asks accelerate the same question
before anything is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass

from vramguard.settings import TORCH_DTYPE_NAMES, Settings

GPU_FRACTION_NUM, GPU_FRACTION_DEN = 9, 10  # transformers keeps ~10% of GPU memory back for "auto"


@dataclass(frozen=True)
class Placement:
    """Modules accelerate would place off the GPU (``offloaded``: name -> "cpu" | "disk"), or why unknown."""

    offloaded: dict[str, str]
    gpu_budget_bytes: int
    reason: str


def auto_placement(config_dict: dict, s: Settings, gpu_free_bytes: int, ram_bytes: int) -> Placement | None:
    """Placement of ``device_map="auto"`` for a model of ``config_dict`` (None when torch/accelerate are absent).

    4-bit weights are sized as ``torch.int8`` halved through a per-module size override: accelerate sizes
    parameters by dtype, so the model is built with the planner's bytes per weight.
    """
    try:
        import torch
        import transformers
        from accelerate import infer_auto_device_map, init_empty_weights
    except ImportError:
        return None
    cfg = transformers.AutoConfig.for_model(**{k: v for k, v in config_dict.items()
                                               if k not in ("source", "architectures", "torch_dtype")})
    with init_empty_weights():
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    dtype = getattr(torch, TORCH_DTYPE_NAMES[s.weight_dtype]) if not s.is_bnb else torch.int8
    budget = gpu_free_bytes * GPU_FRACTION_NUM // GPU_FRACTION_DEN
    if s.is_4bit:  # int8-sized modules are twice the 4-bit size: give accelerate twice the budget instead
        budget *= 2
    dmap = infer_auto_device_map(model, max_memory={0: budget, "cpu": ram_bytes},
                                 no_split_module_classes=getattr(model, "_no_split_modules", None) or [],
                                 dtype=dtype)
    off = {k: str(v) for k, v in dmap.items() if str(v) in ("cpu", "disk")}
    return Placement(off, gpu_free_bytes * GPU_FRACTION_NUM // GPU_FRACTION_DEN,
                     "accelerate.infer_auto_device_map on the empty model")
