"""Where a model's files are and what its ``config.json`` says: one answer for the frontend and the handlers.

Design note: ``option.model_id`` may name another local folder (relative to the model folder, or absolute); the
frontend (its rolling-batch choice, its tokenizer), the preflight and the workers must all look in the same
place, so the rule lives here once. Pure Python, no torch.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any


def weights_folder(model_dir: str | Path, model_id: str | None) -> Path:
    """The folder holding the weights, ``config.json`` and tokenizer: ``option.model_id`` relative to ``model_dir``
    if that exists, else as given (absolute), else ``model_dir`` itself."""
    source = Path(model_dir)
    if model_id:
        return source / model_id if (source / model_id).exists() else Path(model_id)
    return source


def read_config(folder: str | Path) -> dict[str, Any]:
    """``config.json`` of a model folder as a dict (``{}`` when absent, unreadable or not a JSON object)."""
    return read_json_object(Path(folder) / "config.json")


def read_json_object(path: Path) -> dict[str, Any]:
    """A JSON file of a model folder as a dict (``{}`` when absent, unreadable or not a JSON object)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def file_sha256(path: Path) -> str:
    """The SHA-256 of a file's bytes, read in 4 MiB chunks (a cache entry's name, a follower's manifest)."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()
