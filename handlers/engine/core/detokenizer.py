"""Incremental detokenization with stop-sequence hold-back.

Design note: each step decodes a short window of token ids -- the tokens of the previous release (context,
so that decoders that strip or merge at the start, e.g. SentencePiece's leading space, decode as in the
full text) plus the tokens not released yet -- and releases what the window's text adds beyond the
context's text, once it does not end in U+FFFD (an incomplete UTF-8 character waits for its next bytes).
So no character is ever split, no space is lost, and only a few tokens are decoded per step.

The prompt's last tokens are the first context and none of their text is ever released. A prompt (token
ids) may end inside a character, whose first bytes show as U+FFFD in the prompt's text. If the generated
tokens complete that character, the whole character is the completion's first text (the prompt never
showed it; vLLM emits the same); if they do not, the U+FFFD is prompt text and only what follows it is
released. (The first version primed ``tokenizers``' ``DecodeStream`` with the prompt's tail, which then
released the tail's text too when the prompt ended inside a character.)

Text that could still be the start of a stop string is held back until it is disambiguated; a stop string
ends the request and is itself never released. A stop token (``push(..., stop_token=True)``) releases no
text of its own (vLLM's rule); ``flush`` still releases what was held back.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Tokenizer

PROMPT_CONTEXT_TOKENS = 5  # prompt tail decoded before the first token so it decodes as in context
_REPLACEMENT = "\ufffd"


@dataclass(frozen=True, slots=True)
class DetokenizedStep:
    """``piece``: the token's own text (may be ''), ``released``: text the client may see now."""

    piece: str
    released: str
    stopped: bool


class IncrementalDetokenizer:
    """Per-request streaming decoder; runs on the engine thread."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], stop: tuple[str, ...] = (),
                 skip_special_tokens: bool = True, include_stop: bool = False) -> None:
        """``include_stop``: the stop string that ends the request is released with the text before it."""
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._include_stop = include_stop
        self._stop = tuple(s for s in stop if s)
        self._held = ""
        # Window: ids[:_read] decode to _prefix, text already accounted for (at first the prompt's, which is
        # never released); ids[_read:] are tokens whose text is not released yet.
        self._ids = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._read = len(self._ids)
        self._prefix = self._decode(self._ids)

    def push(self, token_id: int, stop_token: bool = False) -> DetokenizedStep:
        """Decode one more token; returns its piece and the text released by it.

        ``stop_token``: the token ends the request (EOS, ``stop_token_ids``); its text is not released and the
        detokenizer is left as before it, so ``flush`` releases only what the earlier tokens held back."""
        if stop_token:
            return DetokenizedStep(self._decode([token_id]), "", False)
        self._ids.append(token_id)
        text = self._decode(self._ids)
        piece = ""
        if not text.endswith(_REPLACEMENT):
            piece = self._new_text(text)
            if piece:
                self._advance_window()
        return self._release(piece)

    def flush(self) -> tuple[str, str]:
        """Release what is left at the end of a request that did not stop on a stop string: text held back
        for stop strings and tokens still waiting for the rest of a character (their U+FFFD, as decoding the
        generated tokens gives). Returns (the released text, the part of it no token's piece had yet: the
        last token's piece gets it)."""
        pending = ""
        if len(self._ids) > self._read:
            pending = self._new_text(self._decode(self._ids))
            self._advance_window()
        held, self._held = self._held + pending, ""
        return held, pending

    # --------------------------------------------------------------- internals
    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def _advance_window(self) -> None:
        """The tokens just released become the context of the next ones."""
        self._ids = self._ids[self._read:]
        self._read = len(self._ids)
        self._prefix = self._decode(self._ids)

    def _new_text(self, text: str) -> str:
        """What ``text`` (the window's decoded text) adds beyond the text already accounted for."""
        if text.startswith(self._prefix):
            return text[len(self._prefix):]
        # The context ended inside a character (only a prompt can: released text never ends in U+FFFD) and
        # the new bytes completed it: the character is new text, the U+FFFD standing for its first bytes goes.
        complete = self._prefix.rstrip(_REPLACEMENT)
        if text.startswith(complete):
            return text[len(complete):]
        # A decoder that rewrote the context's text (not seen with byte-level or SentencePiece decoders):
        # release from the first difference rather than fail the request.
        return text[_common_prefix_length(text, self._prefix):]

    def _release(self, piece: str) -> DetokenizedStep:
        if not self._stop:
            return DetokenizedStep(piece, piece, False)
        text = self._held + piece
        hits = [(i, s) for s in self._stop if (i := text.find(s)) >= 0]
        if hits:
            hit, stop = min(hits, key=lambda h: h[0])  # the earliest; of two at one place, the first listed
            self._held = ""
            return DetokenizedStep(piece, text[:hit + len(stop)] if self._include_stop else text[:hit], True)
        keep = self._hold_length(text)
        self._held = text[len(text) - keep:] if keep else ""
        return DetokenizedStep(piece, text[:len(text) - keep], False)

    def _hold_length(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
        best = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best


def _common_prefix_length(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
