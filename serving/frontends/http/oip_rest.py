"""Open Inference Protocol v2 over REST (KServe's and Triton's HTTP API) and Triton's generate extension.

Design note: a translation only, and the gRPC servicer's (``grpc_oip``): bodies become the same
``ModelInferRequest`` (``oip_rest_tensors``), read by ``grpc_tensors.decode_inputs`` and turned into
``GenerationRequest``s by ``grpc_oip.text_requests``; whole answers are ``grpc_oip.whole_texts``. So a prompt and its
sampling parameters answer the same on both protocols. Routes: ``GET /v2`` (server metadata), ``/v2/health/live``,
``/v2/health/ready``, ``/v2/models/{m}[/versions/{v}]`` (metadata), ``.../ready``, ``POST .../infer``,
``.../generate`` and ``.../generate_stream`` (SSE of ``text_output`` deltas; rolling-batch models). A model that is
not READY answers 503 before its body is read further (``check_ready``), an unknown one 404. Errors are the OIP's
``{"error": "..."}`` (with the server-wide ``error_type`` and ``request_id`` beside it); a failure mid-stream is one
last ``data: {"error": ...}`` event, as Triton sends.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from importlib import metadata
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from rollcore.errors import InvalidRequest, ServingError, Unavailable
from rollcore.types import ModelState
from serving.batching.streams import ResultStream
from serving.frontends.grpc.calls import is_text_model, new_request_id, require_streaming, strict_parameters
from serving.frontends.grpc.oip import text_requests, whole_texts
from serving.frontends.grpc.oip_tensors import TextInputs, decode_inputs
from serving.frontends.http.httpio import (
    REQUEST_ID_HEADER,
    HttpContext,
    collect_or_cancel,
    error_response,
    ignored_headers,
    note_model,
    read_bytes,
    read_json,
    request_id,
    submit_all,
)
from serving.frontends.http.oip_rest_tensors import RestInfer, generate_request, infer_request, text_outputs
from serving.models.endpoint_protocol import Endpoint
from serving.models.resident import ensure_resident
from serving.requests.deadlines import arrival, triton_timeout
from serving.telemetry.health import Health

HEADER_LENGTH = "inference-header-content-length"  # Triton's binary tensor extension: the JSON's length
EXTENSIONS = ["binary_tensor_data", "generate"]
INPUTS = [{"name": "text_input", "datatype": "BYTES", "shape": [-1]},
          {"name": "stream", "datatype": "BOOL", "shape": [1]},
          {"name": "sampling_parameters", "datatype": "BYTES", "shape": [1]},
          {"name": "exclude_input_in_output", "datatype": "BOOL", "shape": [1]}]
OUTPUTS = [{"name": "text_output", "datatype": "BYTES", "shape": [-1]}]


def server_version() -> str:
    try:
        return metadata.version("rollserve")
    except metadata.PackageNotFoundError:  # run from a checkout that is not installed
        return "0.1.0"


class OipRestRoutes:
    """The OIP v2 REST routes over the registry's models (``{m}:{v}`` references a version, as on gRPC)."""

    def __init__(self, ctx: HttpContext, health: Health) -> None:
        self.ctx = ctx
        self.health = health
        self.version = server_version()

    def routes(self) -> list[Route]:
        out = [Route("/v2", self.server_metadata, methods=["GET"]),
               Route("/v2/health/live", self.live, methods=["GET"]),
               Route("/v2/health/ready", self.ready, methods=["GET"])]
        for base in ("/v2/models/{model_name}", "/v2/models/{model_name}/versions/{model_version}"):
            out += [Route(base, self.model_metadata, methods=["GET"]),
                    Route(f"{base}/ready", self.model_ready, methods=["GET"]),
                    Route(f"{base}/infer", self.infer, methods=["POST"]),
                    Route(f"{base}/generate", self.generate, methods=["POST"]),
                    Route(f"{base}/generate_stream", self.generate_stream, methods=["POST"])]
        return out

    # --- health and metadata ---
    async def server_metadata(self, request: Request) -> Response:
        return JSONResponse({"name": "rollserve", "version": self.version, "extensions": EXTENSIONS})

    async def live(self, request: Request) -> Response:
        return JSONResponse({"live": True})

    async def ready(self, request: Request) -> Response:
        ready = self.health.ready()
        return JSONResponse({"ready": ready}, status_code=200 if ready else 503)

    def _endpoint(self, request: Request) -> tuple[Endpoint, str]:
        """The endpoint the path names (``ModelNotFound``: 404) and the version the answer reports."""
        name = request.path_params["model_name"]
        version = request.path_params.get("model_version", "")
        ep = self.ctx.registry.get(f"{name}:{version}" if version else name)
        note_model(request, ep)  # the metrics labels: the model and its version
        return ep, ep.version

    async def model_metadata(self, request: Request) -> Response:
        rid = request_id(request)
        try:
            ep, version = self._endpoint(request)
        except ServingError as exc:
            return error_response(exc, rid)
        versions = getattr(self.ctx.registry, "versions_of", lambda name: [])(ep.name) or [version]
        return JSONResponse({"name": ep.name, "versions": versions,
                             "platform": "rollserve_rolling" if ep.rolling else "rollserve_dynamic",
                             "inputs": INPUTS, "outputs": OUTPUTS}, headers={REQUEST_ID_HEADER: rid})

    async def model_ready(self, request: Request) -> Response:
        rid = request_id(request)
        try:
            ep, _ = self._endpoint(request)
            if self.ctx.state.draining:
                raise Unavailable("server is shutting down", retry_after_s=5)
            ep.check_ready()
        except ServingError as exc:
            response = error_response(exc, rid)
            if response.status_code == 503:  # the OIP's readiness answer, with the reason beside it
                body = json.loads(bytes(response.body))
                keep = {k: v for k, v in response.headers.items() if k in ("retry-after", "x-request-id")}
                return JSONResponse({"name": request.path_params["model_name"], "ready": False, **body},
                                    status_code=503, headers=keep)
            return response
        return JSONResponse({"name": ep.name, "ready": ep.state is ModelState.READY},
                            headers={REQUEST_ID_HEADER: rid})

    # --- inference ---
    async def _prepare(self, request: Request, generate: bool) -> tuple[Any, str, RestInfer, TextInputs, list[Any]]:
        """Resolve the model (404), check it serves (503), read and translate the body (400)."""
        if self.ctx.state.draining:
            raise Unavailable("server is shutting down", retry_after_s=5)
        ep, version = self._endpoint(request)
        await ensure_resident(ep)  # a model loaded on demand: its first request waits for the load
        ep.check_ready()
        rid = request_id(request)
        if generate:
            body = await read_json(request, self.ctx.max_request_size)
            rest = generate_request(body, ep.name, version, rid)
        else:
            body, tail = await _read_body(request, self.ctx.max_request_size)
            rest = infer_request(body, tail, ep.name, version)
        if rest.ignored and strict_parameters(ep):
            raise InvalidRequest(f"unknown fields: {', '.join(repr(k) for k in rest.ignored)} "
                                 "(option.strict_parameters=true)")
        inputs = decode_inputs(rest.request)
        # the body's id names the request (409 while one of that id is live) when usable as one, as on gRPC
        reqs = text_requests(self.ctx.limits, ep, inputs, new_request_id(rest.request.id) if rest.request.id else rid,
                             triton_timeout(rest.request.parameters, arrival()))
        return ep, version, rest, inputs, reqs

    async def infer(self, request: Request) -> Response:
        rid = request_id(request)
        try:
            ep, version, rest, inputs, reqs = await self._prepare(request, generate=False)
            if inputs.stream:
                raise InvalidRequest("input 'stream' true needs generate_stream (or gRPC's ModelStreamInfer); "
                                     "/infer answers once")
            results = await collect_or_cancel(request, submit_all(ep, reqs))
        except ServingError as exc:
            return error_response(exc, rid)
        except ConnectionAbortedError:
            return Response(status_code=499, headers={REQUEST_ID_HEADER: rid})  # logged; the client left
        outputs, raw = text_outputs(whole_texts(inputs, reqs, results), inputs.shape, rest.binary_output)
        answer = {"model_name": ep.name, "model_version": version, "id": rest.request.id or rid, "outputs": outputs}
        headers = {REQUEST_ID_HEADER: rid, **ignored_headers(rest.ignored, rid, ep.name)}
        if not raw:
            return JSONResponse(answer, headers=headers)
        head = json.dumps(answer).encode("utf-8")
        return Response(head + raw, media_type="application/octet-stream",
                        headers={**headers, HEADER_LENGTH: str(len(head))})

    async def generate(self, request: Request) -> Response:
        rid = request_id(request)
        try:
            ep, version, rest, inputs, reqs = await self._prepare(request, generate=True)
            if inputs.stream:
                raise InvalidRequest("'stream' true needs /generate_stream; /generate answers once")
            results = await collect_or_cancel(request, submit_all(ep, reqs))
        except ServingError as exc:
            return error_response(exc, rid)
        except ConnectionAbortedError:
            return Response(status_code=499, headers={REQUEST_ID_HEADER: rid})  # logged; the client left
        headers = {REQUEST_ID_HEADER: rid, **ignored_headers(rest.ignored, rid, ep.name)}
        return JSONResponse({"model_name": ep.name, "model_version": version,
                             "text_output": whole_texts(inputs, reqs, results)[0]}, headers=headers)

    async def generate_stream(self, request: Request) -> Response:
        rid = request_id(request)
        try:
            ep, version, rest, inputs, reqs = await self._prepare(request, generate=True)
            require_streaming(ep)
            if not is_text_model(ep):
                raise InvalidRequest(f"model {ep.name!r} has a custom handler: generate_stream streams the built-in "
                                     "text handlers' tokens")
            streams = submit_all(ep, reqs)
        except ServingError as exc:
            return error_response(exc, rid)
        prefix = reqs[0].prompt if inputs.exclude_input is False else ""  # streamed tokens leave the prompt out
        headers = {REQUEST_ID_HEADER: rid, **ignored_headers(rest.ignored, rid, ep.name)}
        return StreamingResponse(_events(streams[0], ep.name, version, prefix), media_type="text/event-stream",
                                 headers=headers)


async def _events(stream: ResultStream, model: str, version: str, prefix: str) -> AsyncIterator[str]:
    """One SSE event per released piece of text; an error ends the stream with its message."""
    try:
        async for delta in stream:
            text = prefix + delta.text
            prefix = ""
            if text:
                yield _sse({"model_name": model, "model_version": version, "text_output": text})
    except ServingError as exc:
        yield _sse({"error": exc.message})
    finally:
        if not stream.done:
            stream.cancel()  # the client left (or the stream failed): free the slot


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _read_body(request: Request, max_bytes: int) -> tuple[Any, bytes]:
    """The inference body: JSON alone (``read_json``), or with Triton's binary extension the JSON's first
    ``Inference-Header-Content-Length`` bytes and the tensors' bytes after them."""
    length = request.headers.get(HEADER_LENGTH)
    if length is None:
        return await read_json(request, max_bytes), b""
    if not (length.isascii() and length.isdigit()) or len(length) > 12:
        raise InvalidRequest(f"invalid {HEADER_LENGTH} header (the JSON's length in bytes)")
    raw = await read_bytes(request, max_bytes)
    n = int(length)
    if n > len(raw):
        raise InvalidRequest(f"{HEADER_LENGTH} is {n} but the body has {len(raw)} bytes")
    try:
        body = json.loads(raw[:n].decode("utf-8"), parse_constant=_reject_constant)
    except UnicodeDecodeError as exc:
        raise InvalidRequest(f"request JSON is not valid UTF-8 (byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"request JSON is not valid: {exc.msg} at line {exc.lineno} column {exc.colno}") \
            from None
    except (RecursionError, ValueError) as exc:
        raise InvalidRequest(f"request JSON is not acceptable: {str(exc)[:200]}") from None
    return body, raw[n:]


def _reject_constant(name: str) -> Any:
    raise InvalidRequest(f"invalid JSON number {name}: NaN and Infinity are not allowed")
