"""Model and server configuration: defaults, validation messages, env mapping and precedence."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from rollcore.errors import ConfigError
from serving.config import (
    BatchingConfig,
    ModelConfig,
    ParallelConfig,
    load_model_config,
    validate_model_name,
)
from serving.config_report import describe_model_config
from serving.server_config import ServerConfig, load_server_config


def make_model(tmp_path: Path, properties: str | None = None, *, name: str = "m",
               model_py: bool = False) -> Path:
    model_dir = tmp_path / name
    model_dir.mkdir()
    if properties is not None:
        (model_dir / "serving.properties").write_text(properties, encoding="utf-8")
    if model_py:
        (model_dir / "model.py").write_text("def handle(inputs):\n    return None\n")
    return model_dir


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


# --- bad values -------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("text", "line", "key", "value", "reason"),
    [
        ("batch_size=abc\n", 1, "batch_size", "abc", "expected an integer >= 1"),
        ("batch_size=-1\n", 1, "batch_size", "-1", "expected an integer >= 1"),
        ("batch_size=0\n", 1, "batch_size", "0", "expected an integer >= 1"),
        ("batch_size=1.5\n", 1, "batch_size", "1.5", "expected an integer >= 1"),
        ("max_batch_delay=-5\n", 1, "max_batch_delay", "-5", "expected an integer >= 0"),
        ("job_queue_size=0\n", 1, "job_queue_size", "0", "expected an integer >= 1"),
        ("maxWorkers=1\n\nminWorkers=3\n", 3, "minWorkers", "3", "must be <= maxWorkers (1, from serving"),
        ("# c\noption.trust_remote_code=maybe\n", 2, "option.trust_remote_code", "maybe",
         "expected true or false"),
        ("option.rolling_batch=bogus\n", 1, "option.rolling_batch", "bogus",
         "expected one of disable, auto, scheduler, lmi-dist, vllm"),
        ("option.rolling_batch=trtllm\n", 1, "option.rolling_batch", "trtllm",
         "TensorRT-LLM is not part of rollserve; use auto or scheduler"),
        ("option.rolling_batch=tnx\n", 1, "option.rolling_batch", "tnx", "transformers-neuronx is not part of"),
        ("option.dtype=int3\n", 1, "option.dtype", "int3", "expected one of fp32, fp16, bf16, auto"),
        ("option.predict_timeout=0\n", 1, "option.predict_timeout", "0", "expected a number > 0"),
        ("option.model_loading_timeout=soon\n", 1, "option.model_loading_timeout", "soon", "expected a number"),
        ("option.tensor_parallel_degree=0\n", 1, "option.tensor_parallel_degree", "0", "or 'max'"),
        ("option.max_rolling_batch_size=0\n", 1, "option.max_rolling_batch_size", "0", ">= 1"),
        ("option.max_rolling_batch_prefill_tokens=x\n", 1, "option.max_rolling_batch_prefill_tokens", "x", ">= 1"),
        ("load_on_devices=gpu0\n", 1, "load_on_devices", "gpu0", "device ids"),
        ("engine=DeepSpeed\n", 1, "engine", "DeepSpeed", "expected one of Python, MPI"),
        ("a=1\noption.entryPoint=\n", 2, "option.entryPoint", "", "non-empty"),
        ("max_idle_time=-1\n", 1, "max_idle_time", "-1", ">= 0"),
        ("required_memory_mb=lots\n", 1, "required_memory_mb", "lots", ">= 0"),
    ],
)
def test_bad_file_value_names_file_line_key_value(
        tmp_path: Path, text: str, line: int, key: str, value: str, reason: str) -> None:
    model_dir = make_model(tmp_path, text.replace("a=1\n", "batch_size=1\n"))
    with pytest.raises(ConfigError) as info:
        load_model_config(model_dir)
    message = str(info.value)
    assert f"serving.properties:{line}: {key} = {value!r}: " in message
    assert str(model_dir / "serving.properties") in message
    assert reason in message


def test_bad_env_value_names_the_variable(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_model_config(make_model(tmp_path, "batch_size=2\n"), env={"SERVING_BATCH_SIZE": "abc"})
    assert str(info.value) == "env SERVING_BATCH_SIZE: batch_size = 'abc': expected an integer >= 1"


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"OPTION_DTYPE": "int3"}, "env OPTION_DTYPE: option.dtype = 'int3'"),
        ({"OPTION_TRUST_REMOTE_CODE": "maybe"},
         "env OPTION_TRUST_REMOTE_CODE: option.trust_remote_code = 'maybe'"),
        ({"SAGEMAKER_NUM_MODEL_WORKERS": "x"}, "env SAGEMAKER_NUM_MODEL_WORKERS: minWorkers = 'x'"),
    ],
)
def test_bad_env_values(tmp_path: Path, env: dict[str, str], expected: str) -> None:
    with pytest.raises(ConfigError, match="^" + expected.replace(".", r"\.")):
        load_model_config(make_model(tmp_path), env=env)


def test_bad_override_value(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^override: batch_size = '0': expected an integer >= 1"):
        load_model_config(make_model(tmp_path), overrides={"batch_size": "0"})


@pytest.mark.parametrize(
    ("text", "line", "key"),
    [("bogus_key=1\n", 1, "bogus_key"), ("batch_size=1\nbatchsize2=4\n", 2, "batchsize2"),
     ("model_id=x\n", 1, "model_id")],
)
def test_unknown_model_key_is_an_error(tmp_path: Path, text: str, line: int, key: str) -> None:
    with pytest.raises(ConfigError, match=rf"serving\.properties:{line}: {key} = .*unknown key"):
        load_model_config(make_model(tmp_path, text))


def test_unknown_override_key_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="override: nope = '1': unknown key"):
        load_model_config(make_model(tmp_path), overrides={"nope": "1"})


@pytest.mark.parametrize("name", ["", "-x", ".hidden", "a b", "a/b", "é"])
def test_invalid_model_names(tmp_path: Path, name: str) -> None:
    with pytest.raises(ConfigError, match="invalid model name"):
        validate_model_name(name)
    with pytest.raises(ConfigError, match="invalid model name"):
        load_model_config(make_model(tmp_path), name=name)


@pytest.mark.parametrize("name", ["m", "Llama-3.1_8B", "0model"])
def test_valid_model_names(name: str) -> None:
    assert validate_model_name(name) == name


def test_missing_model_folder(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="model folder not found"):
        load_model_config(tmp_path / "absent")


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


# --- server config ----------------------------------------------------------------------------------

def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.properties"
    path.write_text(text, encoding="utf-8")
    return path


def test_server_defaults() -> None:
    cfg = load_server_config(None)
    assert cfg == ServerConfig(sources=cfg.sources)
    assert cfg.inference_host_port() == ("127.0.0.1", 8080)
    assert cfg.management_host_port() == ("127.0.0.1", 8081)
    assert cfg.grpc_host_port() == ("127.0.0.1", 8001)
    assert cfg.metrics_host_port() is None
    assert cfg.max_request_size == 64 * 1024 * 1024
    assert cfg.sagemaker_port is None
    assert set(cfg.sources.values()) == {"default"}


def test_server_file(tmp_path: Path) -> None:
    path = write(tmp_path, """\
inference_address=http://0.0.0.0:0
management_address = http://[::1]:9081/
grpc_address: off
metrics_address=http://127.0.0.1:9090
model_store=/opt/ml/model
load_models=a, b=/models/b ,c
job_queue_size=50
max_request_size=1024
drain_timeout=2.5
log_format=json
""")
    cfg = load_server_config(path)
    assert cfg.inference_host_port() == ("0.0.0.0", 0)
    assert cfg.management_host_port() == ("::1", 9081)
    assert cfg.grpc_address == ""
    assert cfg.grpc_host_port() is None
    assert cfg.metrics_host_port() == ("127.0.0.1", 9090)
    assert cfg.model_store == Path("/opt/ml/model")
    assert cfg.load_models == ("a", "b=/models/b", "c")
    assert (cfg.job_queue_size, cfg.max_request_size) == (50, 1024)
    assert (cfg.drain_timeout_s, cfg.log_format) == (2.5, "json")
    assert cfg.sources["drain_timeout"] == "config.properties:9"


@pytest.mark.parametrize(
    ("env", "attr", "expected", "source_key", "source"),
    [
        ({"SERVING_INFERENCE_ADDRESS": "http://127.0.0.1:9000"}, "inference_address", "http://127.0.0.1:9000",
         "inference_address", "env SERVING_INFERENCE_ADDRESS"),
        ({"SERVING_JOB_QUEUE_SIZE": "3"}, "job_queue_size", 3, "job_queue_size", "env SERVING_JOB_QUEUE_SIZE"),
        ({"SERVING_GRPC_ADDRESS": ""}, "grpc_address", "", "grpc_address", "env SERVING_GRPC_ADDRESS"),
        ({"SAGEMAKER_BIND_TO_PORT": "8085"}, "sagemaker_port", 8085, "sagemaker_port",
         "env SAGEMAKER_BIND_TO_PORT"),
        ({"SAGEMAKER_MAX_REQUEST_SIZE": "100"}, "max_request_size", 100, "max_request_size",
         "env SAGEMAKER_MAX_REQUEST_SIZE"),
        ({"SAGEMAKER_MAX_PAYLOAD_IN_MB": "2"}, "max_request_size", 2 * 1024 * 1024, "max_request_size",
         "env SAGEMAKER_MAX_PAYLOAD_IN_MB"),
        ({"SAGEMAKER_MAX_REQUEST_SIZE": "100", "SERVING_MAX_REQUEST_SIZE": "200"}, "max_request_size", 200,
         "max_request_size", "env SERVING_MAX_REQUEST_SIZE"),
        ({"SERVING_BATCH_SIZE": "4", "OPTION_X": "1"}, "job_queue_size", 10, "job_queue_size",
         "config.properties:1"),
    ],
)
def test_server_env(tmp_path: Path, env: dict[str, str], attr: str, expected: object, source_key: str,
                    source: str) -> None:
    cfg = load_server_config(write(tmp_path, "job_queue_size=10\n"), env=env)
    assert getattr(cfg, attr) == expected
    assert cfg.sources[source_key] == source


def test_server_precedence(tmp_path: Path) -> None:
    path = write(tmp_path, "job_queue_size=10\n")
    env = {"SERVING_JOB_QUEUE_SIZE": "20"}
    assert load_server_config(path, env=env, overrides={"job_queue_size": "30"}).job_queue_size == 30
    assert load_server_config(path, env=env).job_queue_size == 20
    assert load_server_config(path).job_queue_size == 10


@pytest.mark.parametrize(
    ("text", "line", "key", "value"),
    [
        ("inference_address=127.0.0.1:8080\n", 1, "inference_address", "127.0.0.1:8080"),
        ("inference_address=http://127.0.0.1\n", 1, "inference_address", "http://127.0.0.1"),
        ("management_address=https://h:1\n", 1, "management_address", "https://h:1"),
        ("inference_address=http://h:99999\n", 1, "inference_address", "http://h:99999"),
        ("grpc_address=nohost\n", 1, "grpc_address", "nohost"),
        ("\njob_queue_size=0\n", 2, "job_queue_size", "0"),
        ("max_request_size=big\n", 1, "max_request_size", "big"),
        ("drain_timeout=-1\n", 1, "drain_timeout", "-1"),
        ("log_format=xml\n", 1, "log_format", "xml"),
        ("load_models=bad name\n", 1, "load_models", "bad name"),
        ("load_models=a=\n", 1, "load_models", "a="),
        ("model_store=\n", 1, "model_store", ""),
        ("batch_size=1\n", 1, "batch_size", "1"),  # a model key is unknown here
        ("cors_allowed_origin=*\n", 1, "cors_allowed_origin", "*"),
    ],
)
def test_bad_server_values(tmp_path: Path, text: str, line: int, key: str, value: str) -> None:
    with pytest.raises(ConfigError, match=rf"config\.properties:{line}: {key} = {value!r}: ".replace("*", r"\*")):
        load_server_config(write(tmp_path, text))


@pytest.mark.parametrize(
    ("env", "prefix"),
    [
        ({"SAGEMAKER_BIND_TO_PORT": "0"}, "env SAGEMAKER_BIND_TO_PORT: sagemaker_port = '0'"),
        ({"SAGEMAKER_MAX_PAYLOAD_IN_MB": "x"}, "env SAGEMAKER_MAX_PAYLOAD_IN_MB: max_request_size = 'x'"),
        ({"SERVING_LOG_FORMAT": "xml"}, "env SERVING_LOG_FORMAT: log_format = 'xml'"),
    ],
)
def test_bad_server_env(env: dict[str, str], prefix: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_server_config(None, env=env)
    assert str(info.value).startswith(prefix)


def test_missing_server_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_server_config(tmp_path / "absent.properties")


# --- option.rolling_batch: requested -> effective ---------------------------------------------------

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "max_position_embeddings": 2048}
BLOOM = {"architectures": ["BloomForCausalLM"], "model_type": "bloom"}
MPT = {"architectures": ["MPTForCausalLM"], "model_type": "mpt"}
UNKNOWN = {"architectures": ["FancyForCausalLM"], "model_type": "fancy"}
LONGROPE = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "max_position_embeddings": 131072,
            "original_max_position_embeddings": 4096, "rope_scaling": {"type": "longrope"}}
ALIBI = "ALiBi position bias (the engine implements rotary and learned positions only)"
# Off the verified list and unknown to transformers: nothing can self-check it, so it is refused by the screen.
UNLISTED_UNKNOWN = "FancyForCausalLM (model_type=fancy) is not on the rolling engine's verified list"
# Off the verified list but a transformers causal LM: the engine takes it, pending the worker's self-check.
GLM4 = {"architectures": ["Glm4ForCausalLM"], "model_type": "glm4", "max_position_embeddings": 2048}
PENDING = ("rolling engine, pending load-time self-check; Glm4ForCausalLM (model_type=glm4) is not on the verified "
           "list: the worker compares the engine's logits with transformers' forward when it loads and fails the "
           "model on a difference (option.rolling_batch=disable serves it with dynamic batching)")


def make_arch_model(tmp_path: Path, config: dict[str, object] | None, properties: str, **kw: object) -> Path:
    model_dir = make_model(tmp_path, properties, **kw)  # type: ignore[arg-type]
    if config is not None:
        (model_dir / "config.json").write_text(json.dumps(config))
    return model_dir


@pytest.mark.parametrize(("config", "requested", "effective", "reason"), [
    (LLAMA, "auto", "scheduler",
     "option.rolling_batch=auto: rolling engine; LlamaForCausalLM (model_type=llama) is supported"),
    (LLAMA, "scheduler", "scheduler",
     "option.rolling_batch=scheduler: rolling engine; LlamaForCausalLM (model_type=llama) is supported"),
    (LLAMA, "vllm", "scheduler", "option.rolling_batch=vllm (DJL's name, served by rollserve's rolling engine): "
                                 "rolling engine; LlamaForCausalLM (model_type=llama) is supported"),
    (LLAMA, "lmi-dist", "scheduler", "option.rolling_batch=lmi-dist (DJL's name, served by rollserve's rolling "
                                     "engine): rolling engine; LlamaForCausalLM (model_type=llama) is supported"),
    (LLAMA, "disable", "disable", "option.rolling_batch=disable: dynamic batching"),
    (BLOOM, "auto", "disable", "option.rolling_batch=auto: dynamic batching (HF generate); the rolling engine "
                               f"cannot serve this model: BloomForCausalLM (model_type=bloom): {ALIBI}"),
    (MPT, "auto", "disable", "option.rolling_batch=auto: dynamic batching (HF generate); the rolling engine "
                             f"cannot serve this model: MPTForCausalLM (model_type=mpt): {ALIBI}"),
    (BLOOM, "disable", "disable", "option.rolling_batch=disable: dynamic batching"),
    (GLM4, "auto", "scheduler", f"option.rolling_batch=auto: {PENDING}"),
    (GLM4, "scheduler", "scheduler", f"option.rolling_batch=scheduler: {PENDING}"),
    (None, "auto", "scheduler", "option.rolling_batch=auto: rolling engine; no config.json in the model folder "
                                "to check the architecture before loading (the engine checks it when it loads)"),
])
def test_rolling_batch_choice(tmp_path: Path, config: dict[str, object] | None, requested: str, effective: str,
                              reason: str) -> None:
    cfg = load_model_config(make_arch_model(tmp_path, config, f"option.rolling_batch={requested}\n"))
    b = cfg.batching
    assert (b.rolling_batch_requested, b.rolling_batch, b.rolling_batch_reason) == (requested, effective, reason)
    assert b.rolling is (effective == "scheduler")
    assert b.describe_rolling_batch() == {"requested": requested, "effective": effective, "reason": reason}
    assert cfg.options["rolling_batch"] == requested  # the option as configured, for the handler


def test_rolling_batch_auto_on_an_architecture_transformers_does_not_know_falls_back(tmp_path: Path) -> None:
    """Off the verified list with no causal-LM class in transformers: no self-check can run, so ``auto`` falls
    back to dynamic batching at the frontend (an unlisted transformers family goes to the engine: GLM4 above)."""
    b = load_model_config(make_arch_model(tmp_path, UNKNOWN, "option.rolling_batch=auto\n")).batching
    assert b.rolling_batch == "disable"
    assert b.rolling_batch_reason.startswith(
        "option.rolling_batch=auto: dynamic batching (HF generate); the rolling engine cannot serve this model: "
        + UNLISTED_UNKNOWN)
    assert b.rolling_batch_reason.endswith("and transformers has no AutoModelForCausalLM class for it, so the "
                                           "load-time self-check cannot run")


def test_remote_code_architecture_is_pending_the_self_check(tmp_path: Path) -> None:
    """A config whose ``auto_map`` names an AutoModelForCausalLM class loads through transformers too."""
    config = {**UNKNOWN, "auto_map": {"AutoModelForCausalLM": "modeling_fancy.FancyForCausalLM"}}
    b = load_model_config(make_arch_model(tmp_path, config, "option.rolling_batch=auto\n")).batching
    assert b.rolling_batch == "scheduler"
    assert "rolling engine, pending load-time self-check; FancyForCausalLM (model_type=fancy)" in b.rolling_batch_reason


@pytest.mark.parametrize("requested", ["scheduler", "vllm", "lmi-dist", "SCHEDULER"])
@pytest.mark.parametrize(("config", "feature"), [
    (BLOOM, f"BloomForCausalLM (model_type=bloom): {ALIBI}"),
    (MPT, f"MPTForCausalLM (model_type=mpt): {ALIBI}"),
    (UNKNOWN, UNLISTED_UNKNOWN),
])
def test_explicit_rolling_engine_on_an_unsupported_architecture_is_an_error(
        tmp_path: Path, config: dict[str, object], feature: str, requested: str) -> None:
    model_dir = make_arch_model(tmp_path, config, f"batch_size=1\noption.rolling_batch={requested}\n")
    with pytest.raises(ConfigError) as info:
        load_model_config(model_dir)
    assert str(info.value).startswith(
        f"{model_dir / 'serving.properties'}:2: option.rolling_batch = {requested!r}: the rolling engine cannot "
        f"serve this model: {feature}")
    assert str(info.value).endswith("; set option.rolling_batch=auto (falls back to dynamic batching) or disable")


def test_rolling_entry_point_with_auto_on_an_unsupported_architecture_is_an_error(tmp_path: Path) -> None:
    """``option.entryPoint=rolling`` asks for the engine's handler itself: no fallback to dynamic batching."""
    model_dir = make_arch_model(tmp_path, BLOOM, "option.entryPoint=rolling\noption.rolling_batch=auto\n")
    with pytest.raises(ConfigError, match=r"serving.properties:2: option.rolling_batch = 'auto': the rolling "
                                          r"engine cannot serve this model: BloomForCausalLM"):
        load_model_config(model_dir)


def test_rolling_batch_from_env_names_the_variable(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_model_config(make_arch_model(tmp_path, BLOOM, "batch_size=1\n"), env={"OPTION_ROLLING_BATCH": "vllm"})
    assert str(info.value).startswith("env OPTION_ROLLING_BATCH: option.rolling_batch = 'vllm': the rolling engine "
                                      "cannot serve this model: BloomForCausalLM (model_type=bloom)")


@pytest.mark.parametrize(("requested", "effective"), [("auto", "scheduler"), ("scheduler", "scheduler"),
                                                      ("disable", "disable")])
def test_custom_entry_point_keeps_the_requested_batching(tmp_path: Path, requested: str, effective: str) -> None:
    """A model.py handler is its own engine: the architecture is not checked, rolling stays as requested."""
    cfg = load_model_config(make_arch_model(tmp_path, BLOOM, f"option.rolling_batch={requested}\n", model_py=True))
    assert cfg.entry_point == "model.py"
    assert cfg.batching.rolling_batch == effective
    if requested != "disable":
        assert cfg.batching.rolling_batch_reason == (
            f"option.rolling_batch={requested}: rolling batching with the handler of entry point 'model.py' "
            "(not the built-in engine, so the architecture is not checked)")


def test_rolling_batch_reads_config_json_of_model_id_folder(tmp_path: Path) -> None:
    weights = tmp_path / "weights"
    weights.mkdir()
    (weights / "config.json").write_text(json.dumps(BLOOM))
    model_dir = make_arch_model(tmp_path, LLAMA, "option.model_id=../weights\noption.rolling_batch=auto\n")
    assert load_model_config(model_dir).batching.rolling_batch == "disable"
    (model_dir / "serving.properties").write_text(f"option.model_id={weights}\noption.rolling_batch=auto\n")
    assert load_model_config(model_dir).batching.rolling_batch == "disable"
    (model_dir / "serving.properties").write_text("option.rolling_batch=auto\n")
    assert load_model_config(model_dir).batching.rolling_batch == "scheduler"


def test_rolling_batch_length_dependent_rope_depends_on_max_model_len(tmp_path: Path) -> None:
    model_dir = make_arch_model(tmp_path, LONGROPE, "option.rolling_batch=auto\n")
    b = load_model_config(model_dir).batching
    assert b.rolling_batch == "disable" and "RoPE scaling 'longrope'" in b.rolling_batch_reason
    (model_dir / "serving.properties").write_text("option.rolling_batch=auto\noption.max_model_len=4096\n")
    assert load_model_config(model_dir).batching.rolling_batch == "scheduler"


def test_describe_model_config_shows_the_effective_rolling_batch(tmp_path: Path) -> None:
    cfg = load_model_config(make_arch_model(tmp_path, BLOOM, "option.rolling_batch=auto\n"))
    lines = describe_model_config(cfg).splitlines()
    assert lines[-2] == "effective rolling_batch = disable  (dynamic batching; requested auto)"
    assert lines[-1] == f"  reason: {cfg.batching.rolling_batch_reason}"
    assert any(line.strip().startswith("option.rolling_batch = auto") for line in lines)
