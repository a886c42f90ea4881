"""Loading a model and its tokenizer for the engine, in rank 0 and in every other tensor-parallel rank.

Design note: its own module so that ``engine`` (rank 0) and ``parallel`` (the other ranks) both import it
and not each other: ``engine`` imports ``parallel`` to start the ranks, ``parallel`` imports only this.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from handlers.engine.execution.forward.falcon_attention import adapt_model
from handlers.engine.execution.gpu.device import serving_dtype
from handlers.engine.execution.kernels.quantize import QUANTIZE_MODES, float_checkpoint_activations
from handlers.engine.execution.weights.gguf_load import load_gguf_model
from handlers.engine.execution.weights.quant_ckpt_load import load_quantized_checkpoint, load_quantizing
from handlers.engine.planning.cpu import auto_threads, keep_freed_memory
from handlers.engine.planning.engine_config import EngineConfig
from handlers.engine.planning.gguf_plan import gguf_file_in
from handlers.engine.planning.quant_config import parse_checkpoint_quant
from rollcore.errors import ConfigError
from rollcore.model_folder import read_config, weights_folder

TORCH_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
                "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


def load_model_and_tokenizer(model_dir: Path, options: Mapping[str, str], device: torch.device | None = None,
                             dtype_for: torch.device | None = None) -> tuple[torch.nn.Module, Any, EngineConfig]:
    """Parse the options, set torch threads, and load model (safetensors unless allowed) and tokenizer, the
    model on ``device`` (default CPU) in the dtype it is served in on ``dtype_for`` (default ``device``: a
    tensor-parallel rank loads on the host for the GPU it shards to). ``option.model_id`` may name another
    local folder (relative to ``model_dir`` or absolute)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = device or torch.device("cpu")
    dtype_for = dtype_for or device
    config = EngineConfig.from_options(options)
    torch.set_num_threads(config.num_threads or auto_threads(_int_option(options, "maxWorkers", 1),
                                                              config.tensor_parallel_degree))
    keep_freed_memory()
    source = weights_folder(model_dir, options.get("model_id"))
    # auto -> fp32 or bf16 by CPU; on a GPU the checkpoint's half precision unless option.dtype says otherwise
    config = replace(config, dtype=serving_dtype(options.get("dtype"), read_config(source), dtype_for))
    gguf = gguf_file_in(source)
    model: torch.nn.Module | None
    if gguf is not None:
        # the file's quantized tensors run in the integer kernels, which take fp32 activations
        model = load_gguf_model(source, gguf, config.quantize, config.quantize_group_size, config.quantized_activations)
        if config.quantize != "none":
            config = replace(config, dtype="fp32", quantize="auto", prepack_weights="false", fuse_projections=False)
        if config.kv_cache_populate == "auto":  # memory that follows use, as the file's size led a user to expect
            config = replace(config, kv_cache_populate="lazy")
    else:
        model, config = _load_checkpoint(source, config, device)
    if model is None:
        model = AutoModelForCausalLM.from_pretrained(
            source, dtype=TORCH_DTYPES[config.dtype], use_safetensors=not config.allow_unsafe_weights,
            trust_remote_code=config.trust_remote_code)
    if config.kv_cache_populate == "auto":
        config = replace(config, kv_cache_populate="eager")
    if device.type != "cpu":
        model.to(device)
    tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=config.trust_remote_code)
    adapt_model(model)  # before tensor-parallel sharding, which sees the adapted layout
    return model, tokenizer, config


def _load_checkpoint(source: Path, config: EngineConfig,
                     device: torch.device) -> tuple[torch.nn.Module | None, EngineConfig]:
    """A safetensors checkpoint loaded one tensor at a time into integer layers (``quant_ckpt_load``): a quantized
    checkpoint as it is, or a float one with ``option.quantize=int8|int4`` quantized on the way in (the config then
    says so: nothing left to quantize, prepack or fuse). (None, config): transformers loads it whole."""
    quant = parse_checkpoint_quant(read_config(source))
    done = replace(config, prepack_weights="false", fuse_projections=False)
    if quant is not None:  # the integer kernels take fp32 activations
        return load_quantized_checkpoint(source, quant, config.quantized_activations), \
            replace(done, dtype="fp32", quantize="auto")
    if config.quantize not in QUANTIZE_MODES or device.type != "cpu" or config.allow_unsafe_weights \
            or config.trust_remote_code:
        return None, config
    if config.dtype != "fp32":
        raise ConfigError(f"option.quantize={config.quantize} quantizes fp32 weights: set option.dtype=fp32")
    model = load_quantizing(source, config.quantize, config.quantize_group_size,
                            float_checkpoint_activations(config.quantized_activations))
    return (None, config) if model is None else (model, replace(done, quantize="auto"))


def _int_option(options: Mapping[str, str], key: str, default: int) -> int:
    try:
        return int(options.get(key, default))
    except ValueError:
        return default


def eos_token_ids(model: torch.nn.Module, tokenizer: Any) -> frozenset[int]:
    """EOS ids from the generation config (int or list), else the tokenizer's."""
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    if eos is None:
        eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)
