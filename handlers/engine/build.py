"""What ``LLMEngine.from_options`` does before an engine exists: the options parsed, the checks that refuse a
model before anything loads (configuration, layout, the preflight memory plan), the other tensor-parallel ranks
started, then loading, quantizing and sharding on the worker's device.

Design note: apart from ``engine`` so that the engine module holds the step and the requests' life; this one
runs once per worker and only orders calls into ``planning`` and ``execution``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from handlers.engine.execution.forward.lora import folder_adapters
from handlers.engine.execution.forward.paged_attention import KVPool
from handlers.engine.execution.forward.runner import kv_geometry
from handlers.engine.execution.gpu.device import device_budget, device_defaults, engine_device
from handlers.engine.execution.kernels.quantize import QUANTIZE_MODES, check_layout, quantize_model
from handlers.engine.execution.parallel.ranks import TensorParallelGroup, shard_model, start_group
from handlers.engine.execution.weights.loading import load_model_and_tokenizer
from handlers.engine.execution.weights.quant_ckpt_load import check_checkpoint_layout
from handlers.engine.planning.checkpoint import check_quantization
from handlers.engine.planning.engine_config import EngineConfig
from handlers.engine.planning.families import check_config
from handlers.engine.planning.host_memory import MemoryBudget, memory_budget
from handlers.engine.planning.memory import MemoryPlan, plan_loaded_model, preflight
from handlers.engine.planning.quant_config import parse_checkpoint_quant
from rollcore.model_folder import read_config, weights_folder

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedModel:
    """A model ready for ``LLMEngine``: on its device, quantized and sharded as configured."""

    model: torch.nn.Module
    tokenizer: Any
    config: EngineConfig
    group: TensorParallelGroup | None  # rank 0's handle on the other ranks (None: one rank)
    num_kv_heads: int | None  # this rank's KV heads after sharding (None: the config's)
    memory_plan: MemoryPlan | None  # the preflight's (CPU); None: planned by the engine after loading
    adapters: dict[str, Path]  # LoRA adapter folders of the model folder (adapters/NAME/)


def load_for_engine(model_dir: Path, options: Mapping[str, str], device_id: int = -1) -> LoadedModel:
    """Load ``model_dir`` for an engine on the worker's device (``device_id``: an index among the devices this
    process sees, -1 = CPU). With ``tensor_parallel_degree`` N > 1 this process becomes rank 0 of N: it starts
    the other ranks, and every rank loads and shards the model (``handlers.engine.execution.parallel.ranks``)."""
    device = engine_device(device_id)
    config = EngineConfig.from_options(options)
    source = weights_folder(model_dir, options.get("model_id"))
    model_config = read_config(source)
    check_config(model_config, config.max_model_len, config.tensor_parallel_degree)
    check_quantization(model_config, source.name)
    check_layout(config, device)
    check_checkpoint_layout(parse_checkpoint_quant(model_config), config.tensor_parallel_degree, device)
    plan = None
    if device.type == "cpu":  # before anything loads (and before the other ranks start): refuse what cannot fit
        plan = preflight(source, config)
        if plan.prepack_weights != config.prepack_weights:  # auto's one packed copy: this rank's and the others'
            options = {**options, "prepack_weights": plan.prepack_weights}
            config = EngineConfig.from_options(options)
        logger.info("%s", plan.describe().rstrip())
    group: TensorParallelGroup | None = None
    if config.tensor_parallel_degree > 1:
        group = start_group(config.tensor_parallel_degree, model_dir, options, gpu=device.type == "cuda")
    # with tensor parallelism every rank loads on the host, shards, then moves its shard to its device
    model, tokenizer, config = load_model_and_tokenizer(model_dir, options, device if group is None else None,
                                                        dtype_for=device)
    config = device_defaults(config, options, device)
    if config.quantize in QUANTIZE_MODES:
        config = quantize_model(model, config)
    kv_heads = None
    if group is not None:
        kv_heads = shard_model(model, 0, group.world_size)
        model.to(device)
    return LoadedModel(model, tokenizer, config, group, kv_heads, plan, folder_adapters(model_dir))


def plan_for_loaded_model(model: torch.nn.Module, config: EngineConfig, kv_bytes_per_token: int,
                          available_bytes: int | None = None) -> MemoryPlan:
    """The memory plan for a model the caller loaded (its weights are in memory already): from
    ``available_bytes``, else what is free now on the model's device."""
    device = next(model.parameters()).device
    if available_bytes is not None:
        budget = MemoryBudget(available_bytes)
    elif device.type == "cuda":
        budget = device_budget(device, config.gpu_memory_utilization)
    else:
        budget = memory_budget()
    return plan_loaded_model(
        model.config.to_dict(), config, dtype=str(next(model.parameters()).dtype),
        param_bytes=sum(p.nbytes for p in model.parameters()),
        linear_bytes=sum(m.weight.nbytes for m in model.modules() if type(m) is torch.nn.Linear),
        kv_bytes_per_token=kv_bytes_per_token, budget=budget)


def kv_bytes_per_token(model: torch.nn.Module, num_kv_heads: int | None = None) -> int:
    """The KV cache's bytes per token of ``model`` in its dtype (``num_kv_heads``: this rank's share of the
    heads under tensor parallelism)."""
    num_layers, config_kv_heads, head_dim = kv_geometry(model.config)
    dtype = next(model.parameters()).dtype
    return KVPool.bytes_per_token(num_layers, num_kv_heads or config_kv_heads, head_dim, dtype)
