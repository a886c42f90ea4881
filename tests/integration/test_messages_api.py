"""Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``) through the real ``anthropic`` SDK on
the real SmolLM2: answers validated against the SDK's own types (``Message``, ``RawMessageStreamEvent``), greedy
answers equal to the OpenAI chat route's for the same conversation, streamed events in Anthropic's order, tool
use with ``tool_choice`` any and a following ``tool_result`` turn, stop sequences named, token counts equal to the
answers' usage, bad inputs refused naming the field, and ``x-api-key`` as the inference token."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest
from anthropic.types import Message, MessageTokensCount, RawMessageStreamEvent
from pydantic import TypeAdapter

from serving.bench.launch import wait_for
from tests.integration.harness import ServerProcess

MODEL = "smollm2"
SYSTEM = "You answer in one short sentence."
ASK = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {"name": "get_weather", "description": "Current weather in a city", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}
EVENTS: TypeAdapter[Any] = TypeAdapter(RawMessageStreamEvent)
GREEDY = {"temperature": 0}  # this SDK has no sampling arguments: clients send them as extra fields
RAW_TYPES = ("message_start", "content_block_start", "content_block_delta", "content_block_stop", "message_delta",
             "message_stop")


@pytest.fixture(scope="module")
def server(smollm2_server: ServerProcess) -> ServerProcess:
    return smollm2_server


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=300)


def prompt_of(usage: Any) -> int:
    """The prompt's tokens: Anthropic's usage splits off those read from the prefix cache."""
    return int(usage.input_tokens + (usage.cache_read_input_tokens or 0))


def create(client: anthropic.Anthropic, **kwargs: Any) -> Message:
    """``messages.create``, its JSON validated as the SDK's ``Message`` (the SDK itself builds it unchecked)."""
    raw = client.messages.with_raw_response.create(**kwargs)
    return Message.model_validate(raw.http_response.json())


def sse(server: ServerProcess, body: dict[str, Any], headers: dict[str, str] | None = None
        ) -> list[tuple[str, dict[str, Any]]]:
    """A streamed answer's events as sent: (event name, data), each data validated as the SDK's event type."""
    events: list[tuple[str, dict[str, Any]]] = []
    body = {**{k: v for k, v in body.items() if k != "extra_body"}, **body.get("extra_body", {}), "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/messages", json=body, timeout=300,
                      headers={"anthropic-version": "2023-06-01", **(headers or {})}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: "):])
                assert name == data["type"], (name, data)
                if name != "ping":
                    EVENTS.validate_python(data)
                events.append((name, data))
    return events


def blocks(msg: Message) -> list[dict[str, Any]]:
    """A message's content as JSON (the SDK's stream helper gives its own block classes)."""
    return [b.model_dump(exclude_none=True) for b in msg.content]


def assert_order(names: list[str]) -> None:
    """message_start, then blocks (start, deltas, stop) with a ping after the first block's start, then
    message_delta and message_stop."""
    assert names[:3] == ["message_start", "content_block_start", "ping"], names
    blocks = ",".join(n for n in names[1:-2] if n != "ping")
    assert re.fullmatch(r"(content_block_start(,content_block_delta)+,content_block_stop,?)+", blocks), names
    assert names[-2:] == ["message_delta", "message_stop"] and names.count("ping") == 1, names


def chat(server: ServerProcess, messages: list[dict[str, Any]], max_tokens: int) -> dict[str, Any]:
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=300, json={
        "model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_a_plain_answer_is_the_chat_routes_greedy_answer(server: ServerProcess, client: anthropic.Anthropic) -> None:
    msg = create(client, model=MODEL, max_tokens=24, extra_body=GREEDY, system=SYSTEM, messages=ASK)
    assert msg.id.startswith("msg_") and msg.type == "message" and msg.role == "assistant" and msg.model == MODEL
    assert [b.type for b in msg.content] == ["text"] and msg.stop_sequence is None
    same = chat(server, [{"role": "system", "content": SYSTEM}, *ASK], 24)
    choice = same["choices"][0]
    assert msg.content[0].text == choice["message"]["content"]  # type: ignore[union-attr]
    assert msg.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[choice["finish_reason"]]
    assert (prompt_of(msg.usage), msg.usage.output_tokens) == (same["usage"]["prompt_tokens"],
                                                                same["usage"]["completion_tokens"])


def test_system_blocks_and_a_string_system_are_one_prompt(client: anthropic.Anthropic) -> None:
    text = create(client, model=MODEL, max_tokens=12, extra_body=GREEDY, system=SYSTEM, messages=ASK)
    parts = create(client, model=MODEL, max_tokens=12, extra_body=GREEDY, system=[{"type": "text", "text": SYSTEM}],
                    messages=[{"role": "user", "content": [{"type": "text", "text": ASK[0]["content"]}]}])
    assert parts.content == text.content and parts.usage == text.usage


def test_a_streamed_answer_is_the_whole_answer_in_anthropics_events(server: ServerProcess,
                                                                     client: anthropic.Anthropic) -> None:
    kwargs: dict[str, Any] = {"model": MODEL, "max_tokens": 24, "extra_body": GREEDY, "system": SYSTEM, "messages": ASK}
    whole = create(client, **kwargs)
    with client.messages.stream(**kwargs) as stream:
        names = [e.type for e in stream if e.type in RAW_TYPES]
        final = stream.get_final_message()
    assert names[:2] == ["message_start", "content_block_start"] and names[-2:] == ["message_delta", "message_stop"]
    assert blocks(final) == blocks(whole) and final.stop_reason == whole.stop_reason
    # the prompt's tokens: those read from the prefix cache (the second call's hit) and the rest
    prompt = prompt_of(whole.usage)
    assert prompt_of(final.usage) == prompt
    assert final.usage.output_tokens == whole.usage.output_tokens
    events = sse(server, kwargs, {"anthropic-beta": "some-beta-2025-01-01"})  # headers accepted and ignored
    assert_order([n for n, _ in events])
    start, delta = events[0][1], events[-2][1]
    usage = start["message"]["usage"]
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == prompt
    assert start["message"]["stop_reason"] is None and start["message"]["content"] == []
    assert delta["delta"] == {"stop_reason": whole.stop_reason, "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == whole.usage.output_tokens
    text = "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta")
    assert text == whole.content[0].text  # type: ignore[union-attr]


def test_tool_use_with_any_then_a_tool_result_turn(server: ServerProcess, client: anthropic.Anthropic) -> None:
    ask = [{"role": "user", "content": "What is the weather in Madrid?"}]
    kwargs: dict[str, Any] = {"model": MODEL, "max_tokens": 80, "extra_body": GREEDY, "tools": [WEATHER],
                              "tool_choice": {"type": "any"}, "messages": ask}
    msg = create(client, **kwargs)
    assert msg.stop_reason == "tool_use"
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert uses and all(b.type in ("text", "tool_use") for b in msg.content)
    for use in uses:
        assert use.id.startswith("toolu_") and use.name == "get_weather"
        jsonschema.validate(use.input, WEATHER["input_schema"])
    assert client.messages.count_tokens(model=MODEL, tools=[WEATHER], tool_choice={"type": "any"},
                                        messages=ask).input_tokens == prompt_of(msg.usage)

    events = sse(server, kwargs)
    assert_order([n for n, _ in events])
    starts = [d["content_block"] for n, d in events if n == "content_block_start"]
    assert [(b["type"], b.get("name")) for b in starts] == [(b.type, getattr(b, "name", None)) for b in msg.content]
    pieces: dict[int, str] = {}
    for n, d in events:
        if n == "content_block_delta" and d["delta"]["type"] == "input_json_delta":
            pieces[d["index"]] = pieces.get(d["index"], "") + d["delta"]["partial_json"]
    assert [json.loads(p) for _, p in sorted(pieces.items())] == [u.input for u in uses]  # greedy: the same calls
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"
    with client.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert [{**b, "id": None} for b in blocks(final)] == [{**b, "id": None} for b in blocks(msg)]  # new ids

    results = [{"type": "tool_result", "tool_use_id": u.id, "content": [{"type": "text", "text": "31 C, sunny"}]}
               for u in uses]
    turn = [*ask, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]},
            {"role": "user", "content": results}]
    answer = create(client, model=MODEL, max_tokens=40, extra_body=GREEDY, tools=[WEATHER],
                    tool_choice={"type": "none"}, messages=turn)
    assert answer.stop_reason in ("end_turn", "max_tokens") and [b.type for b in answer.content] == ["text"]
    assert answer.content[0].text.strip()  # type: ignore[union-attr]
    assert prompt_of(answer.usage) > prompt_of(msg.usage)  # the call and its result reached the prompt
    assert client.messages.count_tokens(model=MODEL, tools=[WEATHER], tool_choice={"type": "none"},
                                        messages=turn).input_tokens == prompt_of(answer.usage)


def test_a_named_tool_gives_one_call_of_that_tool(client: anthropic.Anthropic) -> None:
    msg = create(client, model=MODEL, max_tokens=80, extra_body=GREEDY, tools=[WEATHER],
                 tool_choice={"type": "tool", "name": "get_weather"},
                 messages=[{"role": "user", "content": "Is it raining in Seattle?"}])
    assert msg.stop_reason == "tool_use" and [b.type for b in msg.content] == ["tool_use"]
    jsonschema.validate(msg.content[0].input, WEATHER["input_schema"])  # type: ignore[union-attr]


def test_stop_sequences_end_the_answer_and_are_named(server: ServerProcess, client: anthropic.Anthropic) -> None:
    kwargs: dict[str, Any] = {"model": MODEL, "max_tokens": 30, "extra_body": GREEDY, "messages": ASK}
    plain = create(client, **kwargs).content[0].text  # type: ignore[union-attr]
    word = plain.split()[2]  # a word the greedy answer writes: it stops before its first occurrence
    msg = create(client, **kwargs, stop_sequences=["zzqx", word])
    assert (msg.stop_reason, msg.stop_sequence) == ("stop_sequence", word)
    assert msg.content[0].text == plain[:plain.index(word)]  # type: ignore[union-attr]
    events = sse(server, {**kwargs, "stop_sequences": ["zzqx", word]})
    assert events[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": word}
    assert "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta") == msg.content[0].text  # type: ignore[union-attr]


def test_count_tokens_is_the_answers_input_tokens(client: anthropic.Anthropic) -> None:
    conversation = [*ASK, {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And of Spain?"}]
    msg = create(client, model=MODEL, max_tokens=4, system=SYSTEM, tools=[WEATHER], tool_choice={"type": "auto"},
                 messages=conversation)
    raw = client.messages.with_raw_response.count_tokens(model=MODEL, system=SYSTEM, tools=[WEATHER],
                                                         tool_choice={"type": "auto"}, messages=conversation)
    count = MessageTokensCount.model_validate(raw.http_response.json())
    assert count.input_tokens == prompt_of(msg.usage)
    plain = client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=conversation).input_tokens
    assert plain < count.input_tokens  # the tools are part of the prompt


@pytest.mark.parametrize(("body", "field", "words"), [
    ({"messages": ASK}, "'max_tokens'", "missing field"),
    ({"max_tokens": 4, "messages": [*ASK, {"role": "assistant", "content": "Paris."},
                                    {"role": "user", "content": [{"type": "video", "url": "x"}]}]},
     "'messages.2.content.0.type'", "must be one of"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]},
     "'messages.0.content.1'", "images are not supported by this model"),
    ({"max_tokens": 4, "temperature": 1.5, "messages": ASK}, "'temperature'", "must be >= 0 and <= 1"),
    ({"max_tokens": 4, "tool_choice": {"type": "any"}, "messages": ASK}, "'tool_choice.type'", "needs 'tools'"),
    ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
     "'messages.0.content.0.tool_use_id'", "missing field"),
    ({"max_tokens": 4, "messages": [*ASK, {"role": "assistant", "content": "The capital"}]}, "'messages.1.role'",
     "prefill"),
], ids=["no-max_tokens", "unknown-block", "image", "temperature", "any-without-tools", "tool_result-id",
        "prefill"])
def test_bad_requests_are_400_naming_the_field(client: anthropic.Anthropic, body: dict[str, Any], field: str,
                                                words: str) -> None:
    with pytest.raises(anthropic.BadRequestError) as err:
        client.post("/v1/messages", cast_to=Message, body={"model": MODEL, **body})
    assert err.value.status_code == 400
    error = err.value.body["error"]  # type: ignore[index]
    assert err.value.body["type"] == "error" and error["type"] == "invalid_request_error"  # type: ignore[index]
    assert field in error["message"] and words in error["message"], error["message"]


def test_other_refusals_in_anthropics_shape(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="no-such-model", max_tokens=4, messages=ASK)  # type: ignore[arg-type]
    assert missing.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError) as dynamic:  # streaming needs a rolling-batch model
        client.messages.create(model="dyn", max_tokens=4, messages=ASK, stream=True)  # type: ignore[arg-type]
    assert "option.rolling_batch" in dynamic.value.body["error"]["message"]  # type: ignore[index]
    whole = create(client, model="dyn", max_tokens=8, extra_body=GREEDY, messages=ASK)  # dynamic batching answers whole
    assert [b.type for b in whole.content] == ["text"] and whole.stop_reason in ("end_turn", "max_tokens")


def test_unknown_fields_are_ignored_and_named_as_the_chat_route_does(server: ServerProcess) -> None:
    r = httpx.post(f"{server.url}/v1/messages", timeout=300, json={
        "model": MODEL, "max_tokens": 2, "messages": ASK, "service_tier": "auto", "metadata": {"user_id": "u1"}})
    assert r.status_code == 200, r.text
    assert r.headers["x-ignored-parameters"] == "service_tier"
    Message.model_validate(r.json())


def engine_counters(server: ServerProcess) -> tuple[int, int]:
    """The rolling engine's (aborted, finished) request counters."""
    stats = next(iter(server.describe(MODEL)["batcher"]["engines"].values()), {})
    return stats.get("num_requests_aborted_total", 0), stats.get("num_requests_finished_total", 0)


def test_a_client_that_leaves_mid_stream_cancels_its_request(server: ServerProcess,
                                                            client: anthropic.Anthropic) -> None:
    aborted, finished = engine_counters(server)
    body = {"model": MODEL, "max_tokens": 1500, "stream": True,
            "messages": [{"role": "user", "content": "Write a very long story about a dragon."}]}
    with httpx.stream("POST", f"{server.url}/v1/messages", json=body, timeout=300) as r:
        deltas = 0
        for line in r.iter_lines():
            deltas += line.startswith("event: content_block_delta")
            if deltas == 3:
                break  # leave: the connection closes
    short = 0

    def aborted_once() -> bool:
        nonlocal short
        create(client, model=MODEL, max_tokens=2, messages=ASK)  # the engine steps on, publishing its counters
        short += 1
        return engine_counters(server)[0] == aborted + 1

    wait_for(aborted_once, "the stream's abort")
    assert engine_counters(server)[1] == finished + short  # the short requests ran to their end, the story did not


# --- x-api-key ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def auth_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The tiny model (with a chat template and a tokenizer), inference authorization on."""
    s = ServerProcess.start(tmp_path_factory.mktemp("messages-auth"), models={"tiny-rb": {
        "option.entryPoint": "huggingface", "option.rolling_batch": "auto", "option.max_rolling_batch_size": "4"}},
        config={"inference_auth": "true"})
    yield s
    s.stop()


def test_x_api_key_is_the_inference_token(auth_server: ServerProcess) -> None:
    token = auth_server.tokens["inference"]
    good = anthropic.Anthropic(base_url=auth_server.url, api_key=token, max_retries=0, timeout=120)
    msg = create(good, model="tiny-rb", max_tokens=3, messages=ASK)
    assert msg.usage.input_tokens > 0 and msg.stop_reason in ("end_turn", "max_tokens")
    assert good.messages.count_tokens(model="tiny-rb", messages=ASK).input_tokens == prompt_of(msg.usage)
    bearer = anthropic.Anthropic(base_url=auth_server.url, auth_token=token, max_retries=0, timeout=120)
    usages = [create(c, model="tiny-rb", max_tokens=3, extra_body=GREEDY, messages=ASK).usage for c in (bearer, good)]
    assert len({(prompt_of(u), u.output_tokens) for u in usages}) == 1
    for wrong in (token[:-1] + ("A" if token[-1] != "A" else "B"), auth_server.tokens["management"]):
        bad = anthropic.Anthropic(base_url=auth_server.url, api_key=wrong, max_retries=0, timeout=120)
        for counting in (False, True):
            with pytest.raises(anthropic.AuthenticationError) as err:
                if counting:
                    bad.messages.count_tokens(model="tiny-rb", messages=ASK)  # type: ignore[arg-type]
                else:
                    bad.messages.create(model="tiny-rb", max_tokens=3, messages=ASK)  # type: ignore[arg-type]
            assert err.value.status_code == 401
            assert err.value.body == {"type": "error", "error": {"type": "authentication_error", "message": (
                "the inference API needs 'Authorization: Bearer <inference token>' or 'x-api-key: <inference "
                "token>' (a wrong token was given); the token is in the server's key file")},
                "request_id": err.value.response.headers["x-request-id"]}
    # the other inference routes take x-api-key too, and keep the server's error shape
    r = httpx.post(f"{auth_server.url}/v1/completions", headers={"x-api-key": "nope"}, timeout=60,
                   json={"model": "tiny-rb", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 401 and r.json()["error_type"] == "unauthorized"
    r = httpx.post(f"{auth_server.url}/v1/completions", headers={"x-api-key": token}, timeout=60,
                   json={"model": "tiny-rb", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200, r.text
