"""Shared servers for the frontend integration tests (one start per test session: loading the torch
models takes most of a test's time on a 2-core machine).

``api_server``: ``tiny`` (the default model, dynamic batching), ``tiny-rb`` (the same weights, rolling
batching, small batch) and ``echo`` (torch-free). ``echo_server``: torch-free models only (``echo``,
``slow`` (0.5 s per request, one at a time) and ``attrs``, a custom handler that reflects its request
attributes), with the inference API bound to ``SAGEMAKER_BIND_TO_PORT``, as SageMaker starts a container.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from tests.integration.harness import ServerProcess

ATTRS_HANDLER = '''
from handlers.base import Output


def handle(inputs):
    return [Output(request_id=i.request_id, payload={"attributes": dict(i.attributes), "prompt": i.prompt})
            for i in inputs]
'''


@pytest.fixture(scope="session")
def api_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = ServerProcess.start(tmp_path_factory.mktemp("api"), models={
        "tiny": {"option.entryPoint": "huggingface", "batch_size": "4", "max_batch_delay": "10"},
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
