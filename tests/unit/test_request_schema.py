"""One source for validation and schema, in process: the routes' validation functions
against the document ``/openapi.json`` serves (``inference_document``), read as JSON Schema by
``tests/schema_strategies.py``. Bodies valid per the document are accepted, a value out of its documented
range is refused with a message naming the field, the document and the validation take their caps from the
same ``Limits``, and the messages keep the project's words. (``tests/integration/test_request_schema_http.py``
does the same through a real server, and probes which fields each route knows.)"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollcore.errors import InvalidRequest
from serving.frontends.http import lmi, tgi
from serving.frontends.http.openai_schema import parse_chat, parse_completion
from serving.frontends.http.openapi import inference_document
from serving.requests.bodies import CHAT, COMPLETION, LMI, TGI
from serving.requests.params import Limits, build_sampling_params, parse_lmi_parameters
from tests.schema_strategies import Caps, Document, put

LIMITS = Limits()
MSG = [{"role": "user", "content": "Hello"}]


class FakeText:
    """What the parsers need of a model's text side, without a tokenizer (no length checks)."""

    chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    special_tokens: dict[str, str] = {}

    def encode(self, text: str) -> None:
        return None

    def decode(self, ids: list[int]) -> str:
        return "decoded"

    def check_length(self, *args: Any) -> None:
        return None

    def room(self, num_prompt_tokens: int | None, cap: int) -> int:
        return cap

    def worker_ids(self, ids: list[int] | None) -> None:
        return None


TEXT_MODEL = SimpleNamespace(name="m", entry_point="huggingface", options={}, rolling=True)
CTX = SimpleNamespace(limits=LIMITS)


def run_lmi(body: Any) -> object:
    return lmi.build_requests(body, TEXT_MODEL, "r", {}, CTX)  # type: ignore[arg-type]


def run_tgi(body: Any) -> object:
    return tgi.TgiRoutes(CTX)._build(body, TEXT_MODEL, "r", FakeText(), None, [])  # type: ignore[arg-type]


def run_completion(body: Any) -> object:
    return parse_completion(body, "m", FakeText(), "r", LIMITS, True)  # type: ignore[arg-type]


def run_chat(body: Any) -> object:
    return parse_chat(body, "m", FakeText(), "r", LIMITS, True)  # type: ignore[arg-type]


# route, its request schema in the document, its validation, a small valid body (the LMI routes' document is
# LmiRequest or ChatRequest: a body with messages goes to the chat parser, which "chat" covers)
ROUTES: list[tuple[str, str, Callable[[Any], object], dict[str, Any]]] = [
    ("lmi", "LmiRequest", run_lmi, {"inputs": "Hello"}),
    ("tgi", "TgiRequest", run_tgi, {"inputs": "Hello"}),
    ("completions", "CompletionRequest", run_completion, {"prompt": "Hello"}),
    ("chat", "ChatRequest", run_chat, {"messages": MSG}),
]
DOC = Document(inference_document(LIMITS, ["m"]))


def cross_field_rules(body: dict[str, Any]) -> dict[str, Any]:
    """The rules the document states in words (schemas' design note), applied to a generated body."""
    body = dict(body)
    if body.get("stream_options") is not None:
        body["stream"] = True  # "stream_options: only with stream: true"
    if body.get("best_of") is not None:
        body["best_of"] = max(body["best_of"], body.get("n") or 1)  # "best_of: at least n"
        if body["best_of"] > (body.get("n") or 1):  # "not with stream"
            body.pop("stream", None)
            body.pop("stream_options", None)
    if body.get("top_logprobs") is not None:
        body["logprobs"] = True  # "top_logprobs: with logprobs: true"
    if body.get("max_tokens") == 0 and "prompt" in body:
        body["echo"] = True  # "0 only with echo"
    body.pop("truncate_prompt_tokens", None)  # needs the model's tokenizer (tests/integration: real ones)
    if isinstance(body.get("adapters"), list):  # "one per prompt of a list"
        inputs = body.get("inputs")
        body["adapters"] = (body["adapters"] * len(inputs))[:len(inputs)] if isinstance(inputs, list) else \
            body["adapters"][0]
    # A constraint's content is a schema, a pattern or a grammar (llguidance checks it, tests/unit/test_structured.py
    # covers it), and tool_choice depends on the tools and the model's options (tests/unit/test_tools.py).
    params = body.get("parameters")
    if isinstance(params, dict) and params.get("best_of") is not None:
        params["best_of"] = 1  # "needs sampling" (candidates: tests/integration/test_prompt_logprobs_http.py)
    for level in (body, params if isinstance(params, dict) else {}):
        for name in (*CONSTRAINT_FIELDS, "tools", "tool_choice"):
            level.pop(name, None)
    return body


CONSTRAINT_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                     "structured_outputs", "grammar",
                     # token ids of the model's vocabulary; at most max_tokens (tests/engine/test_sampling_set.py)
                     "logit_bias", "min_tokens")


# --- the decisions the issue names ---------------------------------------------------------------------
def test_temperature_is_0_to_2_in_the_document_and_in_every_route() -> None:
    """OpenAI's range, on every route (the hand-written document said 2 while the code took 100)."""
    for name in ("LmiParameters", "CompletionRequest", "ChatRequest"):
        temperature = DOC.plain(DOC.properties(DOC.components[name])["temperature"])
        assert (temperature["type"], temperature["minimum"], temperature["maximum"]) == ("number", 0, 2.0), name
    bodies = [(run_lmi, lambda t: {"inputs": "x", "parameters": {"temperature": t}}, "parameter 'temperature'"),
              (run_tgi, lambda t: {"inputs": "x", "parameters": {"temperature": t}}, "parameter 'temperature'"),
              (run_completion, lambda t: {"prompt": "x", "temperature": t}, "'temperature'"),
              (run_chat, lambda t: {"messages": MSG, "temperature": t}, "'temperature'")]
    for run, body, name in bodies:
        run(body(2))
        run(body(0))
        for bad in (2.0000001, -0.5):
            with pytest.raises(InvalidRequest) as err:
                run(body(bad))
            assert err.value.message == f"{name} must be >= 0 and <= 2, got {bad!r}"


def test_fields_the_old_document_missed_are_documented() -> None:
    lmi_params = DOC.properties(DOC.components["LmiParameters"])
    assert {"logprobs", "stop_token_ids", "ignore_eos_token", "top_n_tokens", "stop_sequences"} <= set(lmi_params)
    for name in ("CompletionRequest", "ChatRequest"):
        assert "model" not in DOC.components[name].get("required", []), name
    message = DOC.plain(DOC.components["ChatMessage"])
    assert DOC.plain(message["properties"]["role"])["enum"] == ["system", "developer", "user", "assistant", "tool",
                                                                "function"]
    content = DOC.plain(message["properties"]["content"])
    part = DOC.plain(content["oneOf"][1]["items"])
    assert content["oneOf"][0]["type"] == "string" and part["required"] == ["type", "text"]
    assert DOC.plain(part["properties"]["type"])["const"] == "text"


def test_caps_come_from_the_limits_in_both() -> None:
    limits = Limits(max_stop_sequences=2, max_stop_length=5, max_stop_token_ids=3, max_sequences_per_request=4)
    doc = Document(inference_document(limits))
    params = doc.properties(doc.components["LmiParameters"])
    stop_list = doc.plain(params["stop"])["oneOf"][1]
    assert stop_list["maxItems"] == 2 and stop_list["items"]["maxLength"] == 5
    assert doc.plain(params["stop_token_ids"])["maxItems"] == 3
    assert doc.plain(doc.properties(doc.components["LmiRequest"])["inputs"])["oneOf"][1]["maxItems"] == 4
    cases = [({"stop": ["a", "b", "c"]}, "parameter 'stop' has 3 entries; at most 2 (max_stop_sequences)"),
             ({"stop": "abcdef"}, "parameter 'stop' has 6 characters; at most 5 (max_stop_length)"),
             ({"stop_token_ids": [1, 2, 3, 4]}, "parameter 'stop_token_ids' has 4 entries; at most 3 "
                                                "(max_stop_token_ids)"),
             ({"stop": ["a", "b"], "stop_sequences": ["c"]},
              "parameters 'stop' and 'stop_sequences' have 3 entries together; at most 2 (max_stop_sequences)")]
    for params_value, message in cases:
        with pytest.raises(InvalidRequest) as err:
            parse_lmi_parameters(params_value, limits)
        assert err.value.message == message
    with pytest.raises(InvalidRequest) as err:
        LMI.validate({"inputs": ["a"] * 5}, limits)
    assert err.value.message == "'inputs' has 5 entries; at most 4 (max_sequences_per_request)"
    parse_lmi_parameters({"stop": ["a", "b"], "stop_token_ids": [1, 2, 3]}, limits)


# --- the project's words -------------------------------------------------------------------------------
MESSAGES: list[tuple[Any, Any, str]] = [
    (LMI, [1], "request body must be a JSON object, got a list"),
    (LMI, {"parameters": {}}, "missing field 'inputs'"),
    (LMI, {"inputs": "x", "b": 1, "a": None}, "unknown fields: a, b"),
    (LMI, {"inputs": "x", "parameters": {"colour": 1, "max_new_tokens": 2}}, "unknown parameters: colour"),
    (LMI, {"inputs": 5}, "'inputs' must be a string or a list of strings, got an integer"),
    (LMI, {"inputs": ["a", ""]}, "'inputs[1]' must not be empty"),
    (LMI, {"inputs": "a\ud800"}, "'inputs' contains invalid Unicode (a lone surrogate)"),
    (LMI, {"inputs": "x", "parameters": []}, "'parameters' must be an object, got a list"),
    (LMI, {"inputs": "x", "parameters": {"max_new_tokens": True}},
     "parameter 'max_new_tokens' must be an integer, got a boolean"),
    (LMI, {"inputs": "x", "parameters": {"top_k": 1.5}}, "parameter 'top_k' must be an integer, got a number"),
    (LMI, {"inputs": "x", "parameters": {"top_k": "3"}}, "parameter 'top_k' must be an integer, got a string"),
    (LMI, {"inputs": "x", "parameters": {"do_sample": 1}}, "parameter 'do_sample' must be a boolean, got an integer"),
    (LMI, {"inputs": "x", "parameters": {"top_p": 0}}, "parameter 'top_p' must be > 0 and <= 1, got 0"),
    (LMI, {"inputs": "x", "parameters": {"repetition_penalty": 0.001}},
     "parameter 'repetition_penalty' must be >= 0.01 and <= 100, got 0.001"),
    (LMI, {"inputs": "x", "parameters": {"max_new_tokens": 4097}},
     "parameter 'max_new_tokens' must be >= 1 and <= 4096, got 4097"),
    (LMI, {"inputs": "x", "parameters": {"seed": 2**64}},
     "parameter 'seed' must be >= 0 and <= 9223372036854775807, got an integer of 65 bits"),
    (LMI, {"inputs": "x", "parameters": {"stop": ["a", 5]}}, "parameter 'stop[1]' must be a string, got an integer"),
    (LMI, {"inputs": "x", "parameters": {"stop": {"a": 1}}},
     "parameter 'stop' must be a string or a list of strings, got an object"),
    (LMI, {"inputs": "x", "parameters": {"watermark": True}},
     "parameter 'watermark' is not supported: only false or null is accepted, got True"),
    (LMI, {"inputs": "x", "parameters": {"grammar": {"type": "json"}}}, "missing field parameter 'grammar.value'"),
    (TGI, {"inputs": ["x"]}, "'inputs' must be a string, got a list"),
    (COMPLETION, {"prompt": []}, "'prompt' must not be empty"),
    (COMPLETION, {"prompt": 5}, "'prompt' must be a string, a list of strings, a list of integers or a list of lists"
                                " of integers, got an integer"),
    (COMPLETION, {"prompt": [1, -5]}, "'prompt[1]' must be >= 0 and <= 2147483647, got -5"),
    (COMPLETION, {"prompt": [1, "a"]}, "'prompt[1]' must be an integer, got a string"),
    (COMPLETION, {"prompt": [[1], []]}, "'prompt[1]' must not be empty"),
    (COMPLETION, {"prompt": ["a"] * 257}, "'prompt' has 257 entries; at most 256"),
    (COMPLETION, {"prompt": "x", "n": 9}, "'n' must be >= 1 and <= 8, got 9"),
    (COMPLETION, {"prompt": "x", "presence_penalty": 2.5}, "'presence_penalty' must be >= -2 and <= 2, got 2.5"),
    (COMPLETION, {"prompt": "x", "logit_bias": {"50256": -101}},
     "'logit_bias.50256' must be >= -100, got -101"),
    (COMPLETION, {"prompt": "x", "stream_options": {"include_usage": True, "x": 1}},
     "unknown fields: stream_options.x"),
    (COMPLETION, {"prompt": "x", "user": "u" * 257}, "'user' has 257 characters; at most 256"),
    (CHAT, {"messages": []}, "'messages' must not be empty"),
    (CHAT, {"messages": [{"role": "robot"}]}, "'messages[0].role' must be one of 'system', 'developer', 'user', "
                                              "'assistant', 'tool' or 'function', got 'robot'"),
    (CHAT, {"messages": [{"content": "x"}]}, "missing field 'messages[0].role'"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "'messages[0].content[0].type' must be 'text' (only text parts are supported), got 'image_url'"),
    (CHAT, {"messages": [{"role": "user", "content": 3}]},
     "'messages[0].content' must be a string or a list of objects, got an integer"),
    (CHAT, {"messages": MSG, "tools": [{"type": "function"}]}, "missing field 'tools[0].function'"),
    (CHAT, {"messages": MSG, "tool_choice": "sometimes"},
     "'tool_choice' must be 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": {\"name\": ...}}, "
     "got 'sometimes'"),
    (CHAT, {"messages": MSG, "response_format": {"type": "xml"}},
     "'response_format.type' must be one of 'text', 'json_object', 'json_schema', 'json' or 'regex', got 'xml'"),
]


@pytest.mark.parametrize(("schema", "body", "message"), MESSAGES, ids=[m[2][:60] for m in MESSAGES])
def test_messages_name_the_field_and_quote_the_rule(schema: Any, body: Any, message: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        schema.validate(body, LIMITS)
    assert err.value.message == message


def test_the_same_value_gets_the_same_message_everywhere() -> None:
    """gRPC's typed message and OIP's sampling_parameters, LMI's and TGI's parameters: one message."""
    messages = set()
    for run in (lambda: build_sampling_params({"top_p": 1.5}, LIMITS),
                lambda: parse_lmi_parameters({"top_p": 1.5}, LIMITS),
                lambda: run_lmi({"inputs": "x", "parameters": {"top_p": 1.5}}),
                lambda: run_tgi({"inputs": "x", "parameters": {"top_p": 1.5}})):
        with pytest.raises(InvalidRequest) as err:
            run()
        messages.add(err.value.message)
    assert messages == {"parameter 'top_p' must be > 0 and <= 1, got 1.5"}


def test_values_are_converted_as_documented() -> None:
    params = parse_lmi_parameters({"max_new_tokens": 2.0, "temperature": 1e-300, "top_k": -1, "stop": "a",
                                   "stop_sequences": ["b"], "ignore_eos_token": True, "top_n_tokens": 3,
                                   "watermark": False, "typical_p": 1, "best_of": 1.0, "frequency_penalty": 0,
                                   "grammar": None}, LIMITS)
    assert (params.max_new_tokens, params.temperature, params.top_k, params.stop, params.ignore_eos,
            params.logprobs) == (2, 0.01, 0, ("a", "b"), True, 3)
    assert isinstance(params.max_new_tokens, int)


def test_relaxed_models_drop_unknown_fields() -> None:
    """option.strict_parameters=false: unknown names are dropped at every level, known ones still checked."""
    body = {"inputs": "x", "extra": 1, "parameters": {"colour": "red", "max_new_tokens": 3}}
    assert LMI.validate(body, LIMITS, strict=False).parameters.max_new_tokens == 3  # type: ignore[union-attr]
    assert body == {"inputs": "x", "extra": 1, "parameters": {"colour": "red", "max_new_tokens": 3}}  # not mutated
    with pytest.raises(InvalidRequest, match="parameter 'max_new_tokens' must be >= 1"):
        LMI.validate({**body, "parameters": {"colour": 1, "max_new_tokens": 0}}, LIMITS, strict=False)


# --- properties: the document is the contract ----------------------------------------------------------
CAPS = Caps()


@pytest.mark.parametrize(("route", "schema", "run", "base"), ROUTES, ids=[r[0] for r in ROUTES])
@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_documents_valid_per_the_schema_are_accepted(route: str, schema: str, run: Callable[[Any], object],
                                                     base: dict[str, Any], data: st.DataObject) -> None:
    body = cross_field_rules(data.draw(DOC.valid(DOC.components[schema], CAPS), label="body"))
    run(body)


def breaking_case(schema: str, data: st.DataObject) -> tuple[tuple[str, ...], Any]:
    targets = [(p, node) for p, node in DOC.constrained(DOC.components[schema]) if p != ("model",)]
    where, node = data.draw(st.sampled_from(targets), label="field")
    return where, data.draw(DOC.breaking(node), label="value")


def field_name(where: tuple[str, ...]) -> str:
    """How a message names the field at ``where`` (the first entry of each list; parameters by their name)."""
    text = ""
    for part in where[1:] if where[0] == "parameters" else where:
        text += "[0]" if part == "[]" else (f".{part}" if text else part)
    return f"parameter '{text}'" if where[0] == "parameters" else f"'{text}'"


@pytest.mark.parametrize(("route", "schema", "run", "base"), ROUTES, ids=[r[0] for r in ROUTES])
@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_values_out_of_their_documented_range_are_refused_naming_the_field(
        route: str, schema: str, run: Callable[[Any], object], base: dict[str, Any], data: st.DataObject) -> None:
    where, value = breaking_case(schema, data)
    body = put(base, where, value)
    with pytest.raises(InvalidRequest) as err:
        run(body)
    name = field_name(where)
    assert err.value.message.startswith(name), (body, err.value.message)
    assert re.search(r"must|has \d+|not supported|unknown", err.value.message), err.value.message


def test_readme_lists_every_documented_request_field() -> None:
    """docs/api.md's "Request fields" table names every field of every request schema (and no other)."""
    readme = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text(encoding="utf-8")
    section = readme.split("### Request fields", 1)[1].split("\n## ", 1)[0]
    table = "\n".join(line for line in section.splitlines() if line.startswith("| "))
    named = set(re.findall(r"`([a-z_]+)`", table))
    documented = set()
    for name in ("LmiRequest", "LmiParameters", "TgiRequest", "CompletionRequest", "ChatRequest", "StreamOptions",
                 "ChatMessage"):
        documented |= set(DOC.properties(DOC.components[name]))
    assert documented - named == set(), "not in docs/api.md: " + ", ".join(sorted(documented - named))
    # the caps' settings and the gRPC tensor that carries the parameters may be named too
    other = named - documented - {f.name for f in fields(Limits)} - {"sampling_parameters"}
    assert other == set(), "docs/api.md names what no schema documents: " + ", ".join(sorted(other))


@pytest.mark.parametrize(("params", "message"), [
    ({"best_of": 2, "do_sample": True}, "parameter 'best_of' > 1 (got 2) is answered by the HTTP routes"),
    ({"prompt_logprobs": 1}, "parameters 'prompt_logprobs' and 'decoder_input_details' are answered by the HTTP"),
    ({"decoder_input_details": True, "details": True}, "parameters 'prompt_logprobs' and 'decoder_input_details'"),
])
def test_grpc_parameters_refuse_what_only_http_answers(params: dict[str, Any], message: str) -> None:
    """gRPC OIP's sampling_parameters (and custom handlers') have no place for candidates or prompt scores: they
    are refused by name rather than computed and dropped."""
    from serving.requests.params import parse_lmi_parameters

    with pytest.raises(InvalidRequest) as err:
        parse_lmi_parameters(params, LIMITS)
    assert err.value.message.startswith(message)
    assert parse_lmi_parameters({"best_of": 1, "decoder_input_details": False}, LIMITS).prompt_logprobs is None
