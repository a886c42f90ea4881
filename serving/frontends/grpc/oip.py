"""Open Inference Protocol v2 servicer (``inference.GRPCInferenceService``) for text generation.

Design note: a translation only. ``ModelInfer`` turns ``text_input`` (+ ``sampling_parameters``) into one
``GenerationRequest`` per prompt and answers ``text_output``; ``ModelStreamInfer`` (Triton's bidirectional
stream) serves each request it reads concurrently and, when the request's ``stream`` input is true on a
rolling-batch model, answers one response per generated token (``triton_final_response`` marks the last).
A failed request in a stream gets an ``error_message`` response and the stream stays open, as in Triton.
Back-pressure: at most ``max_stream_requests`` requests of one stream are in flight (the stream is not
read further until one ends, so HTTP/2 flow control holds the client back) and at most
``STREAM_RESPONSE_BUFFER`` responses wait for a slow reader (generation of that stream pauses meanwhile).
``exclude_input_in_output`` unset means: whole answers start with the prompt, streamed tokens do not.
The repository extension maps onto the registry (index, register, unregister). ``model_version`` names a model's
version (``serving.models.versions``; empty: the default one) and every answer carries the version that served it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from rollcore.errors import InvalidRequest, ModelNotFound, ServingError
from rollcore.types import GenerationRequest, ModelState
from serving.batching.streams import ResultStream
from serving.frontends.grpc.calls import (
    FrontendContext,
    Registry,
    check_serving,
    collect,
    deadline_of,
    guarded,
    is_text_model,
    new_request_id,
    register_model,
    register_overrides,
    require_streaming,
    strict_parameters,
)
from serving.frontends.grpc.oip_tensors import TextInputs, decode_inputs, text_response
from serving.frontends.proto.gen.inference import grpc_service_pb2 as pb
from serving.frontends.proto.gen.inference import grpc_service_pb2_grpc as pb_grpc
from serving.models.endpoint_protocol import Endpoint
from serving.models.resident import ensure_resident
from serving.requests.deadlines import earliest, triton_timeout
from serving.requests.params import Limits, check_sequences, check_text, check_wire_value, parse_lmi_parameters
from serving.telemetry.health import Health

log = logging.getLogger("serving.grpc")

FINAL = "triton_final_response"
EMPTY_FINAL = "triton_enable_empty_final_response"
# Triton's repository states for our lifecycle states.
REPOSITORY_STATE = {ModelState.PENDING: "LOADING", ModelState.LOADING: "LOADING", ModelState.READY: "READY",
                    ModelState.FAILED: "UNAVAILABLE", ModelState.DRAINING: "UNLOADING",
                    ModelState.UNLOADED: "UNAVAILABLE"}
STREAM_RESPONSE_BUFFER = 256


def _tensor(name: str, datatype: str, shape: list[int]) -> pb.ModelMetadataResponse.TensorMetadata:
    return pb.ModelMetadataResponse.TensorMetadata(name=name, datatype=datatype, shape=shape)


class OipServicer(pb_grpc.GRPCInferenceServiceServicer):
    """``inference.GRPCInferenceService``. Event-loop only."""

    def __init__(self, ctx: FrontendContext, registry: Registry, drain_timeout_s: float, version: str, *,
                 health: Health | None = None, max_stream_requests: int = 64) -> None:
        self.ctx = ctx
        self.registry = registry
        self.drain_timeout_s = drain_timeout_s
        self.version = version
        self.health = health
        self.max_stream_requests = max_stream_requests

    # --- health and metadata ---
    async def ServerLive(self, request: Any, context: grpc.aio.ServicerContext) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: Any, context: grpc.aio.ServicerContext) -> pb.ServerReadyResponse:
        if self.health is not None:
            return pb.ServerReadyResponse(ready=self.health.ready())
        ready = not self.ctx.state.draining and all(
            ep.state is ModelState.READY for ep in self.registry.endpoints.values())
        return pb.ServerReadyResponse(ready=ready)

    async def ModelReady(self, request: Any, context: grpc.aio.ServicerContext) -> pb.ModelReadyResponse:
        try:
            ep = self.registry.get(_ref(request.name, request.version))
        except ServingError:
            ep = None
        ready = ep is not None and ep.state is ModelState.READY and not self.ctx.state.draining
        return pb.ModelReadyResponse(ready=ready)

    async def ServerMetadata(self, request: Any, context: grpc.aio.ServicerContext) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(name="rollserve", version=self.version,
                                         extensions=["model_repository", "streaming", "health", "reflection"])

    @guarded
    async def ModelMetadata(self, request: Any, context: grpc.aio.ServicerContext) -> pb.ModelMetadataResponse:
        ep = self.registry.get(_ref(request.name, request.version))
        platform = "rollserve_rolling" if ep.rolling else "rollserve_dynamic"
        return pb.ModelMetadataResponse(
            name=ep.name, versions=self.registry.versions_of(ep.name) or [ep.version], platform=platform,
            inputs=[_tensor("text_input", "BYTES", [-1]), _tensor("stream", "BOOL", [1]),
                    _tensor("sampling_parameters", "BYTES", [1]), _tensor("exclude_input_in_output", "BOOL", [1])],
            outputs=[_tensor("text_output", "BYTES", [-1])])

    # --- inference ---
    def _requests(self, request: Any, context: grpc.aio.ServicerContext
                  ) -> tuple[Endpoint, TextInputs, list[GenerationRequest]]:
        check_serving(self.ctx)
        ep = self.registry.get(_ref(request.model_name, request.model_version))
        inputs = decode_inputs(request)
        deadline = earliest(deadline_of(context), triton_timeout(request.parameters, time.monotonic()))
        reqs = text_requests(self.ctx.limits, ep, inputs, new_request_id(request.id), deadline)
        return ep, inputs, reqs

    async def _whole(self, ep: Endpoint, request: Any, inputs: TextInputs, reqs: list[GenerationRequest],
                     parameters: dict[str, bool] | None = None) -> pb.ModelInferResponse:
        streams: list[ResultStream] = []
        try:
            for r in reqs:
                streams.append(ep.submit(r))
            results = await asyncio.gather(*(collect(s) for s in streams))
        finally:
            for s in streams:
                if not s.done:
                    s.cancel()
        return text_response(request, whole_texts(inputs, reqs, results), inputs.shape, parameters,
                             version=ep.version)

    @guarded
    async def ModelInfer(self, request: Any, context: grpc.aio.ServicerContext) -> pb.ModelInferResponse:
        ep, inputs, reqs = self._requests(request, context)
        await ensure_resident(ep)  # a model loaded on demand: its first request waits for the load
        if inputs.stream:
            raise InvalidRequest("'stream' needs ModelStreamInfer (a bidirectional stream); ModelInfer answers "
                                 "once")
        return await self._whole(ep, request, inputs, reqs)

    async def ModelStreamInfer(self, request_iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext
                               ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        """Serve the stream's requests concurrently (bounded, see the module note); interleave responses."""
        out: asyncio.Queue[pb.ModelStreamInferResponse] = asyncio.Queue(maxsize=STREAM_RESPONSE_BUFFER)
        slots = asyncio.Semaphore(self.max_stream_requests)
        wake = asyncio.Event()
        tasks: set[asyncio.Task[None]] = set()
        reading = True

        async def emit(response: pb.ModelStreamInferResponse) -> None:
            await out.put(response)  # waits while a slow reader leaves the buffer full
            wake.set()

        def finished(task: asyncio.Task[None]) -> None:
            tasks.discard(task)
            slots.release()
            wake.set()

        async def read() -> None:
            nonlocal reading
            try:
                async for request in request_iterator:
                    await slots.acquire()  # back-pressure: read no further while the stream is at its cap
                    task = asyncio.ensure_future(self._stream_one(request, context, emit))
                    tasks.add(task)
                    task.add_done_callback(finished)
            finally:
                reading = False
                wake.set()

        reader = asyncio.ensure_future(read())
        try:
            while True:
                while not out.empty():
                    yield out.get_nowait()
                if not reading and not tasks:
                    break
                wake.clear()
                if out.empty() and (reading or tasks):
                    await wake.wait()
        finally:
            reader.cancel()
            for task in list(tasks):
                task.cancel()

    async def _stream_one(self, request: Any, context: grpc.aio.ServicerContext,
                          emit: Callable[[pb.ModelStreamInferResponse], Awaitable[None]]) -> None:
        stream: ResultStream | None = None
        try:
            ep, inputs, reqs = self._requests(request, context)
            await ensure_resident(ep)  # a model loaded on demand: its first request waits for the load
            empty_final = request.parameters[EMPTY_FINAL].bool_param if EMPTY_FINAL in request.parameters else False
            if not inputs.stream:
                final = {FINAL: True}
                await emit(pb.ModelStreamInferResponse(
                    infer_response=await self._whole(ep, request, inputs, reqs, final)))
                return
            require_streaming(ep)
            if len(reqs) != 1:
                raise InvalidRequest("'stream' takes a single element in 'text_input'")
            stream = ep.submit(reqs[0])
            prefix = reqs[0].prompt if inputs.exclude_input is False else ""
            async for response in _token_responses(request, stream, prefix, empty_final, ep.version):
                await emit(pb.ModelStreamInferResponse(infer_response=response))
        except ServingError as exc:
            await emit(pb.ModelStreamInferResponse(error_message=exc.message,
                                              infer_response=pb.ModelInferResponse(
                                                  model_name=request.model_name, id=request.id)))
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - one bad request fails one request
            log.exception("ModelStreamInfer request %s failed", request.id)
            await emit(pb.ModelStreamInferResponse(error_message="internal error"))
        finally:
            if stream is not None and not stream.done:
                stream.cancel()

    # --- model repository ---
    @guarded
    async def RepositoryIndex(self, request: Any, context: grpc.aio.ServicerContext) -> pb.RepositoryIndexResponse:
        response = pb.RepositoryIndexResponse()
        names = set(self.registry.endpoints)
        for name, version, ep in self.registry.all_endpoints():
            if request.ready and ep.state is not ModelState.READY:
                continue
            response.models.add(name=name, version=version, state=REPOSITORY_STATE.get(ep.state, "UNAVAILABLE"),
                                reason=ep.reason or "")
        store = self.registry.model_store
        if not request.ready and store.is_dir():
            for d in sorted(store.iterdir()):
                if d.is_dir() and not d.name.startswith((".", "_")) and d.name not in names:
                    response.models.add(name=d.name, state="UNAVAILABLE", reason="unloaded")
        return response

    @guarded
    async def RepositoryModelLoad(self, request: Any, context: grpc.aio.ServicerContext
                                  ) -> pb.RepositoryModelLoadResponse:
        check_serving(self.ctx)
        self.registry.require_model_api("loading a model")
        name = request.model_name
        options: dict[str, Any] = {}
        url = name
        for key, value in request.parameters.items():
            which = value.WhichOneof("parameter_choice")
            if key == "url" and which == "string_param":
                url = value.string_param
            elif which == "int64_param":
                options[key] = value.int64_param
            elif which == "string_param" and value.string_param.isascii() and value.string_param.isdigit() \
                    and len(value.string_param) <= 9:
                options[key] = int(value.string_param)
            else:
                raise InvalidRequest(f"parameter {key!r} must be an integer")
        ep = self.registry.endpoints.get(name)
        if ep is not None and ep.state is not ModelState.FAILED:
            return pb.RepositoryModelLoadResponse()  # already loaded (or loading)
        if ep is not None:
            await self.registry.unregister(name, 0.0)
        await register_model(self.registry, name, url, register_overrides(options), wait=True)
        return pb.RepositoryModelLoadResponse()

    @guarded
    async def RepositoryModelUnload(self, request: Any, context: grpc.aio.ServicerContext
                                    ) -> pb.RepositoryModelUnloadResponse:
        self.registry.require_model_api("unloading a model")
        if request.model_name not in self.registry.endpoints:
            raise ModelNotFound(f"model {request.model_name!r} is not registered")
        await self.registry.unregister(request.model_name, self.drain_timeout_s)
        return pb.RepositoryModelUnloadResponse()


def text_requests(limits: Limits, ep: Endpoint, inputs: TextInputs, rid: str, deadline: float | None
                  ) -> list[GenerationRequest]:
    """The OIP inputs -> one ``GenerationRequest`` per prompt: the translation gRPC and REST (``oip_rest``) share."""
    ignored: list[str] = []
    params = parse_lmi_parameters(inputs.parameters, limits, strict=strict_parameters(ep), ignored=ignored)
    if ignored and is_text_model(ep):
        log.warning("model %s: ignored unknown sampling parameters: %s", ep.name, ", ".join(ignored))
    check_sequences(len(inputs.prompts), limits, "'text_input'")
    prompts = [check_text("text_input", p, max_chars=limits.max_prompt_chars) for p in inputs.prompts]
    if not is_text_model(ep):
        check_wire_value("sampling_parameters", inputs.parameters)
    text_model = is_text_model(ep)
    return [GenerationRequest(request_id=rid if len(prompts) == 1 else f"{rid}-{i}", model=ep.name, prompt=p,
                              params=params, stream=inputs.stream, deadline=deadline,
                              payload=None if text_model else {"inputs": p, "parameters": inputs.parameters})
            for i, p in enumerate(prompts)]


def whole_texts(inputs: TextInputs, reqs: list[GenerationRequest], results: list[Any]) -> list[str]:
    """Each whole answer's ``text_output``: the prompt first unless ``exclude_input_in_output`` is true."""
    include_prompt = inputs.exclude_input is False or inputs.exclude_input is None
    return [(q.prompt if include_prompt else "") + _text_of(r) for q, r in zip(reqs, results, strict=True)]


def _ref(name: str, version: str) -> str:
    """The registry's reference for an OIP model name and version (``NAME:VERSION``; no version: the default)."""
    return f"{name}:{version}" if version else name


def _text_of(result: Any) -> str:
    if result.payload is not None and not result.text:
        return result.payload if isinstance(result.payload, str) else json.dumps(result.payload)
    return str(result.text)


async def _token_responses(request: Any, stream: ResultStream, prefix: str, empty_final: bool,
                           version: str) -> AsyncIterator[pb.ModelInferResponse]:
    """One response per generated token (its released text); the last carries ``triton_final_response``."""
    async for delta in stream:
        last = delta.finish_reason is not None
        pieces = [delta.text] if len(delta.tokens) <= 1 else [t.text for t in delta.tokens]
        if not delta.tokens and not delta.text and not (last and not empty_final):
            continue
        for i, text in enumerate(pieces):
            final = last and i == len(pieces) - 1 and not empty_final
            yield text_response(request, [prefix + text], [1], {FINAL: final}, version=version)
            prefix = ""
    if empty_final:
        response = pb.ModelInferResponse(model_name=request.model_name, model_version=version, id=request.id)
        response.parameters[FINAL].bool_param = True
        yield response
