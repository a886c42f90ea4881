"""Engine options parsing (table-driven, no torch); KV-cache sizing is tested in test_memory.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from handlers.engine.planning.engine_config import EngineConfig
from rollcore.errors import ConfigError


@pytest.mark.parametrize(("options", "field", "value"), [
    ({}, "max_num_seqs", 32),
    ({}, "max_num_batched_tokens", 2048),
    ({}, "block_size", 16),
    ({}, "enable_prefix_caching", True),
    ({}, "num_threads", 0),
    ({"num_threads": "auto"}, "num_threads", 0),
    ({"num_threads": "3"}, "num_threads", 3),
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
    ({"prepack_weights": "hybrid"}, "prepack_weights", "hybrid"),
    ({}, "fuse_projections", False),
])
def test_options(options: dict[str, str], field: str, value: object) -> None:
    assert getattr(EngineConfig.from_options(options), field) == value


@pytest.mark.parametrize(("options", "message"), [  # the wording of serving.config.model_config's errors (one schema)
    ({"max_rolling_batch_size": "many"}, "option.max_rolling_batch_size = 'many': expected an integer >= 1"),
    ({"block_size": "0"}, "option.block_size = '0': expected an integer >= 1"),
    ({"enable_prefix_caching": "maybe"}, "option.enable_prefix_caching = 'maybe': expected true or false"),
    ({"dtype": "int3"}, "option.dtype = 'int3': expected one of fp32, fp16, bf16, auto"),
    ({"prepack_weights": "sometimes"}, "option.prepack_weights = 'sometimes': expected one of auto, hybrid, true, "
                                       "false"),
    ({"kv_cache_memory_mb": "lots"}, "option.kv_cache_memory_mb = 'lots': expected an integer >= 0 or auto"),
    ({"kv_cache_memory_fraction": "0"}, "expected a number > 0 and <= 1"),
    ({"kv_cache_memory_fraction": "1.5"}, "expected a number > 0 and <= 1"),
    ({"kv_cache_memory_fraction": "nan"}, "expected a number > 0 and <= 1"),
    ({"kv_cache_memory_fraction": "most"}, "option.kv_cache_memory_fraction = 'most': expected a number"),
    ({"num_threads": "0"}, "option.num_threads = '0': expected an integer >= 1 or auto"),
    ({"attention_kernel": "fast"}, "option.attention_kernel = 'fast': expected one of native, torch"),
])
def test_bad_options(options: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        EngineConfig.from_options(options)
    assert message in str(info.value)


@pytest.mark.parametrize(("raw", "mode", "measured"), [
    (None, "hybrid", True), ("auto", "hybrid", True), ("AUTO", "hybrid", True), ("hybrid", "hybrid", False),
    ("false", "false", False), ("yes", "true", False),
])
def test_prepack_auto_plans_two_copies_and_measures(raw: str | None, mode: str, measured: bool) -> None:
    options = {} if raw is None else {"prepack_weights": raw}
    config = EngineConfig.from_options(options)
    assert (config.prepack_weights, config.measure_linears) == (mode, measured)


def test_cpu_flags_from_cpuinfo(tmp_path: Path) -> None:
    from handlers.engine.planning.cpu import cpu_flags, has_fast_bf16

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16\n\nprocessor\t: 1\n")
    flags = cpu_flags(info)
    assert {"avx2", "avx512f", "avx512_bf16"} <= flags
    assert has_fast_bf16(flags)
    assert not has_fast_bf16(frozenset({"avx2"}))
    assert cpu_flags(tmp_path / "missing") == frozenset()


def test_auto_threads_share_the_affinity_mask() -> None:
    import os

    from handlers.engine.planning.cpu import auto_threads

    cores = len(os.sched_getaffinity(0))
    assert auto_threads() == cores
    assert auto_threads(num_workers=2) == max(1, cores // 2)
    assert auto_threads(num_workers=1, ranks_per_worker=cores * 4) == 1
    # models loaded together share the cores too (the frontend sets the variable for its workers)
    assert auto_threads(environ={"ROLLSERVE_MODELS_SHARING_CORES": "2"}) == max(1, cores // 2)
    assert auto_threads(num_workers=2, environ={"ROLLSERVE_MODELS_SHARING_CORES": "2"}) == max(1, cores // 4)
    assert auto_threads(environ={"ROLLSERVE_MODELS_SHARING_CORES": "x"}) == cores
