"""Turning the MODEL argument into a :class:`~vramguard.spec.ModelSpec`.

Accepted, in this order: a local model folder (with config.json; its safetensors headers are read), a path to a
config.json, a catalog name (``llama-2-7b``; :data:`vramguard.catalog.models.MODELS`), then a Hub model id
(``meta-llama/Llama-3.1-8B-Instruct``): without a revision, the local Hugging Face cache
(``huggingface_hub.try_to_load_from_cache``, no network), else the catalog entry copied from that repository
(offline), else the Hub itself (:mod:`vramguard.hub`: config files and safetensors headers, no weights).
"""

from __future__ import annotations

import difflib
import functools
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

from vramguard.catalog.models import ALIASES, MODELS
from vramguard.errors import HubError, InvalidValue, UnknownModel
from vramguard.hub import hub_spec, looks_like_repo_id, with_local_checkpoint
from vramguard.hub.fetch import from_cache
from vramguard.hub.headers import check_weights
from vramguard.inputs import read_config, weight_files_regular
from vramguard.spec import ModelSpec, spec_from_config

ACCEPTED_MODEL_FORMS = ("a local model folder, a config.json path, a catalog name (vramguard.catalog.models.MODELS), "
                        "or a Hugging Face Hub model id")


def _read_json(path: Path, field: str) -> dict:
    """The config.json at ``path``, read and checked once (:func:`vramguard.inputs.read_config`)."""
    return read_config(path, field)


GGUF_MAGIC = b"GGUF"  # the first 4 bytes of a GGUF file (llama.cpp's format; ggml's docs/gguf.md)


def is_gguf(path: Path) -> bool:
    """True when ``path`` is a file that starts with the GGUF magic bytes."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def gguf_error(path: Path, model: str) -> UnknownModel:
    """The error for a GGUF file given where a transformers model is expected: what it is, and how to convert it
    (transformers reads GGUF dequantized with ``from_pretrained(folder, gguf_file=name)``; a model loaded that way
    refuses ``save_pretrained``, so its state_dict goes into a ``from_config`` model that is saved, without the
    ``quantization_config`` the GGUF load set: the saved weights are dequantized tensors, not GGUF). The conversion
    is one shell command on a line of its own, indented by 4 spaces (a line of code, never wrapped)."""
    import shlex
    folder, name = json.dumps(str(path.parent)), json.dumps(path.name)
    dtype, why = gguf_dtype(path)
    program = (f"import torch; from transformers import AutoModelForCausalLM as M, AutoTokenizer as T; "
               f"m = M.from_pretrained({folder}, gguf_file={name}, dtype=torch.{dtype}); "
               f"c = M.from_config(m.config, dtype=torch.{dtype}); "
               'c.load_state_dict(m.state_dict()); vars(c.config).pop("quantization_config", None); '
               'c.save_pretrained("OUT"); '
               f'T.from_pretrained({folder}, gguf_file={name}).save_pretrained("OUT")')
    return UnknownModel(
        "MODEL", model, "a transformers model folder (config.json and safetensors weights); "
        f"{path.name} is a GGUF file (llama.cpp's format), which vramguard does not read",
        "plan the model's Hub id, or convert the file to a folder OUT with transformers, then pass OUT (needs the "
        f"gguf package; the weights come out dequantized, in {dtype}: {why}; a model loaded from GGUF refuses "
        f"save_pretrained, so a copy is saved):\n    python -c {shlex.quote(program)}")


def gguf_dtype(path: Path) -> tuple[str, str]:
    """The torch dtype a conversion of the GGUF file ``path`` should save, and why, from its tensor types
    (``gguf.GGUFReader``; the gguf package is the one transformers' GGUF loading needs):

    * quantized tensors (Q4_K, Q8_0...) or BF16 ones: ``bfloat16``. transformers dequantizes every tensor to
      float32 (``modeling_gguf_pytorch_utils.load_gguf_checkpoint`` through ``gguf.quants.dequantize``) unless a
      ``dtype`` is passed, and the model saved from it is float32: twice the bytes of the 16-bit checkpoint the
      GGUF was made from, for no precision the quantized values hold;
    * F16 tensors and no BF16 or quantized ones: ``float16``, exact;
    * F32 tensors only: ``float32``, exact.

    A file the gguf package cannot read (or no gguf package): ``bfloat16``, with the reason. The reader parses the
    whole header (a SmolLM2 file's 49,152-entry vocabulary: seconds), so the answer is kept per file, size and
    modification time.
    """
    try:
        stat = path.stat()
        return _gguf_dtype(str(path), stat.st_size, stat.st_mtime_ns)
    except OSError as e:
        return _unreadable_gguf(e)


def _unreadable_gguf(e: Exception) -> tuple[str, str]:
    return "bfloat16", (f"the GGUF's tensor types could not be read ({type(e).__name__}: {e}); bfloat16 is "
                        "the dtype of most checkpoints GGUF files are made from")


@functools.lru_cache(maxsize=8)
def _gguf_dtype(path: str, size: int, mtime_ns: int) -> tuple[str, str]:
    try:
        from gguf import GGUFReader
        types = {t.tensor_type.name for t in GGUFReader(path).tensors}
    except Exception as e:  # noqa: BLE001 - any failure to read the header: the default, and why
        return _unreadable_gguf(e)
    quantized = sorted(types - {"F32", "F16", "BF16"})
    if quantized or "BF16" in types:
        return "bfloat16", (f"the GGUF's tensors are quantized ({', '.join(quantized)})" if quantized
                            else "the GGUF's tensors are BF16")
    if "F16" in types:
        return "float16", "the GGUF's tensors are F16"
    return "float32", "the GGUF's tensors are F32"


def _refuse_gguf(p: Path, model: str) -> None:
    """Raise :func:`gguf_error` when ``p`` is a GGUF file, or a folder with no config.json that holds one."""
    if p.is_file() and is_gguf(p):
        raise gguf_error(p, model)
    if p.is_dir() and not (p / "config.json").is_file():
        hit = next((f for f in sorted(p.glob("*.gguf")) if is_gguf(f)), None)
        if hit is not None:
            raise gguf_error(hit, model)


def catalog_name(name: str) -> str | None:
    """The catalog key for ``name`` (case-insensitive, aliases allowed), or None."""
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    return key if key in MODELS else None


def catalog_for_repo_id(model: str) -> str | None:
    """The catalog key whose entry was copied from Hub repository ``model`` (case-insensitive), or None."""
    want = model.strip().lower()
    return next((k for k, v in MODELS.items() if str(v.get("source", "")).lower() == want), None)


def _bare_name(model: str) -> str:
    """``meta-llama/Llama-3.1-8B-Instruct`` -> ``llama-3.1-8b``: the id's last part, lower case, without the
    suffixes of fine-tunes (``-instruct``, ``-chat``, ``-hf``, ``-it``, ``-base``), which keep their base's shapes."""
    import re
    tail = model.strip().rstrip("/").split("/")[-1].lower()
    return re.sub(r"-(instruct|chat|hf|it|base)(?=-|$)", "", tail)


@dataclass(frozen=True)
class NameParts:
    """What a model's name says of it: ``family`` (its leading letters: ``gemma``, ``qwen``, ``gpt``),
    ``version`` (the generation: ``gemma-3`` 3.0, ``qwen2.5`` 2.5; None when the name has none) and ``size_b``
    (billions of parameters: ``12b`` 12.0, ``8x7b`` 56.0; None when the name has none)."""

    family: str
    version: float | None
    size_b: float | None


_OWNER_WORDS = ("meta",)  # a vendor word before the family (Meta-Llama-3-8B)
MAX_SIZE_RATIO = 2.0  # a catalog model more than twice as large or small as the one asked is no stand-in for it


def name_parts(model: str) -> NameParts | None:
    """The family, generation and size of a model id's name (:class:`NameParts`), or None when its first word
    is not letters, optionally followed by a version (``qwen2.5``)."""
    tokens = _bare_name(model).split("-")
    if tokens[0] in _OWNER_WORDS and len(tokens) > 1:
        tokens = tokens[1:]
    m = re.fullmatch(r"([a-z]+)(\d+(?:\.\d+)?)?", tokens[0])
    if not m:
        return None
    version, rest = m.group(2), tokens[1:]
    if version is None and rest and re.fullmatch(r"\d+(?:\.\d+)?", rest[0]):
        version, rest = rest[0], rest[1:]
    size = None
    for t in rest:
        dense, moe = re.fullmatch(r"(\d+(?:\.\d+)?)b", t), re.fullmatch(r"(\d+)x(\d+(?:\.\d+)?)b", t)
        if dense or moe:
            size = float(dense.group(1)) if dense else int(moe.group(1)) * float(moe.group(2))
            break
    return NameParts(m.group(1), float(version) if version else None, size)


def closest_catalog_name(model: str, names: list[str] | None = None) -> str | None:
    """The catalog name that stands for a model id (``meta-llama/Llama-3.1-8B-Instruct`` -> ``llama-3.1-8b``), or
    None: the name itself or an alias once ``-Instruct``/``-chat``/``-hf``/``-it``/``-base`` are dropped; else the
    catalog model of the same family (:func:`name_parts`) at the nearest generation, then the nearest size, within
    :data:`MAX_SIZE_RATIO` (``gemma-3-12b`` -> ``gemma-2-9b``, not ``gemma-2-2b``; ``gpt-oss-20b`` -> none); a
    name without a size: a family member whose name is nearly the same (``difflib`` ratio of at least 0.8).
    ``names`` replaces the catalog's (tests)."""
    names = list(MODELS) if names is None else names
    tail = _bare_name(model)
    if tail in names or ALIASES.get(tail) in names:
        return ALIASES.get(tail, tail)
    want = name_parts(model)
    if want is None:
        return None
    family = [(n, name_parts(n)) for n in names]
    family = [(n, p) for n, p in family if p is not None and p.family == want.family]
    if want.size_b is None:
        hit = difflib.get_close_matches(tail, [n for n, _ in family], n=1, cutoff=0.8)
        return hit[0] if hit else None

    def gap(p: NameParts) -> tuple[float, float]:
        version = abs((p.version or 1.0) - (want.version or 1.0))
        return version, abs(math.log(p.size_b / want.size_b))
    sized = [(n, p) for n, p in family if p.size_b and max(p.size_b / want.size_b, want.size_b / p.size_b)
             <= MAX_SIZE_RATIO]
    return min(sized, key=lambda np: gap(np[1]))[0] if sized else None


def _from_hf_cache(model_id: str) -> Path | None:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    if model_id.startswith((".", "/", "~")):
        return None
    try:
        hit = try_to_load_from_cache(model_id, "config.json")
    except ValueError:  # HFValidationError: not a valid repo id, so not in the cache
        return None
    return Path(hit) if isinstance(hit, str) and os.path.isfile(hit) else None


def _catalog_spec(key: str, given: str | None = None) -> ModelSpec:
    cfg = {k: v for k, v in MODELS[key].items() if k != "source"}
    spec = spec_from_config(cfg, name=given or key, source=f"catalog ({MODELS[key]['source']})")
    if given is None:
        return spec
    from dataclasses import replace
    note = (f"the catalog's copy of {given}'s config.json (no network); with a revision (main) the Hub's is "
            "read, with its safetensors headers")
    return replace(spec, notes=spec.notes + (note,))


def resolve_model(model: str, revision: str | None = None) -> ModelSpec:
    """A ModelSpec for ``model`` (see the module docstring for the accepted forms); ``revision`` (a branch, tag
    or commit) reads a Hub id from the Hub at that revision.

    A :class:`pathlib.Path` (any ``os.PathLike``) is taken as its text.

    Raises:
        InvalidValue: a ``model`` that is not a str or a path; a ``revision`` with a model that is not a Hub id (a
            catalog name, a local folder or file).
        UnknownModel: none of the accepted forms matches.
        HubError: a Hub id the Hub or the cache cannot give (gated, not found, no network).
        ConfigError: the config exists but cannot be planned (missing fields, unsupported family).
    """
    model = os.fspath(model) if isinstance(model, os.PathLike) else model
    if not isinstance(model, str):
        raise InvalidValue("model", model, f"{ACCEPTED_MODEL_FORMS}, as a str (or a path), not type "
                           f"{type(model).__name__}", "pass e.g. model='llama-3.2-1b' (a catalog name), a Hub id "
                           "'owner/name' or a model folder")
    p = Path(model).expanduser()
    try:
        p.exists()
    except OSError as e:  # a name longer than the file system takes (ENAMETOOLONG)
        raise UnknownModel("MODEL", model, ACCEPTED_MODEL_FORMS, f"pass a model folder, a catalog name or a Hub id "
                           f"(owner/name, at most 96 characters): the path cannot be read ({e.strerror})") from None
    if revision is not None:
        _check_revision_target(model, revision, p, looks_like_repo_id(model) and not model.startswith((".", "/", "~")))
    _refuse_gguf(p, model)
    if p.is_dir():
        cfg_path = p / "config.json"
        if not os.path.lexists(cfg_path):  # one that is not a regular file is refused by name when read
            raise UnknownModel("MODEL", model, "a folder holding config.json", f"{p} has no config.json")
        cfg = _read_json(cfg_path, "MODEL")
        weight_files_regular(p)  # before the config is planned: a FIFO among the weights is said at once
        return with_local_checkpoint(spec_from_config(cfg, name=str(p), source=str(p)), p)
    if os.path.lexists(p):  # a file; a FIFO, a device or a symlink loop is refused by name
        cfg = _read_json(p, "MODEL")
        weight_files_regular(p.parent)
        return with_local_checkpoint(spec_from_config(cfg, name=str(p), source=str(p)), p.parent)
    key = catalog_name(model)
    if key and revision is None:
        return _catalog_spec(key)
    if looks_like_repo_id(model) and not model.startswith((".", "/", "~")):
        cached = from_cache(model, "main") if revision is None else None
        if cached is None and revision is None and catalog_for_repo_id(model):
            return _catalog_spec(catalog_for_repo_id(model), model)
        try:
            return hub_spec(model, revision, cached)
        except HubError as e:
            hint = _catalog_hint(model)
            if hint and e.field == "MODEL":
                raise HubError(e.field, e.value, e.accepted, f"{e.fix}; or plan a catalog name: {hint}") from None
            raise
    if model.startswith((".", "/", "~")) or model.endswith(".json"):
        raise UnknownModel("MODEL", model, ACCEPTED_MODEL_FORMS, missing_path_fix(model))
    near = close_catalog_names(model)
    meant = f"did you mean {' or '.join(near)}? " if near else ""
    raise UnknownModel("MODEL", model, ACCEPTED_MODEL_FORMS, meant + "pass a Hub id (owner/name), a model folder, "
                       "or a catalog name: " + (_catalog_hint(model) or "vramguard.catalog.models.MODELS lists them"))


def close_catalog_names(model: str, n: int = 2) -> list[str]:
    """Up to ``n`` catalog names spelt nearly as ``model`` (a typo: ``lama-3.1-8b`` -> ``llama-3.1-8b``,
    ``qwen25-7b`` -> ``qwen2.5-7b``): :func:`difflib.get_close_matches` over the names and aliases (cutoff 0.8),
    keeping those with the same digits, so that a model the catalog lacks (``llama-3.1-405b``, ``gemma-3-12b``) is
    never called a typo of another size or generation. Empty when ``model`` is a catalog name."""
    tail = _bare_name(model)
    if catalog_name(tail):
        return []
    digits = sorted(re.sub(r"\D", "", tail))
    near = difflib.get_close_matches(tail, [*MODELS, *ALIASES], n=6, cutoff=0.8)
    keys = [ALIASES.get(k, k) for k in near if sorted(re.sub(r"\D", "", k)) == digits]
    return list(dict.fromkeys(keys))[:n]


def _check_revision_target(model: str, revision: str, p: Path, repo_id: bool) -> None:
    """Raise InvalidValue when ``revision`` cannot apply to ``model``: only a Hub id has revisions (a catalog
    name, a local folder or file has none); an empty ``revision`` is refused too."""
    accepted = "a branch, tag or commit of a Hub id (owner/name)"
    if not revision.strip():
        raise InvalidValue("revision", revision, accepted, "pass revision=main, or no revision")
    if p.exists():
        kind = "folder" if p.is_dir() else "file"
        raise InvalidValue("revision", revision, f"{accepted}; {model!r} is a local {kind}",
                           "no revision for a local model, or pass its Hub id (owner/name) with revision=" + revision)
    if repo_id or model.startswith((".", "/", "~")) or model.endswith(".json"):
        return  # a Hub id; or a missing path, which the caller names
    key = catalog_name(model)
    if key:
        source = MODELS[key]["source"]
        raise InvalidValue("revision", revision, f"{accepted}; {model!r} is a catalog name",
                           f"pass the Hub id {source} with revision={revision}, or no revision for the catalog's "
                           f"copy of {key}")
    raise InvalidValue("revision", revision, f"{accepted}; {model!r} is not one",
                       f"pass a Hub id (owner/name) with revision={revision}")


def _catalog_hint(model: str) -> str | None:
    """``llama-3.1-8b is this architecture`` / ``... is the closest (...)`` / ``gemma-2-9b is the nearest of the
    gemma family in the catalog (generation 2, not 3; 9B parameters, not 12B) ...`` for a name that has a stand-in
    in the
    catalog (:func:`closest_catalog_name`), else None."""
    near = closest_catalog_name(model)
    if near is None:
        return None
    if _bare_name(model) in (near, *[a for a, k in ALIASES.items() if k == near]):
        return f"{near} is this architecture"
    want, got = name_parts(model), name_parts(near)
    differs = []
    if want and got and (got.version or 1.0) != (want.version or 1.0):
        differs.append(f"generation {_num(got.version or 1.0)}, not {_num(want.version or 1.0)}")
    if want and got and want.size_b and got.size_b != want.size_b:
        differs.append(f"{_num(got.size_b)}B parameters, not {_num(want.size_b)}B")
    if not differs:
        return f"{near} is the closest (check that its shapes are your model's)"
    return (f"{near} is the nearest of the {got.family} family in the catalog ({'; '.join(differs)}): a stand-in "
            "only, check its shapes against your model's")


def _num(x: float) -> str:
    """12.0 -> ``12``, 2.5 -> ``2.5``."""
    return f"{x:g}"


def missing_path_fix(model: str) -> str:
    """The fix for a path that does not exist: what to do, and the absolute path that was looked for."""
    return (f"check the path, or pass the folder that holds config.json (no such file or folder: "
            f"{Path(model).expanduser().absolute()})")


def local_model_folder(model: str) -> Path:
    """:func:`model_folder`, for the commands that load weights.

    Raises:
        UnknownModel: a path that does not exist (named, made absolute), or a name with no local folder (a catalog
            name or a Hub id not in the cache: the fix gives the ``hf download`` command).
        ConfigError: the folder's config.json or a weight file a loader could not read
            (:func:`vramguard.inputs.read_config`, :func:`vramguard.inputs.weight_files_regular`, and each
            safetensors header and the weights index, :func:`vramguard.hub.headers.check_weights`: read here,
            before torch is imported, so that a damaged file is said in a second, not after the imports).
    """
    folder = model_folder(model)
    if folder is not None:
        if os.path.lexists(folder / "config.json"):  # a FIFO or a symlink loop there is refused, not skipped
            read_config(folder / "config.json")
        weight_files_regular(folder)
        check_weights(folder)
        return folder
    raise UnknownModel("MODEL", model, "a local model folder or a cached model id with weights",
                       _no_weights_fix(str(model)))


def _no_weights_fix(model: str) -> str:
    """The fix for a model with no local weights: the path looked for, or the ``hf download`` command of its Hub
    repository (a catalog name's is the repository its entry was copied from)."""
    if model.startswith((".", "/", "~")) or model.endswith(".json"):
        return missing_path_fix(model)
    key = catalog_name(model)
    if key:
        repo = MODELS[key]["source"]
        return (f"download the weights first, then run {repo} (the catalog's {key} holds shapes only: use it with "
                f"plan):\n    hf download {repo}")
    return f"download the model first, then run it by this id:\n    hf download {model}"


def model_folder(model: str) -> Path | None:
    """The local folder of ``model`` (a folder, the folder of a config.json, or its HF cache snapshot).

    Raises:
        UnknownModel: ``model`` is a GGUF file, or a folder without config.json holding one (:func:`gguf_error`).
    """
    p = Path(model).expanduser()
    _refuse_gguf(p, model)
    if p.is_dir():
        return p
    if p.is_file():
        return p.parent
    if "/" in model and not catalog_name(model):
        hit = _from_hf_cache(model)
        return hit.parent if hit else None
    return None
