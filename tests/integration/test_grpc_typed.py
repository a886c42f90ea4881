"""The typed ``rollserve.v1`` services, health, reflection and hostile bytes, with grpcio stubs."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from serving.frontends.grpc.oip_tensors import frame_bytes
from serving.frontends.proto.gen.inference import grpc_service_pb2 as oip
from serving.frontends.proto.gen.inference import grpc_service_pb2_grpc as oip_grpc
from serving.frontends.proto.gen.rollserve.v1 import generate_pb2 as pb
from serving.frontends.proto.gen.rollserve.v1 import generate_pb2_grpc as pb_grpc
from tests.integration.harness import ServerProcess

PROMPT = "Deep learning is"
MAX_REQUEST_SIZE = 1 << 20


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    s = ServerProcess.start(tmp_path_factory.mktemp("grpc-typed"),
                            models={"roll": {"option.rolling_batch": "auto"}, "echo": {"option.entryPoint": "echo"}},
                            config={"max_request_size": str(MAX_REQUEST_SIZE), "enable_model_api": "true"})
    yield s
    s.stop()


@pytest.fixture(scope="module")
def channel(server: ServerProcess) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(server.grpc_target) as ch:
        yield ch


def gen_request(model: str = "roll", prompt: str = PROMPT, **params: Any) -> pb.GenerateRequest:
    request_id = params.pop("request_id", "")
    return pb.GenerateRequest(model=model, prompt=prompt, request_id=request_id,
                              parameters=pb.SamplingParameters(**params))


def http_text(server: ServerProcess, max_new_tokens: int) -> str:
    r = httpx.post(f"{server.url}/predictions/roll", timeout=60,
                   json={"inputs": PROMPT, "parameters": {"max_new_tokens": max_new_tokens, "ignore_eos": True}})
    return str(r.json()["generated_text"])


def engine_stats(server: ServerProcess) -> dict[str, Any]:
    engines = server.describe("roll")["batcher"]["engines"]
    return dict(next(iter(engines.values()))) if engines else {}


def test_generate_unary_and_stream_match_http(server: ServerProcess, channel: grpc.Channel) -> None:
    stub = pb_grpc.GenerationStub(channel)
    expected = http_text(server, 8)
    whole = stub.Generate(gen_request(max_new_tokens=8, ignore_eos=True), timeout=60)
    assert whole.text == expected
    assert whole.finish_reason == pb.FINISH_REASON_LENGTH
    assert len(whole.tokens) == 8 and whole.timings.generated_tokens == 8
    assert whole.timings.e2e_s >= whole.timings.ttft_s > 0
    assert 0 < whole.timings.max_itl_s <= whole.timings.decode_s  # its own longest gap between two tokens

    messages = list(stub.GenerateStream(gen_request(max_new_tokens=8, ignore_eos=True, request_id="s-1"),
                                        timeout=60))
    assert len(messages) == 8  # one message per token
    assert [m.token.id for m in messages] == [t.id for t in whole.tokens]
    assert "".join(m.text for m in messages) == expected
    assert all(m.request_id == "s-1" for m in messages)
    assert [m.finish_reason for m in messages[:-1]] == [pb.FINISH_REASON_UNSPECIFIED] * 7
    assert messages[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert messages[-1].timings.generated_tokens == 8 and not messages[0].HasField("timings")
    assert 0 < messages[-1].timings.max_itl_s <= messages[-1].timings.decode_s

    full = stub.Generate(pb.GenerateRequest(model="roll", prompt=PROMPT, return_full_text=True,
                                            parameters=pb.SamplingParameters(max_new_tokens=8, ignore_eos=True)))
    assert full.text == PROMPT + expected


def test_errors_map_to_codes_with_http_messages(server: ServerProcess, channel: grpc.Channel) -> None:
    stub = pb_grpc.GenerationStub(channel)
    with pytest.raises(grpc.RpcError) as err:
        stub.Generate(gen_request(temperature=-1.0), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    http = httpx.post(f"{server.url}/predictions/roll", json={"inputs": PROMPT, "parameters": {"temperature": -1.0}})
    assert err.value.details() == http.json()["error"]
    with pytest.raises(grpc.RpcError) as err:
        stub.Generate(gen_request(model="no-such-model"), timeout=30)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as err:
        list(stub.GenerateStream(gen_request(model="echo"), timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "rolling" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:  # bigger than max_request_size
        stub.Generate(gen_request(prompt="x" * (MAX_REQUEST_SIZE + 10)), timeout=30)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert stub.Generate(gen_request(model="echo", prompt="still serving"), timeout=30).text == "still serving"


def test_deadline_aborts_the_request(server: ServerProcess, channel: grpc.Channel) -> None:
    stub = pb_grpc.GenerationStub(channel)
    before = engine_stats(server)
    with pytest.raises(grpc.RpcError) as err:
        stub.Generate(gen_request(max_new_tokens=1500, ignore_eos=True, request_id="deadline-1"), timeout=0.5)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    deadline = time.monotonic() + 30
    while engine_stats(server).get("num_requests_aborted_total", 0) == before.get("num_requests_aborted_total", 0):
        assert time.monotonic() < deadline, "the request was not aborted"
        time.sleep(0.05)
    stats = engine_stats(server)  # the scheduler dropped it before its 1500 tokens: aborted, not finished
    assert stats["num_requests_aborted_total"] == before.get("num_requests_aborted_total", 0) + 1
    assert stats["num_requests_finished_total"] == before.get("num_requests_finished_total", 0)
    assert "deadline-1" not in stats["blocks_held"] and server.describe("roll")["batcher"]["running"] == 0


def test_cancel_after_three_messages_frees_kv_blocks(server: ServerProcess, channel: grpc.Channel) -> None:
    stub = pb_grpc.GenerationStub(channel)
    background = stub.GenerateStream(gen_request(max_new_tokens=1500, ignore_eos=True, request_id="keep"),
                                      timeout=120)
    received: list[Any] = []
    reader = threading.Thread(target=lambda: received.extend(_drain(background)), daemon=True)
    reader.start()
    call = stub.GenerateStream(gen_request(max_new_tokens=1500, ignore_eos=True, request_id="cancel-me"),
                               timeout=120)
    for _ in range(3):
        next(call)
    held = engine_stats(server)["blocks_held"]
    assert held.get("cancel-me", 0) > 0 and held.get("keep", 0) > 0
    aborted = engine_stats(server)["num_requests_aborted_total"]
    call.cancel()
    # wait on the engine's counter: blocks_held names a request by its client id only while the frontend
    # tracks it, which stops at the cancel, before the engine has aborted it
    deadline = time.monotonic() + 30
    while (stats := engine_stats(server))["num_requests_aborted_total"] == aborted:
        assert time.monotonic() < deadline, "the cancelled call was not aborted"
        time.sleep(0.02)
    assert stats["num_requests_aborted_total"] == aborted + 1
    assert set(stats["blocks_held"]) == {"keep"}  # freed while the other request keeps decoding
    background.cancel()
    reader.join(10)


def _drain(call: Any) -> list[Any]:
    out = []
    try:
        for m in call:
            out.append(m)
    except grpc.RpcError:
        pass
    return out


def test_management_and_health(server: ServerProcess, channel: grpc.Channel) -> None:
    mgmt = pb_grpc.ManagementStub(channel)
    health = health_pb2_grpc.HealthStub(channel)
    md = server.grpc_metadata  # management RPCs need the management token

    def status(service: str) -> int:
        return health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status

    models = mgmt.ListModels(pb.ListModelsRequest(), timeout=10, metadata=md).models
    listed = {m.name: (m.status, m.batching) for m in models}
    assert listed == {"echo": ("READY", "dynamic"), "roll": ("READY", "rolling")}
    described = mgmt.DescribeModel(pb.DescribeModelRequest(name="roll"), timeout=10, metadata=md)
    assert described.status == "READY" and described.num_workers == 1
    assert described.details["batcher"]["mode"] == "rolling"
    for service in ("", "roll", "echo", "inference.GRPCInferenceService", "rollserve.v1.Generation"):
        assert status(service) == health_pb2.HealthCheckResponse.SERVING, service
    with pytest.raises(grpc.RpcError) as err:
        status("no-such-model")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND

    with pytest.raises(grpc.RpcError) as err:
        mgmt.ScaleWorkers(pb.ScaleWorkersRequest(name="echo", num_workers=0), timeout=10, metadata=md)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as err:
        mgmt.RegisterModel(pb.RegisterModelRequest(url="../etc"), timeout=10, metadata=md)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    registered = mgmt.RegisterModel(pb.RegisterModelRequest(url="echo", model_name="echo2", batch_size=2),
                                    timeout=60, metadata=md)
    assert registered.status == "READY"
    assert status("echo2") == health_pb2.HealthCheckResponse.SERVING
    scaled = mgmt.ScaleWorkers(pb.ScaleWorkersRequest(name="echo2", num_workers=2), timeout=60, metadata=md)
    assert scaled.num_workers == 2
    assert mgmt.DescribeModel(pb.DescribeModelRequest(name="echo2"), timeout=10, metadata=md).target_workers == 2
    mgmt.UnregisterModel(pb.UnregisterModelRequest(name="echo2"), timeout=60, metadata=md)
    with pytest.raises(grpc.RpcError) as err:
        mgmt.DescribeModel(pb.DescribeModelRequest(name="echo2"), timeout=10, metadata=md)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND

    bad = server.workdir / "model_store" / "bad"  # an invalid configuration: refused, nothing registered
    bad.mkdir()
    (bad / "serving.properties").write_text("batch_size=many\n")
    with pytest.raises(grpc.RpcError) as err:
        mgmt.RegisterModel(pb.RegisterModelRequest(url="bad"), timeout=60, metadata=md)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "batch_size" in err.value.details() and str(server.workdir) not in err.value.details()
    assert status("") == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_the_services(channel: grpc.Channel) -> None:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                          timeout=10)
    names = {s.name for r in responses for s in r.list_services_response.service}
    assert {"inference.GRPCInferenceService", "rollserve.v1.Generation", "rollserve.v1.Management",
            "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names


def test_malformed_bytes_get_a_status_and_the_server_keeps_serving(channel: grpc.Channel) -> None:
    for method in ("/rollserve.v1.Generation/Generate", "/inference.GRPCInferenceService/ModelInfer",
                   "/rollserve.v1.Management/RegisterModel"):
        raw = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as err:
            raw(b"\xff\xff\xff\xff\x0f garbage \x00\x01", timeout=10)
        assert err.value.code() != grpc.StatusCode.OK
    oip_stub = oip_grpc.GRPCInferenceServiceStub(channel)
    assert oip_stub.ServerLive(oip.ServerLiveRequest(), timeout=10).live


def test_oip_typed_contents_and_bad_framing(channel: grpc.Channel) -> None:
    stub = oip_grpc.GRPCInferenceServiceStub(channel)
    request = oip.ModelInferRequest(model_name="echo", id="typed-1")
    text = request.inputs.add(name="text_input", datatype="BYTES", shape=[2])
    text.contents.bytes_contents.extend([b"first prompt", b"second prompt"])
    flag = request.inputs.add(name="exclude_input_in_output", datatype="BOOL", shape=[1])
    flag.contents.bool_contents.append(True)
    response = stub.ModelInfer(request, timeout=30)
    assert response.id == "typed-1" and response.outputs[0].name == "text_output"
    assert response.raw_output_contents[0] == frame_bytes([b"first prompt", b"second prompt"])

    bad = oip.ModelInferRequest(model_name="echo")
    bad.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    bad.raw_input_contents.append(b"\x10\x00\x00\x00short")
    with pytest.raises(grpc.RpcError) as err:
        stub.ModelInfer(bad, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "overruns" in err.value.details()
