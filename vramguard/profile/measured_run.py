"""One measured ``generate`` call with random prompt tokens: the shared core of ``profile`` and ``fit``.

Memory is read through :mod:`vramguard.runtime.device` (per-step samples, peaks reset between steps). An out-of-memory
error is caught, its message kept, and everything the failed attempt held is freed before returning.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field

from vramguard.runtime.device import StepRecorder, StepSample, is_oom, probe
from vramguard.settings import Settings


@dataclass
class RunResult:
    """A generate call: ``ok`` or the OOM message; peaks in bytes (whole process, weights included)."""

    ok: bool
    samples: list[StepSample] = field(default_factory=list)
    seconds: float = 0.0
    before_allocated: int = 0
    error: str | None = None
    end_device_used: int = 0
    end_reserved: int = 0

    @property
    def peak_allocated(self) -> int | None:
        return max((s.peak_allocated for s in self.samples), default=None)

    @property
    def peak_reserved(self) -> int | None:
        return max((s.peak_reserved for s in self.samples), default=None)


def random_prompt(model, s: Settings, seed: int = 0):
    """``batch x prompt_tokens`` random token ids (ids 100..vocab-100) on the model's device."""
    import torch
    vocab = int(getattr(model.config, "vocab_size", 32000))
    g = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.randint(min(100, vocab - 1), max(vocab - 100, 101), (s.batch, s.prompt_tokens), generator=g)
    return ids.to(next(model.parameters()).device)


def free_memory() -> None:
    """Collect garbage and return cached blocks (CUDA only)."""
    import torch
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_generate(model, s: Settings, seed: int = 0) -> RunResult:
    """Greedy ``generate`` of exactly ``s.max_new_tokens`` tokens after a random prompt, memory sampled per step.

    Returns ``ok=False`` with the message when the run is out of memory
    (:func:`~vramguard.runtime.device.is_oom`); never leaves the failed attempt's tensors allocated.
    """
    import torch
    free_memory()
    ids = random_prompt(model, s, seed)
    rec = StepRecorder()
    before = probe().read()["allocated"]
    rec.start()
    t0 = time.perf_counter()
    try:
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=s.max_new_tokens,
                             min_new_tokens=s.max_new_tokens, do_sample=False, streamer=rec,
                             pad_token_id=getattr(model.generation_config, "pad_token_id", None) or 0,
                             num_beams=s.num_beams)
        del out
        r = probe().read()
        res = RunResult(True, rec.samples, time.perf_counter() - t0, before, None, r["device_used"], r["reserved"])
    except RuntimeError as e:
        if not is_oom(e):
            raise
        res = RunResult(False, rec.samples, time.perf_counter() - t0, before, str(e).split("\n")[0])
    del ids
    free_memory()
    return res
