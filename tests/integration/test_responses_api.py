"""OpenAI's Responses API (``/v1/responses``) on the real SmolLM2, through the real ``openai`` SDK and the OpenAI
Agents SDK. Every answer is validated with the SDK's own ``Response`` type and every streamed event with its
``ResponseStreamEvent`` union; greedy answers are compared with the chat route's for the same messages."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel, Field, TypeAdapter

from tests.integration.harness import ServerProcess

MODEL = "smollm2"
EVENTS: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                          "required": ["city"], "additionalProperties": False}}
TIME = {"type": "function", "name": "get_time", "description": "The local time of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                       "required": ["city"], "additionalProperties": False}}
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def client(smollm2_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=smollm2_server.url + "/v1", api_key="none", max_retries=0, timeout=300)


def create(client: openai.OpenAI, **kwargs: Any) -> Response:
    """``responses.create`` whose raw JSON is validated with the SDK's ``Response`` type."""
    raw = client.responses.with_raw_response.create(model=MODEL, **kwargs)
    assert raw.status_code == 200
    return Response.model_validate(raw.http_response.json())


def events_of(client: openai.OpenAI, **kwargs: Any) -> list[Any]:
    """A streamed response's events, each validated with the SDK's event union."""
    out = []
    with client.responses.create(model=MODEL, stream=True, **kwargs) as stream:
        for event in stream:
            out.append(EVENTS.validate_python(event.model_dump()))
    return out


def test_create_plain(client: openai.OpenAI) -> None:
    r = create(client, input=QUESTION, max_output_tokens=48, temperature=0)
    assert r.object == "response" and r.status == "completed" and r.incomplete_details is None
    assert r.id.startswith("resp_") and r.model == MODEL
    [message] = r.output
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    assert [p.type for p in message.content] == ["output_text"]
    assert "Paris" in r.output_text
    assert r.usage is not None and r.usage.input_tokens > 0 and 0 < r.usage.output_tokens < 48
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0


def test_cut_by_max_output_tokens_is_incomplete(client: openai.OpenAI) -> None:
    r = create(client, input="Write a long story about a dragon.", max_output_tokens=3, temperature=0)
    assert r.status == "incomplete"
    assert r.incomplete_details is not None and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage is not None and r.usage.output_tokens == 3
    assert r.output[0].status == "incomplete"
    events = events_of(client, input="Write a long story about a dragon.", max_output_tokens=3, temperature=0)
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.output_text == r.output_text


def test_stream_events_in_order(client: openai.OpenAI) -> None:
    events = events_of(client, input=QUESTION, max_output_tokens=48, temperature=0)
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 2
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * deltas,
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    item_id = events[2].item.id
    assert all(e.item_id == item_id and e.output_index == 0 and e.content_index == 0 for e in events[3:-2])
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert events[-4].text == text and final.output_text == text and final.status == "completed"
    assert final.output[0].id == item_id
    whole = create(client, input=QUESTION, max_output_tokens=48, temperature=0)  # greedy: the same answer
    assert whole.output_text == text and whole.usage is not None and final.usage is not None
    # the same counts, but the second call's prompt is (partly) read from the prefix cache
    drop = {"input_tokens_details"}
    assert whole.usage.model_dump(exclude=drop) == final.usage.model_dump(exclude=drop)
    assert whole.usage.input_tokens_details.cached_tokens >= final.usage.input_tokens_details.cached_tokens


def test_required_tool_call(client: openai.OpenAI) -> None:
    r = create(client, input="What is the weather in Oslo?", tools=[WEATHER], tool_choice="required",
               max_output_tokens=64, temperature=0)
    assert r.status == "completed" and r.tool_choice == "required"
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and all(c.name == "get_weather" and c.call_id.startswith("call_") for c in calls)
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    events = events_of(client, input="What is the weather in Oslo?", tools=[WEATHER], tool_choice="required",
                       max_output_tokens=64, temperature=0)
    kinds = [e.type for e in events]
    n = kinds.count("response.function_call_arguments.delta")
    assert n >= 1 and len(calls) == 1
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     *["response.function_call_arguments.delta"] * n, "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    assert events[2].item.type == "function_call" and events[2].item.arguments == ""
    streamed = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert streamed == events[-3].arguments == calls[0].arguments
    assert events[-3].name == "get_weather" and events[-2].item.arguments == streamed


def test_named_function(client: openai.OpenAI) -> None:
    r = create(client, input="What time is it in Tokyo?", tools=[WEATHER, TIME],
               tool_choice={"type": "function", "name": "get_time"}, max_output_tokens=64, temperature=0)
    [call] = r.output
    assert call.type == "function_call" and call.name == "get_time" and r.status == "completed"
    jsonschema.validate(json.loads(call.arguments), TIME["parameters"])


def test_json_schema_format(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "country": {"type": "string", "maxLength": 20}},
              "required": ["city", "country"], "additionalProperties": False}
    r = create(client, input="Name a city and its country as JSON.", max_output_tokens=64, temperature=0,
               text={"format": {"type": "json_schema", "name": "place", "schema": schema, "strict": True}})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text is not None and r.text.format is not None and r.text.format.type == "json_schema"


def test_previous_response_retrieve_and_delete(client: openai.OpenAI) -> None:
    first = create(client, input="My name is Ada.", max_output_tokens=24, temperature=0)
    second = create(client, input="What is my name?", previous_response_id=first.id, max_output_tokens=24,
                    temperature=0)
    assert second.previous_response_id == first.id
    assert first.usage is not None and second.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    # the history is exactly the chat conversation: the same prompt as the chat route's
    chat = client.chat.completions.create(model=MODEL, max_tokens=24, temperature=0, messages=[
        {"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"}])
    assert chat.usage is not None and second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.output_text == chat.choices[0].message.content
    got = client.responses.retrieve(first.id)
    assert got.model_dump() == first.model_dump()
    deleted = client.responses.with_raw_response.delete(first.id)
    assert deleted.status_code == 200 and deleted.http_response.json() == {
        "id": first.id, "object": "response.deleted", "deleted": True}
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.retrieve(first.id)
    assert err.value.code == "response_not_found"
    with pytest.raises(openai.NotFoundError) as err:
        create(client, input="Again?", previous_response_id=first.id)
    assert err.value.param == "previous_response_id"


def test_store_false_is_not_kept(client: openai.OpenAI) -> None:
    r = create(client, input="Hi", max_output_tokens=4, temperature=0, store=False)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


def test_greedy_text_equals_chat_route(client: openai.OpenAI) -> None:
    r = create(client, instructions="You are a helpful assistant.", temperature=0, max_output_tokens=40,
               input=[{"role": "user", "content": [{"type": "input_text", "text": "Name three colors."}]}])
    chat = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=40, messages=[
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Name three colors."}])
    assert r.output_text == chat.choices[0].message.content
    assert r.usage is not None and chat.usage is not None
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)


def error_body(exc: openai.APIStatusError) -> dict[str, Any]:
    body = exc.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return dict(body["error"])


@pytest.mark.parametrize(("kwargs", "exc", "param"), [
    ({"input": 3}, openai.BadRequestError, "input"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, openai.BadRequestError,
     "input[0].call_id"),
    ({"input": "Hi", "previous_response_id": "resp_unknown"}, openai.NotFoundError, "previous_response_id"),
    ({"input": "Hi", "tools": [WEATHER], "tool_choice": "sometimes"}, openai.BadRequestError, "tool_choice"),
    ({"input": "Hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
     openai.BadRequestError, "tool_choice"),
    ({"input": "Hi", "max_output_tokens": 0}, openai.BadRequestError, "max_output_tokens"),
    ({"input": "Hi", "temperature": 3}, openai.BadRequestError, "temperature"),
    ({"input": "Hi", "truncation": "auto"}, openai.BadRequestError, "truncation"),
    ({"input": "Hi", "model": "no-such-model"}, openai.NotFoundError, "model"),
], ids=["input-type", "call-without-id", "unknown-previous", "tool-choice-word", "tool-choice-unknown-function",
        "max-output-tokens", "temperature", "truncation", "model"])
def test_bad_inputs_name_the_field(client: openai.OpenAI, kwargs: dict[str, Any], exc: type[openai.APIStatusError],
                                   param: str) -> None:
    body = {"model": MODEL, **kwargs}
    with pytest.raises(exc) as err:
        client.responses.create(**body)
    error = error_body(err.value)
    assert error["param"] == param and err.value.param == param, error
    assert error["type"] == "invalid_request_error", error
    if exc is openai.BadRequestError:  # a 404 names the id or the model by its value
        assert error["message"].startswith(f"'{param}'"), error


def test_unknown_fields_are_named(client: openai.OpenAI) -> None:
    raw = client.responses.with_raw_response.create(model=MODEL, input="Hi", max_output_tokens=2,
                                                    extra_body={"colour": "red"})
    assert raw.status_code == 200 and raw.headers["x-ignored-parameters"] == "colour"
    Response.model_validate(raw.http_response.json())


def test_cancel(client: openai.OpenAI, smollm2_server: ServerProcess) -> None:
    done = create(client, input="Hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.cancel(done.id)
    assert "not in progress" in error_body(err.value)["message"]
    # a stream in progress, cancelled from another connection once its first delta came
    with client.responses.create(model=MODEL, stream=True, input="Count from 1 to 500, one number per line.",
                                 temperature=0) as stream:
        events = iter(stream)
        created = next(events)
        assert created.type == "response.created"
        while next(events).type != "response.output_text.delta":
            pass
        assert client.responses.retrieve(created.response.id).status == "in_progress"
        cancelled = client.responses.cancel(created.response.id)
        assert cancelled.status == "cancelled"
        rest = [EVENTS.validate_python(e.model_dump()) for e in events]
    assert rest[-1].type == "response.incomplete" and rest[-1].response.status == "cancelled"
    assert client.responses.retrieve(created.response.id).status == "cancelled"
    # a background one: answered at once, cancelled while it runs
    background = create(client, input="Count from 1 to 500, one number per line.", temperature=0, background=True)
    assert background.status == "in_progress" and background.background is True
    cancelled = client.responses.cancel(background.id)
    assert cancelled.status == "cancelled" and cancelled.usage is not None
    assert client.responses.retrieve(background.id).status == "cancelled"
    assert "Traceback" not in smollm2_server.log()


# --- the OpenAI Agents SDK ---------------------------------------------------------------------------------
class Report(BaseModel):
    city: str = Field(max_length=16)
    sunny: bool


def run_agent(server: ServerProcess, responses: bool) -> tuple[Any, list[str], list[tuple[str, Any]]]:
    """One agent run with one tool and tool_choice required; (result, the tool's calls, the requests sent)."""
    set_tracing_disabled(True)
    calls: list[str] = []
    sent: list[tuple[str, Any]] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather of a city."""
        calls.append(city)
        return f"It is sunny and 21 C in {city}."

    async def record(request: httpx.Request) -> None:
        if request.method == "POST":
            sent.append((request.url.path, json.loads(request.content)))

    async def nothing_ignored(response: httpx.Response) -> None:  # the output items sent back are all known
        assert "x-ignored-parameters" not in response.headers, response.headers["x-ignored-parameters"]

    async def main() -> Any:
        http = httpx.AsyncClient(event_hooks={"request": [record], "response": [nothing_ignored]}, timeout=300)
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, http_client=http)
        model = (OpenAIResponsesModel(MODEL, client) if responses else OpenAIChatCompletionsModel(MODEL, client))
        agent: Agent[Any] = Agent(name="weather", instructions="Answer in one short sentence.", tools=[get_weather],
                                  model=model, output_type=Report if responses else None,
                                  model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=60))
        try:
            return await Runner.run(agent, "What is the weather in Paris?", max_turns=3)
        finally:
            await http.aclose()

    return asyncio.run(main()), calls, sent


def test_agents_sdk_responses_model_tool_round_trip(smollm2_server: ServerProcess) -> None:
    result, calls, sent = run_agent(smollm2_server, responses=True)
    assert calls == ["Paris"]
    assert [path for path, _ in sent] == ["/v1/responses", "/v1/responses"]
    second = sent[1][1]["input"]
    call = next(i for i in second if i.get("type") == "function_call")
    output = next(i for i in second if i.get("type") == "function_call_output")
    assert output == {"type": "function_call_output", "call_id": call["call_id"],
                      "output": "It is sunny and 21 C in Paris."}
    assert isinstance(result.final_output, Report) and len(result.raw_responses) == 2
    assert [type(i).__name__ for i in result.new_items] == ["ToolCallItem", "ToolCallOutputItem",
                                                            "MessageOutputItem"]


def test_agents_sdk_chat_completions_model_tool_round_trip(smollm2_server: ServerProcess) -> None:
    result, calls, sent = run_agent(smollm2_server, responses=False)
    assert calls == ["Paris"]
    assert [path for path, _ in sent] == ["/v1/chat/completions", "/v1/chat/completions"]
    tool = sent[1][1]["messages"][-1]
    assert tool["role"] == "tool" and tool["content"] == "It is sunny and 21 C in Paris."
    assert isinstance(result.final_output, str) and result.final_output
    assert [type(i).__name__ for i in result.new_items] == ["ToolCallItem", "ToolCallOutputItem",
                                                            "MessageOutputItem"]


def test_tokens_guard_the_routes_in_openai_shape(tmp_path: Path) -> None:
    """With inference tokens required, a wrong token is the SDK's AuthenticationError (OpenAI's error shape), and
    the right one reaches the routes."""
    server = ServerProcess.start(tmp_path, models={"echo": {"option.entryPoint": "echo"}},
                                 config={"inference_auth": "true"})
    try:
        wrong = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong-token", max_retries=0, timeout=60)
        with pytest.raises(openai.AuthenticationError) as err:
            wrong.responses.retrieve("resp_x")
        assert error_body(err.value)["type"] == "authentication_error"
        right = openai.OpenAI(base_url=server.url + "/v1", api_key=server.tokens["inference"], max_retries=0,
                              timeout=60)
        with pytest.raises(openai.NotFoundError):
            right.responses.retrieve("resp_x")
        with pytest.raises(openai.BadRequestError) as err:  # echo has no chat template
            right.responses.create(model="echo", input="Hi")
        assert "chat template" in error_body(err.value)["message"]
    finally:
        server.stop()
