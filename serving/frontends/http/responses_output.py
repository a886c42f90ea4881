"""Responses API answers: the model's text -> output items (message / function_call / reasoning) and stream events.

Design note: one builder (``OutputBuilder``) serves both shapes. The model's text goes through ``AnswerReader``
(the chat route's ``ToolStream`` for a request with tools, plain content otherwise, and the reasoning hook),
which yields chat-style deltas by kind: ``{"content"}``, ``{"reasoning"}``, ``{"tool_calls": [...]}``. The
builder turns each kind into its output item and records the stream events OpenAI sends for it
(``output_item.added``, ``content_part.added``, ``output_text.delta`` ... ``output_item.done``; function calls:
``function_call_arguments.delta``/``.done``; reasoning: ``reasoning_text.delta``/``.done``). A whole answer is
the same deltas folded by the same builder, its events dropped, so streamed and whole answers always agree.

Reasoning: for a thinking model (``ParsedRequest.reasoning`` not None) the text goes through the chat path's
``ReasoningSplitter`` first, as the chat route's ``reasoning_content`` does; its reasoning pieces become a
``reasoning`` item (``reasoning_text`` content), the rest goes on to the tool reader, and the tokens the
splitter counts as reasoning are the answer's ``reasoning_tokens``.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from serving.frontends.http.reasoning import ReasoningSplitter
from serving.frontends.http.tools import ToolPlan, ToolStream

Delta = dict[str, Any]


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class AnswerReader:
    """The model's text, as it arrives, -> chat-style deltas by kind (see the module note). ``opened``: the
    request's ``ParsedRequest.reasoning`` (None: the model does not think)."""

    def __init__(self, plan: ToolPlan | None, opened: bool | None = None) -> None:
        self.tools = ToolStream(plan) if plan is not None else None
        self.thinking = ReasoningSplitter(opened) if opened is not None else None

    def feed(self, text: str, tokens: int = 0) -> tuple[int, list[Delta]]:
        """The deltas ``text`` (``tokens`` tokens) releases, and how many of its tokens were reasoning."""
        if self.thinking is None:
            return 0, self._route([("content", text)])
        counted, pieces = self.thinking.count_feed(text, tokens)
        return counted, self._route(pieces)

    def finish(self) -> list[Delta]:
        out = self._route(self.thinking.finish()) if self.thinking is not None else []
        return out + (self.tools.finish() if self.tools is not None else [])

    def _route(self, pieces: list[tuple[str, str]]) -> list[Delta]:
        out: list[Delta] = []
        for kind, piece in pieces:
            if not piece:
                continue
            if kind == "reasoning":
                out.append({"reasoning": piece})
            elif self.tools is not None:
                out.extend(self.tools.feed(piece))
            else:
                out.append({"content": piece})
        return out


class OutputBuilder:
    """Output items built from deltas; ``emit(event)`` receives each stream event (no ``sequence_number``:
    the caller numbers them)."""

    def __init__(self, emit: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.items: list[dict[str, Any]] = []
        self._emit = emit
        self._open: dict[str, Any] | None = None  # the item deltas are going to
        self._calls: dict[int, dict[str, Any]] = {}  # tool reader's call index -> its item

    def _event(self, kind: str, **fields: Any) -> None:
        if self._emit is not None:
            self._emit({"type": kind, **fields})

    # --- feeding ---
    def feed(self, delta: Delta) -> None:
        if delta.get("reasoning"):
            self._text("reasoning", delta["reasoning"])
        if delta.get("content"):
            self._text("message", delta["content"])
        for part in delta.get("tool_calls", ()):
            self._tool_part(part)

    def _text(self, kind: str, text: str) -> None:
        item = self._open
        if item is None or item["type"] != kind:
            item = self._start_text(kind)
        part = item["content"][0]
        part["text"] += text
        where = {"item_id": item["id"], "output_index": self.items.index(item), "content_index": 0}
        if kind == "message":
            self._event("response.output_text.delta", **where, delta=text, logprobs=[])
        else:
            self._event("response.reasoning_text.delta", **where, delta=text)

    def _start_text(self, kind: str) -> dict[str, Any]:
        self.close_open("completed")
        if kind == "message":
            item: dict[str, Any] = {"id": new_id("msg"), "type": "message", "role": "assistant",
                                    "status": "in_progress", "content": []}
            part: dict[str, Any] = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {"id": new_id("rs"), "type": "reasoning", "summary": [], "status": "in_progress", "content": []}
            part = {"type": "reasoning_text", "text": ""}
        self._add(item)
        item["content"].append(part)
        self._event("response.content_part.added", item_id=item["id"], output_index=len(self.items) - 1,
                    content_index=0, part=dict(part))
        return item

    def _tool_part(self, part: dict[str, Any]) -> None:
        if "id" in part:  # a call's head: a new function_call item
            self.close_open("completed")
            item = {"id": new_id("fc"), "type": "function_call", "status": "in_progress", "call_id": part["id"],
                    "name": part["function"]["name"], "arguments": ""}
            self._add(item)
            self._calls[part["index"]] = item
        item = self._calls[part["index"]]
        piece = part["function"].get("arguments", "")
        if piece:
            item["arguments"] += piece
            self._event("response.function_call_arguments.delta", item_id=item["id"],
                        output_index=self.items.index(item), delta=piece)

    def _add(self, item: dict[str, Any]) -> None:
        self.items.append(item)
        self._open = item
        snapshot = {**item, "content": []} if "content" in item else dict(item)
        self._event("response.output_item.added", output_index=len(self.items) - 1, item=snapshot)

    # --- ending ---
    def close_open(self, status: str) -> None:
        """End the item deltas were going to with ``status`` (completed, or incomplete when cut short)."""
        item, self._open = self._open, None
        if item is None:
            return
        index = self.items.index(item)
        where = {"item_id": item["id"], "output_index": index}
        if item["type"] == "function_call":
            self._event("response.function_call_arguments.done", **where, name=item["name"],
                        arguments=item["arguments"])
        else:
            part = item["content"][0]
            if item["type"] == "message":
                self._event("response.output_text.done", **where, content_index=0, text=part["text"], logprobs=[])
            else:
                self._event("response.reasoning_text.done", **where, content_index=0, text=part["text"])
            self._event("response.content_part.done", **where, content_index=0, part=dict(part))
        item["status"] = status
        self._event("response.output_item.done", output_index=index, item=item)

    def finish(self, status: str) -> list[dict[str, Any]]:
        """The output items once the answer ended: the last one closed with ``status``; an answer with no
        item at all gets an empty message (what OpenAI answers for an empty text)."""
        if not self.items:
            self._start_text("message")
        self.close_open(status)
        return self.items


def output_text(items: list[dict[str, Any]]) -> str:
    """The text of the answer's messages (what the SDK's ``output_text`` gives)."""
    return "".join(p["text"] for i in items if i["type"] == "message" for p in i["content"])
