"""``kernels.verdict``: what the kernel self-test decided for one model on one GPU, kept on disk so that a later
process pays a spot check instead of the whole test.

:class:`vramguard.run.fastdecode.GraphDecoder` checks its Triton kernels on the model's own weights before the
first kernel step (:mod:`vramguard.run.kernels.selftest`, :func:`vramguard.run.fused_step.build`); the first time,
that includes Triton's compilation (seconds for an 8B model; Triton keeps the compiled kernels in its own cache,
``~/.triton/cache`` or ``TRITON_CACHE_DIR``, which vramguard leaves alone). What the test decided, a
:class:`KernelVerdict` (which kernels run, the 4-bit table lookup, the fused step and its measured error), is
written to one gzipped JSON file under ``$VRAMGUARD_KERNEL_CACHE`` (a folder), else ``kernels/`` in
:func:`vramguard.diskcache.vramguard_cache_dir`, named by the SHA-256 of everything the verdict depends on
(:func:`verdict_key`): the device (name and compute capability), the model's configuration and its 4-bit layers'
shapes and formats, the activation dtype, the options that choose the kernels, the CUDA version PyTorch was built
with, and :func:`vramguard.diskcache.environment_version` (torch, transformers, triton, bitsandbytes... versions
and the source of every vramguard module). ``VRAMGUARD_KERNEL_CACHE=0`` turns it off.

A file that cannot be read is ignored, said in the decoder's kernel note, and written again after the full test.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from vramguard import diskcache

KIND = "kernels"
_OFF = ("0", "false", "no", "off")


@dataclass(frozen=True)
class KernelVerdict:
    """The decision of a full kernel self-test: the 4-bit matmul (``nf4``) and decode attention (``attn``) kernels
    on or off, the register lookup of the 4-bit values (``lut``, :data:`vramguard.run.kernels.nf4.LUT`), the fused
    step on or off (``fused``), and the reasons as the test wrote them (``kernel_why``, ``fused_why``)."""

    nf4: bool
    attn: bool
    lut: bool
    fused: bool
    kernel_why: str
    fused_why: str


@dataclass(frozen=True)
class GemmChoice:
    """What the timing of the 4-bit matmul paths chose for one model on one GPU
    (:func:`vramguard.run.kernels.selftest.fastest_4bit_paths`, run by ``serve``'s decode steps): ``choice``
    ``{(N, K, kind): path}`` and ``times``, the timings it was chosen from (microseconds a call, as measured)."""

    choice: dict
    times: list


def cache_folder() -> Path | None:
    """``$VRAMGUARD_KERNEL_CACHE`` when it names a folder, None when it turns the cache off (``0``, ``false``,
    ``no``, ``off``), else ``kernels/`` in :func:`vramguard.diskcache.vramguard_cache_dir`."""
    given = os.environ.get("VRAMGUARD_KERNEL_CACHE", "").strip()
    if given.lower() in _OFF:
        return None
    if given and given.lower() not in ("1", "true", "yes", "on"):
        return Path(given).expanduser()
    return diskcache.vramguard_cache_dir() / KIND


def device_signature(device) -> tuple:
    """What identifies ``device`` for compiled kernels: ``("cuda", name, (major, minor), CUDA version)``, or
    ``("cpu", TRITON_INTERPRET)`` (the kernels run on the CPU only through Triton's interpreter)."""
    import torch
    if device.type == "cuda":
        return ("cuda", torch.cuda.get_device_name(device), tuple(torch.cuda.get_device_capability(device)),
                torch.version.cuda)
    return (device.type, os.environ.get("TRITON_INTERPRET"))


def model_signature(model) -> tuple:
    """The model's configuration as transformers writes it (its path left out: two folders with the same
    configuration share a verdict) and every distinct 4-bit layer format: ``(shape, blocksize, quant_type, double
    quant, storage dtype)``."""
    cfg = model.config.to_dict()
    for name in ("_name_or_path", "name_or_path", "transformers_version"):
        cfg.pop(name, None)
    layers = set()
    for m in model.modules():
        w = getattr(m, "weight", None)
        qs = getattr(w, "quant_state", None)
        if qs is not None:
            layers.add((tuple(int(s) for s in qs.shape), int(qs.blocksize), str(qs.quant_type), bool(qs.nested),
                        str(w.dtype)))
    return json.dumps(cfg, sort_keys=True, default=str), tuple(sorted(layers))


def verdict_key(model, device, dtype, options: tuple) -> Path | None:
    """The file of the verdict for ``model`` on ``device`` with activations in ``dtype`` and the decoder's
    ``options`` (what it was asked to use before any test); None when the cache is off or vramguard's source cannot
    be read (:func:`vramguard.diskcache.environment_version`)."""
    folder = cache_folder()
    version = diskcache.environment_version() if folder is not None else None
    if version is None:
        return None
    h = hashlib.sha256(f"{KIND}\0{version}".encode())
    for part in (device_signature(device), model_signature(model), str(dtype), options):
        h.update(b"\0" + repr(part).encode())
    return folder / f"{KIND}-{h.hexdigest()}.json.gz"


def read_verdict(path: Path | None, kind: type = KernelVerdict):
    """(the verdict in ``path``, None) when it holds one (a ``kind``: :class:`KernelVerdict` or
    :class:`GemmChoice`); (None, None) when there is none; (None, why) when the file exists but cannot be read or is
    not such a verdict (then it is to be checked again and rewritten)."""
    if path is None or not path.exists():
        return None, None
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            obj = diskcache.decode(json.load(f))
    except (OSError, ValueError, EOFError, TypeError, KeyError, AttributeError, ImportError) as e:
        return None, f"the kept kernel check {path} could not be read ({type(e).__name__}: {str(e)[:120]})"
    if not isinstance(obj, kind):
        what = "a kernel verdict" if kind is KernelVerdict else "a 4-bit matmul choice"
        return None, f"the kept kernel check {path} holds {type(obj).__name__}, not {what}"
    return obj, None


def write_verdict(path: Path | None, verdict: KernelVerdict | GemmChoice) -> None:
    """Keep ``verdict`` in ``path`` (atomically, :func:`vramguard.diskcache.write_text_gz`); said once per folder
    (a ``UserWarning``) when the folder cannot be written; nothing when ``path`` is None."""
    if path is None:
        return
    diskcache.write_text_gz(path, json.dumps(diskcache.encode(verdict), separators=(",", ":")), _warn_unwritable)


def _warn_unwritable(folder: Path, e: OSError) -> None:
    diskcache.warn_unwritable_once(folder, e, "the kernel cache folder", "the kernels are checked again in every "
                                   "process; set VRAMGUARD_KERNEL_CACHE to a writable folder, or to 0")
