"""OpenAI tool calling: the tools' grammar and prompt, and the model's text -> ``tool_calls`` (whole or streamed).

Design note: ``tool_choice`` decides who makes the call valid:
- a named function: the answer is constrained (``serving.requests.structured``) to that function's ``parameters``
  schema, and the whole answer is its arguments;
- ``required``: constrained to a JSON array of ``{"name": ..., "arguments": ...}`` objects, one schema branch
  per function (one item unless ``parallel_tool_calls``), as vLLM does; the model's own call format plays no part;
- ``auto`` (every model's default; ``option.enable_auto_tool_choice=false`` refuses it): free text, in which
  the model's own format (``serving.frontends.http.tool_formats``: read from its chat template, or named by
  ``option.tool_call_parser``) finds calls; once the model writes a call's marker, the rest of the call is
  constrained to the tools' schemas (a grammar with a trigger); text that does not parse stays plain content;
- ``none``: the tools are shown to the model but no call is parsed.

The tools reach the model through its chat template (``tools``, as transformers passes them); a template that
never reads ``tools`` gets them in a system message in the Hermes format instead (as TGI does for every model).

``ToolStream`` is the one reader of the answer: the streamed route feeds it each delta's text and sends the
deltas it returns (index, id and name first, argument fragments after, as OpenAI streams them); the whole
answer is the same deltas folded (``fold``), so both shapes always agree.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from rollcore.errors import InvalidRequest
from serving.frontends.http.tool_formats import (
    call_schema,
    call_start,
    detect,
    parameters,
    parse,
    partial_marker,
    triggered_grammar,
)
from serving.requests import structured

__all__ = ["ToolPlan", "ToolStream", "add_tools_prompt", "fold", "parse", "plan"]
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
FORCED = ("required", "named")

SYSTEM_PROMPT = (
    "You are a function calling AI model. You are provided with function signatures within <tools></tools> XML "
    "tags. You may call one or more functions to assist with the user query. Don't make assumptions about what "
    "values to plug into functions. Here are the available tools: <tools>{tools}</tools>\n"
    "For each function call return a json object with function name and arguments within <tool_call></tool_call> "
    "XML tags as follows:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n"
    "</tool_call>")


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What a request's ``tools``/``tool_choice`` ask: ``mode`` none / auto / required / named."""

    functions: tuple[dict[str, Any], ...]  # OpenAI function objects: name, description, parameters
    mode: str
    name: str | None = None  # the named function
    parallel: bool = True
    parser: str = "hermes"  # the call format (serving.frontends.http.tool_formats.PARSERS)

    @property
    def template_tools(self) -> list[dict[str, Any]]:
        """The tools as chat templates read them (OpenAI's shape)."""
        return [{"type": "function", "function": f} for f in self.functions]

    def grammar(self) -> str | None:
        """The constraint of the forced modes (None for auto and none)."""
        if self.mode == "named":
            return structured.json_schema(parameters(self._function(self.name)), "tools[].function.parameters")
        if self.mode != "required":
            return None
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": call_schema(self.functions)}
        if not self.parallel:
            schema["maxItems"] = 1
        return structured.json_schema(schema, "tools")

    def triggered(self, special: dict[str, int] | None = None) -> tuple[str, str] | None:
        """auto: (grammar, trigger) that keep a call the model starts valid, or None (no marker to start from)."""
        if self.mode != "auto":
            return None
        return triggered_grammar(self.parser, self.functions, self.parallel, special)

    def _function(self, name: str | None) -> dict[str, Any]:
        return next(f for f in self.functions if f["name"] == name)


def plan(tools: list[Any] | None, tool_choice: Any, parallel: bool | None, options: dict[str, str],
         template: str | None = None) -> ToolPlan | None:
    """Validated ``tools`` (``schemas.Tool`` dumps) and ``tool_choice`` -> a plan, or None without tools. Raises
    ``InvalidRequest`` for a choice the tools or the model's options cannot honour. ``template``: the model's
    chat template, which says its call format unless ``option.tool_call_parser`` names one."""
    functions = tuple(t["function"] for t in tools or ())
    names = [f["name"] for f in functions]
    for i, name in enumerate(names):
        if not _NAME.fullmatch(name):
            raise InvalidRequest(f"'tools[{i}].function.name' must be 1 to 64 letters, digits, '_', '.' or '-', "
                                 f"got {name!r}")
    if len(set(names)) != len(names):
        raise InvalidRequest("'tools' has two functions of the same name")
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        if name not in names:
            raise InvalidRequest(f"'tool_choice' names function {name!r}, which is not in 'tools'")
        mode = "named"
    else:
        name = None
        mode = tool_choice or ("auto" if functions else "none")
    if not functions:
        if mode in ("required", "named"):
            raise InvalidRequest(f"'tool_choice' {mode!r} needs 'tools'")
        return None
    if mode == "auto" and options.get("enable_auto_tool_choice", "true").lower() != "true":
        raise InvalidRequest("'tool_choice' auto is switched off on this model (option.enable_auto_tool_choice="
                             "false); 'required' or a named function work")
    parser = options.get("tool_call_parser", "auto")
    if parser == "auto":
        parser = detect(template if template and "tools" in template else None)
    return ToolPlan(functions, mode, name, parallel is not False, parser)


def add_tools_prompt(messages: list[dict[str, Any]], plan: ToolPlan) -> list[dict[str, Any]]:
    """For a template that does not read ``tools``: the tools in a system message (Hermes' wording)."""
    text = SYSTEM_PROMPT.format(tools=json.dumps(plan.template_tools, ensure_ascii=False))
    if messages and messages[0]["role"] == "system":
        first = {**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# --- reading the answer ----------------------------------------------------------------------------------
class ToolStream:
    """Turns an answer's text, as it arrives, into OpenAI ``delta`` objects for ``plan``."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.calls = 0
        self._text = ""
        self._pos = 0  # what of _text has been turned into deltas
        self._in_args = False
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._held_from: int | None = None  # auto: where the model's tool calls begin

    @property
    def finish_as_tool_calls(self) -> bool:
        """``finish_reason: tool_calls`` (OpenAI answers ``stop`` for a named function)."""
        return self.calls > 0 and self.plan.mode != "named"

    def feed(self, text: str) -> list[dict[str, Any]]:
        self._text += text
        if self.plan.mode == "named":
            return self._named()
        if self.plan.mode == "required":
            return self._required()
        if self.plan.mode == "auto":
            return self._auto_content()
        return self._content(len(self._text))

    def finish(self) -> list[dict[str, Any]]:
        """The deltas the end of the answer releases (auto: the parsed calls, or the held text as content)."""
        if self.plan.mode != "auto" or self._held_from is None:
            return self._content(len(self._text)) if self.plan.mode in ("auto", "none") else []
        content, calls = parse(self._text[self._held_from:], self.plan.parser)
        if not calls:
            return self._content(len(self._text))
        out = [{"content": content}] if content else []
        for call in calls:
            out.extend(self._call(call["name"], call["arguments"]))
        self._pos = len(self._text)
        return out

    # --- modes ---
    def _content(self, end: int) -> list[dict[str, Any]]:
        piece, self._pos = self._text[self._pos:end], max(self._pos, end)
        return [{"content": piece}] if piece else []

    def _named(self) -> list[dict[str, Any]]:
        out = []
        if self.calls == 0:
            out = self._call(self.plan.name or "", "")
        piece, self._pos = self._text[self._pos:], len(self._text)
        if piece:
            out.append({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]})
        return out

    def _call(self, name: str, arguments: str) -> list[dict[str, Any]]:
        index = self.calls
        self.calls += 1
        head = {"index": index, "id": new_call_id(), "type": "function", "function": {"name": name, "arguments": ""}}
        out: list[dict[str, Any]] = [{"tool_calls": [head]}]
        if arguments:
            out.append({"tool_calls": [{"index": index, "function": {"arguments": arguments}}]})
        return out

    # a call's head: after "[" (the first) or the previous call's "}" and ",", up to where its arguments begin
    _HEAD = re.compile(r'\s*(?:\}\s*)?[\[,]?\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')

    def _required(self) -> list[dict[str, Any]]:
        """``[{"name": N, "arguments": {...}}, ...]`` as it arrives: a call's head once its name is complete,
        then its arguments as they grow (their end found by counting braces outside strings)."""
        out: list[dict[str, Any]] = []
        while True:
            if not self._in_args:
                m = self._HEAD.match(self._text, self._pos)
                if m is None or m.end() == len(self._text):  # the value has not begun: more space may come
                    return out
                out.extend(self._call(json.loads(m.group(1)), ""))
                self._pos, self._in_args, self._depth = m.end(), True, 0
            start = self._pos
            end = self._scan_value()
            piece = self._text[start:end if end is not None else len(self._text)]
            if piece:
                out.append({"tool_calls": [{"index": self.calls - 1, "function": {"arguments": piece}}]})
            if end is None:
                self._pos = len(self._text)
                return out
            self._pos, self._in_args = end, False

    def _scan_value(self) -> int | None:
        """From ``_pos`` inside the arguments object: the index just past its closing brace, or None."""
        for i in range(self._pos, len(self._text)):
            ch = self._text[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return i + 1
        return None

    def _auto_content(self) -> list[dict[str, Any]]:
        """Content up to where a tool call may begin; from there the text is held until ``finish``."""
        if self._held_from is not None:
            return []
        start = call_start(self._text, self.plan.parser)
        if start is not None:
            self._held_from = start
            return self._content(start)
        return self._content(len(self._text) - partial_marker(self._text, self.plan.parser))


def fold(plan: ToolPlan, deltas: list[dict[str, Any]]) -> tuple[str | None, list[dict[str, Any]]]:
    """Deltas -> the whole answer's ``content`` (None when empty) and ``tool_calls``."""
    content = "".join(d.get("content") or "" for d in deltas)
    calls: list[dict[str, Any]] = []
    for d in deltas:
        for part in d.get("tool_calls", ()):
            if "id" in part:
                calls.append({"id": part["id"], "type": "function",
                              "function": {"name": part["function"]["name"], "arguments": ""}})
            calls[part["index"]]["function"]["arguments"] += part["function"].get("arguments", "")
    return content or None, calls
