"""The Messages API's block reader in process: events by kind (text, tool_use, thinking) validate as the
``anthropic`` SDK's stream events, their fold as its ``Message`` content; stop strings are cut and named; field
paths are written as Anthropic writes them. (The route end to end: tests/integration/test_messages_api.py.)"""

from __future__ import annotations

from typing import Any

import pytest
from anthropic.types import Message, RawMessageStreamEvent
from pydantic import TypeAdapter

from rollcore.types import FinishReason
from serving.frontends.http.anthropic_blocks import AnswerReader, Blocks, NoReasoning, cut_stop, fold, tool_input
from serving.frontends.http.anthropic_schema import dotted
from serving.frontends.http.tools import plan

EVENTS: TypeAdapter[Any] = TypeAdapter(RawMessageStreamEvent)
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def as_message(content: list[dict[str, Any]]) -> Message:
    return Message.model_validate({"id": "msg_1", "type": "message", "role": "assistant", "model": "m",
                                   "content": content, "stop_reason": "end_turn", "stop_sequence": None,
                                   "usage": {"input_tokens": 1, "output_tokens": 1}})


def test_blocks_by_kind_are_the_sdks_events_and_fold_into_its_content() -> None:
    blocks = Blocks()
    events = [*blocks.thinking("Let me "), *blocks.thinking("think."), *blocks.text("Hello"), *blocks.text(" there"),
              *blocks.tool_part({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                                 "function": {"name": "get_weather", "arguments": ""}}]}),
              *blocks.tool_part({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}),
              *blocks.tool_part({"tool_calls": [{"index": 0, "function": {"arguments": '"Oslo"}'}}]}),
              *blocks.close()]
    for e in events:
        EVENTS.validate_python(e)
    assert [(e["type"], e["index"]) for e in events] == [
        ("content_block_start", 0), ("content_block_delta", 0), ("content_block_delta", 0),
        ("content_block_stop", 0), ("content_block_start", 1), ("content_block_delta", 1),
        ("content_block_delta", 1), ("content_block_stop", 1), ("content_block_start", 2),
        ("content_block_delta", 2), ("content_block_delta", 2), ("content_block_stop", 2)]
    content = fold(events)
    assert content[0] == {"type": "thinking", "thinking": "Let me think.", "signature": ""}
    assert content[1] == {"type": "text", "text": "Hello there"}
    assert content[2]["type"] == "tool_use" and content[2]["id"].startswith("toolu_")
    assert (content[2]["name"], content[2]["input"]) == ("get_weather", {"city": "Oslo"})
    assert blocks.tool_uses == 1
    as_message(content)


def test_the_reader_finds_forced_calls_in_the_answer_text() -> None:
    tools = plan([WEATHER], "required", None, {})
    reader = AnswerReader(tools, NoReasoning())
    text = '[{"name": "get_weather", "arguments": {"city": "Rome"}}]'
    events = [e for k in range(0, len(text), 7) for e in reader.feed(text[k:k + 7])] + reader.feed("", last=True)
    assert [b["type"] for b in fold(events)] == ["tool_use"] and fold(events)[0]["input"] == {"city": "Rome"}
    assert reader.finished and reader.blocks.tool_uses == 1


def test_an_answer_without_text_has_no_blocks() -> None:
    reader = AnswerReader(None, NoReasoning())
    assert reader.feed("", last=True) == [] and as_message(fold([])).content == []


@pytest.mark.parametrize(("text", "finish", "stops", "expected"), [
    ("Paris is nice", FinishReason.STOP, ("nice", "ice"), ("Paris is ", "nice")),
    ("Paris is nice", FinishReason.STOP, ("zz",), ("Paris is nice", None)),
    ("Paris is nice", FinishReason.EOS, ("nice",), ("Paris is nice", None)),
    ("Paris is nice", FinishReason.LENGTH, ("nice",), ("Paris is nice", None)),
])
def test_the_stop_string_is_cut_and_named(text: str, finish: FinishReason, stops: tuple[str, ...],
                                          expected: tuple[str, str | None]) -> None:
    assert cut_stop(text, finish, stops) == expected


def test_cut_arguments_are_read_as_far_as_they_go() -> None:
    assert tool_input('{"city": "Oslo", "unit": "cel') == {"city": "Oslo"}
    assert tool_input("[1, 2]") == {} and tool_input("") == {}


def test_field_paths_are_written_as_anthropic_writes_them() -> None:
    assert dotted("'messages[1].content[0].type' must be one of 'text' or 'image', got 'a[1]'") == \
        "'messages.1.content.0.type' must be one of 'text' or 'image', got 'a[1]'"
    assert dotted("unknown fields in 'tools[2]': colour") == "unknown fields in 'tools.2': colour"
