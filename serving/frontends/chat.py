"""Chat prompts: validate OpenAI ``messages`` and render them with the model's chat template.

Design note: the frontend process never imports transformers, so the template (a Jinja string the
handler reports in ``describe()["chat_template"]``) is rendered here with jinja2's immutable sandbox, with
the same globals transformers gives it (``raise_exception``, ``strftime_now``, ``bos_token``, ...). A
model without a template, a template that raises, or malformed messages all become ``InvalidRequest``
(400). Compiled templates are cached per template string. Runs on the event loop.
"""

from __future__ import annotations

import datetime
import json
from functools import lru_cache
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from serving.errors import InvalidRequest
from serving.params import check_text

ROLES = ("system", "developer", "user", "assistant", "tool", "function")
MAX_MESSAGES = 4096


class _TemplateError(Exception):
    """Raised by a template's ``raise_exception(...)``."""


def _raise_exception(message: str) -> None:
    raise _TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def _content(index: int, content: Any) -> str:
    """A message's content: a string, or a list of ``{"type": "text", "text": ...}`` parts (joined)."""
    where = f"messages[{index}].content"
    if isinstance(content, str):
        return check_text(where, content, allow_empty=True)
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise InvalidRequest(f"{where}: only text parts ({{'type': 'text', 'text': ...}}) are supported")
            texts.append(check_text(f"{where}[].text", part.get("text"), allow_empty=True))
        return "".join(texts)
    if content is None:
        return ""
    raise InvalidRequest(f"{where} must be a string or a list of text parts")


def check_messages(messages: Any) -> list[dict[str, str]]:
    """OpenAI ``messages`` -> ``[{"role", "content"}]`` with text content. Raises ``InvalidRequest``."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty list of {role, content} objects")
    if len(messages) > MAX_MESSAGES:
        raise InvalidRequest(f"'messages' has {len(messages)} entries; at most {MAX_MESSAGES}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InvalidRequest(f"messages[{i}] must be an object with 'role' and 'content'")
        role = m.get("role")
        if role not in ROLES:
            raise InvalidRequest(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}")
        item: dict[str, str] = {"role": role, "content": _content(i, m.get("content"))}
        if isinstance(m.get("name"), str):
            item["name"] = m["name"]
        out.append(item)
    return out


def render_chat(template: str | None, messages: list[dict[str, str]], *, model: str,
                special_tokens: dict[str, str] | None = None, add_generation_prompt: bool = True) -> str:
    """Render checked ``messages`` with the model's chat ``template``. Raises ``InvalidRequest`` when the
    model has none or the template refuses the conversation."""
    if not template:
        raise InvalidRequest(f"model {model!r} has no chat template: use /v1/completions with a prompt")
    try:
        compiled = _compile(template)
        text = compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               **(special_tokens or {}))
    except _TemplateError as exc:
        raise InvalidRequest(f"the chat template of model {model!r} rejected the messages: {exc}") from None
    except jinja2.TemplateError as exc:
        raise InvalidRequest(f"the chat template of model {model!r} failed: {type(exc).__name__}: {exc}") from None
    if not text:
        raise InvalidRequest("the chat template rendered an empty prompt")
    return text


def special_tokens_of(info: dict[str, Any]) -> dict[str, str]:
    """``bos_token``/``eos_token`` strings a template may reference, when the handler reported them."""
    return {k: v for k in ("bos_token", "eos_token") if isinstance(v := info.get(k), str)}
