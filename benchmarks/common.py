"""Shared by the benchmark scripts: JSON-lines records, random-weight checkpoints of catalog architectures, and the
cases a test module lists."""

from __future__ import annotations

import gc
import importlib.util
import json
from pathlib import Path

from vramguard.catalog.models import MODELS


def emit(path: str, rec: dict, width: int | None = None) -> None:
    """Append ``rec`` as one JSON line to ``path`` and print it (cut to ``width`` characters)."""
    line = json.dumps(rec)
    print(line[:width] if width else line, flush=True)
    with open(path, "a") as f:
        f.write(line + "\n")


def build_checkpoint(arch: str, path: str) -> None:
    """Write a random-weight bf16 checkpoint of catalog architecture ``arch`` to ``path`` (built on the GPU if any;
    memory does not depend on weight values). RoPE scaling is dropped: it changes no memory and keeps the config
    valid on every transformers version."""
    fields = {k: v for k, v in MODELS[arch].items()
              if k not in ("source", "architectures", "torch_dtype", "model_type", "rope_scaling")}
    save_random(MODELS[arch]["model_type"], fields, path)


def save_random(model_type: str, fields: dict, path: str) -> None:
    """Write a random-weight bf16 checkpoint of ``model_type`` with config ``fields`` to ``path``, built on the GPU
    (on the CPU where there is none)."""
    import torch
    import transformers
    cfg = transformers.AutoConfig.for_model(model_type, **fields)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(path, max_shard_size="100GB")
    del model
    gc.collect()
    torch.cuda.empty_cache()


def cuda_ms(fn, reps: int) -> float:
    """GPU milliseconds per call of ``fn``: one call to warm up, then CUDA events around ``reps`` calls."""
    import torch
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / reps


def add_serving_args(ap, new_tokens: int) -> None:
    """The options of the serving benchmarks' model and load: --out, --arch, --ckpt, --budget (GiB), --prompt and
    --new (tokens, default ``new_tokens``)."""
    ap.add_argument("--out", required=True)
    ap.add_argument("--arch", default="llama-3.1-8b")
    ap.add_argument("--ckpt", default="/tmp/ckpt-llama3-8b")
    ap.add_argument("--budget", type=float, default=24)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=new_tokens)


def load_nf4_under_budget(arch: str, ckpt: str, budget_bytes: int):
    """The random-weight checkpoint of ``arch`` at ``ckpt`` (built when missing), this process capped at
    ``budget_bytes`` of the GPU, loaded in NF4 by vramguard's loader; returns the LoadedModel."""
    import os

    import torch

    from vramguard.runtime.load import load_model
    if not os.path.exists(os.path.join(ckpt, "config.json")):
        build_checkpoint(arch, ckpt)
    torch.cuda.set_per_process_memory_fraction(budget_bytes / torch.cuda.get_device_properties(0).total_memory)
    return load_model(ckpt, quant="nf4", verify=False)


def load_test_module(name: str):
    """``tests/<name>.py`` loaded as a module (the cases, settings and sources a benchmark prints from)."""
    path = Path(__file__).resolve().parent.parent / "tests" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
