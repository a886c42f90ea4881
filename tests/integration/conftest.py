"""Shared servers for the frontend integration tests (one start per test session: loading the torch
models takes most of a test's time on a 2-core machine).

``api_server``: ``tiny`` (the default model, dynamic batching, unknown request fields refused), ``tiny-rb`` (the
same weights, rolling batching, small batch, unknown fields ignored as by default) and ``echo`` (torch-free).
``smollm2_server``: the real SmolLM2-135M-Instruct (``tests/real_model.py``) as ``smollm2`` (rolling batching)
and ``dyn`` (dynamic batching).
``echo_server``: torch-free models only (``echo``, ``slow`` (0.5 s per request, one at a time) and ``attrs``, a
custom handler that reflects its request attributes), with the inference API bound to ``SAGEMAKER_BIND_TO_PORT``,
as SageMaker starts a container.
``two_workers_server``: ``chat`` (the default model, rolling batching with the prefix cache, two workers of at
most 4 sequences): SageMaker sessions and prefix-aware routing among a model's workers.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest

from tests.integration.harness import ServerProcess
from tests.real_model import smollm2_folder

ATTRS_HANDLER = '''
from handlers.base import Output


def handle(inputs):
    return [Output(request_id=i.request_id, payload={"attributes": dict(i.attributes), "prompt": i.prompt})
            for i in inputs]
'''


@pytest.fixture(scope="session")
def smollm2_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = smollm2_folder()
    rolling = {"option.rolling_batch": "auto", "option.max_rolling_batch_size": "16", "option.max_model_len": "2048",
               "option.kv_cache_populate": "lazy"}
    dynamic = {"option.max_model_len": "2048", "batch_size": "4", "max_batch_delay": "50"}
    srv = ServerProcess.start(tmp_path_factory.mktemp("smollm2"), models={"smollm2": rolling, "dyn": dynamic},
                              sources={"smollm2": folder, "dyn": folder}, timeout_s=600)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="session")
def two_workers_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = ServerProcess.start(tmp_path_factory.mktemp("two-workers"), models={"chat": {
        "option.entryPoint": "huggingface", "option.rolling_batch": "auto", "option.enable_prefix_caching": "true",
        "option.max_rolling_batch_size": "4", "minWorkers": "2", "maxWorkers": "2"}}, timeout_s=300)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="session")
def api_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = ServerProcess.start(tmp_path_factory.mktemp("api"), models={
        "tiny": {"option.entryPoint": "huggingface", "batch_size": "4", "max_batch_delay": "10",
                 "option.strict_parameters": "true"},
        "tiny-rb": {"option.entryPoint": "huggingface", "option.rolling_batch": "auto",
                    "option.max_rolling_batch_size": "8"},
        "echo": {"option.entryPoint": "echo"},
    }, timeout_s=240)
    yield server
    server.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def echo_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    port = free_port()
    server = ServerProcess.start(
        tmp_path_factory.mktemp("echo"),
        models={"echo": {"option.entryPoint": "echo", "option.echo_delay_ms": "0"},
                "slow": {"option.entryPoint": "echo", "option.echo_delay_ms": "500", "batch_size": "1",
                         "max_batch_delay": "1"},
                "attrs": {"option.entryPoint": "model.py"}},
        files={"attrs": {"model.py": ATTRS_HANDLER}},
        env={"SAGEMAKER_BIND_TO_PORT": str(port)}, timeout_s=120)
    server.sagemaker_port = port  # type: ignore[attr-defined]
    yield server
    server.stop()


def server_log_since(server: ServerProcess, offset: int) -> str:
    return server.log()[offset:]


def log_size(server: ServerProcess) -> int:
    return len(server.log())


@pytest.fixture(scope="session")
def hostile_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The server of the "one request must never break a model" tests (see tests/integration/hostile.py)."""
    from tests.integration.hostile import BROKEN_HANDLER, CUSTOM_HANDLER, POISON_HANDLER

    server = ServerProcess.start(tmp_path_factory.mktemp("hostile"), models={
        "dyn": {"option.entryPoint": "huggingface", "batch_size": "4", "max_batch_delay": "30"},
        "roll": {"option.rolling_batch": "auto", "option.max_rolling_batch_size": "4"},
        "custom": {"option.entryPoint": "model.py", "batch_size": "4", "max_batch_delay": "50"},
        "poison": {"option.entryPoint": "model.py", "option.rolling_batch": "auto"},
        "slowecho": {"option.entryPoint": "echo", "option.echo_delay_ms": "150"},
        "broken": {"option.entryPoint": "model.py"},
    }, files={"custom": {"model.py": CUSTOM_HANDLER}, "poison": {"model.py": POISON_HANDLER},
              "broken": {"model.py": BROKEN_HANDLER}},
        config={"ping_requires": "any", "enable_model_api": "true", "max_models": "7", "max_workers_per_model": "2",
                "grpc_max_stream_requests": "4", "grpc_max_concurrent_rpcs": "6"}, timeout_s=300)
    deadline = time.monotonic() + 300  # ping_requires=any: wait for every model that can load
    while any(server.describe(m)["state"] != "READY" for m in ("dyn", "roll", "custom", "poison", "slowecho")):
        assert time.monotonic() < deadline, server.log()[-3000:]
        time.sleep(0.2)
    yield server
    server.stop()
