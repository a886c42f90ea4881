"""A model's text side in the frontend: its tokenizer, context length, chat template and special tokens.

Design note: validation "before any work" needs the prompt's token count in the frontend, which never
imports transformers; the ``tokenizers`` package reads the model folder's ``tokenizer.json`` (the same
file transformers' fast tokenizer uses, so counts match the worker's; ``rollcore.tokenizer_probe`` checks it
per load, and then the ids travel with the request). A model without one (a custom handler, ``echo``) skips
the frontend length check and leaves it to its handler. Each endpoint owns one ``TextSide``: every route
(LMI, OpenAI, TGI, Responses, Messages, tokenizer, embeddings) reads the same ``ModelText``, so a model's
tokenizer is loaded once per load of its workers. Event loop only (``TextSide.get``); a built ``ModelText``
is read-only and may be used from the tokenize pool.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from rollcore.errors import InvalidRequest
from rollcore.model_folder import read_json_object, weights_folder
from rollcore.tokenizer_probe import TOKENIZER_PROBE

log = logging.getLogger(__name__)


class ModelText:
    """What the frontend knows about one model's text side."""

    def __init__(self, name: str, model_dir: Path | None, info: dict[str, Any]) -> None:
        self.name = name
        self.max_model_len: int | None = info.get("max_model_len") if isinstance(info.get("max_model_len"),
                                                                                  int) else None
        self.tokenizer = _load_tokenizer(model_dir)
        config = read_json_object(model_dir / "tokenizer_config.json") if model_dir is not None else {}
        self.tokenizer_config: dict[str, Any] = config  # tokenizer_config.json as read (/tokenizer_info)
        template = info.get("chat_template")
        if not isinstance(template, str) or not template:
            template = _template_from_dir(model_dir, config)
        self.chat_template: str | None = template
        self.special_tokens = {k: v for k in ("bos_token", "eos_token")
                               if isinstance(v := info.get(k, config.get(k)), str)}
        # the tokenizer's special tokens by text (a tool-call marker that is one is constrained as that token)
        self.special_by_text: dict[str, int] = {
            str(tok.content): i for i, tok in (self.tokenizer.get_added_tokens_decoder().items() if self.tokenizer
                                               else ()) if getattr(tok, "special", False)}
        self._special_ids: frozenset[int] = frozenset(self.special_by_text.values())
        # the worker takes these ids instead of tokenizing the text again once it encodes the probe alike
        probe = info.get("tokenizer_probe")
        self.ids_travel = self.tokenizer is not None and isinstance(probe, list) and probe == self.encode(
            TOKENIZER_PROBE)

    def encode(self, text: str) -> list[int] | None:
        """Token ids of ``text`` as the worker will see them (special tokens added), or None."""
        if self.tokenizer is None:
            return None
        # encode_batch releases the GIL while it works (encode does not): a long prompt tokenized on a
        # thread (see ``off_loop``) then leaves the event loop free.
        return list(self.tokenizer.encode_batch([text])[0].ids)

    def worker_ids(self, ids: list[int] | None) -> tuple[int, ...] | None:
        """``ids`` (this side's encoding of a prompt) as the request's ``prompt_token_ids`` when the worker's
        tokenizer agrees with this one (``rollcore.tokenizer_probe``), so that the prompt is tokenized once; else
        None: the worker tokenizes the text."""
        return tuple(ids) if ids is not None and self.ids_travel else None

    def decode(self, ids: list[int] | tuple[int, ...]) -> str | None:
        if self.tokenizer is None:
            return None
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    def token_text(self, token_id: int) -> str:
        """The text of one token id (for top-logprob listings); the id in brackets if unknown."""
        if self.tokenizer is not None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            if text:
                return str(text)
            piece = self.tokenizer.id_to_token(token_id)  # e.g. a byte-fallback piece like <0xE2>
            if piece:
                return str(piece)
        return f"[{token_id}]"

    def is_special(self, token_id: int) -> bool:
        """True for the tokenizer's special tokens (BOS, EOS, chat markers)."""
        return token_id in self._special_ids

    def check_length(self, num_prompt_tokens: int | None, max_new_tokens: int | None, new_tokens_field: str
                     ) -> None:
        """Reject a prompt that does not fit the context: names both token counts. Raises ``InvalidRequest``."""
        if num_prompt_tokens is None or self.max_model_len is None:
            return
        if num_prompt_tokens >= self.max_model_len:
            raise InvalidRequest(f"the prompt has {num_prompt_tokens} tokens but the context of model "
                                 f"{self.name!r} is {self.max_model_len} tokens (max_model_len)")
        if max_new_tokens is not None and num_prompt_tokens + max_new_tokens > self.max_model_len:
            raise InvalidRequest(
                f"the prompt has {num_prompt_tokens} tokens and {new_tokens_field} is {max_new_tokens}: "
                f"{num_prompt_tokens + max_new_tokens} exceeds the context of model {self.name!r}, "
                f"{self.max_model_len} tokens (max_model_len)")

    def room(self, num_prompt_tokens: int | None, cap: int) -> int:
        """Tokens left in the context after the prompt, at most ``cap`` (a default for max_tokens)."""
        if num_prompt_tokens is None or self.max_model_len is None:
            return cap
        return max(1, min(cap, self.max_model_len - num_prompt_tokens))


class TextSide:
    """One endpoint's ``ModelText``, rebuilt when the facts it is made of (its workers' ``describe()``) change:
    a model's tokenizer is read once, not once per route."""

    FACTS = ("max_model_len", "chat_template", "tokenizer_probe", "bos_token", "eos_token")

    def __init__(self, name: str, model_dir: Path | None, options: Mapping[str, Any]) -> None:
        self.name = name
        self.model_dir = weights_folder(model_dir, options.get("model_id")) if model_dir is not None else None
        self._seen: Mapping[str, Any] | None = None
        self._facts: tuple[Any, ...] | None = None
        self._text: ModelText | None = None

    def get(self, info: Mapping[str, Any]) -> ModelText:
        """The ``ModelText`` for the workers' ``info``; an ``info`` seen last time costs one identity check."""
        if info is self._seen and self._text is not None:
            return self._text
        facts = tuple(info.get(k) for k in self.FACTS)
        if self._text is None or facts != self._facts:
            self._text = ModelText(self.name, self.model_dir, dict(info))
            self._facts = facts
        self._seen = info
        return self._text


def _load_tokenizer(model_dir: Path | None) -> Tokenizer | None:
    if model_dir is None or not (model_dir / "tokenizer.json").is_file():
        return None
    try:
        return Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    except Exception as exc:  # noqa: BLE001 - a tokenizer we cannot read only disables frontend counts
        log.warning("cannot load %s: %s", model_dir / "tokenizer.json", exc)
        return None


def _template_from_dir(model_dir: Path | None, config: dict[str, Any]) -> str | None:
    if model_dir is not None and (model_dir / "chat_template.jinja").is_file():
        return (model_dir / "chat_template.jinja").read_text(encoding="utf-8")
    template = config.get("chat_template")
    return template if isinstance(template, str) and template else None
