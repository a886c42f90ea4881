"""Engine configuration: parsed once from the model's options (``option.`` prefix already stripped).

Design note: ``EngineConfig`` is a frozen value; ``EngineConfig.from_options`` is the only place the engine
reads option strings, and it parses each through the option schema (``rollcore.options``: parser, default
and error wording shared with ``serving.config.model_config``, which validates the same keys when the model loads and
shows them in ``serving config``). KV-cache sizing (the memory preflight) lives in ``handlers.engine.planning.memory``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rollcore.errors import ConfigError
from rollcore.options import option_value, parse_option
from rollcore.values import AUTO


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Limits and switches of one engine. ``max_model_len`` 0 = the model's ``max_position_embeddings``;
    ``kv_cache_memory_mb`` 0 (``auto``) = ``kv_cache_memory_fraction`` of the memory left after the weights
    (``handlers.engine.planning.memory``); ``dtype`` ``auto`` = the checkpoint's (``memory.resolve_dtype``)."""

    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    max_prefill_tokens_while_decoding: int = 256  # 0 = prefill may take the whole step budget
    max_mixed_step_ratio: float = 8.0  # a step that decodes and prefills: at most this many decode steps long (0: off)
    burst_prefill_first: bool = True  # a burst's prompts before the running streams' next tokens
    max_itl_ms: int | None = None  # inter-token latency target (None: auto, measured at load; 0: off)
    block_size: int = 16
    kv_cache_memory_mb: int = 0
    kv_cache_memory_fraction: float = 0.9
    num_kv_blocks: int = 0  # explicit number of KV blocks; overrides kv_cache_memory_mb (tests, tuning)
    # auto | eager | lazy (handlers.engine.execution.forward.lazy_memory; auto: loading.py)
    kv_cache_populate: str = "auto"
    enable_prefix_caching: bool = True
    num_threads: int = 0  # 0 = auto: the cores of this worker's affinity mask / (workers x TP ranks)
    max_model_len: int = 0
    dtype: str = "fp32"
    quantize: str = "auto"  # auto | none | int8 | int4: handlers.engine.execution.kernels.quantize (GGUF: gguf_load)
    quantize_group_size: int = 32
    quantized_activations: str = "auto"  # auto | fp32 | int8 | int8x2: QuantizedLinear.use_activations
    prepack_weights: str = "hybrid"  # hybrid | true | false (see handlers.engine.execution.kernels.prepack)
    measure_linears: bool = False  # prepack_weights=auto: per weight shape, the faster kernel as measured here
    # native (handlers.engine.execution.kernels.native, PyTorch when it cannot build) | torch
    attention_kernel: str = "native"
    fuse_projections: bool = False  # no faster on AVX2 CPUs (benchmarks/HISTORY.md); on by default on GPUs
    trust_remote_code: bool = False
    allow_unsafe_weights: bool = False
    seed: int = 0
    tensor_parallel_degree: int = 1
    tensor_parallel_timeout_s: float = 60.0  # rank 0's longest wait for a peer within a step (execution.parallel)
    follower_weights: str = "auto"  # auto | resolve | stream: how follower hosts get the weights
    speculative_draft: str = "none"  # none | ngram (handlers.engine.core.speculative)
    num_speculative_tokens: int = 8
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 3
    # guesses only while at most this many sequences decode (0: always); None (auto): while the step cost says
    # they pay (handlers.engine.core.draft_gate)
    speculative_max_batch_size: int | None = None
    gpu_memory_utilization: float = 0.9  # GPU: share of the device's memory the worker may fill
    enforce_eager: bool = False  # GPU: no CUDA graphs
    enable_lora: bool = False  # LoRA adapters (handlers.engine.execution.forward.lora)
    max_loras: int = 4
    max_lora_rank: int = 16
    task: str = "auto"  # auto | generate | embedding: which requests the engine takes (handlers.embedding)
    pooling: str = "auto"  # embedding requests' pooling (auto: the folder's sentence-transformers config, else last)

    @classmethod
    def from_options(cls, options: Mapping[str, str]) -> EngineConfig:
        """Parse DJL-style options (each read with ``options.get``); raises ``ConfigError`` naming the bad key
        and value (``option.block_size = '0': expected an integer >= 1``)."""

        def get(key: str) -> Any:  # the schema's parser says the type
            return option_value(options, key)

        def auto_is_zero(key: str) -> int:
            value = get(key)
            return 0 if value == AUTO else int(value)

        def auto_is_none(key: str) -> int | None:
            value = get(key)
            return None if value == AUTO else int(value)

        if get("prompt_lookup_min") > get("prompt_lookup_max"):
            raise ConfigError(f"option.prompt_lookup_min = {get('prompt_lookup_min')} exceeds option.prompt_lookup_max "
                              f"= {get('prompt_lookup_max')}")
        if 0 < get("max_mixed_step_ratio") <= 1:
            raise ConfigError(f"option.max_mixed_step_ratio = {get('max_mixed_step_ratio')}: expected 0 (off) or a "
                              "number > 1 (a mixed step may last that many decode steps)")
        return cls(
            max_num_seqs=get("max_rolling_batch_size"),
            max_num_batched_tokens=get("max_rolling_batch_prefill_tokens"),
            max_prefill_tokens_while_decoding=get("max_prefill_tokens_while_decoding"),
            max_mixed_step_ratio=get("max_mixed_step_ratio"),
            burst_prefill_first=get("burst_prefill_first"),
            max_itl_ms=auto_is_none("max_itl_ms"),
            block_size=get("block_size"),
            kv_cache_memory_mb=auto_is_zero("kv_cache_memory_mb"),
            kv_cache_memory_fraction=get("kv_cache_memory_fraction"),
            num_kv_blocks=get("num_kv_blocks"),
            kv_cache_populate=get("kv_cache_populate"),
            enable_prefix_caching=get("enable_prefix_caching"),
            num_threads=auto_is_zero("num_threads"),
            max_model_len=get("max_model_len") or 0,
            dtype=get("dtype"),
            quantize=get("quantize"),
            quantize_group_size=get("quantize_group_size"),
            quantized_activations=get("quantized_activations"),
            prepack_weights=prepack_mode(options.get("prepack_weights")),
            measure_linears=parse_option("prepack_weights", options.get("prepack_weights")) == "auto",
            fuse_projections=get("fuse_projections"),
            attention_kernel=get("attention_kernel"),
            trust_remote_code=get("trust_remote_code"),
            allow_unsafe_weights=get("allow_unsafe_weights"),
            seed=get("seed"),
            tensor_parallel_degree=get("tensor_parallel_degree"),
            tensor_parallel_timeout_s=get("tensor_parallel_timeout"),
            follower_weights=get("follower_weights"),
            speculative_draft=get("speculative_draft"),
            num_speculative_tokens=get("num_speculative_tokens"),
            prompt_lookup_min=get("prompt_lookup_min"),
            prompt_lookup_max=get("prompt_lookup_max"),
            speculative_max_batch_size=auto_is_none("speculative_max_batch_size"),
            gpu_memory_utilization=get("gpu_memory_utilization"),
            enforce_eager=get("enforce_eager"),
            enable_lora=get("enable_lora"),
            max_loras=get("max_loras"),
            max_lora_rank=get("max_lora_rank"),
            task=get("task"),
            pooling=get("pooling"),
        )


def prepack_mode(raw: str | None) -> str:
    """``option.prepack_weights``: ``auto`` (default), ``hybrid``, or a boolean (``true`` = packed only).
    ``auto`` plans hybrid's two copies and lets the engine measure which kernel each layer's row counts run
    faster on this CPU (``handlers.engine.execution.kernels.linear_choice``), keeping only the copies used; when two
    copies do not fit, the engine's preflight falls back to one packed copy."""
    value = parse_option("prepack_weights", raw)
    return "hybrid" if value == "auto" else str(value)
