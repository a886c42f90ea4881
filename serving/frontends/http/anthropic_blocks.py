"""Anthropic content blocks from the chat pipeline's answer text: one reader for streamed and whole answers.

Design note: ``AnswerReader`` takes the model's text as it arrives and returns Anthropic stream events
(``content_block_start`` / ``content_block_delta`` / ``content_block_stop``). The text goes through the
reasoning hook first (``reasoning_splitter``: thinking vs answer text), then, with tools, through the chat route's
``ToolStream`` (``serving.frontends.http.tools``), whose deltas become blocks by kind: text -> ``text`` blocks
(``text_delta``), a call -> a ``tool_use`` block (``id`` "toolu_...", ``input_json_delta`` fragments), reasoning
-> ``thinking`` blocks (``thinking_delta``; ``signature`` is always "" since the server never reads thinking
back). A whole answer is the same events folded (``fold``), so streamed and whole answers always agree.

Reasoning: for a thinking model (``option.reasoning_parser``), ``reasoning_splitter`` is the chat pipeline's
``<think>`` splitter; its pieces of kind ``reasoning`` become thinking blocks.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from typing import Any, Protocol

import pydantic_core

from rollcore.types import FinishReason
from serving.frontends.http.reasoning import ReasoningSplitter
from serving.frontends.http.tools import ToolPlan, ToolStream

SIGNATURE = ""  # a thinking block's signature: nothing to verify (thinking is left out of later prompts)
Event = dict[str, Any]


class ReasoningSplit(Protocol):
    """Splits an answer's text, as it arrives, into ``("reasoning" | "content", piece)`` (``ReasoningSplitter``'s
    kinds)."""

    def feed(self, text: str) -> list[tuple[str, str]]: ...
    def finish(self) -> list[tuple[str, str]]: ...


class NoReasoning:
    """Every piece is answer text (a model without a reasoning parser)."""

    def feed(self, text: str) -> list[tuple[str, str]]:
        return [("content", text)] if text else []

    def finish(self) -> list[tuple[str, str]]:
        return []


def reasoning_splitter(opened: bool | None) -> ReasoningSplit:
    """The model's splitter: ``opened`` is the parsed chat request's ``reasoning`` (None: the model does not
    think)."""
    return NoReasoning() if opened is None else ReasoningSplitter(opened)


def new_tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


class Blocks:
    """Content-block events, each block by its kind; a new kind closes the open block."""

    def __init__(self) -> None:
        self.started = 0
        self.tool_uses = 0
        self._open: str | None = None

    def text(self, piece: str) -> list[Event]:
        if not piece:
            return []
        out = [] if self._open == "text" else self._start({"type": "text", "text": ""})
        return [*out, self._delta({"type": "text_delta", "text": piece})]

    def thinking(self, piece: str) -> list[Event]:
        if not piece:
            return []
        out = [] if self._open == "thinking" else self._start({"type": "thinking", "thinking": "",
                                                               "signature": SIGNATURE})
        return [*out, self._delta({"type": "thinking_delta", "thinking": piece})]

    def tool_part(self, part: Mapping[str, Any]) -> list[Event]:
        """One ``ToolStream`` delta: content, or a call's head (a new tool_use block) or arguments."""
        out = self.text(part.get("content") or "")
        for call in part.get("tool_calls", ()):
            if "id" in call:
                self.tool_uses += 1
                out += self._start({"type": "tool_use", "id": new_tool_use_id(), "name": call["function"]["name"],
                                    "input": {}})
            arguments = call["function"].get("arguments")
            if arguments:
                out.append(self._delta({"type": "input_json_delta", "partial_json": arguments}))
        return out

    def close(self) -> list[Event]:
        if self._open is None:
            return []
        self._open = None
        return [{"type": "content_block_stop", "index": self.started - 1}]

    def _start(self, block: dict[str, Any]) -> list[Event]:
        out = self.close()
        self._open = block["type"]
        self.started += 1
        return [*out, {"type": "content_block_start", "index": self.started - 1, "content_block": block}]

    def _delta(self, delta: dict[str, Any]) -> Event:
        return {"type": "content_block_delta", "index": self.started - 1, "delta": delta}


class AnswerReader:
    """The model's text, as it arrives, -> content-block events: reasoning split first, then tool calls."""

    def __init__(self, plan: ToolPlan | None, splitter: ReasoningSplit) -> None:
        self.blocks = Blocks()
        self.tools = ToolStream(plan) if plan is not None else None
        self.split = splitter
        self.finished = False

    def feed(self, text: str, last: bool = False) -> list[Event]:
        """Events for ``text``; ``last``: the answer ends here (held text is released, the open block closed)."""
        out: list[Event] = []
        pieces = self.split.feed(text) + (self.split.finish() if last else [])
        for kind, piece in pieces:
            out += self.blocks.thinking(piece) if kind == "reasoning" else self._answer(piece)
        if last:
            self.finished = True
            if self.tools is not None:
                for part in self.tools.finish():
                    out += self.blocks.tool_part(part)
            out += self.blocks.close()
        return out

    def _answer(self, piece: str) -> list[Event]:
        if self.tools is None:
            return self.blocks.text(piece)
        out: list[Event] = []
        for part in self.tools.feed(piece):
            out += self.blocks.tool_part(part)
        return out


def fold(events: list[Event]) -> list[dict[str, Any]]:
    """Block events -> the whole answer's ``content`` (a tool_use's ``input`` parsed from its fragments)."""
    content: list[dict[str, Any]] = []
    inputs: dict[int, str] = {}
    for e in events:
        if e["type"] == "content_block_start":
            content.append(dict(e["content_block"]))
        elif e["type"] == "content_block_delta":
            block, delta = content[e["index"]], e["delta"]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] += delta["thinking"]
            elif delta["type"] == "input_json_delta":
                inputs[e["index"]] = inputs.get(e["index"], "") + delta["partial_json"]
    for index, text in inputs.items():
        content[index]["input"] = tool_input(text)
    return content


def tool_input(text: str) -> dict[str, Any]:
    """A call's arguments as an object; arguments cut short by max_tokens are read as far as they go (as the
    ``anthropic`` SDK reads a stream's partial JSON), anything else is an empty object."""
    try:
        value = json.loads(text)
    except ValueError:
        try:
            value = pydantic_core.from_json(text, allow_partial=True)
        except ValueError:
            value = None
    return value if isinstance(value, dict) else {}


def cut_stop(text: str, finish: FinishReason | None, stops: tuple[str, ...]) -> tuple[str, str | None]:
    """The answer ends with the stop string that ended it (asked with include_stop_str_in_output): the text
    without it, and which one it was."""
    if finish is not FinishReason.STOP:
        return text, None
    hits = [s for s in stops if s and text.endswith(s)]
    if not hits:
        return text, None
    stop = max(hits, key=len)  # the earliest to begin (the engine ends at the earliest match)
    return text[:len(text) - len(stop)], stop


def stop_reason(finish: FinishReason | None, stop: str | None, tool_uses: int) -> str:
    """Anthropic's ``stop_reason``: cut short, a tool call, a stop sequence, or the model's own end."""
    if finish is FinishReason.LENGTH:
        return "max_tokens"
    if tool_uses:
        return "tool_use"
    return "stop_sequence" if stop is not None else "end_turn"
