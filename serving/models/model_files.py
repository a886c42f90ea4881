"""Whether a model folder holds anything a built-in handler can load, checked before a worker is started.

Design note: a folder with only ``serving.properties`` (no ``option.model_id``, no checkpoint, no ``model.py``) can
never load, however often a worker tries; the handlers would fail deep inside transformers with a message about a
tokenizer or a ``config.json`` that is not there. The registry marks such a model FAILED at once with this module's
reason (the other models serve), and ``serving config`` reports it as an error. Files are named relative to the
model folder: the reason reaches API answers.
"""

from __future__ import annotations

from pathlib import Path

from serving.config.model_config import ModelConfig
from serving.config.rolling_choice import ENGINE_ENTRY_POINTS

# Checkpoint files the built-in handlers load weights from (a .gguf file is read only when option.model_id names it).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def has_weights(folder: Path) -> bool:
    return any(p.is_file() and p.name.endswith(WEIGHT_SUFFIXES) for p in folder.iterdir())


def nothing_to_load(cfg: ModelConfig) -> str | None:
    """Why the model's folder has nothing its built-in handler could load, or None when it has something (or the
    model's own handler, or ``option.model_id``, decides what it loads)."""
    if cfg.entry_point not in ENGINE_ENTRY_POINTS or cfg.model_id:
        return None
    folder = cfg.model_dir
    if not folder.is_dir() or (folder / "config.json").exists() or (folder / "model.py").exists() \
            or has_weights(folder):
        return None
    return ("the model folder has no weights (*.safetensors, *.bin), no config.json and no model.py: set "
            "option.model_id in serving.properties (a Hugging Face id, an s3:// URL, a local folder or a .gguf file), "
            "copy a checkpoint (config.json and weights) into the folder, or add a model.py handler")
