"""Engine configuration: parsed once from the model's options (``option.`` prefix already stripped).

Design note: ``EngineConfig`` is a frozen value; ``EngineConfig.from_options`` is the only place that
reads option strings. KV-cache sizing (the memory preflight) lives in ``handlers.engine.memory``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from handlers.engine.cpu import packed_weights_win_everywhere
from serving.errors import ConfigError

_BOOL = {"true": True, "1": True, "yes": True, "on": True, "false": False, "0": False, "no": False, "off": False}
_DTYPES = ("fp32", "float32", "bf16", "bfloat16", "fp16", "float16", "auto")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Limits and switches of one engine. ``max_model_len`` 0 = the model's ``max_position_embeddings``;
    ``kv_cache_memory_mb`` 0 (``auto``) = ``kv_cache_memory_fraction`` of the memory left after the weights
    (``handlers.engine.memory``); ``dtype`` ``auto`` = the checkpoint's (``memory.resolve_dtype``)."""

    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    max_prefill_tokens_while_decoding: int = 256  # 0 = prefill may take the whole step budget
    block_size: int = 16
    kv_cache_memory_mb: int = 0
    kv_cache_memory_fraction: float = 0.9
    num_kv_blocks: int = 0  # explicit number of KV blocks; overrides kv_cache_memory_mb (tests, tuning)
    enable_prefix_caching: bool = True
    num_threads: int = 0  # 0 = auto: the cores of this worker's affinity mask / (workers x TP ranks)
    max_model_len: int = 0
    dtype: str = "fp32"
    prepack_weights: str = "hybrid"  # hybrid | true | false (see handlers.engine.prepack)
    attention_kernel: str = "native"  # native (handlers.engine.kernels, PyTorch when it cannot build) | torch
    fuse_projections: bool = False  # measured neutral-to-slower on this CPU (benchmarks/README.md)
    trust_remote_code: bool = False
    allow_unsafe_weights: bool = False
    seed: int = 0
    tensor_parallel_degree: int = 1

    @classmethod
    def from_options(cls, options: Mapping[str, str]) -> EngineConfig:
        """Parse DJL-style options; raises ``ConfigError`` naming the bad key and value."""

        def integer(key: str, default: int, minimum: int = 0) -> int:
            raw = options.get(key)
            if raw is None or raw.strip() == "":
                return default
            try:
                value = int(raw.strip())
            except ValueError:
                raise ConfigError(f"option.{key}={raw!r} is not an integer") from None
            if value < minimum:
                raise ConfigError(f"option.{key}={raw!r} must be >= {minimum}")
            return value

        def choice(key: str, allowed: tuple[str, ...], default: str) -> str:
            value = (options.get(key) or default).strip().lower()
            if value not in allowed:
                raise ConfigError(f"option.{key}={options.get(key)!r} must be one of {', '.join(allowed)}")
            return value

        def boolean(key: str, default: bool) -> bool:
            raw = options.get(key)
            if raw is None:
                return default
            if raw.strip().lower() not in _BOOL:
                raise ConfigError(f"option.{key}={raw!r} is not a boolean (true/false)")
            return _BOOL[raw.strip().lower()]

        def fraction(key: str, default: float) -> float:
            raw = options.get(key)
            if raw is None or raw.strip() == "":
                return default
            try:
                value = float(raw.strip())
            except ValueError:
                raise ConfigError(f"option.{key}={raw!r} is not a number") from None
            if not 0 < value <= 1:
                raise ConfigError(f"option.{key}={raw!r} must be > 0 and <= 1")
            return value

        kv_mb = options.get("kv_cache_memory_mb")
        if kv_mb is not None and kv_mb.strip().lower() == "auto":
            kv_mb = None
        dtype = (options.get("dtype") or "fp32").strip().lower()
        if dtype not in _DTYPES:
            raise ConfigError(f"option.dtype={dtype!r} must be one of {', '.join(_DTYPES)}")
        return cls(
            max_num_seqs=integer("max_rolling_batch_size", 32, 1),
            max_num_batched_tokens=integer("max_rolling_batch_prefill_tokens", 2048, 1),
            max_prefill_tokens_while_decoding=integer("max_prefill_tokens_while_decoding", 256),
            block_size=integer("block_size", 16, 1),
            kv_cache_memory_mb=integer("kv_cache_memory_mb", 0) if kv_mb is not None else 0,
            kv_cache_memory_fraction=fraction("kv_cache_memory_fraction", 0.9),
            num_kv_blocks=integer("num_kv_blocks", 0),
            enable_prefix_caching=boolean("enable_prefix_caching", True),
            num_threads=0 if (options.get("num_threads") or "auto").strip().lower() == "auto"
            else integer("num_threads", 0, 1),
            max_model_len=integer("max_model_len", 0),
            dtype=dtype,
            prepack_weights=prepack_mode(options.get("prepack_weights")),
            fuse_projections=boolean("fuse_projections", False),
            attention_kernel=choice("attention_kernel", ("native", "torch"), "native"),
            trust_remote_code=boolean("trust_remote_code", False),
            allow_unsafe_weights=boolean("allow_unsafe_weights", False),
            seed=integer("seed", 0),
            tensor_parallel_degree=integer("tensor_parallel_degree", 1, 1),
        )


def prepack_mode(raw: str | None, packed_wins_everywhere: bool | None = None) -> str:
    """``option.prepack_weights``: ``auto`` (default), ``hybrid``, or a boolean (``true`` = packed only).
    ``auto`` is ``true`` on CPUs where packed weights win at every size (``handlers.engine.cpu``: the plain
    copy hybrid keeps for prefill would only cost memory there), else ``hybrid``."""
    value = (raw or "auto").strip().lower()
    if value == "auto":
        if packed_wins_everywhere is None:
            packed_wins_everywhere = packed_weights_win_everywhere()
        return "true" if packed_wins_everywhere else "hybrid"
    if value == "hybrid":
        return value
    if value not in _BOOL:
        raise ConfigError(f"option.prepack_weights={raw!r} must be auto, hybrid, true or false")
    return "true" if _BOOL[value] else "false"
