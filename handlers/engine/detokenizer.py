"""Incremental detokenization with stop-sequence hold-back.

Design note: ``tokenizers.decoders.DecodeStream`` turns one token id at a time into text and returns
nothing until the bytes form complete UTF-8, so no character is ever split and no space is lost. Text
that could still be the start of a stop string is held back until it is disambiguated; a stop string
ends the request and is itself never released.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

PROMPT_CONTEXT_TOKENS = 5  # prompt tail given to the stream so the first piece decodes as in context


@dataclass(frozen=True, slots=True)
class DetokenizedStep:
    """``piece``: the token's own text (may be ''), ``released``: text the client may see now."""

    piece: str
    released: str
    stopped: bool


class IncrementalDetokenizer:
    """Per-request streaming decoder; runs on the engine thread."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], stop: tuple[str, ...] = (),
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._stream = DecodeStream(ids=list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]),
                                    skip_special_tokens=skip_special_tokens)
        self._stop = tuple(s for s in stop if s)
        self._held = ""

    def push(self, token_id: int) -> DetokenizedStep:
        """Decode one more token; returns its piece and the text released by it."""
        piece = self._stream.step(self._tokenizer, token_id) or ""
        if not self._stop:
            return DetokenizedStep(piece, piece, False)
        text = self._held + piece
        hit = min((i for i in (text.find(s) for s in self._stop) if i >= 0), default=-1)
        if hit >= 0:
            self._held = ""
            return DetokenizedStep(piece, text[:hit], True)
        keep = self._hold_length(text)
        self._held = text[len(text) - keep:] if keep else ""
        return DetokenizedStep(piece, text[:len(text) - keep], False)

    def flush(self) -> str:
        """Release held-back text at the end of a request that did not stop on a stop string."""
        held, self._held = self._held, ""
        return held

    def _hold_length(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
        best = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best
