"""Every API's constraint fields -> one llguidance grammar, checked in the frontend (serving.requests.structured, the
OpenAI/LMI/TGI/gRPC parsers): a grammar that accepts exactly what was asked, a 400 naming the field otherwise."""

from __future__ import annotations

from typing import Any

import pytest
from llguidance import LLMatcher, LLTokenizer

from rollcore.errors import InvalidRequest
from serving.frontends.grpc.rollserve_v1 import sampling_values
from serving.frontends.http.openai_schema import parse_chat, parse_completion
from serving.frontends.proto.gen.rollserve.v1 import generate_pb2 as pb
from serving.models.model_text import ModelText
from serving.requests import structured
from serving.requests.params import Limits, build_sampling_params, parse_lmi_parameters

LIMITS = Limits()
MSG = [{"role": "user", "content": "hi"}]
TEXT = ModelText("m", None, {"chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"})
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}


def accepts(grammar: str, text: str) -> bool:
    """Whether ``grammar`` accepts exactly ``text`` (byte-level tokenizer: the grammar alone decides)."""
    matcher = LLMatcher(LLTokenizer("byte"), grammar, log_level=0)
    ok = matcher.consume_tokens(list(text.encode()))
    return ok and matcher.is_accepting()


def chat(**fields: Any) -> str | None:
    parsed = parse_chat({"messages": MSG, **fields}, "m", TEXT, "r", LIMITS, True)
    return parsed.choices[0].request.params.grammar


def test_json_schema_accepts_valid_json_in_the_fixed_layout_only() -> None:
    g = structured.json_schema(SCHEMA, "f")
    assert accepts(g, '{"n": 42}')
    assert not accepts(g, '{"n": "42"}')  # type
    assert not accepts(g, '{"n": 42, "m": 1}')  # additionalProperties
    assert not accepts(g, '{ "n":42}')  # no free whitespace: small models would loop on it
    assert structured.json_schema('{"type": "string"}', "f") and accepts(structured.json_schema(True, "f"), "[1]")


def test_regex_choice_and_grammars() -> None:
    assert accepts(structured.regex(r"\d{3}-[a-z]+", "f"), "123-abc")
    assert not accepts(structured.regex(r"\d{3}", "f"), "12")
    choices = structured.choice(["yes", "no", 'say "hi"\n'], "f")
    assert all(accepts(choices, c) for c in ("yes", "no", 'say "hi"\n')) and not accepts(choices, "maybe")
    lark = structured.grammar('start: "a" b\nb: "b"+', "f")
    assert accepts(lark, "abbb") and not accepts(lark, "a")
    gbnf = structured.grammar('root ::= "x" [0-9]+', "f")
    assert accepts(gbnf, "x12") and not accepts(gbnf, "y1")
    assert accepts(structured.json_object("f"), '{"a": [1, 2]}') and not accepts(structured.json_object("f"), "[1]")


@pytest.mark.parametrize(("build", "value", "message"), [
    (structured.json_schema, {"type": "objec"}, "'f' cannot be used as a constraint: Invalid type: objec"),
    (structured.json_schema, "{", "'f' is not valid JSON"),
    (structured.json_schema, [1], "'f' must be a JSON schema (an object), got list"),
    (structured.regex, "(abc", "'f' cannot be used as a constraint: "),
    (structured.regex, "", "'f' must be a non-empty string"),
    (structured.choice, [], "'f' must be a list of 1 to 1024 non-empty strings"),
    (structured.choice, ["a", ""], "'f' must be a list of 1 to 1024 non-empty strings"),
    (structured.grammar, "start: undefined_rule", "'f' cannot be used as a constraint: "),
    (structured.grammar, "root ::= (", "'f' is not a valid GBNF grammar"),
    (structured.regex, "a" * (structured.MAX_GRAMMAR_BYTES + 1), "'f' is larger than 256 KiB"),
])
def test_bad_constraints_are_refused_naming_the_field(build: Any, value: Any, message: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        build(value, "f")
    assert err.value.message.startswith(message), err.value.message


def test_every_api_spelling_gives_the_same_grammar() -> None:
    want = structured.json_schema(SCHEMA, "x")
    assert chat(response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA,
                                                                        "strict": True}}) == want
    assert chat(response_format={"type": "json", "value": SCHEMA}) == want  # TGI's chat shape
    assert chat(guided_json=SCHEMA) == want
    assert chat(structured_outputs={"json": SCHEMA}) == want
    completion = parse_completion({"prompt": "x", "guided_json": SCHEMA}, "m", TEXT, "r", LIMITS, True)
    assert completion.choices[0].request.params.grammar == want
    assert parse_lmi_parameters({"guided_json": SCHEMA}, LIMITS).grammar == want
    assert parse_lmi_parameters({"grammar": {"type": "json", "value": SCHEMA}}, LIMITS).grammar == want
    message = pb.SamplingParameters(guided_json='{"type": "object", "properties": {"n": {"type": "integer"}}, '
                                    '"required": ["n"], "additionalProperties": false}')
    assert build_sampling_params(sampling_values(message), LIMITS).grammar == want
    choice = structured.choice(["a", "b"], "x")
    assert chat(guided_choice=["a", "b"]) == chat(structured_outputs={"choice": ["a", "b"]}) == choice
    assert build_sampling_params(sampling_values(pb.SamplingParameters(guided_choice=["a", "b"])), LIMITS).grammar \
        == choice
    assert chat(response_format={"type": "text"}) is None and chat() is None
    assert chat(response_format={"type": "json_object"}) == structured.json_object("x")


@pytest.mark.parametrize(("fields", "message"), [
    ({"guided_json": SCHEMA, "guided_regex": "a"},
     "only one constraint per request: got 'guided_json', 'guided_regex'"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"},
     "only one constraint per request: got 'response_format', 'guided_*'"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}},
     "only one constraint per request: got structured_outputs.regex, structured_outputs.choice"),
    ({"structured_outputs": {"pattern": "a"}}, "'structured_outputs' has unknown fields ['pattern']"),
    ({"response_format": {"type": "json_schema"}}, "'response_format.json_schema' must be an object"),
    ({"response_format": {"type": "regex"}},
     "'response_format.value' must be a non-empty string (a regular expression)"),
    ({"guided_json": {"type": "objec"}}, "'guided_json' cannot be used as a constraint"),
])
def test_conflicting_or_bad_fields_are_a_400(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        chat(**fields)
    assert err.value.message.startswith(message), err.value.message


def test_lmi_parameters_name_the_field() -> None:
    with pytest.raises(InvalidRequest) as err:
        parse_lmi_parameters({"grammar": {"type": "regex", "value": "(x"}}, LIMITS)
    assert err.value.message.startswith("'grammar.value' cannot be used as a constraint")
    with pytest.raises(InvalidRequest) as err:
        parse_lmi_parameters({"grammar": {"type": "json", "value": {}}, "guided_regex": "a"}, LIMITS)
    assert err.value.message == "only one constraint per request: got 'grammar', 'guided_*'"
