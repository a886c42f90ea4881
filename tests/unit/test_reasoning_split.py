"""The reasoning splitter (serving.frontends.http.reasoning): both styles, any split of the text, tags held back only
while they may complete, the token count, and constraints that apply after the thinking (run by llguidance)."""

from __future__ import annotations

import pytest
from llguidance import LLMatcher, LLTokenizer

from rollcore.types import TokenInfo
from serving.frontends.http.reasoning import (
    ReasoningSplitter,
    after_reasoning,
    opened_by,
    reasoning_tokens,
    split_whole,
    thinks,
)
from serving.requests import structured

CASES = [
    (True, "2 and 2 make 4.</think>\n\nThe answer is 4.", "2 and 2 make 4.", "The answer is 4."),
    (False, "<think>short</think> Yes.", "short", "Yes."),
    (False, "\n<think>a < b </thin k</think>ok", "a < b </thin k", "ok"),
    (False, "No thinking here.", None, "No thinking here."),
    (False, "  <thi", None, "  <thi"),  # a tag that never completes is text
    (True, "cut off while thinking <", "cut off while thinking <", ""),
    (True, "</think>", None, ""),
]


@pytest.mark.parametrize(("opened", "text", "reasoning", "content"), CASES)
def test_every_split_of_the_text_gives_the_same_parts(opened: bool, text: str, reasoning: str | None,
                                                     content: str) -> None:
    assert split_whole(text, opened) == (reasoning, content)
    for cut in range(len(text) + 1):
        s = ReasoningSplitter(opened)
        pieces = s.feed(text[:cut]) + s.feed(text[cut:]) + s.finish()
        assert ("".join(p for k, p in pieces if k == "reasoning") or None,
                "".join(p for k, p in pieces if k == "content")) == (reasoning, content), cut


def test_text_is_held_only_while_it_may_be_a_tag() -> None:
    s = ReasoningSplitter(True)
    assert s.feed("thinking </th") == [("reasoning", "thinking ")]
    assert s.feed("is") == [("reasoning", "</this")]
    plain = ReasoningSplitter(False)
    assert plain.feed("<th") == [] and plain.feed("e") == [("content", "<the")]


def test_reasoning_tokens_count_the_thinking_and_its_tags() -> None:
    tokens = [TokenInfo(i, t) for i, t in enumerate(["<think>", "hm", "m", "</think>", "\n", "Yes", "."])]
    assert reasoning_tokens(tokens, opened=False) == 4
    assert reasoning_tokens(tokens[1:], opened=True) == 3
    assert reasoning_tokens([TokenInfo(0, "Yes")], opened=False) == 0


def test_which_models_think() -> None:
    assert thinks({}, "{{ '<think>' }}") and not thinks({}, "{{ messages }}") and not thinks({}, None)
    assert not thinks({"reasoning_parser": "none"}, "<think>") and thinks({"reasoning_parser": "qwen3"}, None)
    assert opened_by("<|im_start|>assistant\n<think>\n") and not opened_by("<|im_start|>assistant\n")


def accepts(grammar: str, text: str) -> bool:
    tok = LLTokenizer("byte")
    m = LLMatcher(tok, grammar, log_level=0)
    return all(m.consume_token(t) for t in tok.tokenize_str(text)) and m.is_accepting()


@pytest.mark.parametrize(("inner", "answer"), [
    (structured.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, "f"),
     '{"a": 1}'),
    (structured.regex("[0-9]+", "f"), "42"),
    (structured.grammar('start: "yes" | "no"', "f"), "no")])
def test_a_constraint_applies_after_the_thinking(inner: str, answer: str) -> None:
    opened = after_reasoning(inner, opened=True)
    assert accepts(opened, "free < text {</think>\n" + answer)
    assert not accepts(opened, "free</think>\nnot the answer")
    optional = after_reasoning(inner, opened=False)
    assert accepts(optional, "<think>why</think>" + answer) and accepts(optional, answer)
    assert not accepts(optional, "why</think>" + answer)
