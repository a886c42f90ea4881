"""``minWorkers`` / ``maxWorkers`` ``auto`` (``serving.config.layout``): the layout from the cores and the model's
size."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollcore.errors import ConfigError
from serving.config import model_config as config_module
from serving.config.layout import PROCESS_BOUND_PARAMS, auto_layout, checkpoint_parameters
from serving.config.model_config import load_model_config
from tests.integration.harness import DEFAULT_MODEL


@pytest.mark.parametrize(("cores", "params", "tp", "workers", "threads"), [
    (1, 3_400_000, 1, 1, 1),  # one core: one worker whatever the model
    (1, 135_000_000, 1, 1, 1),
    (2, 3_400_000, 1, 2, 1),  # process-bound: a worker per core
    (8, PROCESS_BOUND_PARAMS - 1, 1, 8, 1),
    (2, PROCESS_BOUND_PARAMS, 1, 1, 2),  # GEMM-bound: one worker, every core a thread
    (16, 135_000_000, 1, 1, 16),
    (2, None, 1, 1, 2),  # size unknown (converted at load): one worker
    (8, 3_400_000, 2, 1, 4),  # tensor parallelism: one worker, ranks share the cores
])
def test_auto_layout(cores: int, params: int | None, tp: int, workers: int, threads: int) -> None:
    layout = auto_layout(cores, params, tp)
    assert (layout.workers, layout.threads_per_worker) == (workers, threads)
    assert layout.reason


def test_checkpoint_parameters_reads_the_headers() -> None:
    assert checkpoint_parameters(DEFAULT_MODEL) == pytest.approx(3.4e6, rel=0.05)
    assert checkpoint_parameters(DEFAULT_MODEL / "missing") is None


def _model(tmp_path: Path, lines: str) -> Path:
    d = tmp_path / "m"
    d.mkdir()
    for f in DEFAULT_MODEL.iterdir():
        if f.suffix in (".json", ".safetensors", ".jinja"):
            (d / f.name).symlink_to(f)
    (d / "serving.properties").write_text("option.rolling_batch=auto\n" + lines)
    return d


@pytest.mark.parametrize(("cores", "lines", "expected"), [
    (2, "minWorkers=auto\nmaxWorkers=auto\n", (2, 2)),
    (1, "minWorkers=auto\nmaxWorkers=auto\n", (1, 1)),
    (2, "minWorkers=1\nmaxWorkers=auto\n", (1, 2)),  # one auto bound: the other stays as set
    (2, "minWorkers=auto\nmaxWorkers=1\n", (1, 1)),  # auto never exceeds a maxWorkers set lower
    (4, "minWorkers=auto\nmaxWorkers=8\n", (4, 8)),
])
def test_auto_workers_in_the_model_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cores: int, lines: str,
                                          expected: tuple[int, int]) -> None:
    monkeypatch.setattr(config_module, "server_cores", lambda: cores)
    cfg = load_model_config(_model(tmp_path, lines))
    assert (cfg.min_workers, cfg.max_workers) == expected
    assert cfg.layout_reason.startswith("workers auto: ")


def test_numbers_need_no_layout(tmp_path: Path) -> None:
    cfg = load_model_config(_model(tmp_path, "minWorkers=2\nmaxWorkers=3\n"))
    assert (cfg.min_workers, cfg.max_workers, cfg.layout_reason) == (2, 3, "")


def test_a_bad_word_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="minWorkers.*expected an integer >= 0 or auto"):
        load_model_config(_model(tmp_path, "minWorkers=many\n"))
