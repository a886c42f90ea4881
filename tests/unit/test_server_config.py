"""Server configuration (config.properties): defaults, file values, env mapping and precedence, and bad values
named by file, line and key."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollcore.errors import ConfigError
from serving.config.server_config import ServerConfig, load_server_config


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

