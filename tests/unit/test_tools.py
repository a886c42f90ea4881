"""Tool calling in the frontend (serving.frontends.http.tools): plans from tools/tool_choice, the forced modes'
grammars, the parsers of each model family's call format (well-formed, several calls, malformed: plain content), and the
streamed deltas, which fold to exactly the whole answer however the text is split."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from llguidance import LLMatcher, LLTokenizer

from rollcore.errors import InvalidRequest
from serving.frontends.http.tools import ToolPlan, ToolStream, fold, parse, plan

WEATHER = {"name": "get_weather", "description": "the weather of a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city"], "additionalProperties": False}}
TIME = {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}
TOOLS = [{"type": "function", "function": WEATHER}, {"type": "function", "function": TIME}]
AUTO = {"enable_auto_tool_choice": "true"}
OFF = {"enable_auto_tool_choice": "false"}


def tool_plan(choice: Any = "required", parallel: bool | None = None, parser: str = "hermes") -> ToolPlan:
    made = plan(TOOLS, choice, parallel, {**AUTO, "tool_call_parser": parser})
    assert made is not None
    return made


def whole(p: ToolPlan, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    reader = ToolStream(p)
    return fold(p, reader.feed(text) + reader.finish())


def pieces(p: ToolPlan, chunks: list[str]) -> tuple[tuple[str | None, list[dict[str, Any]]], list[dict[str, Any]]]:
    reader = ToolStream(p)
    deltas = [d for c in chunks for d in reader.feed(c)] + reader.finish()
    return fold(p, deltas), deltas


def without_ids(calls: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


# --- plans ------------------------------------------------------------------------------------------------
def test_choices_become_plans() -> None:
    assert plan(None, None, None, {}) is None and plan([], "none", None, {}) is None
    assert tool_plan("none").mode == "none"
    assert tool_plan({"type": "function", "function": {"name": "get_time"}}).name == "get_time"
    assert tool_plan("auto", parser="mistral").parser == "mistral"
    assert plan(TOOLS, None, None, AUTO).mode == "auto"  # type: ignore[union-attr]  # OpenAI's default with tools


@pytest.mark.parametrize(("tools", "choice", "options", "message"), [
    (TOOLS, "auto", OFF, "'tool_choice' auto is switched off on this model (option.enable_auto_tool_choice=false)"),
    (TOOLS, None, OFF, "'tool_choice' auto is switched off on this model (option.enable_auto_tool_choice=false)"),
    (None, "required", {}, "'tool_choice' 'required' needs 'tools'"),
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, {}, "'tool_choice' names function 'nope', which"),
    ([TOOLS[0], TOOLS[0]], "required", {}, "'tools' has two functions of the same name"),
    ([{"type": "function", "function": {"name": "a b"}}], "required", {},
     "'tools[0].function.name' must be 1 to 64 letters, digits"),
])
def test_impossible_choices_are_a_400(tools: Any, choice: Any, options: dict[str, str], message: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        plan(tools, choice, None, options)
    assert err.value.message.startswith(message), err.value.message


def test_forced_grammars_accept_only_valid_calls() -> None:
    byte = LLTokenizer("byte")

    def accepts(grammar: str, text: str) -> bool:
        m = LLMatcher(byte, grammar, log_level=0)
        return m.consume_tokens(list(text.encode())) and m.is_accepting()

    required = tool_plan("required").grammar()
    assert required is not None
    assert accepts(required, '[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                             '{"name": "get_time", "arguments": {}}]')
    assert not accepts(required, '[{"name": "get_weather", "arguments": {"town": "Paris"}}]')  # schema
    assert not accepts(required, '[{"name": "send_mail", "arguments": {}}]')  # not a tool
    assert not accepts(required, "[]")  # at least one call
    single = tool_plan("required", parallel=False).grammar()
    assert single is not None and not accepts(single, '[{"name": "get_time", "arguments": {}}, '
                                                      '{"name": "get_time", "arguments": {}}]')
    named = tool_plan({"type": "function", "function": {"name": "get_weather"}}).grammar()
    assert named is not None and accepts(named, '{"city": "Oslo", "unit": "c"}') and not accepts(named, '{"unit": "c"}')
    assert tool_plan("none").grammar() is None and tool_plan("auto").grammar() is None


# --- the forced modes' answers, whole and streamed ---------------------------------------------------------
REQUIRED_TEXT = ('[{"name": "get_weather", "arguments": {"city": "Par\\"is {x}", "unit": "c"}}, '
                 '{"name": "get_time", "arguments": {"zone": "[UTC]"}}]')


def test_required_answers_become_calls_however_the_text_is_split() -> None:
    p = tool_plan("required")
    content, calls = whole(p, REQUIRED_TEXT)
    assert content is None
    assert without_ids(calls) == [("get_weather", '{"city": "Par\\"is {x}", "unit": "c"}'),
                                  ("get_time", '{"zone": "[UTC]"}')]
    for call in calls:  # the arguments are the JSON the grammar allowed: they validate
        schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call["function"]["name"])
        jsonschema.validate(json.loads(call["function"]["arguments"]), schema)
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    for cut in range(1, len(REQUIRED_TEXT)):
        (c2, calls2), _ = pieces(p, [REQUIRED_TEXT[:cut], REQUIRED_TEXT[cut:]])
        assert (c2, without_ids(calls2)) == (None, without_ids(calls)), cut
    (_, by_char), deltas = pieces(p, list(REQUIRED_TEXT))
    assert without_ids(by_char) == without_ids(calls)
    heads = [d["tool_calls"][0] for d in deltas if "id" in d["tool_calls"][0]]
    assert [(h["index"], h["function"]["name"], h["function"]["arguments"]) for h in heads] == [
        (0, "get_weather", ""), (1, "get_time", "")]  # OpenAI's stream: id and name first, arguments after


def test_a_named_answer_is_the_arguments_streamed_as_they_come() -> None:
    p = tool_plan({"type": "function", "function": {"name": "get_weather"}})
    (content, calls), deltas = pieces(p, ['{"city"', ': "Rome"}'])
    assert content is None and without_ids(calls) == [("get_weather", '{"city": "Rome"}')]
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert [d["tool_calls"][0]["function"]["arguments"] for d in deltas[1:]] == ['{"city"', ': "Rome"}']
    assert not ToolStream(p).finish_as_tool_calls  # OpenAI finishes a named call with "stop"


def test_a_forced_answer_cut_by_max_tokens_keeps_what_came() -> None:
    content, calls = whole(tool_plan("required"), '[{"name": "get_weather", "arguments": {"city": "Pa')
    assert content is None and without_ids(calls) == [("get_weather", '{"city": "Pa')]


# --- auto: each family's format ---------------------------------------------------------------------------
# Texts in the format each family's chat template teaches its models (Hermes 2 Pro / Qwen 2.5, Llama 3.1 JSON,
# Mistral v0.3): the shapes these parsers must take, and the malformed ones a small model writes.
HERMES_TWO = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
              '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')
CASES = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>',
     None, [("get_weather", '{"city": "Paris", "unit": "c"}')]),
    ("hermes", HERMES_TWO, "Let me check.", [("get_weather", '{"city": "Paris"}'), ("get_time", '{"zone": "CET"}')]),
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}', None,
     [("get_time", '{"zone": "UTC"}')]),  # arguments as a JSON string, closing tag cut off by EOS
    ("hermes", "The weather in Paris is sunny.", "The weather in Paris is sunny.", []),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"\n</tool_call>',
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"\n</tool_call>', []),  # broken JSON
    ("hermes", '<tool_call>\n{"arguments": {}}\n</tool_call>', '<tool_call>\n{"arguments": {}}\n</tool_call>', []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', None,
     [("get_weather", '{"city": "Paris"}')]),
    ("llama3_json", '<|python_tag|>{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": '
                    '{"city": "Oslo"}}', None, [("get_time", "{}"), ("get_weather", '{"city": "Oslo"}')]),
    ("llama3_json", "{not json at all", "{not json at all", []),
    ("llama3_json", "Paris is in France.", "Paris is in France.", []),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", '
                '"arguments": {"zone": "UTC"}}]', None, [("get_weather", '{"city": "Paris"}'),
                                                         ("get_time", '{"zone": "UTC"}')]),
    ("mistral", '[{"name": "get_time", "arguments": {}}]', None, [("get_time", "{}")]),  # marker dropped as special
    ("mistral", "[TOOL_CALLS] [{\"name\": \"get_time\", \"arguments\": {}", "[TOOL_CALLS] [{\"name\": \"get_time\", "
                "\"arguments\": {}", []),
    ("mistral", "No tools needed: 4.", "No tools needed: 4.", []),
]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_auto_parsers_read_each_format_and_leave_the_rest_as_content(
        parser: str, text: str, content: str | None, calls: list[tuple[str, str]]) -> None:
    parsed_content, parsed = parse(text, parser)
    if calls:
        assert (parsed_content, [(c["name"], c["arguments"]) for c in parsed]) == (content, calls)
    else:
        assert (parsed_content, parsed) == (text, [])
    p = tool_plan("auto", parser=parser)
    folded_content, folded = whole(p, text)
    # the content before a call is streamed as it comes (its trailing newline included)
    assert ((folded_content or "").strip() or None, without_ids(folded)) == (content, calls)
    for cut in range(1, len(text)):  # streamed in two pieces: the same answer
        (c2, calls2), _ = pieces(p, [text[:cut], text[cut:]])
        assert (c2, without_ids(calls2)) == (folded_content, without_ids(folded)), cut


def test_auto_streams_content_before_a_call_and_holds_a_partial_marker() -> None:
    reader = ToolStream(tool_plan("auto"))
    assert reader.feed("Let me check. <tool") == [{"content": "Let me check. "}]  # "<tool" may open a call
    assert reader.feed("_call>\n{\"name\": ") == []
    rest = reader.feed('"get_time", "arguments": {}}\n</tool_call>') + reader.finish()
    assert [d for d in rest if "content" in d] == []
    assert reader.finish_as_tool_calls and reader.calls == 1
    plain = ToolStream(tool_plan("auto"))
    assert plain.feed("a <to") == [{"content": "a "}] and plain.feed("y>") == [{"content": "<toy>"}]
