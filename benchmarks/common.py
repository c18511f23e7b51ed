"""Shared by the GPU scripts: JSON-lines records and random-weight checkpoints of catalog architectures."""

from __future__ import annotations

import gc
import json

from vramguard.catalog.models import MODELS


def emit(path: str, rec: dict, width: int | None = None) -> None:
    """Append ``rec`` as one JSON line to ``path`` and print it (cut to ``width`` characters)."""
    line = json.dumps(rec)
    print(line[:width] if width else line, flush=True)
    with open(path, "a") as f:
        f.write(line + "\n")


def build_checkpoint(arch: str, path: str) -> None:
    """Write a random-weight bf16 checkpoint of catalog architecture ``arch`` to ``path`` (built on the GPU;
    memory does not depend on weight values). RoPE scaling is dropped: it changes no memory and keeps the config
    valid on every transformers version."""
    fields = {k: v for k, v in MODELS[arch].items()
              if k not in ("source", "architectures", "torch_dtype", "model_type", "rope_scaling")}
    save_random(MODELS[arch]["model_type"], fields, path)


def save_random(model_type: str, fields: dict, path: str) -> None:
    """Write a random-weight bf16 checkpoint of ``model_type`` with config ``fields`` to ``path``, built on the GPU."""
    import torch
    import transformers
    cfg = transformers.AutoConfig.for_model(model_type, **fields)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(path, max_shard_size="100GB")
    del model
    gc.collect()
    torch.cuda.empty_cache()
