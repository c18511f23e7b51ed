"""Reading a model's metadata from the Hugging Face Hub through huggingface_hub: config files and safetensors
headers, never the weights.

What is read, with huggingface_hub's own calls: ``HfApi.model_info`` (the file list and the commit), ``hf_hub_download``
of ``config.json``, ``generation_config.json`` and a separate quantization config (``quantize_config.json``,
``quant_config.json``) into the Hugging Face cache, and ``HfApi.get_safetensors_metadata`` (or
``parse_safetensors_file_metadata`` for shards named otherwise), which reads each header by HTTP range requests:
``bytes=0-100000``, then the rest of a longer header (``hf_api.py::parse_safetensors_file_metadata``). The parsed
headers are cached as one JSON per commit beside the Hugging Face cache (:func:`header_cache_dir`).

Environment: ``HF_TOKEN`` (huggingface_hub reads it), ``HF_ENDPOINT`` and ``HF_HUB_OFFLINE`` (read here at each
call, since huggingface_hub 1.x and 2.x read them once at import, ``constants.ENDPOINT`` /
``constants.HF_HUB_OFFLINE``). Offline, or when the Hub cannot be reached, the Hugging Face cache answers.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from vramguard.diskcache import vramguard_cache_dir
from vramguard.errors import HubError
from vramguard.hub.headers import (
    CheckpointHeaders, Fetched, TensorHeader, from_cache_json, read_local_checkpoint, tensors_from_header,
    to_cache_json)

HEADER_RANGE_BYTES = 100_001  # huggingface_hub's first range request per file: bytes=0-100000
_QUANT_FILES = {"quantize_config.json": "gptq", "quant_config.json": "awq"}
_TRUE = {"1", "on", "yes", "true"}


def endpoint() -> str:
    """The Hub's address: ``HF_ENDPOINT`` as set now, else huggingface_hub's ``constants.ENDPOINT``."""
    from huggingface_hub import constants
    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def offline() -> bool:
    """``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) set now, or huggingface_hub's own offline mode."""
    from huggingface_hub import constants
    env = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return env.strip().lower() in _TRUE or bool(constants.HF_HUB_OFFLINE)


def header_cache_dir() -> Path:
    """``$VRAMGUARD_CACHE_DIR/headers``, else ``headers/`` under a ``vramguard`` folder beside huggingface_hub's
    cache (``HF_HOME/vramguard`` by default)."""
    return vramguard_cache_dir() / "headers"


@dataclass(frozen=True)
class HubModel:
    """What the Hub (or its cache) holds for one repo at one commit: ``config`` is config.json (with a separate
    quantization config merged in when config.json has none), ``checkpoint`` the headers or the file list."""

    repo_id: str
    revision: str
    commit: str | None
    config: dict
    generation_config: dict | None
    checkpoint: CheckpointHeaders
    notes: tuple[str, ...] = ()
    snapshot: str | None = None  # the local cache folder it was read from (None: read from the Hub)


def _fix_login(repo_id: str) -> str:
    return (f"accept the model's terms on its Hub page, then log in: hf auth login (or set HF_TOKEN); "
            f"or download it where you have access: hf download {repo_id} config.json")


def hub_error(e: BaseException, repo_id: str, revision: str) -> HubError:
    """A :class:`HubError` saying what happened, for an exception of huggingface_hub or its HTTP client."""
    from huggingface_hub import errors as hf
    first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
    if isinstance(e, hf.GatedRepoError):
        return HubError("MODEL", repo_id, f"a gated repository: the Hub refused access without a token that was "
                        f"granted it ({first})", _fix_login(repo_id))
    if isinstance(e, hf.RepositoryNotFoundError):
        return HubError("MODEL", repo_id, "no such repository on the Hub (or a private one this token cannot see)",
                        "check the id (e.g. meta-llama/Llama-3.1-8B-Instruct); for a private repo: hf auth login")
    if isinstance(e, hf.RevisionNotFoundError):
        return HubError("revision", revision, f"no such branch, tag or commit in {repo_id}",
                        "pass an existing revision: main, a tag or a commit id from the repo's page")
    status = getattr(getattr(e, "response", None), "status_code", None)
    if isinstance(e, hf.HfHubHTTPError) and status in (401, 403):
        return HubError("MODEL", repo_id, f"the Hub refused access ({first})", _fix_login(repo_id))
    if isinstance(e, hf.HfHubHTTPError):
        return HubError("MODEL", repo_id, f"the Hub answered an error ({first})",
                        "retry later; check HF_ENDPOINT if you set it")
    if isinstance(e, hf.SafetensorsParsingError):
        return HubError("MODEL", repo_id, f"a safetensors header on the Hub could not be parsed ({first})",
                        "plan a local folder of the model, or another revision")
    return HubError("MODEL", repo_id, f"the Hub cannot be reached ({type(e).__name__}: {first}) and the local "
                    "cache does not hold this model's config.json",
                    f"connect and retry, or on a connected machine: hf download {repo_id} config.json (then copy "
                    "the cache), or pass a local folder")


def _network_errors() -> tuple[type[BaseException], ...]:
    from huggingface_hub import errors as hf
    return (hf.OfflineModeIsEnabled, hf.HTTPError, ConnectionError, TimeoutError, OSError)


def _read_json_file(path: str | os.PathLike, what: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise HubError("MODEL", str(path), f"a readable {what} (JSON)", f"delete it from the cache and retry "
                       f"({type(e).__name__})") from None
    if not isinstance(data, dict):
        raise HubError("MODEL", str(path), f"a {what} holding one JSON object", "delete it from the cache")
    return data


def _commit_of(path: str) -> str | None:
    m = re.search(r"[/\\]snapshots[/\\]([0-9a-f]{40})[/\\]", path)
    return m.group(1) if m else None


def _cache_path(repo_id: str, commit: str) -> Path:
    return header_cache_dir() / repo_id.replace("/", "--") / f"{commit}.json"


def _cached_headers(repo_id: str, commit: str | None) -> CheckpointHeaders | None:
    if not commit:
        return None
    p = _cache_path(repo_id, commit)
    try:
        ck = from_cache_json(p.read_text(encoding="utf-8"))
    except (OSError, ValueError, KeyError, TypeError):  # absent or damaged: read the headers again
        return None
    from dataclasses import replace
    return replace(ck, fetched=(Fetched(f"headers of {len(ck.files)} file(s) ({p.name})", p.stat().st_size,
                                        "cache"),))


def _store_headers(repo_id: str, ck: CheckpointHeaders) -> None:
    if not ck.commit:
        return
    p = _cache_path(repo_id, ck.commit)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(".tmp")
        tmp.write_text(to_cache_json(ck), encoding="utf-8")
        tmp.replace(p)
    except OSError:  # a read-only cache: the headers are read again next time
        pass


def _download(repo_id: str, filename: str, revision: str, fetched: list[Fetched]) -> str:
    """hf_hub_download of one small file, recording whether the cache had it."""
    from huggingface_hub import hf_hub_download, try_to_load_from_cache
    hit = try_to_load_from_cache(repo_id, filename, revision=revision)
    path = hf_hub_download(repo_id, filename, revision=revision, endpoint=endpoint())
    fetched.append(Fetched(filename, os.path.getsize(path), "cache" if isinstance(hit, str) else "network"))
    return path


def _remote_headers(api, repo_id: str, commit: str, st_files: list[str], sizes: dict[str, int],
                    fetched: list[Fetched]) -> CheckpointHeaders:
    """The safetensors headers at ``commit`` by range requests (huggingface_hub), with the bytes each cost."""
    from huggingface_hub import constants
    from huggingface_hub import errors as hf
    try:
        meta = api.get_safetensors_metadata(repo_id, revision=commit)
        files_meta = meta.files_metadata
        if meta.sharded:
            fetched.append(Fetched(constants.SAFETENSORS_INDEX_FILE, sizes.get(constants.SAFETENSORS_INDEX_FILE, 0),
                                   "network"))
    except hf.NotASafetensorsRepoError:  # shards named otherwise (gptq_model-4bit-128g.safetensors)
        files_meta = {f: api.parse_safetensors_file_metadata(repo_id, f, revision=commit) for f in st_files}
    tensors: list[TensorHeader] = []
    header_total = 0
    file_bytes = []
    for name in sorted(files_meta):
        fm = files_meta[name]
        header = {k: {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": list(t.data_offsets)}
                  for k, t in fm.tensors.items()}
        tensors += tensors_from_header(header, name)
        n = _header_length(header, fm.metadata, sizes.get(name))
        header_total += n
        file_bytes.append(n + max((v["data_offsets"][1] for v in header.values()), default=0))
        fetched.append(Fetched(f"{name} header", range_bytes(n, sizes.get(name)), "network"))
    return CheckpointHeaders(f"hub:{repo_id}", "safetensors", tuple(sorted(files_meta)), tuple(tensors),
                             header_total, commit=commit, file_bytes=tuple(file_bytes))


def range_bytes(header_bytes: int, file_bytes: int | None) -> int:
    """Bytes huggingface_hub's header reading receives for one file: the first range ``bytes=0-100000`` (the
    whole file when smaller), then ``bytes=8-(8+N-1)`` again when the header ``8 + N`` is longer than that."""
    first = min(HEADER_RANGE_BYTES, file_bytes) if file_bytes else HEADER_RANGE_BYTES
    return first + (header_bytes - 8 if header_bytes > first else 0)


def _header_length(header: dict, metadata: dict | None, file_bytes: int | None) -> int:
    """``8 + N`` of one file: the file's size less its data (the largest data offset), exact when the Hub gave
    the size; else the length of the header re-encoded as JSON (huggingface_hub keeps no raw length)."""
    data_end = max((v["data_offsets"][1] for v in header.values()), default=0)
    if file_bytes:
        return file_bytes - data_end
    body = {"__metadata__": metadata, **header} if metadata else header
    return 8 + len(json.dumps(body, separators=(",", ":")).encode())


def _siblings(info) -> tuple[list[str], dict[str, int]]:
    names, sizes = [], {}
    for s in info.siblings or ():
        names.append(s.rfilename)
        if getattr(s, "size", None) is not None:
            sizes[s.rfilename] = int(s.size)
    return names, sizes


def _configs(repo_id: str, revision: str, names: list[str], fetched: list[Fetched]) -> tuple[dict, dict | None,
                                                                                              list[str]]:
    """(config.json with a separate quantization config merged in, generation_config.json or None, notes)."""
    config = _read_json_file(_download(repo_id, "config.json", revision, fetched), "config.json")
    gen = None
    if "generation_config.json" in names:
        gen = _read_json_file(_download(repo_id, "generation_config.json", revision, fetched),
                              "generation_config.json")
    notes = []
    for fname, method in _QUANT_FILES.items():
        if fname in names:
            q = _read_json_file(_download(repo_id, fname, revision, fetched), fname)
            if not config.get("quantization_config"):
                config["quantization_config"] = {"quant_method": method, **q}
                notes.append(f"{fname} read as the quantization config ({method}); config.json has none, so "
                             "transformers would not load this checkpoint as quantized")
    return config, gen, notes


def _checkpoint_files(names: list[str]) -> tuple[list[str], list[str]]:
    """(safetensors files, PyTorch pickle weight files) among a repo's files."""
    st = sorted(n for n in names if n.endswith(".safetensors") and "/" not in n)
    bins = sorted(n for n in names if n.endswith(".bin") and "/" not in n and n != "training_args.bin")
    return st, bins


def _from_hub(repo_id: str, revision: str) -> HubModel:
    from dataclasses import replace

    from huggingface_hub import HfApi
    api = HfApi(endpoint=endpoint())
    info = api.model_info(repo_id, revision=revision, files_metadata=True)
    commit = info.sha or revision
    names, sizes = _siblings(info)
    if "config.json" not in names:
        raise HubError("MODEL", repo_id, f"the repository has no config.json at {revision} (files: "
                       f"{', '.join(names[:6]) or 'none'})", "pass the id of a transformers model repository")
    fetched: list[Fetched] = []
    config, gen, notes = _configs(repo_id, revision, names, fetched)  # by revision: the cache records its ref
    st, bins = _checkpoint_files(names)
    ck = _cached_headers(repo_id, commit) if st else None
    if ck is None and st:
        ck = _remote_headers(api, repo_id, commit, st, sizes, fetched)
        _store_headers(repo_id, ck)
    if ck is None:
        ck = CheckpointHeaders(f"hub:{repo_id}", "pytorch" if bins else "none", tuple(bins), commit=commit)
    return HubModel(repo_id, revision, commit, config, gen, replace(ck, fetched=tuple(fetched) + ck.fetched),
                    tuple(notes))


def from_cache(repo_id: str, revision: str) -> HubModel | None:
    """The model as the local Hugging Face cache holds it at ``revision`` (no network), or None when its
    config.json is not there. Headers: vramguard's header cache, else the snapshot's own safetensors files."""
    from huggingface_hub import try_to_load_from_cache

    try:
        hit = try_to_load_from_cache(repo_id, "config.json", revision=revision)
    except ValueError:  # not a valid repo id: not in the cache
        return None
    if not isinstance(hit, str) or not os.path.isfile(hit):
        return None
    snapshot = Path(hit).parent
    commit = _commit_of(hit) or snapshot.name
    fetched = [Fetched("config.json", os.path.getsize(hit), "cache")]
    config = _read_json_file(hit, "config.json")
    gen_path = snapshot / "generation_config.json"
    gen = _read_json_file(gen_path, "generation_config.json") if gen_path.is_file() else None
    for fname, method in _QUANT_FILES.items():
        if (snapshot / fname).is_file() and not config.get("quantization_config"):
            config["quantization_config"] = {"quant_method": method, **_read_json_file(snapshot / fname, fname)}
    ck = _cached_headers(repo_id, commit) or read_local_checkpoint(snapshot)
    if ck is None:
        ck = CheckpointHeaders(f"hf-cache:{snapshot}", "unknown", (), commit=commit)
    from dataclasses import replace
    return HubModel(repo_id, revision, commit, config, gen,
                    replace(ck, fetched=tuple(fetched) + ck.fetched, commit=ck.commit or commit),
                    snapshot=str(snapshot))


def fetch_model(repo_id: str, revision: str | None = None) -> HubModel:
    """config.json, generation_config.json, the quantization config and the safetensors headers of ``repo_id`` at
    ``revision`` (default ``main``): from the Hub, or from the local cache when offline (``HF_HUB_OFFLINE``) or
    when the Hub cannot be reached.

    Raises:
        HubError: a gated repo without an accepted token (401/403), an unknown repo or revision (404), another
            HTTP error, or no network and nothing in the cache; each with what happened and the fix.
    """
    from dataclasses import replace

    from huggingface_hub import errors as hf
    rev = revision or "main"
    if offline():
        hit = from_cache(repo_id, rev)
        if hit is None:
            raise HubError("MODEL", repo_id, f"not in the local Hugging Face cache (revision {rev}), and "
                           "HF_HUB_OFFLINE is set, so the Hub was not asked",
                           f"unset HF_HUB_OFFLINE, or on a connected machine: hf download {repo_id} config.json")
        return replace(hit, notes=hit.notes + ("HF_HUB_OFFLINE is set: read from the local cache",))
    try:
        return _from_hub(repo_id, rev)
    except (hf.HfHubHTTPError, hf.SafetensorsParsingError) as e:
        raise hub_error(e, repo_id, rev) from None
    except _network_errors() as e:
        hit = from_cache(repo_id, rev)
        if hit is None:
            raise hub_error(e, repo_id, rev) from None
        why = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        return replace(hit, notes=hit.notes + (f"the Hub cannot be reached ({why}); read from the local cache",))
