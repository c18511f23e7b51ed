"""What a checkpoint stores, read from its safetensors headers alone: every tensor's name, dtype, shape and bytes.

A safetensors file starts with an 8-byte little-endian header length ``N`` and ``N`` bytes of JSON mapping each
tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (https://huggingface.co/docs/safetensors,
"Format"); ``end - begin`` is the tensor's stored size in bytes. Remote headers come from huggingface_hub's
``get_safetensors_metadata`` (range requests); local files are read here the same way (the first ``8 + N`` bytes,
no tensor data). Knows nothing about quantization methods (:mod:`vramguard.hub.prequant`) or the network
(:mod:`vramguard.hub.fetch`).
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from vramguard.dtypes import SAFETENSORS_BYTES, SAFETENSORS_FLOATS
from vramguard.errors import ConfigError
from vramguard.inputs import check_index, open_regular, regular_file

MAX_HEADER_BYTES = 100_000_000  # safetensors refuses larger headers (``MAX_HEADER_SIZE`` in safetensors' lib.rs)


@dataclass(frozen=True)
class TensorHeader:
    """One stored tensor: ``nbytes`` is ``data_offsets[1] - data_offsets[0]`` as the header states it."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    file: str

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class Fetched:
    """One thing read to plan a model: ``what`` (a file name, or ``<file> header``), ``nbytes`` its size in bytes,
    ``origin`` ``network`` (sent by the Hub now), ``cache`` (the local Hugging Face cache or vramguard's header
    cache) or ``local`` (a model folder)."""

    what: str
    nbytes: int
    origin: str


@dataclass(frozen=True)
class CheckpointHeaders:
    """The tensors a checkpoint stores, from its safetensors headers (``format="safetensors"``), or only the names
    of its files when it has none (``format="pytorch"``: ``.bin`` files, whose sizes need the pickles read).

    ``header_bytes``: bytes of the headers themselves (``8 + N`` per file); ``fetched``: what was read, where from
    and how many bytes; ``commit``: the Hub commit the headers belong to (None for a local folder);
    ``card_capability``: the compute capability of the card the load is planned for (None: not known).
    """

    source: str
    format: str
    files: tuple[str, ...]
    tensors: tuple[TensorHeader, ...] = ()
    header_bytes: int = 0
    fetched: tuple[Fetched, ...] = ()
    commit: str | None = None
    card_capability: tuple[int, int] | None = None  # the compute capability the load is planned for
    file_bytes: tuple[int, ...] = ()  # size of each file in ``files`` (header + tensors), when known

    @property
    def total_bytes(self) -> int:
        """Sum of the stored tensor bytes (0 without headers)."""
        return sum(t.nbytes for t in self.tensors)

    def bytes_by_dtype(self) -> dict[str, int]:
        """Stored bytes per safetensors dtype, largest first."""
        out: dict[str, int] = {}
        for t in self.tensors:
            out[t.dtype] = out.get(t.dtype, 0) + t.nbytes
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    @property
    def stored_float_dtype(self) -> str | None:
        """``bf16``/``fp16``/``fp32`` of the floating tensors holding the most bytes, or None."""
        for dt in self.bytes_by_dtype():
            if dt in SAFETENSORS_FLOATS:
                return SAFETENSORS_FLOATS[dt]
        return None

    def to_json(self) -> dict:
        """A summary for ``--format json`` (not the tensors one by one): sizes are ints of bytes."""
        return {"source": self.source, "format": self.format, "commit": self.commit, "files": list(self.files),
                "tensor_count": len(self.tensors), "stored_bytes": self.total_bytes,
                "stored_bytes_by_dtype": self.bytes_by_dtype(), "header_bytes": self.header_bytes,
                "fetched": [{"what": f.what, "bytes": f.nbytes, "origin": f.origin} for f in self.fetched],
                "fetched_network_bytes": sum(f.nbytes for f in self.fetched if f.origin == "network"),
                "planned_for_compute_capability": list(self.card_capability) if self.card_capability else None}


def tensors_from_header(header: dict, file: str) -> list[TensorHeader]:
    """The tensors of one parsed header dict (``__metadata__`` skipped).

    Raises:
        ConfigError: an entry without ``dtype``/``shape``/``data_offsets`` or with an unknown dtype.
    """
    out = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = info["data_offsets"]
            dtype, shape = str(info["dtype"]), tuple(int(d) for d in info["shape"])
        except (KeyError, TypeError, ValueError):
            raise ConfigError(f"{file}:{name}", info, "a safetensors entry with dtype, shape and data_offsets",
                              "re-download the file; its header is damaged") from None
        out.append(TensorHeader(name, dtype, shape, int(end) - int(begin), file))
    return out


def read_local_header(path: Path) -> tuple[dict, int]:
    """(the header dict, header bytes ``8 + N``) of one local safetensors file, reading no tensor data, checked
    against the file as safetensors checks it before loading: a regular file (never opened otherwise), a length
    ``N`` within the file and :data:`MAX_HEADER_BYTES`, a JSON object whose entries each lie inside the data after
    it (``data_offsets`` ascending, ``end - begin`` the bytes of the shape and dtype) and cover it to its end.

    Raises:
        ConfigError: naming the file and what is wrong with it (empty, truncated, not safetensors, damaged).
    """
    size = regular_file(path, "MODEL", "safetensors file").st_size
    fix = f"re-download {path.name}: "
    if size < 8:
        raise ConfigError("MODEL", str(path), "a safetensors file (an 8-byte header length first)",
                          fix + f"it holds {size} bytes" + (" (an empty file: an interrupted download?)" if not size
                                                            else ""))
    with open_regular(path, "MODEL", "safetensors file") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > min(MAX_HEADER_BYTES, size - 8):
            raise ConfigError("MODEL", str(path), f"a header length of at most {min(MAX_HEADER_BYTES, size - 8):,}"
                              " bytes (the file's size and safetensors' limit)",
                              fix + f"its first 8 bytes say {n:,}: the file is not safetensors, or is cut short")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        header = None
    if not isinstance(header, dict):
        raise ConfigError("MODEL", str(path), "a safetensors header (a JSON object)", fix + "its header is damaged")
    _check_offsets(path, header, size - 8 - n)
    return header, 8 + n


def _check_offsets(path: Path, header: dict, data_bytes: int) -> None:
    """Each entry's ``data_offsets`` inside the ``data_bytes`` after the header, sized by its shape and dtype, and
    the entries together ending where the file ends (safetensors' "file not fully covered")."""
    end_max = 0
    for t in tensors_from_header(header, path.name):
        begin, end = header[t.name]["data_offsets"]
        width = SAFETENSORS_BYTES.get(t.dtype)
        if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end <= data_bytes) or \
                (width is not None and end - begin != t.numel * width):
            raise ConfigError(f"{path.name}:{t.name}", [begin, end], f"offsets inside the file's {data_bytes:,} "
                              "bytes of tensor data, sized by the tensor's shape and dtype",
                              f"re-download {path}: the file is truncated or damaged")
        end_max = max(end_max, end)
    if end_max != data_bytes:
        raise ConfigError("MODEL", str(path), f"tensor data of {end_max:,} bytes after the header, as it says",
                          f"the file holds {data_bytes:,}: re-download {path.name} (it is cut short or damaged)")


def read_local_checkpoint(folder: Path) -> CheckpointHeaders | None:
    """The headers of every ``*.safetensors`` file in ``folder``; a ``pytorch`` record naming the ``.bin`` files
    when there are none; None when the folder holds neither (a config.json alone)."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        bins = sorted(p.name for p in folder.glob("*.bin") if p.name != "training_args.bin")
        return CheckpointHeaders(str(folder), "pytorch", tuple(bins)) if bins else None
    tensors: list[TensorHeader] = []
    header_total = 0
    fetched = []
    for path in files:
        header, nbytes = read_local_header(path)
        tensors += tensors_from_header(header, path.name)
        header_total += nbytes
        fetched.append(Fetched(f"{path.name} header", nbytes, "local"))
    return CheckpointHeaders(str(folder), "safetensors", tuple(p.name for p in files), tuple(tensors),
                             header_total, tuple(fetched), file_bytes=tuple(p.stat().st_size for p in files))


def to_cache_json(ck: CheckpointHeaders) -> str:
    """Canonical JSON of ``ck`` with every tensor, for vramguard's header cache (:func:`from_cache_json`)."""
    return json.dumps({"source": ck.source, "format": ck.format, "files": list(ck.files), "commit": ck.commit,
                       "header_bytes": ck.header_bytes, "file_bytes": list(ck.file_bytes),
                       "tensors": [[t.name, t.dtype, list(t.shape), t.nbytes, t.file] for t in ck.tensors]})


def from_cache_json(text: str) -> CheckpointHeaders:
    """Inverse of :func:`to_cache_json`. Raises ValueError/KeyError/TypeError on a damaged cache entry."""
    d = json.loads(text)
    tensors = tuple(TensorHeader(n, dt, tuple(shape), int(b), f) for n, dt, shape, b, f in d["tensors"])
    return CheckpointHeaders(d["source"], d["format"], tuple(d["files"]), tensors, int(d["header_bytes"]),
                             commit=d.get("commit"), file_bytes=tuple(int(b) for b in d.get("file_bytes", ())))


def check_weights(folder: str | os.PathLike) -> None:
    """Check every safetensors file of ``folder`` (its header against the file,
    :func:`read_local_header`) and its weights index (:func:`vramguard.inputs.check_index`) before a loader
    opens them.

    Raises:
        ConfigError: naming the file at fault and the fix.
    """
    folder = Path(folder)
    check_index(folder)
    for path in sorted(folder.glob("*.safetensors")):
        read_local_header(path)
