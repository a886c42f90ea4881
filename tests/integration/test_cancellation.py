"""Cancellation end to end on a rolling-batch model: a client that leaves mid-stream (LMI jsonlines, OpenAI
SSE, gRPC) or mid whole answer (logged as 499) aborts its request: the engine's aborted counter moves and its
KV blocks are freed; ``DELETE /requests/{id}`` cancels from the management API. Block accounting and counters
are read from ``GET /models/{name}`` (the engine stats of the last step)."""

from __future__ import annotations

import json
import socket
import threading
from typing import Any

import grpc
import httpx
import pytest

from serving.bench.launch import wait_for
from serving.frontends.proto.gen.rollserve.v1 import generate_pb2 as pb
from serving.frontends.proto.gen.rollserve.v1 import generate_pb2_grpc as pb_grpc
from tests.integration.harness import ServerProcess

MODEL = "tiny-rb"


def engine(server: ServerProcess) -> tuple[int, dict[str, Any]]:
    batcher = server.describe(MODEL)["batcher"]
    stats = next(iter(batcher["engines"].values()), {})
    return batcher["steps_total"], stats


def stream_lines(server: ServerProcess, rid: str, max_new_tokens: int, n: int) -> list[dict[str, Any]]:
    """Start a jsonlines stream, read ``n`` token lines, then drop the connection."""
    body = {"inputs": "Once upon a time", "stream": True,
            "parameters": {"max_new_tokens": max_new_tokens, "ignore_eos": True}}
    lines = []
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", f"{server.url}/predictions/{MODEL}", json=body,
                           headers={"X-Request-Id": rid}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.strip():
                    lines.append(json.loads(line))
                if len(lines) >= n:
                    break
    return lines


@pytest.fixture()
def background(api_server: ServerProcess) -> Any:
    """A long request that keeps the engine stepping (so its stats stay fresh), cancelled at the end."""
    done = threading.Event()

    def run() -> None:
        try:
            stream_lines(api_server, "bg-long", 1900, 1900)
        except httpx.HTTPError:
            pass
        done.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    wait_for(lambda: "bg-long" in engine(api_server)[1].get("blocks_held", {}))
    yield
    r = httpx.delete(f"{api_server.mgmt}/requests/bg-long", headers=api_server.mgmt_headers, timeout=10)
    assert r.status_code == 200, r.text
    assert done.wait(30)
    thread.join(5)


def counters(server: ServerProcess) -> tuple[int, int]:
    """The engine's (aborted, finished) request counters."""
    stats = engine(server)[1]
    return stats.get("num_requests_aborted_total", 0), stats.get("num_requests_finished_total", 0)


def settled_counters(server: ServerProcess) -> tuple[int, int]:
    """The counters once the engine is idle: an abort sent before (e.g. the background fixture's teardown) has
    then been applied and published, so it cannot land after the baseline."""
    wait_for(lambda: (lambda s: s.get("num_running", 0) == 0 and not s.get("blocks_held"))(engine(server)[1]))
    return counters(server)


def test_disconnect_aborts_and_frees_blocks(api_server: ServerProcess, background: Any) -> None:
    aborted, finished = counters(api_server)
    lines = stream_lines(api_server, "cut-1", 1000, 3)
    assert len(lines) == 3
    steps_at_close, _ = engine(api_server)
    # the engine's own counter, not the absence of "cut-1" (blocks_held shows client ids only while the
    # frontend still tracks the request, which it stops doing at the cancel, before the engine aborts)
    steps_freed, stats = wait_for(lambda: (lambda s: s if s[1]["num_requests_aborted_total"] == aborted + 1
                                           else None)(engine(api_server)))
    print(f"aborted {steps_freed - steps_at_close} steps after the close")
    # aborted (not run to its 1000 tokens) while the background request still runs and holds its blocks:
    # its blocks are the only ones held
    assert stats["num_requests_finished_total"] == finished
    assert set(stats["blocks_held"]) == {"bg-long"} and stats["kv_blocks_used"] == stats["blocks_held"]["bg-long"]
    r = httpx.post(f"{api_server.url}/predictions/{MODEL}", json={"inputs": "Hi", "parameters": {
        "max_new_tokens": 3}}, timeout=30)
    assert r.status_code == 200


def test_delete_request_cancels_a_running_stream(api_server: ServerProcess) -> None:
    aborted, finished = settled_counters(api_server)
    body = {"inputs": "Hello", "stream": True, "parameters": {"max_new_tokens": 1900, "ignore_eos": True}}
    with httpx.stream("POST", f"{api_server.url}/predictions/{MODEL}", json=body,
                      headers={"X-Request-Id": "del-1"}, timeout=30) as r:
        lines = r.iter_lines()
        assert json.loads(next(lines))["token"]["id"] >= 0
        d = httpx.delete(f"{api_server.mgmt}/requests/del-1", headers=api_server.mgmt_headers, timeout=10)
        assert d.status_code == 200, d.text
        rest = [json.loads(line) for line in lines if line.strip()]
    assert rest[-1]["details"]["finish_reason"] == "error" and rest[-1]["error_type"] == "cancelled"
    assert len(rest) < 1800
    again = httpx.delete(f"{api_server.mgmt}/requests/del-1", headers=api_server.mgmt_headers, timeout=10)
    assert again.status_code == 404
    stats = wait_for(lambda: (s := engine(api_server)[1])["num_requests_aborted_total"] == aborted + 1 and s)
    assert "del-1" not in stats["blocks_held"] and stats["kv_blocks_used"] == 0, stats
    assert stats["num_requests_finished_total"] == finished


def test_whole_answer_client_disconnect_aborts_with_499(api_server: ServerProcess) -> None:
    aborted, finished = settled_counters(api_server)
    body = json.dumps({"inputs": "Hello", "parameters": {"max_new_tokens": 1900, "ignore_eos": True}}).encode()
    head = (f"POST /predictions/{MODEL} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"X-Request-Id: whole-1\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", api_server.ports["inference"]), timeout=30) as sock:
        sock.sendall(head + body)
        wait_for(lambda: "whole-1" in engine(api_server)[1].get("blocks_held", {}))  # it is generating
    stats = wait_for(lambda: (s := engine(api_server)[1])["num_requests_aborted_total"] == aborted + 1 and s)
    assert "whole-1" not in stats["blocks_held"] and stats["num_requests_finished_total"] == finished
    wait_for(lambda: f"request whole-1 model {MODEL}: /predictions/{MODEL} -> 499 in" in api_server.log())


def test_fifty_disconnects_over_three_protocols_leave_no_blocks(api_server: ServerProcess) -> None:
    aborted, finished = settled_counters(api_server)
    for i in range(20):
        assert len(stream_lines(api_server, f"many-{i}", 1000, 3)) == 3
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    for i in range(15):
        with httpx.stream("POST", f"{api_server.url}/v1/completions", json=body, timeout=30,
                          headers={"X-Request-Id": f"sse-{i}"}) as r:
            assert r.status_code == 200
            events = []
            for line in r.iter_lines():
                if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
                    events.append(line)
                if len(events) == 3:
                    break
    with grpc.insecure_channel(api_server.grpc_target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        for i in range(15):
            call = stub.GenerateStream(pb.GenerateRequest(
                model=MODEL, prompt="Once upon a time", request_id=f"grpc-{i}",
                parameters=pb.SamplingParameters(max_new_tokens=1000, ignore_eos=True)), timeout=60)
            assert [next(call).request_id for _ in range(3)] == [f"grpc-{i}"] * 3
            call.cancel()
    stats = wait_for(lambda: (s := engine(api_server)[1])["num_requests_aborted_total"] == aborted + 50 and s)
    assert stats["num_requests_finished_total"] == finished  # none ran to its end
    wait_for(lambda: engine(api_server)[1]["num_running"] == 0)
    stats = engine(api_server)[1]
    assert stats["kv_blocks_used"] == 0 and stats["blocks_held"] == {} and stats["num_waiting"] == 0, stats
    r = httpx.post(f"{api_server.url}/predictions/{MODEL}", json={"inputs": "Hi", "parameters": {
        "max_new_tokens": 3}}, timeout=30)
    assert r.status_code == 200
