"""Engine options parsing and KV-cache sizing (table-driven, no torch)."""

from __future__ import annotations

import pytest

from handlers.engine.config import EngineConfig, kv_cache_blocks
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
])
def test_bad_options(options: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        EngineConfig.from_options(options)


def test_kv_cache_sizing() -> None:
    per_token = 1024  # bytes
    cfg = EngineConfig(max_num_seqs=4, block_size=16)
    # Enough memory: exactly what 4 sequences of 2048 tokens need.
    assert kv_cache_blocks(cfg, 2048, per_token, 1 << 40) == 4 * 128
    # Little memory: a quarter of what is available.
    assert kv_cache_blocks(cfg, 2048, per_token, 64 * 16 * 1024 * 4) == 64
    assert kv_cache_blocks(EngineConfig(kv_cache_memory_mb=1, block_size=16), 2048, per_token, 0) == 64
    assert kv_cache_blocks(EngineConfig(num_kv_blocks=7), 2048, per_token, 0) == 7
