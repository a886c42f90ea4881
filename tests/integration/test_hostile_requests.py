"""Hostile requests through a real server (the engine step, gRPC back-pressure and more): client ids
never collide, an engine step that raises fails only the request it can blame, a worker whose step keeps
failing is replaced, gRPC streams are bounded, no internal path reaches a client, health tells the truth."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from serving.frontends.proto.gen.inference import grpc_service_pb2 as oip_pb
from serving.frontends.proto.gen.inference import grpc_service_pb2_grpc as oip_grpc
from serving.frontends.proto.gen.rollserve.v1 import generate_pb2 as pb
from serving.frontends.proto.gen.rollserve.v1 import generate_pb2_grpc as pb_grpc
from tests.integration.harness import ServerProcess
from tests.integration.hostile import (
    PROMPT,
    Neighbour,
    assert_no_leaks,
    error_of,
    lmi_body,
    post,
    twelve_afterwards,
)
from tests.integration.test_hostile_values import oip_request

ABSOLUTE_PATH = re.compile(r"(?<![\w:/.])/(?:[\w.-]+/)+")


def answer_of(r: httpx.Response) -> str:
    return str(r.json()["generated_text"])


def test_24_concurrent_requests_sharing_one_request_id(hostile_server: ServerProcess) -> None:
    """Each is answered: 200 with its own answer, or 409 naming X-Request-Id; none hangs."""
    s = hostile_server
    prompts = [f"{PROMPT} number {i} of the test" for i in range(24)]
    models = ["dyn", "roll"] * 12

    def one(i: int) -> httpx.Response:
        return post(s, f"/predictions/{models[i]}", lmi_body(prompts[i], max_new_tokens=6), timeout=120,
                    headers={"X-Request-Id": "same-id"})

    with ThreadPoolExecutor(24) as pool:
        responses = list(pool.map(one, range(24)))
    ok = [i for i, r in enumerate(responses) if r.status_code == 200]
    conflicts = [i for i, r in enumerate(responses) if r.status_code == 409]
    assert len(ok) + len(conflicts) == 24, [r.status_code for r in responses]
    assert ok and conflicts
    for i in conflicts:
        error_of(responses[i], 409, "same-id", "X-Request-Id")
    for i in ok:  # nobody received a neighbour's output
        assert responses[i].headers["X-Request-Id"] == "same-id"
        alone = post(s, f"/predictions/{models[i]}", lmi_body(prompts[i], max_new_tokens=6))
        assert answer_of(responses[i]) == answer_of(alone), i
    for model in ("dyn", "roll"):
        twelve_afterwards(s, model)
        assert_no_leaks(s, model)
    reuse = post(s, "/predictions/roll", lmi_body(), headers={"X-Request-Id": "same-id"})
    assert reuse.status_code == 200  # an id is free again once its request ended


def test_a_live_id_is_refused_and_cancel_by_id_finds_its_request(hostile_server: ServerProcess) -> None:
    s = hostile_server
    done: dict[str, Any] = {}
    body = {**lmi_body(max_new_tokens=1500), "stream": True}

    def long_stream() -> None:
        with httpx.stream("POST", f"{s.url}/predictions/roll", json=body, headers={"X-Request-Id": "mine"},
                          timeout=120) as r:
            done["lines"] = [line for line in r.iter_lines() if line.strip()]

    t = threading.Thread(target=long_stream)
    t.start()
    deadline = time.monotonic() + 60
    while s.describe("roll")["batcher"]["running"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    error_of(post(s, "/predictions/dyn", lmi_body(), headers={"X-Request-Id": "mine"}), 409, "'mine'")
    with grpc.insecure_channel(s.grpc_target) as channel:
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.GenerationStub(channel).Generate(pb.GenerateRequest(model="roll", prompt=PROMPT, request_id="mine"),
                                                    timeout=30)
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    r = httpx.delete(f"{s.mgmt}/requests/mine", headers=s.mgmt_headers, timeout=10)
    assert r.status_code == 200, r.text
    t.join(60)
    assert "cancelled" in done["lines"][-1]
    assert_no_leaks(s, "roll")


def test_an_engine_step_that_raises_fails_only_the_request_it_blames(hostile_server: ServerProcess) -> None:
    s = hostile_server
    with Neighbour(s, "poison", stream=True, max_new_tokens=60) as neighbour:
        r = post(s, "/predictions/poison", lmi_body("boom", max_new_tokens=5), timeout=60)
        message = error_of(r, 424, "engine step failed on this request", "ValueError", "kernels.py")
        assert "/opt/secret" not in message and not ABSOLUTE_PATH.search(message)
    neighbour.check()
    twelve_afterwards(s, "poison")
    assert_no_leaks(s, "poison")


def test_a_worker_whose_step_keeps_failing_is_replaced(hostile_server: ServerProcess) -> None:
    s = hostile_server
    before = s.describe("poison")
    r = post(s, "/predictions/poison", lmi_body("wedge", max_new_tokens=5), timeout=60)
    error_of(r, 424, "engine step failed on this request", "wedged")
    # The engine is broken for good now. The next request fails alone too; being the third failure in a row
    # that no good step confirmed, it makes the worker exit, and the pool replaces it.
    probe = post(s, "/predictions/poison", lmi_body("probe", max_new_tokens=2), timeout=60)
    error_of(probe, 424, "engine step failed on this request", "wedged")
    deadline = time.monotonic() + 120
    while True:
        after = s.describe("poison")
        if after["worker_restarts"] == before["worker_restarts"] + 1 and after["workers"] and \
                after["workers"][0]["pid"] != before["workers"][0]["pid"]:
            break
        assert time.monotonic() < deadline, after
        time.sleep(0.1)
    assert "engine steps in a row failed" in s.log()
    deadline = time.monotonic() + 60
    while s.describe("poison")["state"] != "READY" or not s.describe("poison")["workers"]:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    twelve_afterwards(s, "poison")
    assert_no_leaks(s, "poison")


def test_grpc_stream_in_flight_requests_are_bounded(hostile_server: ServerProcess) -> None:
    """grpc_max_stream_requests=4: 20 requests sent at once on one ModelStreamInfer never have more than 4
    pending on the model, and all 20 are answered."""
    s = hostile_server
    peak = [0]
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            b = s.describe("slowecho")["batcher"]
            peak[0] = max(peak[0], b["queued"] + b["in_flight_batches"])
            time.sleep(0.02)

    def requests() -> Iterator[oip_pb.ModelInferRequest]:
        for i in range(20):
            yield oip_request("slowecho", f"hello {i}", "{}", rid=f"stream-{i}")

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with grpc.insecure_channel(s.grpc_target) as channel:
            responses = list(oip_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(requests(), timeout=120))
    finally:
        stop.set()
        watcher.join()
    assert len(responses) == 20 and not [r.error_message for r in responses if r.error_message]
    assert 1 <= peak[0] <= 4, peak[0]


def test_grpc_concurrent_rpcs_are_capped(hostile_server: ServerProcess) -> None:
    """grpc_max_concurrent_rpcs=6: a seventh concurrent RPC is refused with RESOURCE_EXHAUSTED, the rest run."""
    s = hostile_server
    with grpc.insecure_channel(s.grpc_target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        calls = [stub.Generate.future(pb.GenerateRequest(model="slowecho", prompt=f"hi {i}"), timeout=60)
                 for i in range(9)]
        codes = []
        for call in calls:
            try:
                call.result()
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as exc:
                codes.append(exc.code())
    assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) >= 1, codes
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
    assert codes.count(grpc.StatusCode.OK) >= 6, codes


def test_no_internal_path_reaches_a_client(hostile_server: ServerProcess) -> None:
    s = hostile_server
    workdir = str(s.workdir)
    broken = s.describe("broken")
    assert broken["state"] == "FAILED" and "FileNotFoundError" in broken["reason"]
    assert workdir not in broken["reason"] and not ABSOLUTE_PATH.search(broken["reason"]), broken["reason"]
    assert "broken/weights/model.bin" in broken["reason"]
    message = error_of(post(s, "/predictions/broken", lmi_body()), 503, "FAILED")
    assert workdir not in message
    handler = error_of(post(s, "/predictions/custom", {"inputs": "raise"}), 424, "OSError", "shard-3.bin")
    assert "/opt/secret" not in handler
    malformed = error_of(post(s, "/predictions/custom", {"inputs": "malformed"}), 424, "malformed")
    assert not ABSOLUTE_PATH.search(malformed)
    twelve_afterwards(s, "custom")


def test_health_tells_liveness_from_readiness(hostile_server: ServerProcess) -> None:
    """A FAILED model (broken) never makes the server not live; with ping_requires=any it stays ready."""
    s = hostile_server
    for base in (s.url, s.mgmt):
        assert httpx.get(f"{base}/health/live", timeout=5).status_code == 200
        ping = httpx.get(f"{base}/ping", timeout=5)
        assert ping.status_code == 200 and ping.json()["models"]["broken"] == "FAILED"
        assert httpx.get(f"{base}/health/ready", timeout=5).status_code == 200
    with grpc.insecure_channel(s.grpc_target) as channel:
        oip = oip_grpc.GRPCInferenceServiceStub(channel)
        assert oip.ServerLive(oip_pb.ServerLiveRequest(), timeout=5).live
        assert oip.ServerReady(oip_pb.ServerReadyRequest(), timeout=5).ready
        assert not oip.ModelReady(oip_pb.ModelReadyRequest(name="broken"), timeout=5).ready
        health = health_pb2_grpc.HealthStub(channel)
        serving = health_pb2.HealthCheckResponse.SERVING
        assert health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status == serving
        assert health.Check(health_pb2.HealthCheckRequest(service="broken"), timeout=5).status != serving
