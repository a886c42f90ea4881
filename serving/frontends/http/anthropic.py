"""Anthropic's Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

Design note: a translation onto the chat pipeline, as vLLM, SGLang and llama.cpp's server serve this API. The body
is validated and turned into an OpenAI chat body (``messages_schema``), which ``openai_schema.parse_chat`` turns
into the one ``GenerationRequest`` (so a conversation gets the same prompt and the same greedy answer on both
routes); the answer's text is read into content blocks by ``messages_blocks`` (the chat route's tool reader
inside). ``stream: true`` gives Anthropic's server-sent events (``message_start``, ``content_block_start``,
``ping``, deltas, ``content_block_stop``, ``message_delta``, ``message_stop``; an error after the start is an
``error`` event); a client that disconnects cancels its request. ``message_start`` is sent with the first delta,
which carries the prompt's token count. Stop sequences are asked with ``include_stop_str_in_output`` so the
answer can name the one that ended it, then cut. Errors use Anthropic's shape ``{"type": "error", "error":
{"type", "message"}, "request_id"}`` (the ``anthropic`` SDK raises by status); the inference guard answers this
route's 401 in the same shape (``GUARD_BODIES``). ``x-api-key`` is the inference token (``serving.auth``); the
``anthropic-version`` and ``anthropic-beta`` headers are accepted and ignored.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from rollcore.errors import ErrorKind, InvalidRequest, ServingError
from rollcore.types import FinishReason, GenerationResult
from serving.batching.streams import ResultStream
from serving.frontends.http.anthropic_blocks import AnswerReader, Event, cut_stop, fold, reasoning_splitter, stop_reason
from serving.frontends.http.anthropic_schema import to_chat, validate
from serving.frontends.http.httpio import (
    REQUEST_ID_HEADER,
    STATUS,
    HttpContext,
    body_size,
    collect_or_cancel,
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
from serving.models.endpoint_protocol import Endpoint
from serving.models.model_text import ModelText
from serving.models.resident import ensure_resident
from serving.requests.validation import type_error

ERROR_TYPES = {ErrorKind.INVALID: "invalid_request_error", ErrorKind.METHOD: "invalid_request_error",
               ErrorKind.TOO_LARGE: "request_too_large", ErrorKind.NOT_FOUND: "not_found_error",
               ErrorKind.UNAUTHORIZED: "authentication_error", ErrorKind.FORBIDDEN: "permission_error",
               ErrorKind.OVERLOADED: "overloaded_error", ErrorKind.UNAVAILABLE: "overloaded_error",
               ErrorKind.TIMEOUT: "timeout_error"}  # any other kind: api_error


def error_body(error_type: str, message: str, rid: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error_type, "message": message}, "request_id": rid}


def error_response(exc: ServingError, rid: str) -> JSONResponse:
    """A ``ServingError`` in Anthropic's shape, with the server's status for its kind."""
    status = STATUS.get(exc.kind, 500)
    headers = {REQUEST_ID_HEADER: rid}
    if exc.retry_after_s is not None and status in (429, 503):
        headers["Retry-After"] = str(exc.retry_after_s)
    return JSONResponse(error_body(ERROR_TYPES.get(exc.kind, "api_error"), exc.message, rid), status_code=status,
                        headers=headers)


def guard_body(status: int, message: str, rid: str) -> dict[str, Any]:
    """The inference guard's refusal (401 / 403) of a request to these routes, in Anthropic's shape."""
    return error_body("authentication_error" if status == 401 else "permission_error", message, rid)


GUARD_BODIES: tuple[tuple[str, Callable[[int, str, str], dict[str, Any]]], ...] = (("/v1/messages", guard_body),)
"""Path prefix -> the body of the guard's refusals there (``http_guard.ApiGuard``'s ``error_bodies``)."""


def _sse(event: Event) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


class MessagesRoutes:
    """The Messages API routes bound to one ``HttpContext``."""

    def __init__(self, ctx: HttpContext) -> None:
        self.ctx = ctx

    def routes(self) -> list[Route]:
        return [Route("/v1/messages", self.create, methods=["POST"]),
                Route("/v1/messages/count_tokens", self.count_tokens, methods=["POST"])]

    async def create(self, request: Request) -> Response:
        rid = request_id(request)
        try:
            body, ep, adapter = await self._read(request)
            text = ep.text
            ignored: list[str] = []
            parsed = await off_loop(self.ctx.tokenize_pool, body_size(request), self._parse, body, ep, text, rid,
                                    ignored, False)
            if parsed.stream:
                require_streaming(ep)
            requests = [c.request for c in parsed.choices]
            if adapter is not None:
                requests = [replace(r, params=replace(r.params, adapter=adapter)) for r in requests]
            streams = submit_all(ep, requests)
            answer = MessageAnswer(f"msg_{rid}", body["model"], parsed, dict(ep.options))
            extra = ignored_headers(ignored, rid, ep.name)
            if parsed.stream:
                return StreamingResponse(answer.events(streams[0], rid), media_type="text/event-stream",
                                         headers={REQUEST_ID_HEADER: rid, "Cache-Control": "no-cache", **extra})
            try:
                results = await collect_or_cancel(request, streams)
            except ConnectionAbortedError:
                return Response(status_code=499, headers={REQUEST_ID_HEADER: rid})  # the client left
            headers = {REQUEST_ID_HEADER: rid, **timing_headers(results[0].timings), **extra}
            return JSONResponse(answer.whole(results[0]), headers=headers)
        except ServingError as exc:
            return error_response(exc, rid)

    async def count_tokens(self, request: Request) -> Response:
        rid = request_id(request)
        try:
            body, ep, _ = await self._read(request)
            text = ep.text
            if text.tokenizer is None:
                raise InvalidRequest(f"model {ep.name!r} has no tokenizer.json: its tokens cannot be counted here")
            ignored: list[str] = []
            count = await off_loop(self.ctx.tokenize_pool, body_size(request), self._count, body, ep, text, rid,
                                   ignored)
            return JSONResponse({"input_tokens": count},
                                headers={REQUEST_ID_HEADER: rid, **ignored_headers(ignored, rid, ep.name)})
        except ServingError as exc:
            return error_response(exc, rid)

    async def _read(self, request: Request) -> tuple[Any, Endpoint, str | None]:
        """The body, and the model it names: (body, endpoint, LoRA adapter or None)."""
        body, model = await read_request(self.ctx, request)
        if not isinstance(body, dict):
            raise type_error("request body", "a JSON object", body)
        if model is None:
            raise InvalidRequest("missing field 'model'")
        ep, adapter = resolve_model(self.ctx.registry, model)
        note_model(request, ep)  # the metrics labels: the model and its version
        await ensure_resident(ep)  # a model loaded on demand: its first request waits for the load
        ep.check_ready()  # a model not READY has no template to read: 503
        return body, ep, adapter

    def _parse(self, body: Any, ep: Endpoint, text: ModelText, rid: str, ignored: list[str],
               count: bool) -> ParsedRequest:
        """Validate, translate, and parse as the chat route does (on the tokenize pool for long bodies)."""
        req = validate(body, self.ctx.limits, strict_parameters(ep), ignored, count)
        return parse_chat(to_chat(req), ep.name, text, rid, self.ctx.limits, True, ep.options)

    def _count(self, body: Any, ep: Endpoint, text: ModelText, rid: str, ignored: list[str]) -> int:
        """The tokens of the prompt ``/v1/messages`` would send the model (tools included)."""
        choice = self._parse(body, ep, text, rid, ignored, True).choices[0]
        ids = choice.request.prompt_token_ids or text.encode(choice.prompt_text)
        return len(ids or ())


class MessageAnswer:
    """Builds the ``Message`` (whole) or its events (streamed) of one parsed request."""

    def __init__(self, message_id: str, model: str, parsed: ParsedRequest, options: dict[str, str]) -> None:
        self.id = message_id
        self.model = model
        self.parsed = parsed
        self.stops = parsed.choices[0].request.params.stop
        self.reader = AnswerReader(parsed.tools, reasoning_splitter(parsed.reasoning))

    def _message(self, content: list[dict[str, Any]], reason: str | None, stop: str | None, prompt_tokens: int,
                 output_tokens: int, cached_tokens: int) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": reason, "stop_sequence": stop, "usage": _usage(prompt_tokens, output_tokens,
                                                                              cached_tokens)}

    def whole(self, result: GenerationResult) -> dict[str, Any]:
        text, stop = cut_stop(result.text, result.finish_reason, self.stops)
        content = fold(self.reader.feed(text, last=True))
        reason = stop_reason(result.finish_reason, stop, self.reader.blocks.tool_uses)
        return self._message(content, reason, stop, result.prompt_tokens, result.generated_tokens,
                             result.cached_tokens)

    async def events(self, stream: ResultStream, rid: str) -> AsyncIterator[str]:
        """``message_start`` (with the first delta), the blocks' events with a ``ping`` after the first block's
        start, ``message_delta`` (stop reason, usage), ``message_stop``; an error ends it with an ``error``."""
        started = pinged = False
        finish: FinishReason | None = None
        stop: str | None = None
        try:
            async for delta in stream:
                if not started:
                    started = True
                    yield _sse({"type": "message_start", "message": self._message(
                        [], None, None, stream.prompt_tokens, 0, stream.cached_tokens)})
                finish = delta.finish_reason or finish
                text, stop = cut_stop(delta.text, delta.finish_reason, self.stops)
                for event in self.reader.feed(text, last=delta.finish_reason is not None):
                    yield _sse(event)
                    if not pinged and event["type"] == "content_block_start":
                        pinged = True
                        yield _sse({"type": "ping"})
            if not started:
                yield _sse({"type": "message_start", "message": self._message(
                    [], None, None, stream.prompt_tokens, 0, stream.cached_tokens)})
            if not self.reader.finished:
                for event in self.reader.feed("", last=True):
                    yield _sse(event)
            if not pinged:
                yield _sse({"type": "ping"})
            reason = stop_reason(finish, stop, self.reader.blocks.tool_uses)
            yield _sse({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": stop},
                        "usage": _usage(stream.prompt_tokens, stream.num_tokens, stream.cached_tokens)})
            yield _sse({"type": "message_stop"})
        except ServingError as exc:
            body = error_body(ERROR_TYPES.get(exc.kind, "api_error"), exc.message, rid)
            yield f"event: error\ndata: {json.dumps(body)}\n\n"
        finally:
            if not stream.done:
                stream.cancel()


def _usage(prompt_tokens: int, output_tokens: int, cached_tokens: int) -> dict[str, int]:
    """Anthropic's usage: ``input_tokens`` are the prompt's tokens not read from the prefix cache, which
    ``cache_read_input_tokens`` counts (nothing is written to a cache on request: ``cache_creation_input_tokens`` 0)."""
    return {"input_tokens": prompt_tokens - cached_tokens, "cache_read_input_tokens": cached_tokens,
            "cache_creation_input_tokens": 0, "output_tokens": output_tokens}
