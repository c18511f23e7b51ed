"""Turning the MODEL argument into a :class:`~vramguard.spec.ModelSpec`, offline.

Accepted, in this order: a local model folder (with config.json), a path to a config.json, a catalog name
(``llama-2-7b``; :data:`vramguard.catalog.models.MODELS`), or a model id already in the local Hugging Face cache
(``meta-llama/Llama-2-7b-chat-hf``), looked up with ``huggingface_hub.try_to_load_from_cache`` which never
touches the network.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from vramguard.catalog.models import ALIASES, MODELS
from vramguard.errors import ConfigError, UnknownModel
from vramguard.spec import ModelSpec, spec_from_config

ACCEPTED_MODEL_FORMS = ("a local model folder, a config.json path, a catalog name (vramguard plan --list-models), "
                        "or a model id in the local Hugging Face cache")


def _read_json(path: Path, field: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(field, str(path), "a config.json (a JSON object)", f"the file is not JSON text "
                          f"({type(e).__name__}); pass the model folder or its config.json") from None
    except OSError as e:
        raise ConfigError(field, str(path), "a readable file", str(e)) from None
    if not isinstance(data, dict):
        raise ConfigError(field, str(path), "a JSON object", "config.json must hold one object")
    return data


def catalog_name(name: str) -> str | None:
    """The catalog key for ``name`` (case-insensitive, aliases allowed), or None."""
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    return key if key in MODELS else None


def _bare_name(model: str) -> str:
    """``meta-llama/Llama-3.1-8B-Instruct`` -> ``llama-3.1-8b``: the id's last part, lower case, without the
    suffixes of fine-tunes (``-instruct``, ``-chat``, ``-hf``, ``-it``, ``-base``), which keep their base's shapes."""
    import re
    tail = model.strip().rstrip("/").split("/")[-1].lower()
    return re.sub(r"-(instruct|chat|hf|it|base)(?=-|$)", "", tail)


def closest_catalog_name(model: str) -> str | None:
    """The catalog name nearest to a model id's name (``meta-llama/Llama-3.1-8B-Instruct`` -> ``llama-3.1-8b``),
    by ``difflib`` similarity of at least 0.6 once ``-Instruct``/``-chat``/``-hf``/``-it``/``-base`` are dropped,
    or None."""
    import difflib
    tail = _bare_name(model)
    names = list(MODELS) + list(ALIASES)
    hit = difflib.get_close_matches(tail, names, n=1, cutoff=0.6)
    return ALIASES.get(hit[0], hit[0]) if hit else None


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


def resolve_model(model: str) -> ModelSpec:
    """A ModelSpec for ``model`` (see the module docstring for the accepted forms).

    Raises:
        UnknownModel: none of the accepted forms matches.
        ConfigError: the config exists but cannot be planned (missing fields, unsupported family).
    """
    p = Path(model).expanduser()
    if p.is_dir():
        cfg_path = p / "config.json"
        if not cfg_path.is_file():
            raise UnknownModel("MODEL", model, "a folder holding config.json", f"{p} has no config.json")
        return spec_from_config(_read_json(cfg_path, "MODEL"), name=str(p), source=str(p))
    if p.is_file():
        return spec_from_config(_read_json(p, "MODEL"), name=str(p), source=str(p))
    key = catalog_name(model)
    if key:
        cfg = {k: v for k, v in MODELS[key].items() if k != "source"}
        return spec_from_config(cfg, name=key, source=f"catalog ({MODELS[key]['source']})")
    if "/" in model and not model.startswith((".", "/")):
        hit = _from_hf_cache(model)
        if hit:
            return spec_from_config(_read_json(hit, "MODEL"), name=model, source=f"hf-cache:{hit.parent}")
    if model.startswith((".", "/", "~")) or model.endswith(".json"):
        raise UnknownModel("MODEL", model, ACCEPTED_MODEL_FORMS, f"no such file or folder: {p}")
    near = closest_catalog_name(model)
    same = near is not None and _bare_name(model) in (near, *[a for a, k in ALIASES.items() if k == near])
    raise UnknownModel("MODEL", model, ACCEPTED_MODEL_FORMS,
                       "download its config.json (all that plan needs; e.g. huggingface-cli download "
                       f"{model} config.json), pass its folder, or use a catalog name: "
                       + (f"{near} is this architecture" if same else
                          f"{near} is the closest (check that its shapes are your model's)" if near
                          else "vramguard plan --list-models"))


def model_folder(model: str) -> Path | None:
    """The local folder of ``model`` (a folder, the folder of a config.json, or its HF cache snapshot)."""
    p = Path(model).expanduser()
    if p.is_dir():
        return p
    if p.is_file():
        return p.parent
    if "/" in model and not catalog_name(model):
        hit = _from_hf_cache(model)
        return hit.parent if hit else None
    return None
