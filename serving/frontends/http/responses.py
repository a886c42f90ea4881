"""OpenAI Responses API: ``POST /v1/responses``, ``GET``/``DELETE /v1/responses/{id}``, ``POST .../{id}/cancel``.

Design note: a translation onto the chat route, as vLLM and llama.cpp's server do it. The body is validated
and turned into a chat body (``responses_schema``), which ``parse_chat`` turns into the one
``GenerationRequest`` (same chat template, tool plan, constraints and sampling validation as
``/v1/chat/completions``); its ``ResultStream`` is read by a ``Job``, which feeds the text through the chat
route's tool reader and builds the output items (``responses_output``). A streamed answer sends each event as
SSE (``event: <type>``, ``data: {...}``, ``sequence_number`` from 0); a whole answer drains the same events;
``background: true`` answers at once and drains them in a task. So all three give the same ``Response``.
Finished responses go to the in-memory ``ResponseStore`` unless ``store: false`` (the bounds are in its module
note); in-progress ones too, so ``cancel`` can stop them. A client that disconnects cancels its generation
(a background one runs on). Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``
(the SDK raises ``BadRequestError``, ``NotFoundError``, ... from the status); ``param`` is the field the
message names first. Mid-stream errors end the stream with an ``error`` event.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from rollcore.errors import ErrorKind, InvalidRequest, ModelNotFound, ServingError
from rollcore.types import FinishReason
from serving.batching.streams import ResultStream
from serving.frontends.http.httpio import (
    REQUEST_ID_HEADER,
    STATUS,
    HttpContext,
    body_size,
    ignored_headers,
    note_model,
    read_request,
    request_id,
    resolve_model,
    strict_parameters,
    submit_all,
    timing_headers,
)
from serving.frontends.http.openai import require_streaming
from serving.frontends.http.openai_schema import ParsedRequest, parse_chat
from serving.frontends.http.prompts import off_loop
from serving.frontends.http.responses_output import AnswerReader, OutputBuilder, new_id
from serving.frontends.http.responses_schema import (
    RESPONSES,
    ResponsesRequest,
    ResponsesToolChoice,
    chat_body,
    chat_messages,
    input_items,
    responses_message,
    responses_param,
)
from serving.frontends.http.responses_store import ResponseStore, Stored, namespace
from serving.models.endpoint_protocol import Endpoint
from serving.models.model_text import ModelText
from serving.models.resident import ensure_resident
from serving.requests.params import Limits
from serving.requests.validation import type_error

CANCEL_WAIT_S = 10.0  # how long POST .../cancel waits for the job to end (a stream whose client stalls)


class ResponseNotFound(ServingError):
    """An unknown (or expired, deleted, other-namespace) response id: 404 naming ``param``."""

    kind = ErrorKind.NOT_FOUND

    def __init__(self, message: str, param: str | None, code: str) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


def openai_error(exc: ServingError, rid: str) -> JSONResponse:
    """OpenAI's error body, with rollserve's status for the error's kind."""
    status = STATUS.get(exc.kind, 500)
    kind = {401: "authentication_error", 403: "permission_error"}.get(
        status, "invalid_request_error" if status < 500 else "server_error")
    param = exc.param if isinstance(exc, ResponseNotFound) else responses_param(exc.message)
    code = exc.code if isinstance(exc, ResponseNotFound) else exc.kind.value
    headers = {REQUEST_ID_HEADER: rid}
    if exc.retry_after_s is not None and status in (429, 503):
        headers["Retry-After"] = str(exc.retry_after_s)
    return JSONResponse({"error": {"message": exc.message, "type": kind, "param": param, "code": code}},
                        status_code=status, headers=headers)


def guard_body(status: int, message: str, rid: str) -> dict[str, Any]:
    """The inference guard's refusal (401 / 403) of a request to these routes, in OpenAI's shape."""
    kind, code = ("authentication_error", "invalid_api_key") if status == 401 else ("permission_error", "forbidden")
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


GUARD_BODIES: tuple[tuple[str, Callable[[int, str, str], dict[str, Any]]], ...] = (("/v1/responses", guard_body),)
"""Path prefix -> the body of the guard's refusals there (``http_guard.ApiGuard``'s ``error_bodies``)."""


def routes(ctx: HttpContext, tokens_required: bool = False) -> list[Route]:
    """The Responses routes bound to ``ctx`` (called once by the composition root)."""
    return ResponsesRoutes(ctx, tokens_required).routes()


def _validate(body: Any, limits: Limits, strict: bool) -> tuple[ResponsesRequest, list[str]]:
    ignored: list[str] = []
    return RESPONSES.validate(body, limits, strict=strict, ignored=ignored), ignored


def _parse(req: ResponsesRequest, items: list[dict[str, Any]], ep: Endpoint, text: ModelText, rid: str,
           limits: Limits) -> ParsedRequest:
    """The chat request of a Responses request; chat's messages renamed to this API's fields."""
    try:
        body = chat_body(req, ep.name, chat_messages(req.instructions, items))
        return parse_chat(body, ep.name, text, rid, limits, True, ep.options)
    except InvalidRequest as exc:
        raise InvalidRequest(responses_message(exc.message)) from None


class ResponsesRoutes:
    """The Responses routes; ``tokens_required``: inference tokens are on, so the store has one namespace per
    token (see ``responses_store``)."""

    def __init__(self, ctx: HttpContext, tokens_required: bool = False, store: ResponseStore | None = None) -> None:
        self.ctx = ctx
        self.store = store if store is not None else ResponseStore()
        self.tokens_required = tokens_required
        self._background: set[asyncio.Task[None]] = set()  # held: a task nobody references may be collected

    def routes(self) -> list[Route]:
        return [Route("/v1/responses", self.create, methods=["POST"]),
                Route("/v1/responses/{response_id}", self.one, methods=["GET", "DELETE"]),
                Route("/v1/responses/{response_id}/cancel", self.cancel, methods=["POST"])]

    def _ns(self, request: Request) -> str:
        return namespace(request.headers.get("authorization"), self.tokens_required)

    def _stored(self, request: Request) -> Stored:
        rid = request.path_params["response_id"]
        entry = self.store.get(self._ns(request), rid)
        if entry is None:
            raise ResponseNotFound(f"response {rid!r} not found (unknown, expired or deleted)", None,
                                   "response_not_found")
        return entry

    async def one(self, request: Request) -> Response:
        rid = request_id(request)
        try:
            entry = self._stored(request)
        except ServingError as exc:
            return openai_error(exc, rid)
        if request.method == "DELETE":
            self.store.delete(self._ns(request), entry.response["id"])
            return JSONResponse({"id": entry.response["id"], "object": "response.deleted", "deleted": True},
                                headers={REQUEST_ID_HEADER: rid})
        return JSONResponse(entry.response, headers={REQUEST_ID_HEADER: rid})

    async def cancel(self, request: Request) -> Response:
        rid = request_id(request)
        try:
            entry = self._stored(request)
            if not entry.in_progress or entry.cancel is None:
                raise InvalidRequest(f"response {entry.response['id']!r} is not in progress (status "
                                     f"{entry.response['status']!r}): only a queued or in-progress response can be "
                                     "cancelled")
        except ServingError as exc:
            return openai_error(exc, rid)
        entry.cancel()
        job = entry.job if isinstance(entry.job, Job) else None
        if job is not None:  # cancelling fails the stream: the job ends at its next step
            await asyncio.wait([asyncio.ensure_future(job.finished.wait())], timeout=CANCEL_WAIT_S)
        return JSONResponse(entry.response, headers={REQUEST_ID_HEADER: rid})

    def _resolve(self, model: str | None) -> tuple[Any, str | None]:
        """``model`` -> (endpoint, LoRA adapter), as the chat route resolves it."""
        if model is None:
            return self.ctx.registry.only(), None
        try:
            return resolve_model(self.ctx.registry, model)
        except ModelNotFound as exc:
            raise ResponseNotFound(exc.message, "model", "model_not_found") from None

    async def create(self, request: Request) -> Response:
        rid = request_id(request)
        try:
            body, model = await read_request(self.ctx, request)
            if not isinstance(body, dict):
                raise type_error("request body", "an object", body)
            ep, adapter = self._resolve(model)
            note_model(request, ep)  # the metrics labels: the model and its version
            return await self._create(request, body, ep, adapter, rid)
        except ServingError as exc:
            return openai_error(exc, rid)

    async def _create(self, request: Request, body: dict[str, Any], ep: Endpoint, adapter: str | None,
                      rid: str) -> Response:
        pool, size = self.ctx.tokenize_pool, body_size(request)
        req, ignored = await off_loop(pool, size, _validate, body, self.ctx.limits, strict_parameters(ep))
        ns = self._ns(request)
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            prev = self.store.get(ns, req.previous_response_id)
            if prev is None:
                raise ResponseNotFound(f"previous response {req.previous_response_id!r} not found (unknown, expired, "
                                       "deleted or stored with store: false)", "previous_response_id",
                                       "previous_response_not_found")
            if prev.in_progress:
                raise InvalidRequest(f"'previous_response_id' names response {req.previous_response_id!r}, which is "
                                     "still in progress")
            history = prev.conversation()
        store = req.store is not False
        if req.background and not store:
            raise InvalidRequest("'background' needs 'store' (the answer is fetched with GET /v1/responses/{id})")
        if req.background and req.stream:
            raise InvalidRequest("'background' with 'stream' is not supported: stream, or poll a background response")
        items = [*history, *input_items(req)]
        await ensure_resident(ep)  # a model loaded on demand: its first request waits for the load
        ep.check_ready()  # a model not READY has no template to read: 503
        text = ep.text
        parsed = await off_loop(pool, size, _parse, req, items, ep, text, rid, self.ctx.limits)
        if parsed.stream:
            require_streaming(ep)
        gen = parsed.choices[0].request
        if adapter is not None:
            gen = replace(gen, params=replace(gen.params, adapter=adapter))
        stream = submit_all(ep, [gen])[0]
        job = Job(new_response(req, adapter or ep.name), parsed, stream, self.store if store else None, ns, items)
        extra = ignored_headers(ignored, rid, ep.name)
        headers = {REQUEST_ID_HEADER: rid, **extra}
        if parsed.stream:
            return StreamingResponse(job.sse(), media_type="text/event-stream",
                                     headers={**headers, "Cache-Control": "no-cache"})
        if req.background:
            task = asyncio.create_task(job.drain())
            self._background.add(task)
            task.add_done_callback(self._background.discard)
            return JSONResponse(job.response, headers=headers)
        drain = asyncio.ensure_future(job.drain())
        watch = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait([drain, watch], return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
        if not drain.done():  # the client left: its generation stops
            job.cancel()
            await drain
            return Response(status_code=499, headers={REQUEST_ID_HEADER: rid})
        if job.error is not None and not job.cancelled:
            raise job.error
        return JSONResponse(job.response, headers={**headers, **timing_headers(stream.timings())})


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def new_response(req: ResponsesRequest, model: str) -> dict[str, Any]:
    """A new ``Response`` object (in progress, no output) echoing the request's settings."""
    fmt = req.text.format if req.text is not None else None
    fmt_out = fmt.model_dump(by_alias=True, exclude_none=True) if fmt is not None else {"type": "text"}
    if fmt_out["type"] == "json_schema":
        fmt_out.setdefault("name", "response")
    tools = [t.model_dump(exclude_none=True) for t in req.tools or ()]
    choice = req.tool_choice.model_dump() if isinstance(req.tool_choice, ResponsesToolChoice) else req.tool_choice
    return {"id": new_id("resp"), "object": "response", "created_at": int(time.time()), "status": "in_progress",
            "background": bool(req.background), "error": None, "incomplete_details": None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": model,
            "output": [], "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": req.reasoning.model_dump() if req.reasoning is not None else None,
            "store": req.store is not False, "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": {"format": fmt_out}, "tool_choice": choice or ("auto" if tools else "none"), "tools": tools,
            "top_p": 1.0 if req.top_p is None else req.top_p, "truncation": "disabled", "usage": None,
            "user": req.user, "metadata": dict(req.metadata or {})}


class Job:
    """One response being generated: reads its stream into output items, yields the events, stores the result."""

    def __init__(self, response: dict[str, Any], parsed: ParsedRequest, stream: ResultStream,
                 store: ResponseStore | None, ns: str, items: list[dict[str, Any]]) -> None:
        self.response = response
        self.parsed = parsed
        self.stream = stream
        self.store = store
        self.ns = ns
        self.items = items
        self.error: ServingError | None = None
        self.cancelled = False
        self.finished = asyncio.Event()
        self.reasoning_tokens = 0
        if store is not None:
            store.put(ns, Stored(response, items, self.cancel, job=self))

    def cancel(self) -> None:
        """Stop generating (POST .../cancel, or the client left): the answer ends with status cancelled."""
        self.cancelled = True
        self.response["status"] = "cancelled"
        self.stream.cancel()

    async def drain(self) -> None:
        async for _ in self.events():
            pass

    async def sse(self) -> AsyncIterator[str]:
        async for event in self.events():
            yield f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        """Every stream event of the answer, numbered; the response object is complete when they end."""
        pending: list[dict[str, Any]] = []
        builder = OutputBuilder(pending.append)
        reader = AnswerReader(self.parsed.tools, self.parsed.reasoning)
        seq = 0
        try:
            for kind in ("response.created", "response.in_progress"):  # at once: before the first token
                yield {"type": kind, "response": self._snapshot(), "sequence_number": seq}
                seq += 1
            try:
                async for delta in self.stream:
                    counted, parts = reader.feed(delta.text, len(delta.tokens))
                    self.reasoning_tokens += counted
                    if delta.finish_reason is not None:
                        parts += reader.finish()
                    for part in parts:
                        builder.feed(part)
                    for event in pending:
                        yield {**event, "sequence_number": seq}
                        seq += 1
                    pending.clear()
            except ServingError as exc:
                self.error = exc
            self._finish(builder)
            pending.append(self._last_event())
            for event in pending:
                yield {**event, "sequence_number": seq}
                seq += 1
        finally:
            if self.response["usage"] is None:  # the client left mid-stream (the generator was closed)
                self.cancel()
                self._finish(builder)
            if self.store is not None:
                self.store.put(self.ns, Stored(self.response, self.items))
            self.finished.set()

    def _snapshot(self) -> dict[str, Any]:
        return {**self.response, "output": list(self.response["output"])}

    def _finish(self, builder: OutputBuilder) -> None:
        """Set the response's status, output and usage from how the stream ended."""
        r = self.response
        cut = self.stream.finish_reason is FinishReason.LENGTH
        if self.cancelled:
            r["status"] = "cancelled"
        elif self.error is not None:
            r["status"] = "failed"
            r["error"] = {"code": "server_error", "message": self.error.message}
        elif cut:
            r["status"] = "incomplete"
            r["incomplete_details"] = {"reason": "max_output_tokens"}
        else:
            r["status"] = "completed"
        r["output"] = builder.finish("completed" if r["status"] == "completed" else "incomplete")
        prompt, generated = self.stream.prompt_tokens, self.stream.num_tokens
        r["usage"] = {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": self.stream.cached_tokens,
                                                                "cache_write_tokens": 0},
                      "output_tokens": generated, "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
                      "total_tokens": prompt + generated}
        if r["status"] == "completed":
            r["completed_at"] = int(time.time())

    def _last_event(self) -> dict[str, Any]:
        """``response.completed`` / ``.incomplete`` (cut short or cancelled), or an ``error`` event."""
        if self.error is not None and not self.cancelled:
            return {"type": "error", "code": self.error.kind.value, "message": self.error.message, "param": None}
        kind = {"completed": "response.completed", "failed": "response.failed"}.get(self.response["status"],
                                                                                  "response.incomplete")
        return {"type": kind, "response": self._snapshot()}
