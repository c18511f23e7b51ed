"""Canonical JSON text of a config dict: the key under which plans memoize structures and replays."""

from __future__ import annotations

import json
from typing import Any


def canonical_json(cfg: dict[str, Any]) -> str:
    """``json.dumps`` with sorted keys; values JSON cannot hold are written with ``str``."""
    return json.dumps(cfg, sort_keys=True, default=str)
