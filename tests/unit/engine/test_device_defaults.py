"""What a GPU changes in the engine's defaults (``device_defaults``), checked without one: only the device's type
is read, and an option the user set is kept."""

from __future__ import annotations

import torch

from handlers.engine.execution.gpu.device import device_defaults
from handlers.engine.planning.engine_config import EngineConfig


def test_a_gpu_mixes_the_decodes_into_every_step_and_drops_the_time_bound() -> None:
    cpu = EngineConfig.from_options({})
    knobs = ("burst_prefill_first", "max_mixed_step_ratio", "max_prefill_tokens_while_decoding")
    assert [getattr(cpu, k) for k in knobs] == [True, 8.0, 256]
    assert device_defaults(cpu, {}, torch.device("cpu")) is cpu
    gpu = device_defaults(cpu, {}, torch.device("cuda"))
    assert [getattr(gpu, k) for k in knobs] == [False, 0.0, 0]


def test_options_the_user_set_are_kept_on_a_gpu() -> None:
    options = {"burst_prefill_first": "true", "max_mixed_step_ratio": "4", "max_prefill_tokens_while_decoding": "64"}
    config = EngineConfig.from_options(options)
    gpu = device_defaults(config, options, torch.device("cuda"))
    assert [gpu.burst_prefill_first, gpu.max_mixed_step_ratio, gpu.max_prefill_tokens_while_decoding] == [True, 4.0, 64]
