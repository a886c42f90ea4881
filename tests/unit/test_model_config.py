"""Model configuration: defaults, values read from serving.properties, env mapping and precedence, the
description of each key with its source."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from serving.config.config_report import describe_model_config
from serving.config.model_config import BatchingConfig, ModelConfig, ParallelConfig, load_model_config
from serving.config.server_config import load_server_config
from tests.unit.config_cases import make_model

# --- defaults ---------------------------------------------------------------------------------------

def test_defaults_without_properties_file(tmp_path: Path) -> None:
    cfg = load_model_config(make_model(tmp_path))
    assert cfg.name == "m"
    assert cfg.model_dir == (tmp_path / "m").resolve()
    assert cfg.engine == "Python"
    assert cfg.entry_point == "huggingface"
    assert (cfg.min_workers, cfg.max_workers, cfg.max_idle_time_s) == (1, 1, 60)
    assert (cfg.predict_timeout_s, cfg.model_loading_timeout_s) == (120.0, 600.0)
    assert cfg.trust_remote_code is False
    assert cfg.dtype == "fp32"
    assert cfg.model_id is None
    assert cfg.batching == BatchingConfig()
    assert cfg.batching.rolling is False
    assert cfg.parallel == ParallelConfig()
    assert cfg.extra == {}
    assert set(cfg.sources.values()) == {"default"}
    assert "option.model_id" not in cfg.sources
    assert cfg.options["dtype"] == "fp32"
    assert cfg.options["entryPoint"] == "huggingface"


@pytest.mark.parametrize(("model_py", "expected"), [(True, "model.py"), (False, "huggingface")])
def test_entry_point_default_depends_on_model_py(tmp_path: Path, model_py: bool, expected: str) -> None:
    cfg = load_model_config(make_model(tmp_path, "batch_size=1\n", model_py=model_py))
    assert cfg.entry_point == expected
    assert cfg.sources["option.entryPoint"] == "default"


def test_explicit_entry_point_beats_model_py(tmp_path: Path) -> None:
    cfg = load_model_config(make_model(tmp_path, "option.entryPoint=djl_python.huggingface\n", model_py=True))
    assert cfg.entry_point == "djl_python.huggingface"


def test_server_job_queue_size_is_the_model_default(tmp_path: Path) -> None:
    server = load_server_config(None, env={"SERVING_JOB_QUEUE_SIZE": "7"})
    model_dir = make_model(tmp_path)
    cfg = load_model_config(model_dir, server=server)
    assert cfg.batching.job_queue_size == 7
    assert cfg.sources["job_queue_size"] == "server config (env SERVING_JOB_QUEUE_SIZE)"
    assert cfg.sources["max_queue_time"] == "server config (default)"
    (model_dir / "serving.properties").write_text("job_queue_size=9\n")
    assert load_model_config(model_dir, server=server).batching.job_queue_size == 9


# --- file values ------------------------------------------------------------------------------------

FULL_PROPERTIES = """\
# a model
engine=Python
batch_size=4
max_batch_delay=0
job_queue_size=10
minWorkers=1
maxWorkers=2
max_idle_time=5
load_on_devices=0;1
required_memory_mb=512
gpu.maxWorkers=2
log_request_metric=true
option.model_id=/models/tiny
option.dtype=bf16
option.trust_remote_code=TRUE
option.predict_timeout=2.5
option.model_loading_timeout=30
option.rolling_batch=scheduler
option.max_rolling_batch_size=16
option.max_rolling_batch_prefill_tokens=512
option.tensor_parallel_degree=2
option.output_formatter=jsonlines
option.custom_Camel=Value With Spaces
"""


def test_file_values(tmp_path: Path) -> None:
    cfg = load_model_config(make_model(tmp_path, FULL_PROPERTIES), name="tiny")
    assert cfg.name == "tiny"
    assert cfg.batching == BatchingConfig(
        batch_size=4, max_batch_delay_ms=0, job_queue_size=10, rolling_batch="scheduler", max_rolling_batch_size=16,
        max_rolling_batch_prefill_tokens=512, rolling_batch_requested="scheduler",
        rolling_batch_reason="option.rolling_batch=scheduler: rolling engine; no config.json in the model folder to "
                             "check the architecture before loading (the engine checks it when it loads)")
    assert cfg.batching.rolling is True
    assert cfg.parallel == ParallelConfig(tensor_parallel_degree=2, load_on_devices="0;1")
    assert (cfg.min_workers, cfg.max_workers, cfg.max_idle_time_s) == (1, 2, 5)
    assert (cfg.predict_timeout_s, cfg.model_loading_timeout_s) == (2.5, 30.0)
    assert cfg.trust_remote_code is True
    assert cfg.dtype == "bf16"
    assert cfg.model_id == "/models/tiny"
    assert cfg.extra == {"required_memory_mb": "512", "gpu.maxWorkers": "2", "log_request_metric": "true"}
    assert cfg.sources["batch_size"] == "serving.properties:3"
    assert cfg.sources["option.custom_Camel"] == "serving.properties:23"
    assert cfg.sources["max_idle_time"] == "serving.properties:8"


def test_options_pass_through(tmp_path: Path) -> None:
    cfg = load_model_config(make_model(tmp_path, FULL_PROPERTIES))
    assert cfg.options["output_formatter"] == "jsonlines"
    assert cfg.options["custom_Camel"] == "Value With Spaces"
    assert cfg.options["trust_remote_code"] == "true"  # normalised effective value
    assert cfg.options["predict_timeout"] == "2.5"
    assert cfg.options["model_loading_timeout"] == "30"
    assert cfg.options["model_id"] == "/models/tiny"
    assert all(not key.startswith("option.") for key in cfg.options)


def test_handler_properties(tmp_path: Path) -> None:
    props = load_model_config(make_model(tmp_path, FULL_PROPERTIES)).handler_properties()
    assert props["output_formatter"] == "jsonlines"
    assert props["model_id"] == "/models/tiny"
    assert props["rolling_batch"] == "scheduler"
    assert props["batch_size"] == "4"
    assert props["max_batch_delay"] == "0"
    assert props["maxWorkers"] == "2"
    assert props["load_on_devices"] == "0;1"
    assert props["required_memory_mb"] == "512"
    assert props["engine"] == "Python"
    assert all(isinstance(value, str) for value in props.values())


@pytest.mark.parametrize(
    ("line", "attr", "expected"),
    [
        ("option.dtype=float16", "dtype", "fp16"),
        ("option.dtype=auto", "dtype", "auto"),
        ("option.trust_remote_code=false", "trust_remote_code", False),
        ("batch_size = 8   ", "batching.batch_size", 8),
        ("option.entrypoint=model.py", "entry_point", "model.py"),  # key case-insensitive
        ("min_workers=0", "min_workers", 0),
        ("engine=MPI", "engine", "MPI"),
        ("option.tensor_parallel_degree=max", "parallel.tensor_parallel_degree", 3),
        ("option.rolling_batch=auto", "batching.rolling", True),
    ],
)
def test_single_values(tmp_path: Path, line: str, attr: str, expected: object) -> None:
    cfg: object = load_model_config(make_model(tmp_path, line + "\n"), num_devices=3)
    for part in attr.split("."):
        cfg = getattr(cfg, part)
    assert cfg == expected


# --- environment and precedence ---------------------------------------------------------------------

@pytest.mark.parametrize(
    ("file", "env", "overrides", "expected", "source"),
    [
        ("", {}, {}, 1, "default"),
        ("batch_size=2\n", {}, {}, 2, "serving.properties:1"),
        ("batch_size=2\n", {"SERVING_BATCH_SIZE": "3"}, {}, 3, "env SERVING_BATCH_SIZE"),
        ("", {"SERVING_BATCH_SIZE": "3"}, {}, 3, "env SERVING_BATCH_SIZE"),
        ("batch_size=2\n", {"SERVING_BATCH_SIZE": "3"}, {"batch_size": "4"}, 4, "override"),
        ("batch_size=2\n", {}, {"batch_size": "4"}, 4, "override"),
    ],
)
def test_precedence_override_env_file_default(
        tmp_path: Path, file: str, env: dict[str, str], overrides: dict[str, str], expected: int,
        source: str) -> None:
    cfg = load_model_config(make_model(tmp_path, file), env=env, overrides=overrides)
    assert cfg.batching.batch_size == expected
    assert cfg.sources["batch_size"] == source


@pytest.mark.parametrize(
    ("env", "key", "value", "source"),
    [
        ({"OPTION_MAX_ROLLING_BATCH_SIZE": "8"}, "option.max_rolling_batch_size", "8",
         "env OPTION_MAX_ROLLING_BATCH_SIZE"),
        ({"OPTION_ENTRYPOINT": "x.py"}, "option.entryPoint", "x.py", "env OPTION_ENTRYPOINT"),
        ({"OPTION_ENTRY_POINT": "x.py"}, "option.entryPoint", "x.py", "env OPTION_ENTRY_POINT"),
        ({"OPTION_MY_FLAG": "on"}, "option.my_flag", "on", "env OPTION_MY_FLAG"),
        ({"OPTION_DTYPE": "fp16"}, "option.dtype", "fp16", "env OPTION_DTYPE"),
        ({"HF_MODEL_ID": "org/a"}, "option.model_id", "org/a", "env HF_MODEL_ID"),
        ({"HF_MODEL_ID": "org/a", "OPTION_MODEL_ID": "org/b"}, "option.model_id", "org/b", "env OPTION_MODEL_ID"),
    ],
)
def test_option_env_mapping(tmp_path: Path, env: dict[str, str], key: str, value: str, source: str) -> None:
    cfg = load_model_config(make_model(tmp_path, "option.dtype=bf16\n"), env=env)
    assert cfg.options[key[len("option."):]] == value
    assert cfg.sources[key] == source


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"SERVING_MIN_WORKERS": "2", "SERVING_MAX_WORKERS": "3"}, (2, 3)),
        ({"SERVING_MINWORKERS": "2", "SERVING_MAXWORKERS": "2"}, (2, 2)),
        ({"SAGEMAKER_NUM_MODEL_WORKERS": "4"}, (4, 4)),
        ({"SAGEMAKER_NUM_MODEL_WORKERS": "4", "SERVING_MIN_WORKERS": "1"}, (1, 4)),
        ({"SERVING_OPTS": "-Xmx1g", "SERVING_UNRELATED": "x"}, (1, 1)),  # ignored
    ],
)
def test_serving_env_mapping_for_workers(tmp_path: Path, env: dict[str, str], expected: tuple[int, int]) -> None:
    cfg = load_model_config(make_model(tmp_path), env=env)
    assert (cfg.min_workers, cfg.max_workers) == expected


def test_serving_job_queue_size_is_server_level(tmp_path: Path) -> None:
    cfg = load_model_config(make_model(tmp_path, "job_queue_size=9\n"), env={"SERVING_JOB_QUEUE_SIZE": "5"})
    assert cfg.batching.job_queue_size == 9


def test_env_does_not_leak_from_os_environ(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SERVING_BATCH_SIZE", "7")
    assert load_model_config(make_model(tmp_path)).batching.batch_size == 1


def test_tensor_parallel_max_defaults_to_cpu_count(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.cpu_count", lambda: 5)
    cfg = load_model_config(make_model(tmp_path), env={"OPTION_TENSOR_PARALLEL_DEGREE": "max"})
    assert cfg.parallel.tensor_parallel_degree == 5
    assert cfg.options["tensor_parallel_degree"] == "5"


# --- describe ---------------------------------------------------------------------------------------

def test_describe_model_config_lists_each_key_with_its_source(tmp_path: Path) -> None:
    cfg = load_model_config(make_model(tmp_path, "batch_size=4\noption.foo=bar\n"),
                            env={"OPTION_DTYPE": "fp16"}, overrides={"maxWorkers": "2"})
    text = describe_model_config(cfg)
    lines = text.splitlines()
    assert lines[0].startswith("model m")
    for key, source in cfg.sources.items():
        assert any(line.strip().startswith(f"{key} = ") and line.endswith(f"({source})") for line in lines), key
    assert any("batch_size = 4" in line and "(serving.properties:1)" in line for line in lines)
    assert any("option.foo = bar" in line and "(serving.properties:2)" in line for line in lines)
    assert any("option.dtype = fp16" in line and "(env OPTION_DTYPE)" in line for line in lines)
    assert any("maxWorkers = 2" in line and "(override)" in line for line in lines)
    assert any("max_batch_delay = 100" in line and "(default)" in line for line in lines)


def test_configs_are_frozen(tmp_path: Path) -> None:
    cfg = load_model_config(make_model(tmp_path))
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.name = "x"  # type: ignore[misc]
    with pytest.raises(TypeError):
        cfg.options["dtype"] = "fp16"  # type: ignore[index]
    assert isinstance(cfg, ModelConfig)
