"""Reasoning kept apart from the answer: models that think in ``<think>`` ... ``</think>`` before they answer.

Design note: one splitter serves every API (chat's ``reasoning_content``, Responses' reasoning items, Messages'
thinking blocks): it takes the answer's text as it arrives and returns ``("reasoning" | "content", piece)``, holding
back only what may be the start of a tag. Whether a model thinks comes from ``option.reasoning_parser``: ``auto``
(the default) reads the chat template (one that writes ``<think>`` thinks), ``none`` never, ``think`` (aliases
``deepseek_r1``, ``qwen3``, ``granite`` as vLLM names its parsers) always. Two styles, told apart per request by the
rendered prompt: DeepSeek-R1's templates open the thinking in the prompt (the answer starts inside it and the first
``</think>`` closes it); Qwen3's let the model open it (``<think>`` at the answer's start, else no reasoning).

A constraint (a JSON schema, a tool call, a regex) describes the answer, not the thinking: for a thinking model
its grammar is wrapped so that the thinking comes first, free up to ``</think>``, and the constraint applies after
(llguidance's lazy ``suffix`` lexeme ends the thinking exactly at the tag).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from rollcore.types import TokenInfo
from serving.requests import structured

OPEN, CLOSE = "<think>", "</think>"
PARSERS = ("auto", "none", "think", "deepseek_r1", "qwen3", "granite")
Piece = tuple[str, str]


def thinks(options: Mapping[str, str], template: str | None) -> bool:
    """Whether this model's answers may hold reasoning."""
    parser = options.get("reasoning_parser", "auto")
    if parser == "auto":
        return bool(template) and OPEN in str(template)
    return parser != "none"


def opened_by(prompt: str) -> bool:
    """True when the rendered prompt leaves a ``<think>`` open: the answer starts inside the reasoning."""
    tail = prompt.rstrip()
    return tail.endswith(OPEN)


class ReasoningSplitter:
    """An answer's text, as it arrives -> reasoning and content pieces. ``opened``: the prompt opened the
    reasoning (DeepSeek-R1's style); otherwise only an answer that starts with ``<think>`` reasons."""

    def __init__(self, opened: bool) -> None:
        self.state = "reasoning" if opened else "start"  # start -> reasoning -> content, or start -> content
        self._held = ""
        self._after_close = False  # drop the whitespace right after </think> (it separates, it is not content)

    def count_feed(self, text: str, tokens: int = 1) -> tuple[int, list[Piece]]:
        """``feed`` of ``tokens`` tokens' text, and how many of them count as reasoning (all when the text was
        in, opened or closed the reasoning)."""
        before = self.state
        pieces = self.feed(text)
        return (tokens if "reasoning" in (before, self.state) else 0), pieces

    def feed(self, text: str) -> list[Piece]:
        self._held += text
        out: list[Piece] = []
        while self._held:
            if self.state == "start":
                stripped = self._held.lstrip()
                if stripped.startswith(OPEN):
                    self.state, self._held = "reasoning", stripped[len(OPEN):]
                    continue
                if OPEN.startswith(stripped):  # may still become the tag
                    return out
                self.state = "content"
            if self.state == "reasoning":
                at = self._held.find(CLOSE)
                if at < 0:
                    keep = _tag_prefix(self._held, CLOSE)
                    piece, self._held = self._held[:len(self._held) - keep], self._held[len(self._held) - keep:]
                    if piece:
                        out.append(("reasoning", piece))
                    return out
                if at:
                    out.append(("reasoning", self._held[:at]))
                self.state, self._held, self._after_close = "content", self._held[at + len(CLOSE):], True
                continue
            if self._after_close:
                self._held = self._held.lstrip()
                if not self._held:
                    return out
                self._after_close = False
            out.append(("content", self._held))
            self._held = ""
        return out

    def finish(self) -> list[Piece]:
        """What is still held at the end of the answer (a tag that never completed is text of its part)."""
        held, self._held = self._held, ""
        if not held or (self._after_close and not held.strip()):
            return []
        return [("reasoning" if self.state == "reasoning" else "content", held)]


def split_whole(text: str, opened: bool) -> tuple[str | None, str]:
    """A whole answer -> (reasoning or None, content)."""
    splitter = ReasoningSplitter(opened)
    pieces = splitter.feed(text) + splitter.finish()
    reasoning = "".join(p for kind, p in pieces if kind == "reasoning")
    return reasoning or None, "".join(p for kind, p in pieces if kind == "content")


def reasoning_tokens(tokens: Sequence[TokenInfo], opened: bool) -> int:
    """How many of an answer's tokens were reasoning (the tags' included)."""
    splitter, count = ReasoningSplitter(opened), 0
    for t in tokens:
        count += splitter.count_feed(t.text)[0]
        if splitter.state == "content":
            break
    return count


def _tag_prefix(text: str, tag: str) -> int:
    """How many trailing characters of ``text`` may be the start of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def after_reasoning(grammar: str, opened: bool) -> str:
    """``grammar`` (llguidance's serialized form, or Lark text) applied after the reasoning: free thinking up to
    ``</think>`` first (optional, from ``<think>``, unless the prompt opened it)."""
    try:
        top = json.loads(grammar)
    except ValueError:
        top = {"grammars": [{"lark_grammar": grammar}]}
    first, *rest = top["grammars"]
    thinking = "think /[ \\n]*/" if opened else f'("{OPEN}" think /[ \\n]*/)?'
    head = f'start: {thinking} @answer\nthink[suffix="{CLOSE}"]: /(.|\\n)*/\n'
    wrapped = {**top, "grammars": [{"lark_grammar": head}, {**first, "name": "answer"}, *rest]}
    return structured.check(json.dumps(wrapped), "response_format")
