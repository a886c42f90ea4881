"""OpenAI-compatible routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``.

Design note: a thin translation. ``openai_schema`` turns the body into one ``GenerationRequest`` per
choice; answers are built in OpenAI's shapes by ``openai_answer`` (checked in tests against the ``openai`` package's
pydantic types). ``stream: true`` gives SSE chunks ending in ``data: [DONE]``; the last chunk of each
choice also carries ``timings`` (rollserve's per-request timings), whole answers carry them as
``X-*`` headers. Streaming needs a rolling-batch model: a dynamic-batching model answers ``stream`` with
a 400 naming ``option.rolling_batch`` (the same decision as the LMI routes). A client that disconnects
cancels every choice of its request. Errors use the server-wide ``{"error", "error_type", "request_id"}``
shape (the ``openai`` SDK raises its status-specific exceptions from the status code).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from rollcore.errors import InvalidRequest, ServingError
from serving.frontends.http.embeddings import check_generates
from serving.frontends.http.httpio import (
    REQUEST_ID_HEADER,
    HttpContext,
    body_size,
    collect_or_cancel,
    error_response,
    ignored_headers,
    note_model,
    read_request,
    request_id,
    resolve_model,
    strict_parameters,
    submit_all,
    timing_headers,
)
from serving.frontends.http.openai_answer import Answer
from serving.frontends.http.openai_schema import parse_chat, parse_completion
from serving.frontends.http.prompts import off_loop
from serving.models.endpoint_protocol import Endpoint
from serving.models.resident import ensure_resident


def routes(ctx: HttpContext) -> list[Route]:
    """The OpenAI routes bound to ``ctx`` (called once by the composition root)."""
    return OpenAIRoutes(ctx).routes()


def require_streaming(ep: Endpoint) -> None:
    """Streaming needs a rolling-batch model (documented decision; DJL rejects the same way)."""
    if not ep.rolling:
        raise InvalidRequest("'stream' needs a rolling-batch model (set option.rolling_batch=auto); "
                             f"model {ep.name!r} uses dynamic batching")


class OpenAIRoutes:
    """The OpenAI routes; also serves LMI's ``/invocations`` bodies that carry ``messages``."""

    def __init__(self, ctx: HttpContext) -> None:
        self.ctx = ctx

    def routes(self) -> list[Route]:
        return [Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat, methods=["POST"])]

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": model_objects(self.ctx)},
                            headers={REQUEST_ID_HEADER: request_id(request)})

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, chat=False)

    async def chat(self, request: Request) -> Response:
        return await self._serve(request, chat=True)

    async def chat_for_lmi(self, request: Request, body: Any, ep: Endpoint, rid: str) -> Response:
        """LMI's ``/invocations`` with a ``messages`` body: an OpenAI chat request on ``ep``."""
        try:
            return await self._run(request, body, ep, rid, chat=True)
        except ServingError as exc:
            return error_response(exc, rid)

    async def completion_for_lmi(self, request: Request, body: Any, ep: Endpoint, rid: str) -> Response:
        """LMI's ``/invocations`` with a ``prompt`` body: an OpenAI completions request on ``ep`` (what LMI's vLLM
        handler does), answered as ``POST /v1/completions`` answers it."""
        try:
            return await self._run(request, body, ep, rid, chat=False)
        except ServingError as exc:
            return error_response(exc, rid)

    async def _serve(self, request: Request, chat: bool) -> Response:
        rid = request_id(request)
        try:
            body, model = await read_request(self.ctx, request)
            ep, adapter = resolve_model(self.ctx.registry, model) if model else (self.ctx.registry.only(), None)
            note_model(request, ep)  # the metrics labels: the model and its version
            return await self._run(request, body, ep, rid, chat, adapter)
        except ServingError as exc:
            return error_response(exc, rid)

    async def _run(self, request: Request, body: Any, ep: Endpoint, rid: str, chat: bool,
                   adapter: str | None = None) -> Response:
        await ensure_resident(ep)  # a model loaded on demand: its first request waits for the load
        ep.check_ready()  # a model not READY has no template to read: 503, not a 400 about its template
        check_generates(ep)
        text = ep.text
        args = (body, ep.name, text, rid, self.ctx.limits, strict_parameters(ep))
        if chat:
            parsed = await off_loop(self.ctx.tokenize_pool, body_size(request), parse_chat, *args, ep.options)
        else:
            parsed = await off_loop(self.ctx.tokenize_pool, body_size(request), parse_completion, *args)
        if parsed.stream:
            require_streaming(ep)
        requests = [c.request for c in parsed.choices]
        if adapter is not None:
            requests = [replace(r, params=replace(r.params, adapter=adapter)) for r in requests]
        streams = submit_all(ep, requests)
        kind = "chat.completion" if chat else "text_completion"
        answer = Answer(f"{'chatcmpl' if chat else 'cmpl'}-{rid}", kind, adapter or ep.name, parsed, text)
        extra = ignored_headers(parsed.ignored, rid, ep.name)
        if parsed.stream:
            return StreamingResponse(answer.events(streams), media_type="text/event-stream",
                                     headers={REQUEST_ID_HEADER: rid, "Cache-Control": "no-cache", **extra})
        try:
            results = await collect_or_cancel(request, streams)
        except ConnectionAbortedError:
            return Response(status_code=499, headers={REQUEST_ID_HEADER: rid})  # logged; the client left
        headers = {REQUEST_ID_HEADER: rid, **timing_headers(results[0].timings), **extra}
        return JSONResponse(answer.whole(results), headers=headers)



def model_objects(ctx: HttpContext) -> list[dict[str, Any]]:
    """OpenAI's ``Model`` objects of every served model and, after each, its LoRA adapters (``GET /v1/models``;
    ``GET /v1/models/{id}`` answers one of them)."""
    created = int(ctx.state.started_at)
    data = []
    for name, ep in sorted(ctx.registry.endpoints.items()):
        entry: dict[str, Any] = {"id": name, "object": "model", "created": created, "owned_by": "rollserve",
                                 "status": ep.state.value}
        max_len = ep.info.get("max_model_len")
        if isinstance(max_len, int):
            entry["max_model_len"] = max_len
        data.append(entry)
        data.extend({"id": a, "object": "model", "created": created, "owned_by": "rollserve", "parent": name,
                     "status": ep.state.value} for a in adapters_of(ep))  # vLLM lists adapters with their parent
    return data


def adapters_of(ep: Endpoint) -> list[str]:
    """The LoRA adapters a model serves (its workers' ``describe``)."""
    return list(ep.info.get("adapters") or ())
