"""What the frontend may ask of the backend before any worker starts, torch-free: whether the rolling engine
serves a model folder's architecture, the engine's memory plan, and a checkpoint's parameter count. The one
door from ``serving`` into ``handlers`` besides the worker's entry point (``serving.worker.main``)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from handlers.engine.planning.checkpoint import checkpoint_tensors, weights_dir
from handlers.engine.planning.config import EngineConfig
from handlers.engine.planning.families import ADMITTED_BY_LIST, admission, load_config_dict, unsupported_reason
from handlers.engine.planning.memory import preflight


def engine_admission(folder: Path, max_model_len: int | None) -> tuple[dict[str, Any], str | None, bool]:
    """``folder``'s ``config.json``, why the engine refuses it (None: it serves it), and whether it is on the
    verified list (False: a load-time self-check decides). Raises ``ConfigError`` for an unreadable file."""
    config = load_config_dict(folder)
    reason = unsupported_reason(config, max_model_len)
    return config, reason, reason is None and admission(config) == ADMITTED_BY_LIST


def memory_plan_text(model_dir: Path, model_id: str | None, options: Mapping[str, str]) -> str:
    """The engine's memory plan for the model (the preflight its worker runs before loading), or "" when the
    weights' folder has no ``config.json``. Raises ``ConfigError`` (``InsufficientMemory``: cannot fit)."""
    source = weights_dir(model_dir, model_id)
    if not (source / "config.json").is_file():
        return ""
    return preflight(source, EngineConfig.from_options(options)).describe()


def checkpoint_parameters(weights: Path) -> int | None:
    """Parameters of the folder's safetensors checkpoint, read from the headers (None: no readable checkpoint,
    e.g. a model the worker downloads or converts at load)."""
    try:
        tensors = checkpoint_tensors(weights)
    except Exception:  # noqa: BLE001 -- an unreadable checkpoint fails at load with its own error
        return None
    return sum(t.numel for t in tensors) or None
