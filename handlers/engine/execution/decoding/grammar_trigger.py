"""A grammar held back until the answer writes its trigger (``SamplingParams.grammar_trigger``).

Design note: ``tool_choice`` auto leaves the answer free until the model starts a tool call; from there the call
must be valid (``serving.frontends.http.tool_formats``). So the grammar's matcher is built as usual but stays dormant
while the answer's text is watched for the trigger (a marker such as ``<tool_call>``). When the marker appears,
the matcher is fed the answer's tokens from the one where the marker begins (the grammar admits text before the
marker inside that token) and from the next step on masks the logits like any other grammar. A model that writes
the marker in a way the grammar refuses (it cannot, once masked, but it can before the marker completes: e.g.
``<tool_call>`` split unusually) keeps its free answer: the call is then read as the parser finds it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


class Trigger:
    """Watches one answer for ``trigger``; ``piece(token)`` is a token's text with special tokens kept."""

    def __init__(self, matcher: Any, trigger: str, piece: Callable[[int], str]) -> None:
        self.matcher = matcher
        self.trigger = trigger
        self._piece = piece
        self._tokens: list[int] = []
        self._starts: list[int] = []  # where each token's text begins in _text
        self._text = ""

    def push(self, token: int) -> bool | None:
        """Feed the answer's next token. True: the trigger appeared and the matcher has taken every token from
        the one where it begins (this one included): constrain from the next step on. False: still waiting.
        None: the matcher refused the answer's start of a call; stay free (the caller drops this watch)."""
        searched_to = max(0, len(self._text) - len(self.trigger) + 1)
        self._starts.append(len(self._text))
        self._tokens.append(token)
        self._text += self._piece(token)
        at = self._text.find(self.trigger, searched_to)
        if at < 0:
            return False
        first = max(i for i, start in enumerate(self._starts) if start <= at)
        for t in self._tokens[first:]:
            if not self.matcher.consume_token(t):
                log.info("a tool call began in a form its grammar does not take (%s); the answer stays free",
                         self.matcher.get_error())
                return None
        return True
