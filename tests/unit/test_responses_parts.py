"""The Responses API's parts in process: the store's bounds and namespaces, the output builder's items and events
(validated with the ``openai`` SDK's own types, reasoning included: SmolLM2 does not think, so the integration
tests cannot show it), and the translation's field names. The routes themselves: tests/integration/
test_responses_api.py."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from rollcore.errors import InvalidRequest, WorkerFailed
from rollcore.types import TokenDelta, TokenInfo
from serving.batching.streams import ResultStream
from serving.frontends.http import tools
from serving.frontends.http.openai_schema import ParsedRequest
from serving.frontends.http.responses import Job, new_response
from serving.frontends.http.responses_output import AnswerReader, OutputBuilder, output_text
from serving.frontends.http.responses_schema import (
    RESPONSES,
    chat_body,
    chat_messages,
    input_items,
    responses_message,
    responses_param,
)
from serving.frontends.http.responses_store import ResponseStore, Stored, namespace
from serving.requests.params import Limits

EVENTS: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def stored(rid: str) -> Stored:
    return Stored({"id": rid, "status": "completed", "output": []}, [])


def test_store_keeps_at_most_max_entries_oldest_dropped_first() -> None:
    store = ResponseStore(max_entries=2, ttl_s=60)
    for rid in ("a", "b", "c"):
        store.put("", stored(rid))
    assert store.get("", "a") is None and store.get("", "b") is not None and len(store) == 2
    store.put("", stored("b"))  # rewritten: now the newest
    store.put("", stored("d"))
    assert store.get("", "c") is None and store.get("", "b") is not None


def test_store_forgets_after_the_ttl() -> None:
    clock = Clock()
    store = ResponseStore(max_entries=10, ttl_s=60, clock=clock)
    store.put("", stored("a"))
    clock.now = 30
    store.put("", stored("b"))
    clock.now = 61
    assert store.get("", "a") is None and store.get("", "b") is not None
    clock.now = 91
    assert len(store) == 0


def test_store_namespaces_are_apart() -> None:
    store = ResponseStore()
    one, other = namespace("Bearer token-one", True), namespace("Bearer token-two", True)
    assert one != other and namespace("Bearer token-one", False) == namespace(None, False) == ""
    store.put(one, stored("a"))
    assert store.get(other, "a") is None and store.delete(other, "a") is None and store.get(one, "a") is not None
    with pytest.raises(ValueError):
        ResponseStore(max_entries=0)


def build(reader: AnswerReader, pieces: list[str], status: str = "completed") -> tuple[list[Any], list[Any], int]:
    """Feed ``pieces`` as one answer: (validated events, output items, reasoning tokens)."""
    events: list[dict[str, Any]] = []
    builder = OutputBuilder(events.append)
    counted = 0
    for piece in pieces:
        n, deltas = reader.feed(piece, 1)
        counted += n
        for d in deltas:
            builder.feed(d)
    for d in reader.finish():
        builder.feed(d)
    items = builder.finish(status)
    checked = [EVENTS.validate_python({**e, "sequence_number": i}) for i, e in enumerate(events)]
    return checked, items, counted


def response_with(items: list[dict[str, Any]]) -> Response:
    return Response.model_validate({"id": "resp_x", "object": "response", "created_at": 0, "model": "m",
                                    "output": items, "parallel_tool_calls": True, "tool_choice": "auto",
                                    "tools": [], "status": "completed"})


def test_reasoning_then_text_are_two_items() -> None:
    events, items, counted = build(AnswerReader(None, opened=False),
                                   ["<think>", "Two and", " two.", "</think>", "\n\n", "Four", "."])
    assert [i["type"] for i in items] == ["reasoning", "message"]
    assert items[0]["content"] == [{"type": "reasoning_text", "text": "Two and two."}]
    assert output_text(items) == "Four." and counted == 4
    assert [e.type for e in events] == [
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done"]
    assert [e.output_index for e in events if hasattr(e, "output_index")][-1] == 1
    assert response_with(items).output_text == "Four."


def test_no_reasoning_without_a_thinking_model() -> None:
    _, items, counted = build(AnswerReader(None), ["<think>x</think>", "y"])
    assert [i["type"] for i in items] == ["message"] and output_text(items) == "<think>x</think>y" and counted == 0


def test_required_calls_become_function_call_items() -> None:
    plan = tools.plan([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
                      "required", None, {})
    events, items, _ = build(AnswerReader(plan), ['[{"name": "f", ', '"arguments": {"a": ', '1}}', ', {"name": "f", '
                                                  '"arguments": {}}]'])
    assert [(i["type"], i["name"], i["arguments"], i["status"]) for i in items] == [
        ("function_call", "f", '{"a": 1}', "completed"), ("function_call", "f", "{}", "completed")]
    assert items[0]["call_id"] != items[1]["call_id"]
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [e.arguments for e in done] == ['{"a": 1}', "{}"]
    response_with(items)


def test_an_empty_answer_is_an_empty_message_and_a_cut_one_incomplete() -> None:
    events, items, _ = build(AnswerReader(None), [], status="incomplete")
    assert [(i["type"], i["status"]) for i in items] == [("message", "incomplete")] and output_text(items) == ""
    assert events[-1].type == "response.output_item.done"


def test_items_translate_to_chat_messages() -> None:
    req = RESPONSES.validate({"input": [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "w", "arguments": "{}", "id": "fc_1"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"}],
        "max_output_tokens": 5, "text": {"format": {"type": "json_object"}}}, Limits())
    messages = chat_messages("Sys.", input_items(req))
    assert messages == [
        {"role": "system", "content": "Sys."}, {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny", "name": "w"}]
    body = chat_body(req, "m", messages)
    assert body["max_completion_tokens"] == 5 and body["response_format"] == {"type": "json_object"}


@pytest.mark.parametrize(("body", "param"), [
    ({"input": 1}, "input"),
    ({"input": "x", "colour": 1}, "colour"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "nam": "x"}}}, "text.format.nam"),
    ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input[0].output"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
])
def test_refusals_name_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        input_items(RESPONSES.validate(body, Limits()))
    assert responses_param(err.value.message) == param, err.value.message


def test_chat_field_names_become_this_apis() -> None:
    assert responses_message("'max_completion_tokens' must be >= 1") == "'max_output_tokens' must be >= 1"
    assert responses_message("'response_format.json_schema.schema' cannot be used") == (
        "'text.format.schema' cannot be used")
    assert responses_message("'tools[0].function.name' must be") == "'tools[0].name' must be"
    assert responses_message("'messages[2].content' is too long") == "'input' is too long"


# --- a Job over a real ResultStream: how a stream ends -------------------------------------------------------
def run_job(feed: Any, store: ResponseStore | None = None) -> tuple[Any, list[Any]]:
    """A Job over a ResultStream that ``feed(stream, job)`` drives after the first two events; (the job, its
    validated events)."""
    async def main() -> tuple[Any, list[Any]]:
        stream = ResultStream("r")
        req = RESPONSES.validate({"input": "Hi"}, Limits())
        job = Job(new_response(req, "m"), ParsedRequest([], True, False, None, False), stream, store, "", [])
        events = []
        async for event in job.events():
            events.append(EVENTS.validate_python(event))
            if len(events) == 2:
                feed(stream, job)
        return job, events

    return asyncio.run(main())


def test_an_error_mid_stream_ends_with_an_error_event() -> None:
    def feed(stream: Any, job: Any) -> None:
        stream.push(TokenDelta("r", (TokenInfo(1, "Hel"),), "Hel", prompt_tokens=3))
        stream.fail(WorkerFailed("the worker died"))

    store = ResponseStore()
    job, events = run_job(feed, store)
    assert [e.type for e in events][2:] == ["response.output_item.added", "response.content_part.added",
                                            "response.output_text.delta", "response.output_text.done",
                                            "response.content_part.done", "response.output_item.done", "error"]
    assert events[-2].item.status == "incomplete"  # the item ends as cut, then the error
    assert events[-1].message == "the worker died" and events[-1].sequence_number == len(events) - 1
    kept = store.get("", job.response["id"])
    assert kept is not None and kept.response["status"] == "failed" and not kept.in_progress
    Response.model_validate(kept.response)


def test_a_cancelled_stream_ends_incomplete_with_status_cancelled() -> None:
    def feed(stream: Any, job: Any) -> None:
        stream.push(TokenDelta("r", (TokenInfo(1, "Hel"),), "Hel", prompt_tokens=3))
        job.cancel()

    job, events = run_job(feed)
    assert events[-1].type == "response.incomplete" and events[-1].response.status == "cancelled"
    assert events[-1].response.output_text == "Hel" and events[-1].response.usage.output_tokens == 1
