"""Frontend-side prompt facts of a model: token counts, context length, chat template.

Design note: validation "before any work" needs the prompt's token count in the frontend, which never
imports transformers; the ``tokenizers`` package reads the model folder's ``tokenizer.json`` (the same
file transformers' fast tokenizer uses, so counts match the worker's). A model without one (a custom
handler, ``echo``) skips the frontend length check and leaves it to its handler. ``ModelTexts`` caches
one ``ModelText`` per endpoint object; it is owned by a route module, never global. Event loop only.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections.abc import Callable
from concurrent.futures import Executor
from pathlib import Path
from typing import Any, TypeVar

from tokenizers import Tokenizer

from rollcore.errors import InvalidRequest
from rollcore.tokenizer_probe import TOKENIZER_PROBE

log = logging.getLogger(__name__)


class ModelText:
    """What the frontend knows about one model's text side."""

    def __init__(self, name: str, model_dir: Path | None, info: dict[str, Any]) -> None:
        self.name = name
        self.max_model_len: int | None = info.get("max_model_len") if isinstance(info.get("max_model_len"),
                                                                                  int) else None
        self.tokenizer = _load_tokenizer(model_dir)
        config = _read_json(model_dir / "tokenizer_config.json") if model_dir is not None else {}
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


INLINE_WORK_BYTES = 4096  # bodies up to this size are tokenized on the event loop (cheaper than a thread hop)
T = TypeVar("T")


async def off_loop(pool: Executor | None, size_bytes: int, fn: Callable[..., T], *args: Any) -> T:
    """Run ``fn(*args)`` (prompt parsing and tokenization) on ``pool`` unless the body is small, so that long
    prompts never stall the event loop (``/ping`` and every stream keep flowing). The composition root's
    pool has one thread fewer than the CPUs, so tokenization cannot take every core from the loop."""
    if size_bytes <= INLINE_WORK_BYTES:
        return fn(*args)
    return await asyncio.get_running_loop().run_in_executor(pool, functools.partial(fn, *args))


class ModelTexts:
    """One ``ModelText`` per model version, rebuilt when the endpoint object (a reload) or its info changes."""

    def __init__(self) -> None:
        self._cache: dict[str, tuple[int, int, ModelText]] = {}

    def get(self, ep: Any) -> ModelText:
        info = dict(getattr(ep, "info", None) or {})
        key = (id(ep), len(info))
        slot = f"{ep.name}:{getattr(ep, 'version', '')}"  # versions of one model alternate without a rebuild
        hit = self._cache.get(slot)
        if hit is not None and hit[:2] == key:
            return hit[2]
        config = getattr(ep, "config", None)
        model_dir = _tokenizer_dir(config)
        text = ModelText(ep.name, model_dir, info)
        self._cache[slot] = (*key, text)
        return text


def _tokenizer_dir(config: Any) -> Path | None:
    if config is None:
        return None
    model_dir = Path(config.model_dir)
    model_id = config.options.get("model_id") if hasattr(config, "options") else None
    if model_id and (model_dir / model_id).is_dir():
        return model_dir / model_id
    return model_dir


def _load_tokenizer(model_dir: Path | None) -> Tokenizer | None:
    if model_dir is None or not (model_dir / "tokenizer.json").is_file():
        return None
    try:
        return Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    except Exception as exc:  # noqa: BLE001 - a tokenizer we cannot read only disables frontend counts
        log.warning("cannot load %s: %s", model_dir / "tokenizer.json", exc)
        return None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _template_from_dir(model_dir: Path | None, config: dict[str, Any]) -> str | None:
    if model_dir is not None and (model_dir / "chat_template.jinja").is_file():
        return (model_dir / "chat_template.jinja").read_text(encoding="utf-8")
    template = config.get("chat_template")
    return template if isinstance(template, str) and template else None
