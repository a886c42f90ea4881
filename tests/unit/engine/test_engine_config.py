"""Engine options parsing (table-driven, no torch); KV-cache sizing is tested in test_memory.py."""

from __future__ import annotations

import pytest

from handlers.engine.config import EngineConfig
from serving.errors import ConfigError


@pytest.mark.parametrize(("options", "field", "value"), [
    ({}, "max_num_seqs", 32),
    ({}, "max_num_batched_tokens", 2048),
    ({}, "block_size", 16),
    ({}, "enable_prefix_caching", True),
    ({}, "num_threads", 1),
    ({}, "dtype", "fp32"),
    ({"max_rolling_batch_size": "8"}, "max_num_seqs", 8),
    ({"max_rolling_batch_prefill_tokens": " 512 "}, "max_num_batched_tokens", 512),
    ({"enable_prefix_caching": "False"}, "enable_prefix_caching", False),
    ({"kv_cache_memory_mb": "100"}, "kv_cache_memory_mb", 100),
    ({"kv_cache_memory_mb": "auto"}, "kv_cache_memory_mb", 0),
    ({"kv_cache_memory_mb": " AUTO "}, "kv_cache_memory_mb", 0),
    ({}, "kv_cache_memory_fraction", 0.9),
    ({"kv_cache_memory_fraction": "0.5"}, "kv_cache_memory_fraction", 0.5),
    ({"dtype": "auto"}, "dtype", "auto"),
    ({"max_model_len": "1024"}, "max_model_len", 1024),
    ({"prepack_weights": "false"}, "prepack_weights", "false"),
    ({"prepack_weights": "True"}, "prepack_weights", "true"),
    ({}, "prepack_weights", "hybrid"),
    ({}, "fuse_projections", False),
])
def test_options(options: dict[str, str], field: str, value: object) -> None:
    assert getattr(EngineConfig.from_options(options), field) == value


@pytest.mark.parametrize(("options", "message"), [
    ({"max_rolling_batch_size": "many"}, "option.max_rolling_batch_size='many' is not an integer"),
    ({"block_size": "0"}, "must be >= 1"),
    ({"enable_prefix_caching": "maybe"}, "not a boolean"),
    ({"dtype": "int3"}, "option.dtype"),
    ({"prepack_weights": "sometimes"}, "must be hybrid, true or false"),
    ({"kv_cache_memory_mb": "lots"}, "option.kv_cache_memory_mb='lots' is not an integer"),
    ({"kv_cache_memory_fraction": "0"}, "must be > 0 and <= 1"),
    ({"kv_cache_memory_fraction": "1.5"}, "must be > 0 and <= 1"),
    ({"kv_cache_memory_fraction": "nan"}, "must be > 0 and <= 1"),
    ({"kv_cache_memory_fraction": "most"}, "is not a number"),
])
def test_bad_options(options: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        EngineConfig.from_options(options)
