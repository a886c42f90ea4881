"""OpenAI-compatible routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``.

Design note: a thin translation. ``openai_schema`` turns the body into one ``GenerationRequest`` per
choice; answers are built here in OpenAI's shapes (checked in tests against the ``openai`` package's
pydantic types). ``stream: true`` gives SSE chunks ending in ``data: [DONE]``; the last chunk of each
choice also carries ``timings`` (rollserve's per-request timings), whole answers carry them as
``X-*`` headers. Streaming needs a rolling-batch model: a dynamic-batching model answers ``stream`` with
a 400 naming ``option.rolling_batch`` (the same decision as the LMI routes). A client that disconnects
cancels every choice of its request. Errors use the server-wide ``{"error", "error_type", "request_id"}``
shape (the ``openai`` SDK raises its status-specific exceptions from the status code).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from rollcore.errors import InvalidRequest, ServingError
from rollcore.types import FinishReason, GenerationResult, TokenDelta, TokenInfo
from serving.batching.streams import ResultStream
from serving.frontends.embeddings import check_generates
from serving.frontends.httpio import (
    REQUEST_ID_HEADER,
    HttpContext,
    body_size,
    collect_or_cancel,
    error_response,
    ignored_headers,
    read_request,
    request_id,
    resolve_model,
    strict_parameters,
    submit_all,
    timing_headers,
    timings_json,
)
from serving.frontends.openai_schema import Choice, ParsedRequest, parse_chat, parse_completion
from serving.frontends.prompts import ModelText, ModelTexts, off_loop
from serving.frontends.reasoning import ReasoningSplitter, reasoning_tokens, split_whole
from serving.frontends.tools import ToolStream, fold


def routes(ctx: HttpContext) -> list[Route]:
    """The OpenAI routes bound to ``ctx`` (called once by the composition root)."""
    return OpenAIRoutes(ctx).routes()


def _options(ep: Any) -> dict[str, str]:
    config = getattr(ep, "config", None)
    return {k: str(v) for k, v in config.options.items()} if config is not None else {}


def require_streaming(ep: Any) -> None:
    """Streaming needs a rolling-batch model (documented decision; DJL rejects the same way)."""
    if not ep.rolling:
        raise InvalidRequest("'stream' needs a rolling-batch model (set option.rolling_batch=auto); "
                             f"model {ep.name!r} uses dynamic batching")


class OpenAIRoutes:
    """The OpenAI routes; also serves LMI's ``/invocations`` bodies that carry ``messages``."""

    def __init__(self, ctx: HttpContext) -> None:
        self.ctx = ctx
        self.texts = ModelTexts()

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

    async def chat_for_lmi(self, request: Request, body: Any, ep: Any, rid: str) -> Response:
        """LMI's ``/invocations`` with a ``messages`` body: an OpenAI chat request on ``ep``."""
        try:
            return await self._run(request, body, ep, rid, chat=True)
        except ServingError as exc:
            return error_response(exc, rid)

    async def completion_for_lmi(self, request: Request, body: Any, ep: Any, rid: str) -> Response:
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
            request.state.model = ep.name  # the metrics label
            return await self._run(request, body, ep, rid, chat, adapter)
        except ServingError as exc:
            return error_response(exc, rid)

    async def _run(self, request: Request, body: Any, ep: Any, rid: str, chat: bool,
                   adapter: str | None = None) -> Response:
        check_generates(ep)
        text = self.texts.get(ep)
        args = (body, ep.name, text, rid, self.ctx.limits, strict_parameters(ep))
        if chat:
            parsed = await off_loop(self.ctx.tokenize_pool, body_size(request), parse_chat, *args, _options(ep))
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
        max_len = (getattr(ep, "info", None) or {}).get("max_model_len")
        if isinstance(max_len, int):
            entry["max_model_len"] = max_len
        data.append(entry)
        data.extend({"id": a, "object": "model", "created": created, "owned_by": "rollserve", "parent": name,
                     "status": ep.state.value} for a in adapters_of(ep))  # vLLM lists adapters with their parent
    return data


def adapters_of(ep: Any) -> list[str]:
    """The LoRA adapters a model serves (its workers' ``describe``)."""
    return list((getattr(ep, "info", None) or {}).get("adapters") or ())


class Answer:
    """Builds the OpenAI answer (whole or streamed chunks) of one parsed request."""

    def __init__(self, answer_id: str, kind: str, model: str, parsed: ParsedRequest, text: ModelText) -> None:
        self.id = answer_id
        self.kind = kind
        self.chat = kind == "chat.completion"
        self.model = model
        self.parsed = parsed
        self.text = text
        self.created = int(time.time())

    # --- whole answers ---
    def _kept(self, results: list[GenerationResult]) -> tuple[list[Choice], list[GenerationResult]]:
        """The choices the answer shows: all of them, or with best_of > n each prompt's n candidates of the highest
        cumulative log-probability, renumbered in that order (vLLM's best_of)."""
        keep = self.parsed.keep_best
        if keep is None:
            return self.parsed.choices, results
        by_prompt: dict[int, list[tuple[Choice, GenerationResult]]] = {}
        for choice, result in zip(self.parsed.choices, results, strict=True):
            by_prompt.setdefault(choice.prompt_index, []).append((choice, result))
        kept_choices, kept_results = [], []
        for p_index, candidates in sorted(by_prompt.items()):
            ranked = sorted(candidates, key=lambda cr: -sum(t.logprob or 0.0 for t in cr[1].tokens))
            for rank, (choice, result) in enumerate(ranked[:keep]):
                kept_choices.append(replace(choice, index=p_index * keep + rank))
                kept_results.append(result)
        return kept_choices, kept_results

    def whole(self, results: list[GenerationResult]) -> dict[str, Any]:
        choices = []
        shown, results = self._kept(results)
        for choice, result in zip(shown, results, strict=True):
            body, tokens = ("", []) if self.parsed.echo_only else (result.text, list(result.tokens))
            prompt = result.prompt_logprobs if self.parsed.echo else None
            if self.parsed.echo:
                body = choice.prompt_text + body
            entry: dict[str, Any] = {"index": choice.index, "logprobs": self._logprobs(tokens, prompt),
                                     "finish_reason": self._finish_reason(result.finish_reason)}
            if self.chat and self.parsed.reasoning is not None:
                thought, body = split_whole(body, self.parsed.reasoning)
                entry["message"] = {"role": "assistant", "content": body, "reasoning_content": thought}
            if self.chat and self.parsed.tools is not None:
                reader = ToolStream(self.parsed.tools)
                content, calls = fold(self.parsed.tools, reader.feed(body) + reader.finish())
                entry["message"] = {**entry.get("message", {}), "role": "assistant", "content": content,
                                    **({"tool_calls": calls} if calls else {})}
                entry["finish_reason"] = _finish(result.finish_reason.openai, reader)
            elif self.chat:
                entry["message"] = {**entry.get("message", {}), "role": "assistant", "content": body}
            else:
                entry["text"] = body
                if self.parsed.prompt_logprobs is not None:
                    entry["prompt_logprobs"] = self._prompt_logprobs(result.prompt_logprobs)
            choices.append(entry)
        usage = self._usage(results, shown)
        if self.parsed.reasoning is not None:
            usage["completion_tokens_details"] = {"reasoning_tokens": sum(
                reasoning_tokens(r.tokens, self.parsed.reasoning) for r in results)}
        answer = {"id": self.id, "object": self.kind, "created": self.created, "model": self.model,
                  "choices": choices, "usage": usage}
        if self.chat and self.parsed.prompt_logprobs is not None:  # vLLM: one prompt, on the answer
            answer["prompt_logprobs"] = self._prompt_logprobs(results[0].prompt_logprobs)
        return answer

    def _finish_reason(self, reason: FinishReason) -> str:
        return "length" if self.parsed.echo_only else reason.openai

    def _usage(self, results: list[Any], choices: list[Choice] | None = None) -> dict[str, Any]:
        prompt: dict[int, int] = {}
        completion = 0
        for choice, r in zip(choices or self.parsed.choices, results, strict=True):
            prompt[choice.prompt_index] = r.prompt_tokens
            completion += r.generated_tokens if isinstance(r, GenerationResult) else r.num_tokens
        if self.parsed.echo_only:
            completion = 0  # the one token generated is not part of the answer
        total_prompt = sum(prompt.values())
        return {"prompt_tokens": total_prompt, "completion_tokens": completion,
                "total_tokens": total_prompt + completion}

    def _logprobs(self, tokens: list[TokenInfo], prompt: tuple[TokenInfo, ...] | None = None) -> dict[str, Any] | None:
        if self.parsed.logprobs is None:
            return None
        if self.chat:
            return {"content": [self._chat_token(t) for t in tokens]}
        return self._completion_logprobs(tokens, 0, prompt)

    def _chat_token(self, t: TokenInfo) -> dict[str, Any]:
        def one(text: str, lp: float | None) -> dict[str, Any]:
            return {"token": text, "logprob": lp if lp is not None else 0.0, "bytes": list(text.encode("utf-8"))}
        entry = one(t.text, t.logprob)
        entry["top_logprobs"] = [one(self.text.token_text(i), lp) for i, lp in t.top_logprobs]
        return entry

    def _completion_logprobs(self, tokens: list[TokenInfo], offset: int,
                             prompt: tuple[TokenInfo, ...] | None = None) -> dict[str, Any]:
        """OpenAI's completion logprobs; with the echoed ``prompt``'s tokens first: its first token has no
        log-probability (null), each other one lists its alternatives plus itself (as vLLM)."""
        everything = list(prompt or ()) + tokens
        offsets = []
        for t in everything:
            offsets.append(offset)
            offset += len(t.text)
        top: list[dict[str, float] | None] = []
        for k, t in enumerate(prompt or ()):
            top.append(None if k == 0 else {**self._top(t), t.text: t.logprob or 0.0})
        top.extend(self._top(t) for t in tokens)
        return {"tokens": [t.text for t in everything], "token_logprobs": [t.logprob for t in everything],
                "top_logprobs": top, "text_offset": offsets}

    def _top(self, t: TokenInfo) -> dict[str, float]:
        return {self.text.token_text(i): lp for i, lp in t.top_logprobs}

    def _prompt_logprobs(self, prompt: tuple[TokenInfo, ...] | None) -> list[dict[str, Any] | None] | None:
        """vLLM's ``prompt_logprobs``: per prompt token null (the first) or {token id: {logprob, rank,
        decoded_token}} holding the k most likely tokens and the prompt's own (its rank null when not among them)."""
        if prompt is None:
            return None
        out: list[dict[str, Any] | None] = [None]
        for t in prompt[1:]:
            entry = {str(i): {"logprob": lp, "rank": r + 1, "decoded_token": self.text.token_text(i)}
                     for r, (i, lp) in enumerate(t.top_logprobs)}
            entry.setdefault(str(t.id), {"logprob": t.logprob, "rank": None, "decoded_token": t.text})
            out.append(entry)
        return out

    # --- streamed answers ---
    async def events(self, streams: list[ResultStream]) -> AsyncIterator[str]:
        """SSE frames: a first role chunk per choice (chat), content chunks, the finish chunk with
        ``timings``, the usage chunk when asked, ``[DONE]``. An error ends the stream with an error event."""
        choices = self.parsed.choices
        offsets = [0] * len(choices)
        plan = self.parsed.tools
        readers = [ToolStream(plan) for _ in choices] if plan is not None else None
        opened = self.parsed.reasoning
        thinking = [ReasoningSplitter(opened) for _ in choices] if opened is not None else None
        thought_tokens = 0
        try:
            if self.chat:
                for c in choices:
                    yield self._frame([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}])
            echoed = [not self.parsed.echo] * len(choices)
            async for k, delta in _merge(streams):
                if not echoed[k]:  # the prompt (with its scores, which come with the first delta), then the answer
                    echoed[k] = True
                    offsets[k] = len(choices[k].prompt_text)
                    yield self._frame([self._completion_choice(choices[k].index, choices[k].prompt_text, [], None, 0,
                                                               delta.prompt_logprobs or ())])
                if self.parsed.echo_only:
                    delta = replace(delta, tokens=(), text="")
                if thinking is not None:  # the reasoning goes out as reasoning_content, the rest as before
                    counted, pieces = thinking[k].count_feed(delta.text, len(delta.tokens))
                    thought_tokens += counted
                    pieces += thinking[k].finish() if delta.finish_reason is not None else []
                    thought = "".join(p for kind, p in pieces if kind == "reasoning")
                    if thought:
                        yield self._frame([{"index": choices[k].index, "delta": {"reasoning_content": thought},
                                            "logprobs": None, "finish_reason": None}])
                    delta = replace(delta, text="".join(p for kind, p in pieces if kind == "content"))
                if readers is not None:
                    for frame in self._tool_frames(k, delta, streams[k], readers[k]):
                        yield frame
                    continue
                frame = self._delta_frame(k, delta, streams[k], offsets)
                if frame is not None:
                    yield frame
            if self.parsed.include_usage:
                usage = self._usage(streams)
                if thinking is not None:
                    usage["completion_tokens_details"] = {"reasoning_tokens": thought_tokens}
                yield self._frame([], usage=usage)
            yield "data: [DONE]\n\n"
        except ServingError as exc:
            rid = self.parsed.choices[0].request.request_id  # the client's id (the stream's is the server's)
            err = {"error": exc.message, "error_type": exc.kind.value, "request_id": rid}
            yield f"data: {json.dumps(err)}\n\n"
        finally:
            for s in streams:
                if not s.done:
                    s.cancel()

    def _delta_frame(self, k: int, delta: TokenDelta, stream: ResultStream, offsets: list[int]) -> str | None:
        index = self.parsed.choices[k].index
        finish = self._finish_reason(delta.finish_reason) if delta.finish_reason is not None else None
        if not delta.text and finish is None and (self.parsed.logprobs is None or not delta.tokens):
            return None
        tokens = list(delta.tokens)
        if self.chat:
            lp = {"content": [self._chat_token(t) for t in tokens]} if self.parsed.logprobs is not None else None
            choice = {"index": index, "delta": {"content": delta.text} if delta.text or finish is None else {},
                      "logprobs": lp, "finish_reason": finish}
        else:
            choice = self._completion_choice(index, delta.text, tokens, finish, offsets[k])
        offsets[k] += len(delta.text)
        extra = {"timings": timings_json(stream.timings())} if finish is not None else {}
        return self._frame([choice], **extra)

    def _tool_frames(self, k: int, delta: TokenDelta, stream: ResultStream, reader: ToolStream) -> list[str]:
        """A chat-with-tools delta: the tool reader's deltas, each a frame; the finish frame after them."""
        index = self.parsed.choices[k].index
        parts = reader.feed(delta.text)
        if delta.finish_reason is not None:
            parts += reader.finish()
        frames = [self._frame([{"index": index, "delta": part, "logprobs": None, "finish_reason": None}])
                  for part in parts]
        if delta.finish_reason is not None:
            finish = _finish(delta.finish_reason.openai, reader)
            frames.append(self._frame([{"index": index, "delta": {}, "logprobs": None, "finish_reason": finish}],
                                      timings=timings_json(stream.timings())))
        return frames

    def _completion_choice(self, index: int, text: str, tokens: list[TokenInfo], finish: str | None,
                           offset: int, prompt: tuple[TokenInfo, ...] = ()) -> dict[str, Any]:
        lp = self._completion_logprobs(tokens, offset, prompt) if self.parsed.logprobs is not None else None
        return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}

    def _frame(self, choices: list[dict[str, Any]], **extra: Any) -> str:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        obj = {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices,
               **extra}
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _finish(reason: str, reader: ToolStream) -> str:
    """``tool_calls`` when the answer made calls and was not cut short (OpenAI's reasons)."""
    return "tool_calls" if reason == "stop" and reader.finish_as_tool_calls else reason


async def _merge(streams: list[ResultStream]) -> AsyncIterator[tuple[int, TokenDelta]]:
    """Deltas of several streams as they come, tagged with the stream's position."""
    if len(streams) == 1:
        async for delta in streams[0]:
            yield 0, delta
        return
    queue: asyncio.Queue[tuple[int, TokenDelta | BaseException | None]] = asyncio.Queue()

    async def pump(k: int, stream: ResultStream) -> None:
        try:
            async for delta in stream:
                queue.put_nowait((k, delta))
        except BaseException as exc:  # noqa: BLE001 - re-raised on the consumer side
            queue.put_nowait((k, exc))
            return
        queue.put_nowait((k, None))

    tasks = [asyncio.ensure_future(pump(k, s)) for k, s in enumerate(streams)]
    remaining = len(streams)
    try:
        while remaining:
            k, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield k, item
    finally:
        for t in tasks:
            t.cancel()

