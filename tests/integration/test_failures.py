"""What clients see when things go wrong or get busy, against one real server: a worker that dies on a
request (502 after one retry), a request that outlives ``predict_timeout`` (504), a full queue on a rolling
model over HTTP (503 + Retry-After) and gRPC (RESOURCE_EXHAUSTED), and one saturated model next to another
that keeps answering at once. (499, a whole-answer client that left, is in test_cancellation.py.)"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import httpx
import pytest

from serving.bench.launch import wait_for
from serving.frontends.proto.gen.rollserve.v1 import generate_pb2 as pb
from serving.frontends.proto.gen.rollserve.v1 import generate_pb2_grpc as pb_grpc
from tests.integration.harness import ServerProcess

CRASH_ON_PROMPT = '''
import os

from handlers.base import Output


def handle(inputs):
    if any(i.prompt == "CRASH" for i in inputs):
        os._exit(1)  # the worker dies with the batch in its hands
    return [Output(request_id=i.request_id, text=i.prompt) for i in inputs]
'''
ONE_AT_A_TIME = {"option.entryPoint": "echo", "option.echo_delay_ms": "200", "batch_size": "1",
                 "max_batch_delay": "1"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    s = ServerProcess.start(tmp_path_factory.mktemp("failures"), models={
        "crashy": {"option.entryPoint": "model.py", "batch_size": "1"},
        "stuck": {"option.entryPoint": "echo", "option.echo_delay_ms": "600000", "option.predict_timeout": "1"},
        "roll1": {"option.rolling_batch": "auto", "option.max_rolling_batch_size": "1", "job_queue_size": "1"},
        "busy": {**ONE_AT_A_TIME, "option.echo_delay_ms": "1000"},
        "calm": ONE_AT_A_TIME,
    }, files={"crashy": {"model.py": CRASH_ON_PROMPT}}, timeout_s=240)
    yield s
    s.stop()


def test_a_worker_dying_on_a_request_twice_is_502(server: ServerProcess) -> None:
    r = httpx.post(f"{server.url}/predictions/crashy", json={"inputs": "CRASH"}, timeout=120)
    assert r.status_code == 502, r.text
    body = r.json()
    assert body["error_type"] == "worker_failed" and "retried once already" in body["error"], body
    assert server.describe("crashy")["worker_restarts"] == 2  # the first death was retried, the second not
    wait_for(lambda: server.describe("crashy")["state"] == "READY" and server.describe("crashy")["workers"],
             "the restarted worker")
    r = httpx.post(f"{server.url}/predictions/crashy", json={"inputs": "fine"}, timeout=60)
    assert (r.status_code, r.json()) == (200, {"generated_text": "fine"})


def test_a_request_past_predict_timeout_is_504_and_its_worker_restarted(server: ServerProcess) -> None:
    (old,) = server.describe("stuck")["workers"]
    r = httpx.post(f"{server.url}/predictions/stuck", json={"inputs": "never answered"}, timeout=120)
    assert r.status_code == 504, r.text
    body = r.json()
    assert body["error_type"] == "timeout" and "option.predict_timeout=1s" in body["error"], body
    new = wait_for(lambda: (w := server.describe("stuck")["workers"]) and w[0]["pid"] != old["pid"] and w,
                   "the stuck worker replaced")
    assert new[0]["status"] == "READY"


def test_a_full_rolling_queue_is_503_over_http_and_resource_exhausted_over_grpc(server: ServerProcess) -> None:
    url = f"{server.url}/predictions/roll1"
    running: list[dict[str, Any]] = []

    def stream_long() -> None:
        body = {"inputs": "keep going", "stream": True, "parameters": {"max_new_tokens": 1900, "ignore_eos": True}}
        with httpx.stream("POST", url, json=body, headers={"X-Request-Id": "long"}, timeout=120) as r:
            running.extend(json.loads(line) for line in r.iter_lines() if line.strip())

    first = threading.Thread(target=stream_long, daemon=True)
    first.start()
    wait_for(lambda: server.describe("roll1")["batcher"]["running"] == 1, "the long request running")
    with ThreadPoolExecutor(1) as pool:
        queued = pool.submit(httpx.post, url, json={"inputs": "queued", "parameters": {
            "max_new_tokens": 4, "ignore_eos": True, "details": True}},
                             timeout=120)
        wait_for(lambda: server.describe("roll1")["batcher"]["waiting"] == 1, "one request waiting")
        r = httpx.post(url, json={"inputs": "one too many"}, timeout=30)
        assert r.status_code == 503, r.text
        assert r.json()["error_type"] == "overloaded" and int(r.headers["Retry-After"]) >= 1
        with grpc.insecure_channel(server.grpc_target) as channel:
            with pytest.raises(grpc.RpcError) as err:
                pb_grpc.GenerationStub(channel).Generate(pb.GenerateRequest(model="roll1", prompt="grpc too"),
                                                         timeout=30)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "queue is full" in (err.value.details() or "")
        batcher = server.describe("roll1")["batcher"]
        assert (batcher["running"], batcher["waiting"]) == (1, 1)  # refused, while nothing had moved on
        assert httpx.delete(f"{server.mgmt}/requests/long", headers=server.mgmt_headers, timeout=10).status_code \
            == 200
        answer = queued.result()
    first.join(60)
    assert answer.status_code == 200 and answer.json()["details"]["generated_tokens"] == 4  # ran once freed
    assert running[-1]["error_type"] == "cancelled"


def test_a_saturated_model_does_not_hold_up_another(server: ServerProcess) -> None:
    """``busy`` gets 10 requests of 1 s at once (10 s of work, one at a time); ``calm`` answers three requests
    of 0.2 s in a row meanwhile, each as if alone: all three done while busy's queue has not drained."""
    with httpx.Client(timeout=120, limits=httpx.Limits(max_connections=16)) as client, ThreadPoolExecutor(10) as pool:
        flood = [pool.submit(client.post, f"{server.url}/predictions/busy", json={"inputs": f"b {i}"})
                 for i in range(10)]
        wait_for(lambda: server.describe("busy")["batcher"]["queued"] >= 5, "busy saturated")
        calm = [httpx.post(f"{server.url}/predictions/calm", json={"inputs": f"c {i}"}, timeout=60)
                for i in range(3)]
        busy_left = server.describe("busy")["batcher"]["queued"]
        flooded = [f.result() for f in flood]
    assert [(r.status_code, r.json()) for r in calm] == [(200, {"generated_text": f"c {i}"}) for i in range(3)]
    assert busy_left > 0, "calm's requests waited for busy's queue"
    assert sorted(r.json()["generated_text"] for r in flooded) == sorted(f"b {i}" for i in range(10))
