"""OpenAI answers of one parsed request: the whole ``chat.completion`` / ``text_completion`` object, or its SSE chunks.

Design note: one builder for both shapes (the streamed chunks and the whole answer read the model's text the same
way: reasoning split first, then tool calls), so a streamed greedy answer always equals the whole one. The last
chunk of each choice carries ``timings``; ``best_of`` keeps each prompt's best candidates (vLLM's rule).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from rollcore.errors import ServingError
from rollcore.types import FinishReason, GenerationResult, TokenDelta, TokenInfo
from serving.batching.streams import ResultStream
from serving.frontends.http.httpio import timings_json
from serving.frontends.http.openai_schema import Choice, ParsedRequest
from serving.frontends.http.reasoning import ReasoningSplitter, reasoning_tokens, split_whole
from serving.frontends.http.tools import ToolStream, fold
from serving.models.model_text import ModelText


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
            if self.chat:
                entry["message"], reader = self._message(body)
                if reader is not None:
                    entry["finish_reason"] = _finish(result.finish_reason.openai, reader)
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

    def _message(self, body: str) -> tuple[dict[str, Any], ToolStream | None]:
        """A whole chat answer's message: the reasoning split off first, then the tool calls read from the rest
        (with the reader that read them, for the finish reason)."""
        thought = None
        if self.parsed.reasoning is not None:
            thought, body = split_whole(body, self.parsed.reasoning)
        message: dict[str, Any] = {"role": "assistant", "content": body}
        reader = None
        if self.parsed.tools is not None:
            reader = ToolStream(self.parsed.tools)
            message["content"], calls = fold(self.parsed.tools, reader.feed(body) + reader.finish())
            if calls:
                message["tool_calls"] = calls
        if self.parsed.reasoning is not None:
            message["reasoning_content"] = thought
        return message, reader

    def _finish_reason(self, reason: FinishReason) -> str:
        return "length" if self.parsed.echo_only else reason.openai

    def _usage(self, results: list[Any], choices: list[Choice] | None = None) -> dict[str, Any]:
        prompt: dict[int, int] = {}
        cached: dict[int, int] = {}  # per prompt: its tokens the prefix cache served (OpenAI's cached_tokens)
        completion = 0
        for choice, r in zip(choices or self.parsed.choices, results, strict=True):
            prompt[choice.prompt_index] = r.prompt_tokens
            cached[choice.prompt_index] = r.cached_tokens
            completion += r.generated_tokens if isinstance(r, GenerationResult) else r.num_tokens
        if self.parsed.echo_only:
            completion = 0  # the one token generated is not part of the answer
        total_prompt = sum(prompt.values())
        return {"prompt_tokens": total_prompt, "completion_tokens": completion,
                "total_tokens": total_prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(cached.values())}}

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

