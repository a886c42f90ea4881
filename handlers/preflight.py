"""What the frontend may ask of the backend before any worker starts, torch-free: whether the rolling engine
serves a model folder's architecture, the engine's memory plan, and a checkpoint's parameter count. The one
door from ``serving`` into ``handlers`` besides the worker's entry point (``serving.worker.main``)."""

from __future__ import annotations

import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from handlers.engine.planning.checkpoint import checkpoint_tensors
from handlers.engine.planning.engine_config import EngineConfig
from handlers.engine.planning.families import ADMITTED_BY_LIST, admission, unsupported_reason
from handlers.engine.planning.gguf_plan import GGUFFileError, gguf_file_in, read_header, whole_gguf
from handlers.engine.planning.memory import preflight
from handlers.engine.planning.quant_config import checkpoint_parameter_count, parse_checkpoint_quant
from rollcore.model_folder import read_config, weights_folder

# The budget ``planned_memory`` plans with: far more than any model needs, so every figure is the model's own.
UNBOUNDED_BUDGET_KIB = 1 << 40


__all__ = ["whole_gguf"]  # the watched store asks whether a GGUF file is whole yet


def engine_admission(folder: Path, max_model_len: int | None) -> tuple[dict[str, Any], str | None, bool]:
    """``folder``'s ``config.json``, why the engine refuses it (None: it serves it), and whether it is on the
    verified list (False: a load-time self-check decides). Raises ``ConfigError`` for an unreadable file."""
    config = read_config(folder)
    reason = unsupported_reason(config, max_model_len)
    return config, reason, reason is None and admission(config) == ADMITTED_BY_LIST


def gguf_header_held(prefix: Path, size: int) -> bool:
    """Whether ``prefix``, the first bytes of a GGUF file of ``size`` bytes, holds the file's whole header (a
    remote file's header is read by range, growing until it does). A type this server does not load counts as
    held: the plan then refuses the file by name."""
    try:
        read_header(prefix, size)
    except GGUFFileError as exc:
        return exc.unsupported
    return True


def memory_plan_text(model_dir: Path, model_id: str | None, options: Mapping[str, str]) -> str:
    """The engine's memory plan for the model (the preflight its worker runs before loading), or "" when the
    weights' folder has no ``config.json``. Raises ``ConfigError`` (``InsufficientMemory``: cannot fit)."""
    source = weights_folder(model_dir, model_id)
    if not (source / "config.json").is_file() and gguf_file_in(source) is None:
        return ""
    return preflight(source, EngineConfig.from_options(options)).describe()


@dataclass(frozen=True, slots=True)
class PlannedMemory:
    """The figures of a model's memory plan, in bytes, when memory is no constraint: what one worker (all its
    tensor-parallel ranks) takes with its KV cache at its full size (``max_rolling_batch_size`` sequences of
    ``max_model_len`` tokens, or the ``kv_cache_memory_mb`` / ``num_kv_blocks`` it is given). ``kv_source`` is
    the plan's: ``auto`` means the cache is ``kv_fraction`` of the memory left after the rest, so a memory limit
    has to leave ``kv_cache_bytes / kv_fraction`` for it."""

    tensor_parallel_degree: int
    weight_bytes: int  # all ranks; each rank holds 1/N
    prepack_bytes: int  # all ranks
    activation_bytes: int  # all ranks
    kv_cache_bytes: int  # all ranks
    kv_source: str  # auto | kv_cache_memory_mb | num_kv_blocks
    kv_fraction: float


def planned_memory(model_dir: Path, model_id: str | None, options: Mapping[str, str]) -> PlannedMemory | None:
    """The engine's memory plan for the model (``preflight``, as its worker runs it) with a budget no model
    reaches, or None when the weights' folder has no ``config.json`` (a model fetched at start). For sizing a
    machine or a container before the model runs there. Raises ``ConfigError``."""
    source = weights_folder(model_dir, model_id)
    if not (source / "config.json").is_file() and gguf_file_in(source) is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        meminfo = Path(tmp) / "meminfo"
        meminfo.write_text(f"MemAvailable: {UNBOUNDED_BUDGET_KIB} kB\n", encoding="ascii")
        plan = preflight(source, EngineConfig.from_options(options), meminfo=meminfo,
                         cgroup_root=Path(tmp) / "no-cgroup", self_cgroup=Path(tmp) / "no-self-cgroup")
    tp = plan.tensor_parallel_degree
    return PlannedMemory(tensor_parallel_degree=tp, weight_bytes=plan.weight_bytes, prepack_bytes=plan.prepack_bytes,
                         activation_bytes=plan.activation_bytes, kv_cache_bytes=tp * plan.kv_bytes_per_rank,
                         kv_source=plan.kv_source, kv_fraction=plan.kv_fraction)


def checkpoint_parameters(weights: Path) -> int | None:
    """Parameters of the folder's safetensors checkpoint, read from the headers (None: no readable checkpoint,
    e.g. a model the worker downloads or converts at load)."""
    try:
        tensors = checkpoint_tensors(weights)
        quant = parse_checkpoint_quant(read_config(weights))
    except Exception:  # noqa: BLE001 -- an unreadable checkpoint fails at load with its own error
        return None
    if quant is not None:  # int32 words of packed weights: counted as the weights they hold
        return checkpoint_parameter_count(tensors, quant) or None
    return sum(t.numel for t in tensors) or None
