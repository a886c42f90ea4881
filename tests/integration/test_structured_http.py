"""Structured output and tool calling over every API, on the real SmolLM2-135M-Instruct, through the clients users
run (the openai SDK, gRPC stubs, plain HTTP for LMI and TGI): constrained answers validate, free answers in the same
burst are the ones they are alone, forced tool calls validate against their function's schema streamed and not,
a bad schema is a 400, a cut answer ends with finish_reason length, the dynamic handler constrains too."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import httpx
import jsonschema
import openai
import pytest

from serving.frontends.proto.gen.rollserve.v1 import generate_pb2 as pb
from serving.frontends.proto.gen.rollserve.v1 import generate_pb2_grpc as pb_grpc
from tests.integration.harness import ServerProcess

CITY = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 30}, "country": {"type": "string", "maxLength": 30},
    "population_millions": {"type": "number", "minimum": 0, "maximum": 40},
    "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 30}, "minItems": 1, "maxItems": 3},
    "climate": {"enum": ["cold", "mild", "hot"]}},
    "required": ["city", "country", "population_millions", "landmarks", "climate"], "additionalProperties": False}
CITIES = ["Paris", "Tokyo", "Cairo", "Lima", "Oslo", "Rome", "Delhi", "Quebec"]
FREE = ["What is the capital of Italy?", "Name a fruit that is red.", "What do bees make?", "How many legs has a cat?",
        "What color is grass?", "Say good morning.", "What is 2 plus 2?", "Name a big animal."]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 30},
                                                "unit": {"enum": ["celsius", "fahrenheit"]}},
                                                "required": ["city", "unit"], "additionalProperties": False}}}
FLIGHT = {"type": "function", "function": {"name": "book_flight", "description": "Book a flight",
                                           "parameters": {"type": "object", "properties": {
                                               "origin": {"type": "string", "maxLength": 20},
                                               "destination": {"type": "string", "maxLength": 20},
                                               "passengers": {"type": "integer", "minimum": 1, "maximum": 9}},
                                               "required": ["origin", "destination", "passengers"],
                                               "additionalProperties": False}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, FLIGHT)}
ASKS = ["What is the weather in Madrid?", "Book a flight from Boston to Denver for two people.",
        "Is it raining in Seattle?"]


@pytest.fixture(scope="module")
def server(smollm2_server: ServerProcess) -> ServerProcess:
    return smollm2_server


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.tokens.get("inference", "none"), max_retries=0,
                         timeout=300)


def ask(client: openai.OpenAI, question: str, model: str = "smollm2", **kw: Any) -> Any:
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": question}],
                                          temperature=0, **kw)


def json_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def test_a_burst_of_constrained_and_free_requests(client: openai.OpenAI) -> None:
    with ThreadPoolExecutor(len(FREE)) as pool:  # free neighbours only: greedy rows do not depend on batch-mates
        alone = [r.choices[0].message.content for r in pool.map(lambda q: ask(client, q, max_tokens=24), FREE)]

    def one(k: int) -> tuple[str, Any]:
        if k % 2:
            return "free", ask(client, FREE[k // 2], max_tokens=24)
        return "json", ask(client, f"Describe {CITIES[k // 2]} as JSON.", max_tokens=200,
                           response_format=json_format(CITY))

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(one, range(16)))
    for k, (kind, r) in enumerate(answers):
        choice = r.choices[0]
        if kind == "json":
            jsonschema.validate(json.loads(choice.message.content), CITY)
            assert choice.finish_reason == "stop"
        else:
            assert choice.message.content == alone[k // 2]  # greedy: the same with constrained neighbours


def test_streamed_json_and_the_other_constraint_kinds(client: openai.OpenAI) -> None:
    chunks = list(ask(client, "Describe Paris as JSON.", max_tokens=200, response_format=json_format(CITY),
                      stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), CITY)
    dog = ask(client, "Reply with a JSON object describing a dog: its name and age.", max_tokens=120,
              response_format={"type": "json_object"}).choices[0]
    assert isinstance(json.loads(dog.message.content), dict) and dog.finish_reason == "stop"
    for q in ("Is the sky green?", "Is water wet?"):
        got = ask(client, q, max_tokens=5, extra_body={"guided_choice": ["yes", "no", "maybe not"]})
        assert got.choices[0].message.content in ("yes", "no", "maybe not")
    phone = ask(client, "Give me a phone number.", max_tokens=20, extra_body={"guided_regex": r"\(\d{3}\) \d{3}-\d{4}"})
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", phone.choices[0].message.content)
    gbnf = 'root ::= "The answer is " [0-9]+ "."'
    maths = ask(client, "What is 6 times 7?", max_tokens=12, extra_body={"structured_outputs": {"grammar": gbnf}})
    assert re.fullmatch(r"The answer is [0-9]+\.", maths.choices[0].message.content)
    completion = client.completions.create(model="smollm2", prompt="A list of three fruits:", max_tokens=40,
                                           temperature=0, extra_body={"guided_json": {
                                               "type": "array", "items": {"type": "string", "maxLength": 12},
                                               "minItems": 3, "maxItems": 3}})
    assert len(json.loads(completion.choices[0].text)) == 3


def test_cut_answers_say_length_and_bad_schemas_are_a_400(client: openai.OpenAI) -> None:
    cut = ask(client, "Describe Paris as JSON.", max_tokens=5, response_format=json_format(CITY)).choices[0]
    assert cut.finish_reason == "length"
    with pytest.raises(json.JSONDecodeError):
        json.loads(cut.message.content)
    with pytest.raises(openai.BadRequestError) as err:
        ask(client, "x", response_format=json_format({"type": "object", "properties": {"a": {"type": "strnig"}}}))
    assert "'response_format.json_schema.schema' cannot be used as a constraint" in err.value.response.json()["error"]
    with pytest.raises(openai.BadRequestError) as err:
        ask(client, "x", extra_body={"guided_regex": "a", "guided_choice": ["b"]})
    assert "only one constraint per request" in err.value.response.json()["error"]


def test_lmi_tgi_and_grpc_constraints(server: ServerProcess) -> None:
    headers = server.inference_headers
    r = httpx.post(f"{server.url}/predictions/smollm2", headers=headers, timeout=300, json={
        "inputs": "A JSON profile of a cat:", "parameters": {"max_new_tokens": 120, "guided_json": {
            "type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                             "age": {"type": "integer", "minimum": 0, "maximum": 30}},
            "required": ["name", "age"], "additionalProperties": False}}})
    assert r.status_code == 200, r.text
    assert set(json.loads(r.json()["generated_text"])) == {"name", "age"}
    r = httpx.post(f"{server.url}/generate?model_name=smollm2", headers=headers, timeout=300, json={
        "inputs": "The year the moon landing happened:", "parameters": {
            "max_new_tokens": 8, "grammar": {"type": "regex", "value": "19[0-9]{2}"}}})
    assert r.status_code == 200 and re.fullmatch(r"19[0-9]{2}", r.json()["generated_text"]), r.text
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        seasons = pb.SamplingParameters(max_new_tokens=8, guided_choice=["spring", "summer", "autumn", "winter"])
        reply = stub.Generate(pb.GenerateRequest(model="smollm2", prompt="Pick a season:", parameters=seasons),
                              metadata=server.grpc_inference_metadata, timeout=300)
        assert reply.text in ("spring", "summer", "autumn", "winter")
        with pytest.raises(grpc.RpcError) as err:
            stub.Generate(pb.GenerateRequest(model="smollm2", prompt="x", parameters=pb.SamplingParameters(
                guided_json="{not json")), metadata=server.grpc_inference_metadata, timeout=60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "'guided_json'" in (err.value.details() or "")


def test_the_dynamic_handler_constrains_too(client: openai.OpenAI) -> None:
    for city in CITIES[:2]:
        r = ask(client, f"Describe {city} as JSON.", model="dyn", max_tokens=200, response_format=json_format(CITY))
        jsonschema.validate(json.loads(r.choices[0].message.content), CITY)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_forced_tool_calls_validate_streamed_and_not(client: openai.OpenAI, choice: Any) -> None:
    named = isinstance(choice, dict)
    for question in ASKS:
        whole = ask(client, question, max_tokens=120, tools=[WEATHER, FLIGHT], tool_choice=choice)
        message = whole.choices[0].message
        assert whole.choices[0].finish_reason == ("stop" if named else "tool_calls")
        assert message.content is None and message.tool_calls
        for call in message.tool_calls:
            assert call.id.startswith("call_") and call.type == "function"
            assert not named or call.function.name == "get_weather"
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        chunks = [c for c in ask(client, question, max_tokens=120, tools=[WEATHER, FLIGHT], tool_choice=choice,
                                 stream=True) if c.choices]
        calls: dict[int, dict[str, str]] = {}
        for c in chunks:
            for part in c.choices[0].delta.tool_calls or ():
                if part.id is not None:  # the first delta of a call: id and name, then argument fragments
                    assert part.index not in calls and part.function.name
                    calls[part.index] = {"name": part.function.name, "arguments": part.function.arguments or ""}
                else:
                    assert part.function.name is None
                    calls[part.index]["arguments"] += part.function.arguments or ""
        assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
        assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
            (t.function.name, t.function.arguments) for t in message.tool_calls]  # greedy: the same calls


# An agent's conversation: two earlier turns in which the model called get_weather in the Hermes format (the generic
# format this server prompts SmolLM2 with), so that it calls again; those calls omit "unit", which the tool requires.
EARLIER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "%s"}}\n</tool_call>'
AGENT_TURNS = [{"role": "user", "content": "What is the weather in Paris?"},
               {"role": "assistant", "content": EARLIER % "Paris"},
               {"role": "user", "content": "What is the weather in Berlin?"},
               {"role": "assistant", "content": EARLIER % "Berlin"}]
NEW_CITIES = ["Tokyo", "Rome", "Lima"]


def written_calls(text: str | None) -> list[dict[str, Any]]:
    """The Hermes calls in a free answer, read with a regular expression and json (not the server's parser, whose
    output the auto tests judge): each ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``."""
    return [json.loads(body) for body in re.findall(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", text or "", re.DOTALL)]


def agent_ask(client: openai.OpenAI, city: str, model: str = "smollm2", **kw: Any) -> Any:
    return client.chat.completions.create(
        model=model, temperature=0, max_tokens=60, tools=[WEATHER], messages=[
            *AGENT_TURNS, {"role": "user", "content": f"What is the weather in {city}?"}], **kw)


@pytest.mark.parametrize("model", ["smollm2", "dyn"])
def test_auto_is_on_by_default_and_a_call_the_model_starts_is_valid(client: openai.OpenAI, model: str) -> None:
    """tool_choice auto (no option set, no tool_choice sent): the model starts a call; from its marker on the
    grammar holds it to the tool's schema, so the required "unit" the free answer leaves out is there."""
    for city in NEW_CITIES:
        free = agent_ask(client, city, model, tool_choice="none").choices[0]
        free_calls = written_calls(free.message.content)
        assert [c["name"] for c in free_calls] == ["get_weather"], free.message.content  # the model does call
        assert free_calls[0]["arguments"]["city"] == city  # the city asked about
        assert "unit" not in free_calls[0]["arguments"]  # ... and, unconstrained, misses "unit"
        auto = agent_ask(client, city, model).choices[0]
        assert auto.finish_reason == "tool_calls" and auto.message.content is None
        assert [c.function.name for c in auto.message.tool_calls or ()] == ["get_weather"]
        arguments = json.loads(auto.message.tool_calls[0].function.arguments)  # type: ignore[index]
        jsonschema.validate(arguments, SCHEMAS["get_weather"])
        assert arguments["city"] == city  # the same call, made valid


def test_an_auto_call_streams_as_it_answers_whole(client: openai.OpenAI) -> None:
    whole = agent_ask(client, NEW_CITIES[0]).choices[0].message
    chunks = [c for c in agent_ask(client, NEW_CITIES[0], stream=True) if c.choices]
    calls: dict[int, dict[str, str]] = {}
    for c in chunks:
        for part in c.choices[0].delta.tool_calls or ():
            entry = calls.setdefault(part.index, {"name": part.function.name or "", "arguments": ""})
            entry["arguments"] += part.function.arguments or ""
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
        (t.function.name, t.function.arguments) for t in whole.tool_calls or ()]


def test_auto_without_a_call_is_the_free_answer(client: openai.OpenAI) -> None:
    """No call started: nothing is constrained, the answer is the one tool_choice none gives (same prompt)."""
    def one(question: str, choice: str) -> Any:
        return ask(client, question, max_tokens=80, tools=[WEATHER, FLIGHT], tool_choice=choice).choices[0]

    with ThreadPoolExecutor(2 * len(ASKS)) as pool:  # greedy rows do not depend on their batch-mates
        answers = {(q, c): pool.submit(one, q, c) for q in ASKS for c in ("none", "auto")}
    for question in ASKS:
        free, auto = answers[(question, "none")].result(), answers[(question, "auto")].result()
        assert "<tool_call>" not in (free.message.content or "")  # these questions alone make no call
        assert auto.message.tool_calls is None and auto.message.content == free.message.content
        assert auto.finish_reason == free.finish_reason


def test_tool_history_reaches_the_template(client: openai.OpenAI, tmp_path: Path) -> None:
    """An assistant's earlier call and the tool's answer are part of the conversation the model continues."""
    r = client.chat.completions.create(model="smollm2", temperature=0, max_tokens=30, tools=[WEATHER],
                                       tool_choice="none", messages=[
        {"role": "user", "content": "What is the weather in Madrid?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Madrid", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 31, "sky": "sunny"}'}])
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens > 200  # the tools' system prompt and the history were rendered


def test_the_sampling_set_means_the_same_on_every_api(server: ServerProcess, client: openai.OpenAI) -> None:
    """logit_bias, the penalties, min_tokens, stop strings and bad_words through LMI, TGI, OpenAI and typed gRPC: one
    answer for one set."""
    headers, prompt = server.inference_headers, "Write the word hello five times:"

    def lmi(**params: Any) -> tuple[str, list[int]]:
        r = httpx.post(f"{server.url}/predictions/smollm2", headers=headers, timeout=300, json={
            "inputs": prompt, "parameters": {"max_new_tokens": 12, "ignore_eos": True, "details": True, **params}})
        assert r.status_code == 200, r.text
        return r.json()["generated_text"], [t["id"] for t in r.json()["details"]["tokens"]]

    plain_text, plain = lmi()
    banned = plain[1]
    sets: list[dict[str, Any]] = [{"logit_bias": {str(banned): -100}}, {"frequency_penalty": 1.5},
                                  {"presence_penalty": 2.0, "min_tokens": 5},
                                  {"stop": ["hello"], "include_stop_str_in_output": True, "skip_special_tokens": False},
                                  {"bad_words": ["hello"]}]
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        for params in sets:
            text, ids = lmi(**params)
            assert text != plain_text, params
            assert "logit_bias" not in params or banned not in ids
            assert "stop" not in params or text.endswith("hello")
            tgi = httpx.post(f"{server.url}/generate?model_name=smollm2", headers=headers, timeout=300, json={
                "inputs": prompt, "parameters": {"max_new_tokens": 12, "ignore_eos": True, **params}})
            assert tgi.status_code == 200 and tgi.json()["generated_text"] == text, tgi.text
            oai = client.completions.create(model="smollm2", prompt=prompt, max_tokens=12, temperature=0,
                                            extra_body={"ignore_eos": True, **params})
            assert oai.choices[0].text == text
            grpc_params = {**params, "logit_bias": {int(k): float(v) for k, v in params.get("logit_bias", {}).items()}}
            message = pb.SamplingParameters(max_new_tokens=12, ignore_eos=True, **grpc_params)
            reply = stub.Generate(pb.GenerateRequest(model="smollm2", prompt=prompt, parameters=message),
                                  metadata=server.grpc_inference_metadata, timeout=300)
            assert reply.text == text and [t.id for t in reply.tokens] == ids
