"""The model families' own tool-call formats: which one a model speaks, how a call starts, how to read one, and
the grammar that keeps a started call valid.

Design note: ``tool_choice`` auto lets the model decide, so the answer is free text until the model starts a
call; from that point the call is constrained like a forced one (llama.cpp's lazy grammars, vLLM's structural
tags): the grammar travels with the request beside its *trigger*, the text that starts a call, and the engine
applies it from the token where the trigger appears (``handlers.engine.execution.decoding.grammar_trigger``). A started
call therefore always names one of the request's functions with arguments valid for its schema.

Formats (vLLM's parser names): ``hermes`` (``<tool_call>{json}</tool_call>``: Hermes, Qwen 2.5/3, SmolLM3, and
the generic format this server prompts any model with whose template ignores ``tools``), ``llama3_json``
(``<|python_tag|>`` or bare ``{"name", "parameters"}``), ``mistral`` (``[TOOL_CALLS][{...}]``), ``granite``
(``<|tool_call|>[{...}]``), ``qwen3_xml`` (``<tool_call><function=f><parameter=a>1</parameter></function></tool_call>``:
Qwen3-Coder; the grammar holds function and parameter names, values are free text), ``pythonic``
(``[f(a=1), g(b="x")]``: Llama 3.2/4; read only, no grammar). With
``option.tool_call_parser=auto`` (the default) the format is read from the chat template.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from serving.requests import structured

PARSERS = ("hermes", "llama3_json", "mistral", "granite", "qwen3_xml", "pythonic")
MARKERS = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]", "llama3_json": "<|python_tag|>",
           "granite": "<|tool_call|>", "qwen3_xml": "<tool_call>"}

# what in a chat template says which format it renders (first match wins: Granite's marker contains Hermes',
# Qwen3-Coder's calls sit inside Hermes' tags)
_TEMPLATE_SIGNS = (("<|tool_call|>", "granite"), ("[TOOL_CALLS]", "mistral"), ("<|python_tag|>", "llama3_json"),
                   ("<function=", "qwen3_xml"), ("<tool_call>", "hermes"))


def detect(template: str | None) -> str:
    """The format a chat template renders tool calls in; ``hermes`` (the generic format) when it names none."""
    for sign, parser in _TEMPLATE_SIGNS:
        if template and sign in template:
            return parser
    return "hermes"


# --- where a call starts -----------------------------------------------------------------------------------
def call_start(text: str, parser: str) -> int | None:
    """Where in ``text`` the model's calls begin, or None."""
    marker = MARKERS.get(parser)
    if marker is not None:
        at = text.find(marker)
        if at >= 0:
            return at
    stripped = text.lstrip()
    if parser in ("llama3_json", "mistral", "pythonic") and stripped[:1] in ("{", "["):
        # Llama 3 answers a call with bare JSON; Mistral's marker is a special token a decoder may drop;
        # pythonic calls are a bare list
        if (parser == "llama3_json") == (stripped[0] == "{"):
            return len(text) - len(stripped)
    return None


def partial_marker(text: str, parser: str) -> int:
    """How many trailing characters could be the start of the parser's marker (held back)."""
    marker = MARKERS.get(parser, "")
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return len(text) if parser in ("llama3_json", "pythonic") and not text.strip() else 0


# --- reading calls -----------------------------------------------------------------------------------------
def parse(text: str, parser: str) -> tuple[str | None, list[dict[str, str]]]:
    """A whole answer in ``parser``'s format -> (content before the calls, calls as ``{"name", "arguments"}``
    with the arguments as JSON text). Text that is not a well-formed call gives ``(text, [])``."""
    readers = {"hermes": _hermes, "llama3_json": _llama3, "mistral": _mistral, "granite": _granite,
               "qwen3_xml": _qwen3_xml, "pythonic": _pythonic}
    try:
        content, raw = readers[parser](text)
        calls = [_one_call(c) for c in raw]
    except (ValueError, KeyError, TypeError, SyntaxError):
        return text, []
    if not calls:
        return text, []
    return (content.strip() or None), calls


def _one_call(c: Any) -> dict[str, str]:
    name = c["name"]
    args = c.get("arguments", c.get("parameters", {}))
    if isinstance(args, str):
        args = json.loads(args)
    if not isinstance(name, str) or not isinstance(args, dict):
        raise TypeError("a call is a name and an arguments object")
    return {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}


def _hermes(text: str) -> tuple[str, list[Any]]:
    start = text.find("<tool_call>")
    if start < 0:
        return text, []
    calls = []
    for part in text[start:].split("<tool_call>")[1:]:
        body = part.split("</tool_call>")[0].strip()
        calls.append(json.loads(body))
    return text[:start], calls


def _json_values(text: str, separator: str) -> list[Any]:
    """Consecutive JSON values in ``text``, separated by whitespace and ``separator``; anything else raises."""
    decoder = json.JSONDecoder()
    values, at = [], 0
    while True:
        while at < len(text) and (text[at].isspace() or text[at] == separator):
            at += 1
        if at == len(text):
            return values
        value, at = decoder.raw_decode(text, at)
        values.append(value)


def _llama3(text: str) -> tuple[str, list[Any]]:
    body = text.replace("<|python_tag|>", "")
    stripped = body.lstrip()
    if not stripped.startswith("{"):
        return text, []
    return "", _json_values(stripped, ";")


def _listed(text: str, marker: str) -> tuple[str, list[Any]]:
    at = text.find(marker)
    content, body = (text[:at], text[at + len(marker):]) if at >= 0 else ("", text)
    values = _json_values(body, ",")
    return content, [c for v in values for c in (v if isinstance(v, list) else [v])]


def _mistral(text: str) -> tuple[str, list[Any]]:
    return _listed(text, "[TOOL_CALLS]")


def _granite(text: str) -> tuple[str, list[Any]]:
    if "<|tool_call|>" not in text:
        return text, []
    return _listed(text, "<|tool_call|>")


_XML_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.DOTALL)
_XML_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


def _qwen3_xml(text: str) -> tuple[str, list[Any]]:
    """``<tool_call><function=f><parameter=a>value</parameter></function></tool_call>``; a value that reads as JSON
    other than a string (a number, true, an object) is that value, anything else the text itself (as vLLM's
    parser, which has the schema, mostly decides)."""
    start = text.find("<tool_call>")
    if start < 0:
        return text, []
    calls = []
    for part in text[start:].split("<tool_call>")[1:]:
        found = _XML_FUNCTION.search(part)
        if found is None:
            raise ValueError("a tool call without a function")
        calls.append({"name": found.group(1).strip(), "arguments": {
            m.group(1).strip(): _xml_value(m.group(2)) for m in _XML_PARAMETER.finditer(found.group(2))}})
    return text[:start], calls


def _xml_value(text: str) -> Any:
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return text if isinstance(value, str) else value


def _pythonic(text: str) -> tuple[str, list[Any]]:
    """``[f(a=1), g(b="x")]``: a Python list of calls with keyword arguments of literal values."""
    stripped = text.strip()
    if not stripped.startswith("["):
        return text, []
    tree = ast.parse(stripped, mode="eval").body
    if not isinstance(tree, ast.List):
        raise TypeError("pythonic calls are a list")
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            raise TypeError("each pythonic call is name(keyword=value, ...)")
        calls.append({"name": node.func.id,
                      "arguments": {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg}})
    return "", calls


# --- keeping a started call valid ----------------------------------------------------------------------------
def call_schema(functions: tuple[dict[str, Any], ...], arguments_key: str = "arguments") -> dict[str, Any]:
    """One call of any of ``functions``: ``{"name": <one of them>, arguments_key: <its parameters>}``."""
    calls = [{"type": "object", "properties": {"name": {"const": f["name"]}, arguments_key: parameters(f)},
              "required": ["name", arguments_key], "additionalProperties": False} for f in functions]
    return {"anyOf": calls}


def parameters(function: dict[str, Any]) -> dict[str, Any]:
    params = function.get("parameters")
    return params if isinstance(params, dict) else {"type": "object"}


def triggered_grammar(parser: str, functions: tuple[dict[str, Any], ...], parallel: bool,
                      special: dict[str, int] | None = None) -> tuple[str, str] | None:
    """(grammar, trigger) for a started call in ``parser``'s format, or None where the format has no marker
    to start from (pythonic; Llama 3's bare JSON is covered once ``<|python_tag|>`` is written). ``special``:
    the tokenizer's special tokens by text (a marker that is one is matched as that token, not as its text)."""
    marker = MARKERS.get(parser)
    if marker is None:
        return None
    key = "parameters" if parser == "llama3_json" else "arguments"
    call = json.dumps({"x-guidance": structured.JSON_OPTIONS, **call_schema(functions, key)}, ensure_ascii=False)
    token = (special or {}).get(marker)
    start = f"<[{token}]>" if token is not None else json.dumps(marker)
    # the token that completes a marker written as text may carry text before it: anything but the marker's
    # first character
    prefix = "" if token is not None else f"/[^{_class_escape(marker[0])}]*/"
    if parser == "qwen3_xml":
        return structured.lark(_xml_lark(functions, parallel), "tools"), marker
    if parser == "hermes":
        one = f'{start} "\\n"? call "\\n"? "</tool_call>"'
        rest = f" (WS {one})*" if parallel else ""
        lark = f"start: PREFIX {one}{rest}\nWS: /[ \\n]*/\n"
    elif parser == "llama3_json":
        rest = ' (";" " "? call)*' if parallel else ""
        lark = f"start: PREFIX {start} call{rest}\n"
    else:
        rest = ' (", " call)*' if parallel else ""
        lark = f'start: PREFIX {start} " "? "[" call{rest} "]"\n'
    if prefix:
        lark += f"PREFIX: {prefix}\n"
    else:
        lark = lark.replace("start: PREFIX ", "start: ")
    lark += f"call: %json {call}\n"
    return structured.lark(lark, "tools"), marker


def _xml_lark(functions: tuple[dict[str, Any], ...], parallel: bool) -> str:
    """Qwen3-Coder's calls: the names of a request's functions and of their parameters, each value free text up to
    its closing tag."""
    rules = []
    for k, f in enumerate(functions):
        names = list(parameters(f).get("properties") or {})
        param = (f'"<parameter=" ({" | ".join(json.dumps(n) for n in names)}) ">\\n" value "\\n"' if names
                 else None)
        rules.append(f'f{k}: "<function={f["name"]}>\\n" {f"({param})*" if param else ""} "</function>"')
    one = '"<tool_call>\\n" call "\\n</tool_call>"'
    rest = f" (WS {one})*" if parallel else ""
    return (f"start: PREFIX {one}{rest}\nWS: /[ \\n]*/\nPREFIX: /[^<]*/\n"
            f"call: {' | '.join(f'f{k}' for k in range(len(functions)))}\n" + "\n".join(rules) + "\n"
            'value[suffix="</parameter>"]: /(.|\\n)*/\n')


def _class_escape(ch: str) -> str:
    return "\\" + ch if ch in "[]\\^-/" else ch
