"""Chat prompts: render OpenAI ``messages`` (validated by ``schemas.ChatMessage``) with the model's chat template.

Design note: the frontend process never imports transformers, so the template (a Jinja string the
handler reports in ``describe()["chat_template"]``) is rendered here with jinja2's immutable sandbox, with
the same globals transformers gives it (``raise_exception``, ``strftime_now``, ``bos_token``, ...). A
model without a template or a template that raises becomes ``InvalidRequest``
(400). Compiled templates are cached per template string. Runs on the event loop.
"""

from __future__ import annotations

import datetime
import json
from functools import lru_cache
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from rollcore.errors import InvalidRequest
from serving.requests.bodies import ChatMessage


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


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Validated messages (``schemas.ChatMessage``) -> ``[{"role", "content"[, "name", "tool_calls",
    "tool_call_id"]}]`` with text content (text parts joined; null content is empty), what chat templates read.
    A call's arguments are given as an object when they parse (templates such as Qwen's and Llama's serialize
    them with ``tojson``), as vLLM passes them."""
    out = []
    for m in messages:
        content = m.content
        text = "" if content is None else content if isinstance(content, str) else "".join(p.text for p in content)
        item: dict[str, Any] = {"role": m.role, "content": text}
        if m.name is not None:
            item["name"] = m.name
        if m.tool_calls:
            item["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _arguments(c.function.arguments)}} for c in m.tool_calls]
        if m.tool_call_id is not None:
            item["tool_call_id"] = m.tool_call_id
        out.append(item)
    return out


def _arguments(text: str) -> Any:
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def render_chat(template: str | None, messages: list[dict[str, Any]], *, model: str,
                special_tokens: dict[str, str] | None = None, add_generation_prompt: bool = True,
                tools: list[dict[str, Any]] | None = None) -> str:
    """Render checked ``messages`` (and ``tools``, OpenAI's shape) with the model's chat ``template``. Raises
    ``InvalidRequest`` when the model has none or the template refuses the conversation."""
    if not template:
        raise InvalidRequest(f"model {model!r} has no chat template: use /v1/completions with a prompt")
    try:
        compiled = _compile(template)
        text = compiled.render(messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
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
