"""The engine's device: which torch device a worker runs on, the dtype it serves there, and its memory budget.

Design note: the pool gives every worker its devices through ``CUDA_VISIBLE_DEVICES`` (``serving.config.devices``), so
a GPU worker sees its first device as ``cuda:0`` and the handler's ``device_id`` is that local index (-1: CPU).
On a GPU the memory budget is the device's, measured after the weights load (vLLM's and DJL's
``gpu_memory_utilization``: the share of the whole device the worker may fill), and the dtype a model is served
in by default is its checkpoint's half precision (bf16 when the checkpoint is fp32): fp32 halves a GPU's
throughput for no gain in serving. An explicit ``option.dtype`` always wins.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch

from handlers.engine.planning.checkpoint import resolve_dtype
from handlers.engine.planning.engine_config import EngineConfig
from handlers.engine.planning.host_memory import MemoryBudget

logger = logging.getLogger(__name__)

_HALF = {"bfloat16": "bf16", "torch.bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "torch.float16": "fp16",
         "fp16": "fp16", "half": "fp16"}


def engine_device(device_id: int) -> torch.device:
    """``cuda:<device_id>`` for a GPU worker (an index among the devices it sees), else the CPU."""
    return torch.device("cpu") if device_id < 0 else torch.device("cuda", device_id)


def serving_dtype(option: str | None, model_config: Mapping[str, Any], device: torch.device) -> str:
    """The dtype to serve in: ``option.dtype`` when set (``auto`` resolved per device), else on a GPU the
    checkpoint's half precision (bf16 for an fp32 checkpoint) and on CPU the option's default."""
    if device.type == "cpu":
        return resolve_dtype(option or "fp32", model_config)
    if option is not None and option.strip().lower() != "auto":
        return resolve_dtype(option, model_config)
    stored = str(model_config.get("dtype") or model_config.get("torch_dtype") or "").lower()
    chosen = _HALF.get(stored, "bf16")
    logger.info("dtype on %s: %s (checkpoint %s; option.dtype sets another)", device, chosen, stored or "unknown")
    return chosen


def device_budget(device: torch.device, utilization: float) -> MemoryBudget:
    """What a GPU worker may still fill now: ``utilization`` of the device's memory minus what is in use
    (the weights, once loaded, and anything else on the device)."""
    free, total = torch.cuda.mem_get_info(device)
    available = max(0, int(total * utilization) - (total - free))
    return MemoryBudget(available, note=f"{device}: {utilization:g} x {total / 2**30:.1f} GiB - "
                                         f"{(total - free) / 2**30:.1f} GiB in use")


def device_defaults(config: EngineConfig, options: Mapping[str, str], device: torch.device) -> EngineConfig:
    """The engine's defaults where the device changes what is fast; an option the user set is kept.

    On a GPU: the prefill tokens of a step that also decodes are the whole step budget, with no time bound (a
    step of 2048 tokens costs a GPU about what 256 do, while the CPU default of 256 stretches 64 arriving prompts
    over ~100 steps), and a burst's steps carry the decodes too (they ride along at almost no cost, where on a CPU
    core each row is paid for and stalls every stream for the whole step);
    Q/K/V and gate/up run as one matmul each in half precision (fewer, wider GEMMs for small batches; fp32 keeps
    the separate products, so that it stays comparable with transformers' own forward)."""
    if device.type != "cuda":
        return config
    changes: dict[str, Any] = {}
    if options.get("max_prefill_tokens_while_decoding") is None:
        changes["max_prefill_tokens_while_decoding"] = 0
    if options.get("max_mixed_step_ratio") is None:
        changes["max_mixed_step_ratio"] = 0.0
    if options.get("burst_prefill_first") is None:
        changes["burst_prefill_first"] = False
    if options.get("fuse_projections") is None and config.dtype in ("bf16", "fp16"):
        changes["fuse_projections"] = True
    return replace(config, **changes) if changes else config
