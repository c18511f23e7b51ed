"""What a plan learned, kept on disk: a later process that plans the same model with the same settings on the same
cards reads the :class:`~vramguard.plan.estimator.Plan` computed before, and a later read of the same config.json
the config transformers built for it, without importing torch or transformers.

A plan of a hand family needs transformers for its load (the meta-device module tree) and its reserved memory (the
caching-allocator tape of transformers' forward); a plan of any other architecture needs it for all of its figures.
Both take seconds to tens of seconds, most of it importing torch and transformers, so the result is kept once
computed. One gzipped JSON file per entry under ``$VRAMGUARD_CACHE_DIR/plans`` (else ``plans/`` beside the Hub
header cache, :func:`vramguard_cache_dir`), named by the SHA-256 of everything the entry depends
on (:func:`entry_key`): the inputs given, the versions of the libraries whose rules the figures follow (read from
their installed metadata, not imported) and the source of every vramguard module (so a changed rule never reads an
old plan). ``VRAMGUARD_PLAN_CACHE=0`` turns it off; ``VRAMGUARD_PLAN_CACHE=/a/folder`` keeps the entries there. An
entry that cannot be read is computed again; one that cannot be written is said once, as for the tape cache
(:mod:`vramguard.introspect.tape_cache`). A folder past :data:`MAX_FOLDER_BYTES` or :data:`MAX_FOLDER_ENTRIES`
drops its least recently used entries (:func:`prune`; a read counts as a use), so that entries of earlier versions
do not pile up.

Objects are written as JSON (:func:`encode`): a dataclass as its module, class and fields; a tuple, a dict and an
enum member tagged as such, so that a plan read back equals the one written (a test compares the JSON and the
table of both to the byte). Only vramguard's own dataclasses and enums are rebuilt when read (:func:`decode`).
"""

from __future__ import annotations

import dataclasses
import enum
import gzip
import hashlib
import importlib
import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

from vramguard.extras import OPTIONAL_PACKAGES

# the distributions whose rules a plan follows: vramguard's optional packages (transformers' modules and quantizers,
# bitsandbytes' layout, accelerate's device maps, PyTorch's allocator...), the Hub client, and those a pre-quantized
# checkpoint's load rule asks for (vramguard.hub.prequant: its backends, the Triton and kernels checks of MXFP4)
DISTRIBUTIONS = (*OPTIONAL_PACKAGES, "huggingface_hub", "flash_attn", "optimum", "gptqmodel", "compressed-tensors",
                 "triton", "kernels", "mamba-ssm", "causal-conv1d", "flash-linear-attention")

_PACKAGE = Path(__file__).resolve().parent.parent


def enabled() -> bool:
    """False when ``VRAMGUARD_PLAN_CACHE`` is ``0``, ``false``, ``no`` or ``off``."""
    return os.environ.get("VRAMGUARD_PLAN_CACHE", "1").strip().lower() not in ("0", "false", "no", "off")


def vramguard_cache_dir() -> Path:
    """The folder of everything vramguard keeps on disk: ``$VRAMGUARD_CACHE_DIR``, else a ``vramguard`` folder
    beside huggingface_hub's cache (``HF_HOME/vramguard`` by default)."""
    if os.environ.get("VRAMGUARD_CACHE_DIR"):
        return Path(os.environ["VRAMGUARD_CACHE_DIR"])
    from huggingface_hub import constants
    return Path(constants.HF_HUB_CACHE).parent / "vramguard"


def cache_dir() -> Path:
    """``VRAMGUARD_PLAN_CACHE`` where it names a folder (any value but ``1``, ``true``, ``yes``, ``on`` and those
    that turn the cache off), else ``plans/`` in :func:`vramguard_cache_dir`."""
    given = os.environ.get("VRAMGUARD_PLAN_CACHE", "").strip()
    if given and given.lower() not in ("1", "true", "yes", "on"):
        return Path(given).expanduser()
    return vramguard_cache_dir() / "plans"


def _version(dist: str) -> str | None:
    """The installed version of distribution ``dist``, None when it is not installed."""
    from importlib import metadata  # here, not at the top: importing it costs every command ~50 ms at start
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


@lru_cache(maxsize=1)
def environment_version() -> str | None:
    """SHA-256 of the installed versions of :data:`DISTRIBUTIONS` (None where absent) and of the source of every
    module of vramguard; None when a source file cannot be read (an install without sources: nothing is cached).
    About 10 ms: no library is imported."""
    h = hashlib.sha256("|".join(f"{d}={_version(d)}" for d in DISTRIBUTIONS).encode())
    try:
        for path in sorted(_PACKAGE.rglob("*.py")):
            h.update(str(path.relative_to(_PACKAGE)).encode() + b"\0" + path.read_bytes())
    except OSError:
        return None
    return h.hexdigest()


def entry_key(kind: str, *parts: object) -> Path | None:
    """The file of the ``kind`` entry (``plan``, ``config``) computed from ``parts`` (each written with ``repr``,
    which must name every input the entry depends on); None when the cache is off or the code cannot be read."""
    version = environment_version() if enabled() else None
    if version is None:
        return None
    h = hashlib.sha256(f"{kind}\0{version}".encode())
    for part in parts:
        h.update(b"\0" + repr(part).encode())
    return cache_dir() / f"{kind}-{h.hexdigest()}.json.gz"


def read(path: Path | None) -> Any | None:
    """The object stored in ``path``; None when there is none, or it cannot be read or rebuilt."""
    if path is None:
        return None
    try:
        return decode(read_gz_json(path))
    except (OSError, ValueError, EOFError, TypeError, KeyError, AttributeError, ImportError):
        return None


def write(path: Path | None, obj: Any) -> None:
    """Store ``obj`` in ``path`` (written beside it, then renamed: a reader never sees half a file); nothing when
    ``path`` is None or ``obj`` holds a value :func:`encode` does not write; said once when the folder cannot be
    written."""
    if path is None:
        return
    try:
        text = json.dumps(encode(obj), separators=(",", ":"))
    except TypeError:
        return
    write_text_gz(path, text, _warn_unwritable)


MAX_FOLDER_BYTES = 256 * 2**20  # a cache folder (plans, tapes) past this drops its least recently used entries
MAX_FOLDER_ENTRIES = 5_000  # ... or past this many files (listing 2,000 takes ~13 ms a write)


def read_gz_json(path: Path) -> Any:
    """The JSON in the gzipped file ``path``, its modification time set to now (the folder's least recently used
    entries are the first :func:`prune` removes). Raises what ``gzip`` and ``json`` raise (``OSError``,
    ``ValueError``, ``EOFError``)."""
    with gzip.open(path, "rt", encoding="utf-8") as f:
        found = json.load(f)
    try:
        os.utime(path)
    except OSError:  # a read-only cache is still read
        pass
    return found


def prune(folder: Path, max_bytes: int | None = None, max_entries: int | None = None) -> int:
    """Remove the least recently used ``*.json.gz`` files of ``folder`` (oldest modification time first: a read
    sets it, :func:`read_gz_json`) until it holds at most three quarters of ``max_bytes`` and of ``max_entries``,
    when it holds more than either. Returns the files removed; a file another process removed first, or one that
    cannot be removed, is passed over. None: :data:`MAX_FOLDER_BYTES`, :data:`MAX_FOLDER_ENTRIES`."""
    max_bytes = MAX_FOLDER_BYTES if max_bytes is None else max_bytes
    max_entries = MAX_FOLDER_ENTRIES if max_entries is None else max_entries
    try:
        entries = [(st.st_mtime, st.st_size, e.path) for e in os.scandir(folder)
                   if e.name.endswith(".json.gz") and (st := e.stat())]
    except OSError:
        return 0
    total = sum(size for _, size, _ in entries)
    if total <= max_bytes and len(entries) <= max_entries:
        return 0
    removed = 0
    left = len(entries)
    for _, size, name in sorted(entries):
        if total <= max_bytes * 3 // 4 and left <= max_entries * 3 // 4:
            break
        try:
            os.unlink(name)
            removed += 1
        except OSError:
            pass
        total, left = total - size, left - 1
    return removed


def write_text_gz(path: Path, text: str, unwritable) -> None:
    """Write ``text`` gzipped to ``path`` beside it first, then renamed (a reader never sees half a file), then
    :func:`prune` its folder; on an ``OSError`` the half-written file is removed and ``unwritable(folder, error)``
    is called instead of raising."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with gzip.open(tmp, "wt", encoding="utf-8", compresslevel=3) as f:
            f.write(text)
        os.replace(tmp, path)
        prune(path.parent)
    except OSError as e:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        unwritable(path.parent, e)


_WARNED: set[str] = set()


def warn_unwritable_once(folder: Path, e: OSError, what: str, consequence: str) -> None:
    """Say once per folder (a ``UserWarning``) that ``what`` (e.g. "the plan cache folder") at ``folder`` cannot be
    written, and ``consequence``."""
    if f"{what}\0{folder}" in _WARNED:
        return
    _WARNED.add(f"{what}\0{folder}")
    import warnings
    warnings.warn(f"vramguard: {what} {folder} cannot be written ({e.strerror or e}): {consequence}", UserWarning,
                  stacklevel=4)


def _warn_unwritable(folder: Path, e: OSError) -> None:
    """Plans cannot be kept in ``folder``: each is computed again."""
    warn_unwritable_once(folder, e, "the plan cache folder", "each plan is computed again; set VRAMGUARD_PLAN_CACHE "
                         "to a writable folder, or to 0 to turn the cache off")


def encode(obj: Any) -> Any:
    """``obj`` as JSON values: a dataclass ``{"c": "module:Class", "f": {field: value}}``, a tuple ``{"t": [...]}``,
    a dict ``{"d": [[key, value], ...]}``, an enum member ``{"e": "module:Class", "v": value}``. Raises TypeError
    for any other object (a set, a function, another library's object)."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, enum.Enum):
        return {"e": _where(type(obj)), "v": encode(obj.value)}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {"c": _where(type(obj)), "f": {f.name: encode(getattr(obj, f.name)) for f in dataclasses.fields(obj)}}
    if isinstance(obj, tuple):
        return {"t": [encode(v) for v in obj]}
    if isinstance(obj, list):
        return [encode(v) for v in obj]
    if isinstance(obj, dict):
        return {"d": [[encode(k), encode(v)] for k, v in obj.items()]}
    raise TypeError(f"{type(obj).__name__} is not stored in the plan cache")


def decode(data: Any) -> Any:
    """The object :func:`encode` wrote. Raises TypeError for a class outside vramguard or not a dataclass/enum."""
    if isinstance(data, list):
        return [decode(v) for v in data]
    if not isinstance(data, dict):
        return data
    if "t" in data:
        return tuple(decode(v) for v in data["t"])
    if "d" in data:
        return {decode(k): decode(v) for k, v in data["d"]}
    if "e" in data:
        return _class(data["e"], enum.Enum)(decode(data["v"]))
    cls = _class(data["c"], None)
    obj = object.__new__(cls)  # the fields as written, without running __init__'s checks again
    for name, value in data["f"].items():
        object.__setattr__(obj, name, decode(value))
    return obj


def _where(cls: type) -> str:
    if not cls.__module__.startswith("vramguard."):
        raise TypeError(f"{cls.__module__}.{cls.__qualname__} is not stored in the plan cache")
    return f"{cls.__module__}:{cls.__qualname__}"


def _class(where: str, base: type | None) -> type:
    module, _, name = where.partition(":")
    if not module.startswith("vramguard."):
        raise TypeError(f"{where}: not a vramguard class")
    cls = getattr(importlib.import_module(module), name)
    if not (issubclass(cls, base) if base else dataclasses.is_dataclass(cls)):
        raise TypeError(f"{where}: not a vramguard dataclass or enum")
    return cls
