"""Tool calling's formats (serving.frontends.http.tool_formats) and its held-back grammar
(handlers.engine.execution.decoding.grammar_trigger): the format read from each family's template, the newer formats'
parsers, and the grammar that keeps a started call valid, run by llguidance on the real SmolLM2 tokenizer, fed
the tokens a model would write."""

from __future__ import annotations

import json
from typing import Any

import pytest
from llguidance import LLMatcher
from llguidance.hf import from_tokenizer
from tokenizers import Tokenizer

from handlers.engine.execution.decoding.grammar_trigger import Trigger
from serving.frontends.http.tool_formats import detect, parse, triggered_grammar
from serving.frontends.http.tools import plan
from tests.real_model import smollm2_folder

WEATHER = {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city"], "additionalProperties": False}}
TIME = {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}
TOOLS = [{"type": "function", "function": WEATHER}, {"type": "function", "function": TIME}]


# --- which format a model speaks --------------------------------------------------------------------------
# excerpts of the families' published chat templates: the part that renders an assistant's tool call
TEMPLATES = {
    "hermes": "{%- for tool_call in message.tool_calls %}{{- '<tool_call>\\n' }}{{ tool_call | tojson }}"
              "{{- '\\n</tool_call>' }}{%- endfor %}{% if tools %}{% endif %}",
    "llama3_json": "{%- if tools %}{{- '<|python_tag|>' + tool_call.name }}{%- endif %}",
    "mistral": "{%- if tools %}[AVAILABLE_TOOLS]{%- endif %}{{- '[TOOL_CALLS] [' }}",
    "granite": "{%- if tools %}{{- '<|tool_call|>' + message.tool_calls | tojson }}{%- endif %}",
    "qwen3_xml": "{%- if tools %}{{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}{%- endif %}",
}


@pytest.mark.parametrize("family", sorted(TEMPLATES))
def test_the_format_is_read_from_the_chat_template(family: str) -> None:
    assert detect(TEMPLATES[family]) == family
    made = plan(TOOLS, "auto", None, {}, TEMPLATES[family])  # no options: auto is on, the parser auto
    assert made is not None and (made.mode, made.parser) == ("auto", family)


def test_a_template_without_tools_gets_the_generic_format_and_an_option_overrides() -> None:
    assert detect(None) == detect("{{ messages }}") == "hermes"
    made = plan(TOOLS, None, None, {}, "{{ messages }}")
    assert made is not None and (made.mode, made.parser) == ("auto", "hermes")
    named = plan(TOOLS, None, None, {"tool_call_parser": "pythonic"}, TEMPLATES["hermes"])
    assert named is not None and named.parser == "pythonic"


@pytest.mark.parametrize(("parser", "text", "content", "calls"), [
    ("granite", '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]', None,
     [("get_weather", '{"city": "Paris"}')]),
    ("granite", 'Sure. <|tool_call|>[{"name": "get_time", "arguments": {}}, {"name": "get_weather", '
                '"arguments": {"city": "Oslo"}}]', "Sure.", [("get_time", "{}"), ("get_weather", '{"city": "Oslo"}')]),
    ("qwen3_xml", 'Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n'
                  '<parameter=unit>\nc\n</parameter>\n</function>\n</tool_call>', "Sure.",
     [("get_weather", '{"city": "New York", "unit": "c"}')]),
    ("qwen3_xml", '<tool_call>\n<function=get_time>\n</function>\n</tool_call>\n<tool_call>\n<function=set>\n'
                  '<parameter=n>\n42\n</parameter>\n<parameter=on>\ntrue\n</parameter>\n</function>\n</tool_call>',
     None, [("get_time", "{}"), ("set", '{"n": 42, "on": true}')]),  # JSON values other than strings as such
    ("qwen3_xml", "<tool_call>\nno function here</tool_call>", "<tool_call>\nno function here</tool_call>", []),
    ("pythonic", '[get_weather(city="Paris", unit="c"), get_time()]', None,
     [("get_weather", '{"city": "Paris", "unit": "c"}'), ("get_time", "{}")]),
    ("pythonic", "[get_weather(city=open('x'))]", "[get_weather(city=open('x'))]", []),  # not a literal: no call
    ("pythonic", "[1, 2]", "[1, 2]", []),
])
def test_newer_formats_parse(parser: str, text: str, content: str | None, calls: list[tuple[str, str]]) -> None:
    got_content, got = parse(text, parser)
    assert (got_content, [(c["name"], c["arguments"]) for c in got]) == (content, calls)


# --- the grammar that keeps a started call valid ------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(smollm2_folder() / "tokenizer.json"))


@pytest.fixture(scope="module")
def ll_tokenizer() -> Any:
    from transformers import AutoTokenizer

    return from_tokenizer(AutoTokenizer.from_pretrained(str(smollm2_folder())))


def watch(tokenizer: Tokenizer, ll_tokenizer: Any, parser: str, answer: str, parallel: bool = True) -> \
        tuple[Trigger, list[bool | None]]:
    """Feed ``answer``'s tokens to a held-back grammar of ``parser``'s format, as the engine does."""
    made = triggered_grammar(parser, (WEATHER, TIME), parallel)
    assert made is not None
    grammar, marker = made
    trigger = Trigger(LLMatcher(ll_tokenizer, grammar, log_level=0), marker,
                      lambda t: str(tokenizer.decode([t], skip_special_tokens=False)))
    return trigger, [trigger.push(t) for t in tokenizer.encode(answer, add_special_tokens=False).ids]


def test_the_grammar_waits_for_the_marker_then_takes_the_call_from_its_first_token(tokenizer: Tokenizer,
                                                                                 ll_tokenizer: Any) -> None:
    prose = "Let me look that up for you."
    answer = prose + ' <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    trigger, states = watch(tokenizer, ll_tokenizer, "hermes", answer)
    ids = tokenizer.encode(answer, add_special_tokens=False).ids
    marker_done = next(i for i in range(len(ids)) if "<tool_call>" in tokenizer.decode(ids[:i + 1]))
    assert states[:marker_done] == [False] * marker_done  # free while the model writes prose
    assert states[marker_done] is True  # the marker's last token hands over to the grammar
    assert trigger.matcher.get_error() == ""


def grammar_accepts(tokenizer: Tokenizer, ll_tokenizer: Any, parser: str, call_text: str,
                    parallel: bool = True) -> bool:
    """Whether the grammar, triggered by its marker, takes ``call_text`` (after the marker) to the end."""
    made = triggered_grammar(parser, (WEATHER, TIME), parallel)
    assert made is not None
    m = LLMatcher(ll_tokenizer, made[0], log_level=0)
    ids = tokenizer.encode(made[1] + call_text, add_special_tokens=False).ids
    return all(m.consume_token(t) for t in ids) and m.is_accepting()


@pytest.mark.parametrize(("parser", "good", "bad"), [
    ("hermes", '\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>',
     ['\n{"name": "get_wether", "arguments": {"city": "Paris"}}\n</tool_call>',  # no such function
      '\n{"name": "get_weather", "arguments": {"unit": "c"}}\n</tool_call>',  # a required argument missing
      '\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "k"}}\n</tool_call>']),  # not in the enum
    ("llama3_json", '{"name": "get_time", "parameters": {"zone": "UTC"}}',
     ['{"name": "get_time", "arguments": {"zone": "UTC"}}']),  # Llama 3 calls them parameters
    ("mistral", ' [{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "Oslo"}}]',
     [' [{"name": "get_time", "arguments": {"zone": 3}}]']),
    ("granite", '[{"name": "get_weather", "arguments": {"city": "Oslo"}}]', ['[{"name": "get_weather"}]']),
    ("qwen3_xml", "\n<function=get_weather>\n<parameter=city>\nSan Jose, CA\n</parameter>\n</function>\n"
                  "</tool_call>",
     ["\n<function=get_wether>\n</function>\n</tool_call>",  # no such function
      "\n<function=get_time>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>"]),  # not its
])
def test_a_started_call_can_only_be_valid(tokenizer: Tokenizer, ll_tokenizer: Any, parser: str, good: str,
                                          bad: list[str]) -> None:
    assert grammar_accepts(tokenizer, ll_tokenizer, parser, good)
    for text in bad:
        assert not grammar_accepts(tokenizer, ll_tokenizer, parser, text), text


def test_one_call_only_without_parallel_calls(tokenizer: Tokenizer, ll_tokenizer: Any) -> None:
    one = '\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    assert grammar_accepts(tokenizer, ll_tokenizer, "hermes", one + "\n<tool_call>" + one)
    assert not grammar_accepts(tokenizer, ll_tokenizer, "hermes", one + "\n<tool_call>" + one, parallel=False)
    made = triggered_grammar("hermes", (TIME,), parallel=False)
    assert made is not None
    m = LLMatcher(ll_tokenizer, made[0], log_level=0)
    assert all(m.consume_token(t) for t in tokenizer.encode("<tool_call>" + one, add_special_tokens=False).ids)
    assert m.is_stopped()  # the one call is the whole answer: the engine ends it there


def test_pythonic_has_no_marker_to_start_from() -> None:
    assert triggered_grammar("pythonic", (TIME,), True) is None
    made = plan(TOOLS, "auto", None, {"tool_call_parser": "pythonic"})
    assert made is not None and made.triggered() is None


def test_a_marker_the_tokenizer_holds_as_a_special_token_is_matched_as_that_token() -> None:
    made = triggered_grammar("llama3_json", (TIME,), True, special={"<|python_tag|>": 128010})
    assert made is not None
    assert json.dumps("<|python_tag|>") not in made[0] and "128010" in made[0]
