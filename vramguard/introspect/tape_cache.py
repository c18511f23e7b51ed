"""The allocation tapes of the meta-device forwards, kept on disk: a later plan of the same model, settings and
prompt reads them instead of running transformers' forward again; and, beside them, the result of each replay
through the allocator model (a JSON object), which depends on nothing else.

One gzipped JSON file per tape under ``$VRAMGUARD_CACHE_DIR/tapes`` (else ``tapes/`` beside the Hub headers,
:func:`vramguard.hub.fetch.header_cache_dir`). Its name is the SHA-256 of everything the tape depends on: the
config text, the model name, the settings, the prompt, the number of forwards, the versions of torch and
transformers (from their installed metadata, without importing them), the kernel packages installed (the path
``kernels='installed'`` replays) and the source of the modules that record the tape (so a changed tracker never
reads an old tape). A hand family's tape (:mod:`vramguard.memory.hand_tape`) is written afresh each time: only the
replays through the allocator model are kept for it.
``VRAMGUARD_TAPE_CACHE=0`` turns it off; ``VRAMGUARD_TAPE_CACHE=/a/folder`` keeps the tapes there. A file that
cannot be read or written is recomputed and the plan goes on. A folder past 256 MiB or 5,000 files drops its
least recently used tapes (:func:`vramguard.diskcache.prune`).
"""

from __future__ import annotations

import hashlib
import json
import os
from functools import lru_cache
from pathlib import Path

from vramguard.diskcache import read_gz_json, write_text_gz
from vramguard.hub.fetch import header_cache_dir
from vramguard.introspect.mixers import installed_packages

# the modules whose code decides what a tape holds (vramguard/introspect/*, and the memory rules they read)
_SOURCES = ("alloc_replay.py", "build.py", "generic.py", "keys.py", "layer_trim.py", "mixers.py", "replay.py",
            "tracker.py", "mixer_paths.py", "load_tape.py",
            "../memory/forward.py", "../memory/kv.py", "../settings.py", "../memory/allocator.py",
            "../memory/decode_steps.py", "../memory/weights.py", "hand.py", "../memory/hand_tape.py",
            "../memory/metatensor.py", "stretch.py", "tape_stretch.py", "loop_trim.py")


def enabled() -> bool:
    """False when ``VRAMGUARD_TAPE_CACHE`` is ``0``, ``false``, ``no`` or ``off``."""
    return os.environ.get("VRAMGUARD_TAPE_CACHE", "1").strip().lower() not in ("0", "false", "no", "off")


def tape_cache_dir() -> Path:
    """``VRAMGUARD_TAPE_CACHE`` where it names a folder (any value but ``1``, ``true``, ``yes``, ``on`` and the
    values that turn the cache off), else ``$VRAMGUARD_CACHE_DIR/tapes``, else ``tapes/`` beside the Hub header
    cache."""
    given = os.environ.get("VRAMGUARD_TAPE_CACHE", "").strip()
    if given and given.lower() not in ("1", "true", "yes", "on"):
        return Path(given).expanduser()
    return header_cache_dir().parent / "tapes"


@lru_cache(maxsize=1)
def _code_version() -> str | None:
    """SHA-256 of the tape-recording modules' source, and the torch and transformers versions; None when a source
    file cannot be read (an install without sources: no tape is cached)."""
    h = hashlib.sha256(f"{_version('torch')}|{_version('transformers')}|{installed_packages()}".encode())
    here = Path(__file__).parent
    try:
        for name in _SOURCES:
            h.update((here / name).read_bytes())
    except OSError:
        return None
    return h.hexdigest()


def _version(package: str) -> str:
    """The installed version of ``package`` as its metadata records it (read without importing it), else ``-``."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(package)
    except PackageNotFoundError:
        return "-"


def tape_path(*key: object) -> Path | None:
    """The file of the tape recorded for ``key`` (the arguments of the recording, each written with ``repr``);
    None when the cache is off (:func:`enabled`) or the recording code cannot be read."""
    version = _code_version() if enabled() else None
    if version is None:
        return None
    h = hashlib.sha256(version.encode())
    for part in key:
        h.update(b"\0" + repr(part).encode())
    return tape_cache_dir() / f"{h.hexdigest()}.json.gz"


def read(path: Path) -> tuple | None:
    """The tape in ``path``: a tuple per forward of ``(key, bytes)`` pairs; None when absent or unreadable."""
    try:
        forwards = read_gz_json(path)["forwards"]
        return tuple(tuple((int(k), int(n)) for k, n in fw) for fw in forwards)
    except (OSError, ValueError, KeyError, TypeError, EOFError):
        return None


def read_record(path: Path) -> dict | None:
    """The JSON object :func:`write_record` stored in ``path``; None when absent or unreadable."""
    try:
        found = read_gz_json(path)
        return found if isinstance(found, dict) else None
    except (OSError, ValueError, EOFError):
        return None


def write(path: Path, forwards: tuple) -> None:
    """Store ``forwards`` in ``path`` (written beside it, then renamed: a reader never sees half a file);
    nothing when the folder cannot be written."""
    write_record(path, {"forwards": [list(map(list, fw)) for fw in forwards]})


def write_record(path: Path, record: dict) -> None:
    """Store the JSON object ``record`` in ``path`` as :func:`write` stores a tape."""
    write_text_gz(path, json.dumps(record, separators=(",", ":")), _warn_unwritable)


_WARNED: set[str] = set()


def _warn_unwritable(folder: Path, e: OSError) -> None:
    """Say once per folder (a ``UserWarning``) that the cache cannot be written there: plans still work, each
    replaying its tape again."""
    if str(folder) in _WARNED:
        return
    _WARNED.add(str(folder))
    import warnings
    warnings.warn(f"vramguard: the tape cache folder {folder} cannot be written ({e.strerror or e}): plans replay "
                  "their tapes each time; set VRAMGUARD_TAPE_CACHE to a writable folder, or to 0 to turn the cache "
                  "off", UserWarning, stacklevel=3)
