"""gRPC servicers without sockets: the error table, health states, and ModelStreamInfer over fake endpoints."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2

from rollcore.errors import ErrorKind, InvalidRequest, Overloaded
from rollcore.types import FinishReason, GenerationRequest, ModelState, TokenDelta, TokenInfo
from serving.batching.streams import ResultStream
from serving.frontends.grpc.calls import GRPC_CODE, abort, deadline_of, new_request_id, register_overrides
from serving.frontends.grpc.grpc_server import HealthServicer
from serving.frontends.grpc.oip import OipServicer
from serving.frontends.grpc.oip_tensors import frame_bytes, split_bytes
from serving.frontends.proto.gen.inference import grpc_service_pb2 as pb
from serving.requests.params import Limits

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Aborted(Exception):
    pass


class FakeContext:
    def __init__(self, remaining: float | None = None) -> None:
        self.remaining = remaining
        self.code: grpc.StatusCode | None = None
        self.details = ""
        self.trailers: tuple[Any, ...] = ()

    def time_remaining(self) -> float | None:
        return self.remaining

    def set_trailing_metadata(self, md: tuple[Any, ...]) -> None:
        self.trailers = md

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.code, self.details = code, details
        raise Aborted(details)


@dataclass
class FakeConfig:
    entry_point: str = "rolling"
    options: dict[str, str] = field(default_factory=dict)


class FakeEndpoint:
    """A rolling model whose streams the test feeds by hand."""

    def __init__(self, name: str, state: ModelState = ModelState.READY) -> None:
        self.name = name
        self.state = state
        self.reason: str | None = None
        self.rolling = True
        self.version = "1"
        self.config = FakeConfig()
        self.entry_point = self.config.entry_point
        self.options = self.config.options
        self.successor = None  # not replaced by a reload
        self.residency = None  # loaded at start: no residence under the memory budget
        self.streams: dict[str, ResultStream] = {}
        self.cancelled: list[str] = []
        self.submitted = asyncio.Event()

    def submit(self, request: GenerationRequest) -> ResultStream:
        stream = ResultStream(request.request_id, on_cancel=self.cancelled.append)
        self.streams[request.request_id] = stream
        self.submitted.set()
        return stream


@dataclass
class FakeState:
    draining: bool = False


@dataclass
class FakeRegistry:
    endpoints: dict[str, Any]
    model_store: Path = Path("/nonexistent")

    def get(self, name: str) -> Any:
        from rollcore.errors import ModelNotFound
        if name not in self.endpoints:
            raise ModelNotFound(f"model {name!r} is not registered")
        return self.endpoints[name]

    def versions_of(self, name: str) -> list[str]:
        return ["1"] if name in self.endpoints else []

    def all_endpoints(self) -> list[tuple[str, str, Any]]:
        return [(n, "1", ep) for n, ep in sorted(self.endpoints.items())]


@dataclass
class FakeCtx:
    registry: Any
    state: FakeState = field(default_factory=FakeState)
    limits: Limits = field(default_factory=Limits)
    max_request_size: int = 1 << 20


def test_every_error_kind_has_a_code() -> None:
    assert set(GRPC_CODE) == set(ErrorKind)
    assert GRPC_CODE[ErrorKind.INVALID] is grpc.StatusCode.INVALID_ARGUMENT
    assert GRPC_CODE[ErrorKind.NOT_FOUND] is grpc.StatusCode.NOT_FOUND
    assert GRPC_CODE[ErrorKind.OVERLOADED] is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert GRPC_CODE[ErrorKind.TOO_LARGE] is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert GRPC_CODE[ErrorKind.UNAVAILABLE] is grpc.StatusCode.UNAVAILABLE
    assert GRPC_CODE[ErrorKind.TIMEOUT] is grpc.StatusCode.DEADLINE_EXCEEDED
    assert GRPC_CODE[ErrorKind.CANCELLED] is grpc.StatusCode.CANCELLED


def test_abort_carries_code_message_and_retry_after() -> None:
    context = FakeContext()
    with pytest.raises(Aborted):
        asyncio.run(abort(context, Overloaded("queue is full", retry_after_s=1)))  # type: ignore[arg-type]
    assert context.code is grpc.StatusCode.RESOURCE_EXHAUSTED and context.details == "queue is full"
    assert context.trailers == (("retry-after", "1"),)


def test_deadline_and_request_ids() -> None:
    assert deadline_of(FakeContext(None)) is None  # type: ignore[arg-type]
    assert deadline_of(FakeContext(2.5), clock=lambda: 100.0) == 102.5  # type: ignore[arg-type]
    assert new_request_id("abc-1") == "abc-1"
    assert len(new_request_id("bad\nid")) == 32 and len(new_request_id("x" * 200)) == 32


def test_register_overrides() -> None:
    assert register_overrides({"batch_size": 4, "min_workers": 2}) == {"batch_size": "4", "minWorkers": "2"}
    with pytest.raises(InvalidRequest, match="unknown parameter 'colour'"):
        register_overrides({"colour": 1})
    with pytest.raises(InvalidRequest, match="integer between 0 and 999999999"):
        register_overrides({"batch_size": -1})


@pytest.mark.parametrize("states, draining, service, expected", [
    ([ModelState.READY], False, "", SERVING),
    ([ModelState.READY, ModelState.LOADING], False, "", NOT_SERVING),
    ([ModelState.LOADING], False, "m0", NOT_SERVING),
    ([ModelState.FAILED], False, "m0", NOT_SERVING),
    ([ModelState.READY], False, "m0", SERVING),
    ([ModelState.READY], True, "", NOT_SERVING),
    ([ModelState.READY], True, "m0", NOT_SERVING),
    ([ModelState.READY], True, "rollserve.v1.Generation", NOT_SERVING),
    ([ModelState.READY], False, "inference.GRPCInferenceService", SERVING),
    ([ModelState.READY], False, "nope", None),
])
def test_health_status(states: list[ModelState], draining: bool, service: str, expected: int | None) -> None:
    registry = FakeRegistry({f"m{i}": FakeEndpoint(f"m{i}", s) for i, s in enumerate(states)})
    health = HealthServicer(FakeCtx(registry, FakeState(draining)), registry)  # type: ignore[arg-type]
    assert health.status_of(service) == expected


def stream_request(rid: str, prompt: str, params: bytes = b"{}") -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="m", id=rid)
    for name, dtype, data in (("text_input", "BYTES", frame_bytes([prompt.encode()])),
                              ("sampling_parameters", "BYTES", frame_bytes([params])),
                              ("stream", "BOOL", b"\x01")):
        request.inputs.add(name=name, datatype=dtype, shape=[1])
        request.raw_input_contents.append(data)
    return request


def test_model_stream_infer_interleaves_requests_and_reports_errors() -> None:
    async def run() -> tuple[list[pb.ModelStreamInferResponse], FakeEndpoint]:
        ep = FakeEndpoint("m")
        registry = FakeRegistry({"m": ep})
        servicer = OipServicer(FakeCtx(registry), registry, 1.0, "test")  # type: ignore[arg-type]
        requests: asyncio.Queue[pb.ModelInferRequest | None] = asyncio.Queue()

        async def incoming() -> AsyncIterator[pb.ModelInferRequest]:
            while (r := await requests.get()) is not None:
                yield r

        responses: list[pb.ModelStreamInferResponse] = []

        async def consume() -> None:
            async for r in servicer.ModelStreamInfer(incoming(), FakeContext()):  # type: ignore[arg-type]
                responses.append(r)

        consumer = asyncio.ensure_future(consume())
        for rid in ("a", "b"):
            requests.put_nowait(stream_request(rid, "hi"))
        requests.put_nowait(stream_request("bad", "hi", b'{"top_p": 0}'))
        while len(ep.streams) < 2:
            await asyncio.sleep(0.01)
        a, b = ep.streams["a"], ep.streams["b"]
        a.push(TokenDelta("a", (TokenInfo(1, "x"),), "x", prompt_tokens=1))
        b.push(TokenDelta("b", (TokenInfo(2, "y"),), "y", prompt_tokens=1))
        a.push(TokenDelta("a", (TokenInfo(3, "z"),), "z", finish_reason=FinishReason.LENGTH))
        requests.put_nowait(None)  # the client half-closes; b still runs
        await asyncio.sleep(0.05)
        assert not consumer.done()
        b.push(TokenDelta("b", (TokenInfo(4, "w"),), "w", finish_reason=FinishReason.EOS))
        await asyncio.wait_for(consumer, 5)
        return responses, ep

    responses, ep = asyncio.run(run())
    errors = [r.error_message for r in responses if r.error_message]
    assert errors == ["parameter 'top_p' must be > 0 and <= 1, got 0"]
    by_id: dict[str, list[tuple[bytes, bool]]] = {}
    for r in responses:
        if not r.error_message:
            ir = r.infer_response
            text = split_bytes(ir.raw_output_contents[0], "text_output")[0]
            by_id.setdefault(ir.id, []).append((text, ir.parameters["triton_final_response"].bool_param))
    assert by_id == {"a": [(b"x", False), (b"z", True)], "b": [(b"y", False), (b"w", True)]}
    assert ep.cancelled == []


def test_model_stream_infer_cancel_cancels_running_requests() -> None:
    async def run() -> FakeEndpoint:
        ep = FakeEndpoint("m")
        registry = FakeRegistry({"m": ep})
        servicer = OipServicer(FakeCtx(registry), registry, 1.0, "test")  # type: ignore[arg-type]

        async def incoming() -> AsyncIterator[pb.ModelInferRequest]:
            yield stream_request("a", "hi")
            await asyncio.sleep(3600)

        async def consume() -> None:
            async for _ in servicer.ModelStreamInfer(incoming(), FakeContext()):  # type: ignore[arg-type]
                pass

        consumer = asyncio.ensure_future(consume())
        await asyncio.wait_for(ep.submitted.wait(), 5)
        ep.streams["a"].push(TokenDelta("a", (TokenInfo(1, "x"),), "x"))
        await asyncio.sleep(0.05)
        consumer.cancel()  # what grpc.aio does when the client cancels the RPC
        await asyncio.gather(consumer, return_exceptions=True)
        await asyncio.sleep(0)
        return ep

    ep = asyncio.run(run())
    assert ep.cancelled == ["a"]


def infer_request(prompt: str = "hi") -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="m", id="r")
    request.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    request.raw_input_contents.append(frame_bytes([prompt.encode()]))
    return request


def test_model_infer_passes_the_client_deadline_and_refuses_while_draining() -> None:
    async def run() -> tuple[FakeEndpoint, FakeContext]:
        ep = FakeEndpoint("m")
        registry = FakeRegistry({"m": ep})
        ctx = FakeCtx(registry)
        servicer = OipServicer(ctx, registry, 1.0, "test")  # type: ignore[arg-type]
        submitted: list[GenerationRequest] = []
        submit = ep.submit
        ep.submit = lambda r: (submitted.append(r), submit(r))[1]  # type: ignore[method-assign]
        call = asyncio.ensure_future(servicer.ModelInfer(infer_request(), FakeContext(remaining=30.0)))
        await asyncio.wait_for(ep.submitted.wait(), 5)
        assert submitted[0].deadline is not None
        assert 25 < submitted[0].deadline - asyncio.get_running_loop().time() <= 30.5
        ep.streams["r"].push(TokenDelta("r", (TokenInfo(1, " there"),), " there", FinishReason.LENGTH, 1))
        response = await asyncio.wait_for(call, 5)
        assert split_bytes(response.raw_output_contents[0], "text_output") == [b"hi there"]
        ctx.state.draining = True
        refused = FakeContext()
        with pytest.raises(Aborted):
            await servicer.ModelInfer(infer_request(), refused)  # type: ignore[arg-type]
        return ep, refused

    _, refused = asyncio.run(run())
    assert refused.code is grpc.StatusCode.UNAVAILABLE and refused.details == "server is shutting down"
