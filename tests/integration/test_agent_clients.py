"""The libraries apps build agents with, against the real SmolLM2 through the OpenAI routes: langchain-openai's
default ``bind_tools`` (tools with no tool_choice: auto), instructor's TOOLS, PARALLEL_TOOLS and JSON_SCHEMA
modes. The small model's content may be poor; what these tests hold is the wire: each library sends what it
sends (recorded), gets an answer it can read, and what it extracts validates against its schema."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any, Literal

import httpx
import instructor
import jsonschema
import openai
import pytest
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

from tests.integration.harness import ServerProcess
from tests.integration.test_structured_http import AGENT_TURNS, EARLIER

UNIT = Literal["celsius", "fahrenheit"]


class Weather(BaseModel):
    """Get the current weather of a city."""

    city: str = Field(max_length=30)
    unit: UNIT


class City(BaseModel):
    city: str = Field(max_length=30)
    country: str = Field(max_length=30)


@pytest.fixture(scope="module")
def sent() -> list[dict[str, Any]]:
    return []


@pytest.fixture(scope="module")
def oai(smollm2_server: ServerProcess, sent: list[dict[str, Any]]) -> openai.OpenAI:
    """An SDK client whose request bodies are recorded (what each library puts on the wire)."""
    def record(request: httpx.Request) -> None:
        sent.append(json.loads(request.content))

    return openai.OpenAI(base_url=f"{smollm2_server.url}/v1", api_key="none", max_retries=0, timeout=300,
                         http_client=httpx.Client(event_hooks={"request": [record]}))


def test_langchain_bind_tools_gets_a_tool_call(smollm2_server: ServerProcess, sent: list[dict[str, Any]]) -> None:
    @tool
    def get_weather(city: str, unit: UNIT) -> str:
        """Get the current weather of a city."""
        return f"sunny in {city}"

    def record(request: httpx.Request) -> None:
        sent.append(json.loads(request.content))

    llm = ChatOpenAI(base_url=f"{smollm2_server.url}/v1", api_key="none", model="smollm2", temperature=0,
                     max_tokens=60, max_retries=0, http_client=httpx.Client(event_hooks={"request": [record]}))
    message = llm.bind_tools([get_weather]).invoke([*AGENT_TURNS, ("user", "What is the weather in Tokyo?")])
    assert "tool_choice" not in sent[-1] and sent[-1]["tools"][0]["function"]["name"] == "get_weather"  # auto
    assert [c["name"] for c in message.tool_calls] == ["get_weather"]
    jsonschema.validate(message.tool_calls[0]["args"], get_weather.tool_call_schema.model_json_schema())


def test_instructor_tools_mode(oai: openai.OpenAI, sent: list[dict[str, Any]]) -> None:
    client = instructor.from_openai(oai, mode=instructor.Mode.TOOLS)
    weather = client.chat.completions.create(model="smollm2", response_model=Weather, temperature=0, max_tokens=60,
                                             max_retries=0, messages=[
                                                 {"role": "user", "content": "What is the weather in Oslo?"}])
    assert sent[-1]["tool_choice"] == {"type": "function", "function": {"name": "Weather"}}
    assert isinstance(weather, Weather) and weather.unit in ("celsius", "fahrenheit")


def test_instructor_parallel_tools_mode(oai: openai.OpenAI, sent: list[dict[str, Any]]) -> None:
    client = instructor.from_openai(oai, mode=instructor.Mode.PARALLEL_TOOLS)
    history = [{**m, "content": m["content"].replace('"}}', '", "unit": "celsius"}}').replace("get_weather", "Weather")}
               if m["role"] == "assistant" else m for m in AGENT_TURNS]
    assert EARLIER  # the turns are those of the tool tests, the calls renamed to this tool
    calls = client.chat.completions.create(model="smollm2", response_model=Iterable[Weather], temperature=0,
                                           max_tokens=60, max_retries=0, messages=[
                                               *history, {"role": "user", "content": "What is the weather in Rome?"}])
    assert sent[-1]["tool_choice"] == "auto" and [t["function"]["name"] for t in sent[-1]["tools"]] == ["Weather"]
    got = list(calls)
    assert got and all(isinstance(w, Weather) for w in got)


def test_instructor_json_schema_mode(oai: openai.OpenAI, sent: list[dict[str, Any]]) -> None:
    client = instructor.from_openai(oai, mode=instructor.Mode.JSON_SCHEMA)
    city = client.chat.completions.create(model="smollm2", response_model=City, temperature=0, max_tokens=60,
                                          max_retries=0, messages=[
                                              {"role": "user", "content": "Describe Paris as JSON."}])
    fmt = sent[-1]["response_format"]
    schema = fmt["schema"] if fmt["type"] == "json_object" else fmt["json_schema"]["schema"]  # either spelling
    assert set(schema["properties"]) == {"city", "country"}
    assert isinstance(city, City) and city.city


def test_responses_auto_tool_choice_makes_a_valid_call(oai: openai.OpenAI) -> None:
    """The Responses API with tool_choice auto on an agent's conversation: the model starts a call, the grammar from
    its marker on makes it valid (the required unit its free answer leaves out)."""
    weather = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
               "parameters": Weather.model_json_schema(), "strict": True}
    turns = [*AGENT_TURNS, {"role": "user", "content": "What is the weather in Lima?"}]
    response = oai.responses.create(model="smollm2", temperature=0, max_output_tokens=60, tools=[weather],
                                    tool_choice="auto", input=turns)  # type: ignore[arg-type]
    calls = [item for item in response.output if item.type == "function_call"]
    assert [c.name for c in calls] == ["get_weather"]  # type: ignore[union-attr]
    Weather.model_validate_json(calls[0].arguments)  # type: ignore[union-attr]
