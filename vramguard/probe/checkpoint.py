"""What a local checkpoint folder holds: shard sizes, format, stored dtype, remote code.

Shard sizes come from the files on disk; the stored dtype from the safetensors headers (read with the
``safetensors`` library, no tensor is loaded).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from vramguard.dtypes import SAFETENSORS_FLOATS
from vramguard.hub.headers import check_weights
from vramguard.settings import short_dtype



@dataclass(frozen=True)
class CheckpointInfo:
    """A checkpoint folder: ``shards`` are (file name, bytes); ``stored_dtype`` of its floating tensors."""

    folder: str
    shards: tuple[tuple[str, int], ...]
    format: str | None
    stored_dtype: str | None
    config_dtype: str | None
    remote_code: bool

    @property
    def largest_shard(self) -> tuple[str, int] | None:
        return max(self.shards, key=lambda s: s[1]) if self.shards else None

    @property
    def total_bytes(self) -> int:
        return sum(b for _, b in self.shards)


def _stored_dtype(path: Path) -> str | None:
    try:
        from safetensors import safe_open
        with safe_open(str(path), framework="np") as f:
            for key in f.keys():
                dt = f.get_slice(key).get_dtype()
                if dt in SAFETENSORS_FLOATS:
                    return SAFETENSORS_FLOATS[dt]
    except Exception:  # no safetensors library or an unreadable header: the dtype stays unknown
        return None
    return None


def read_checkpoint(folder: str | Path) -> CheckpointInfo:
    """Describe the checkpoint in ``folder`` (no tensor is read).

    Raises:
        ConfigError: a weight file or index a loader could not read (:func:`vramguard.hub.headers.check_weights`).
    """
    check_weights(folder)
    p = Path(folder)
    st = sorted(p.glob("*.safetensors"))
    pt = sorted(list(p.glob("*.bin")) + list(p.glob("*.pt")))
    files = st or pt
    cfg = {}
    if (p / "config.json").is_file():
        try:
            cfg = json.loads((p / "config.json").read_text())
        except (OSError, json.JSONDecodeError):
            cfg = {}
    cd = cfg.get("dtype") or cfg.get("torch_dtype")
    return CheckpointInfo(
        folder=str(p), shards=tuple((f.name, f.stat().st_size) for f in files),
        format="safetensors" if st else ("pickle" if pt else None),
        stored_dtype=_stored_dtype(st[0]) if st else None,
        config_dtype=short_dtype(cd),
        remote_code=bool(cfg.get("auto_map")))


def resolve_param_dtype(requested: str | None, ckpt: CheckpointInfo | None, transformers_version: str | None,
                        quant: str) -> tuple[str, str]:
    """The dtype the parameters will really have after ``from_pretrained``, and why.

    transformers 5 (``modeling_utils._get_dtype``): ``dtype`` not given means ``"auto"``: the config's ``dtype``
    (``torch_dtype``), else the stored tensors' dtype. transformers 4: not given means
    ``torch.get_default_dtype()``, float32. A bf16/fp16/fp32 ``quant`` is itself the dtype.
    """
    if quant in ("bf16", "fp16", "fp32"):
        return quant, f"quant={quant} loads the weights in {quant}"
    if requested and requested != "auto":
        return requested, f"dtype={requested} passed to from_pretrained"
    major = int(transformers_version.split(".")[0]) if transformers_version and transformers_version[0].isdigit() \
        else 5
    if requested == "auto" or major >= 5:
        how = ("dtype='auto'" if requested == "auto"
               else f"no dtype given (transformers {transformers_version} means 'auto')")
        if ckpt and ckpt.config_dtype:
            return ckpt.config_dtype, f"{how}: config.json says {ckpt.config_dtype}"
        if ckpt and ckpt.stored_dtype:
            return ckpt.stored_dtype, f"{how}: the checkpoint stores {ckpt.stored_dtype}"
        return "fp32", f"{how}, and neither config.json nor the weights name a dtype: float32"
    return "fp32", f"no dtype given: transformers {transformers_version} loads float32 (torch's default dtype)"


def hub_checkpoint_info(spec):
    """A :class:`vramguard.probe.checkpoint.CheckpointInfo` of a Hub model from its headers (shard sizes: each
    file's header plus its tensors, the file's size), or None when the spec has no checkpoint record."""
    ck = getattr(spec, "checkpoint", None)
    if ck is None or ck.format not in ("safetensors", "pytorch"):
        return None
    cfg = json.loads(spec.config_json) if spec.config_json else {}
    if ck.format == "pytorch":
        return CheckpointInfo(ck.source, (), "pickle", None, spec.checkpoint_dtype, bool(cfg.get("auto_map")))
    return CheckpointInfo(ck.source, tuple(zip(ck.files, ck.file_bytes)), "safetensors", ck.stored_float_dtype,
                          spec.checkpoint_dtype, bool(cfg.get("auto_map")))
