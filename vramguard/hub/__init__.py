"""Models named by a Hugging Face Hub id: their ModelSpec from config.json and the safetensors headers, read
through huggingface_hub without downloading weights (:mod:`vramguard.hub.fetch`); what the checkpoint stores
(:mod:`vramguard.hub.headers`) and how a pre-quantized one loads (:mod:`vramguard.hub.prequant`).
"""

from __future__ import annotations

import re
from dataclasses import replace

from vramguard.errors import ConfigError
from vramguard.hub.fetch import fetch_model
from vramguard.hub.headers import CheckpointHeaders, read_local_checkpoint
from vramguard.inputs import NotAFile, check_config
from vramguard.spec import spec_from_config

_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


def looks_like_repo_id(model: str) -> bool:
    """``owner/name`` with the characters the Hub allows (a path such as ``./x/y`` or ``a/b/c`` is not), as
    huggingface_hub's ``validate_repo_id`` checks it (at most 96 characters)."""
    if not _REPO_ID.match(model) or ".." in model:
        return False
    from huggingface_hub.utils import HFValidationError, validate_repo_id
    try:
        validate_repo_id(model)
    except HFValidationError:
        return False
    return True


def checkpoint_notes(ck: CheckpointHeaders | None, prequantized: str | None) -> tuple[str, ...]:
    """What the plan's weights rest on, in words, for a checkpoint record."""
    if ck is None:
        return ()
    if ck.format == "pytorch":
        return ((f"the checkpoint has only PyTorch .bin weights ({len(ck.files)} file(s)), which have no header "
                 "to read without downloading them: weights planned from config.json alone (safetensors "
                 "checkpoints give exact stored bytes)"),)
    if ck.format in ("none", "unknown") and prequantized:  # a 16-bit checkpoint's config gives its weights
        why = ("no weight files in the repository" if ck.format == "none" else
               "its safetensors headers are not in the cache")
        return (f"{why}: weights planned from config.json alone",)
    return ()  # headers read: the plan's findings say what the weights rest on


def hub_spec(repo_id: str, revision: str | None = None, cached=None):
    """The ModelSpec of Hub model ``repo_id`` at ``revision`` (default ``main``), with its checkpoint record;
    ``cached``: a :class:`~vramguard.hub.fetch.HubModel` already read from the local cache, used as it is.

    Raises:
        HubError: the Hub or its cache cannot give the metadata (see :func:`vramguard.hub.fetch.fetch_model`).
        ConfigError: the config cannot be planned.
    """
    m = cached or fetch_model(repo_id, revision)
    check_config(m.config, f"{repo_id}'s config.json")
    at = f"@{m.commit[:12]}" if m.commit else f"@{m.revision}"
    source = f"hf-cache:{m.snapshot}" if m.snapshot else f"hub:{repo_id}{at}"
    spec = spec_from_config(m.config, name=repo_id, source=source)
    return replace(spec, checkpoint=m.checkpoint,
                   notes=spec.notes + m.notes + checkpoint_notes(m.checkpoint, spec.prequantized))


def with_local_checkpoint(spec, folder):
    """``spec`` with the headers of the safetensors files in ``folder`` (a local model folder); a header that
    cannot be read leaves the spec without them and a note saying why.

    Raises:
        NotAFile: a weight file that is not a regular file (a FIFO, a device, a folder, a symlink loop).
    """
    try:
        ck = read_local_checkpoint(folder)
    except NotAFile:  # a FIFO, a device or a symlink loop where a weight file belongs: refused, never waited on
        raise
    except (ConfigError, OSError) as e:  # a damaged or placeholder file: plan from config.json, and say why
        why = e.render() if isinstance(e, ConfigError) else f"{type(e).__name__}: {e}"
        return replace(spec, notes=spec.notes + (f"the safetensors headers could not be read ({why.splitlines()[0]}): "
                                                 "weights planned from config.json alone",))
    return replace(spec, checkpoint=ck, notes=spec.notes + checkpoint_notes(ck, spec.prequantized)) if ck else spec


def for_cards(spec, gpus):
    """``spec`` with its checkpoint planned for the lowest known compute capability among ``gpus`` (the card
    decides whether transformers dequantizes a pre-quantized checkpoint); unchanged without a checkpoint."""
    ck = getattr(spec, "checkpoint", None)
    if ck is None:
        return spec
    caps = [g.compute_capability for g in gpus if g.compute_capability]
    return replace(spec, checkpoint=replace(ck, card_capability=min(caps) if caps else None))



def fetched_line(spec) -> str | None:
    """``read from the Hub: config.json 1,234 B, model.safetensors header 100,001 B; 101,235 B over the network,
    no weights`` for a Hub model, None for any other."""
    ck = getattr(spec, "checkpoint", None)
    if ck is None or not ck.fetched or not spec.source.startswith(("hub:", "hf-cache:")):
        return None
    net = sum(f.nbytes for f in ck.fetched if f.origin == "network")
    parts = ", ".join(f"{f.what} {f.nbytes:,} B" + (" (cache)" if f.origin == "cache" else "") for f in ck.fetched)
    return f"read for {spec.name}: {parts}; {net:,} B over the network, no weights"
