"""Structured output: a request's constraint (JSON schema, regex, choice, grammar) -> one grammar for the engine.

Design note: every protocol's fields (OpenAI ``response_format``, vLLM's ``guided_*`` and ``structured_outputs``,
TGI's ``grammar``, the same on LMI ``parameters`` and the typed gRPC message) end here and become one string,
``SamplingParams.grammar``: llguidance's serialized grammar. The engine (and the dynamic handler) compiles it
against the model's tokenizer and masks the logits with it; nothing downstream knows which API asked.

llguidance rather than xgrammar: it installs as one wheel with no dependencies (xgrammar pulls triton and a
TVM runtime), computes each step's mask lazily from a lexer and an Earley parser (no ahead-of-time pass over
the vocabulary, so a new schema costs milliseconds), and takes JSON schema, regex, Lark and GBNF. The frontend
checks the grammar here, with no tokenizer, so a bad schema is a 400 naming the field before any work.

JSON is generated with fixed separators (``", "`` and ``": "``) and no free whitespace between tokens: a
small model allowed free whitespace can emit newlines until ``max_tokens`` and never close the object.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from llguidance import LLMatcher
from llguidance.gbnf_to_lark import gbnf_to_lark

from rollcore.errors import InvalidRequest

MAX_GRAMMAR_BYTES = 256 * 1024  # a schema, regex or grammar larger than this is refused before compiling
MAX_CHOICES = 1024
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

# One request asks for at most one constraint; these are the fields that can carry one, by API.
GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def json_schema(schema: Any, field: str) -> str:
    """A JSON schema (an object, or its JSON text) -> grammar. Raises ``InvalidRequest`` naming ``field``."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise InvalidRequest(f"{field!r} is not valid JSON: {exc}") from None
    if isinstance(schema, bool):  # JSON schema's true / false
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise InvalidRequest(f"{field!r} must be a JSON schema (an object), got {type(schema).__name__}")
    _check_size(json.dumps(schema), field)
    return check(LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS), field)  # type: ignore[arg-type]


def json_object(field: str) -> str:
    """Any JSON object (OpenAI's ``json_object``)."""
    return json_schema({"type": "object"}, field)


def regex(pattern: Any, field: str) -> str:
    if not isinstance(pattern, str) or not pattern:
        raise InvalidRequest(f"{field!r} must be a non-empty string (a regular expression)")
    _check_size(pattern, field)
    return check(LLMatcher.grammar_from_regex(pattern), field)


def choice(options: Any, field: str) -> str:
    """Exactly one of the strings ``options``."""
    if (not isinstance(options, list) or not options or len(options) > MAX_CHOICES
            or not all(isinstance(o, str) and o for o in options)):
        raise InvalidRequest(f"{field!r} must be a list of 1 to {MAX_CHOICES} non-empty strings")
    _check_size(json.dumps(options), field)
    # JSON string literals are Lark string literals: the choices are matched exactly, whatever they contain
    return check(LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(o) for o in options)), field)


def grammar(text: Any, field: str) -> str:
    """A context-free grammar: Lark (llguidance's dialect), or GBNF (llama.cpp's, vLLM's examples) when it uses
    ``::=``."""
    if not isinstance(text, str) or not text.strip():
        raise InvalidRequest(f"{field!r} must be a non-empty string (a Lark or GBNF grammar)")
    _check_size(text, field)
    if "::=" in text:
        try:
            text = gbnf_to_lark(text)
        except Exception as exc:  # noqa: BLE001 - the converter raises plain exceptions on bad GBNF
            raise InvalidRequest(f"{field!r} is not a valid GBNF grammar: {exc}") from None
    return check(LLMatcher.grammar_from_lark(text), field)


def lark(text: str, field: str) -> str:
    """A Lark grammar this server wrote (tool calls' formats): compiled and checked like a client's."""
    return check(LLMatcher.grammar_from_lark(text), field)


def check(serialized: str, field: str) -> str:
    """Refuse a grammar llguidance cannot build (the message is its own, naming the rule or keyword)."""
    error = LLMatcher.validate_grammar(serialized)
    if error:
        raise InvalidRequest(f"{field!r} cannot be used as a constraint: {error.strip()}")
    return serialized


def _check_size(text: str, field: str) -> None:
    if len(text.encode("utf-8", "surrogatepass")) > MAX_GRAMMAR_BYTES:
        raise InvalidRequest(f"{field!r} is larger than {MAX_GRAMMAR_BYTES // 1024} KiB; at most that is compiled")


def from_guided(values: Mapping[str, Any], where: str = "") -> str | None:
    """vLLM's ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` (null = absent) ->
    grammar or None. More than one -> 400."""
    given = [k for k in GUIDED_FIELDS if values.get(k) is not None]
    if not given:
        return None
    if len(given) > 1:
        raise InvalidRequest(f"only one constraint per request: got {', '.join(repr(where + k) for k in given)}")
    key = given[0]
    build = {"guided_json": json_schema, "guided_regex": regex, "guided_choice": choice, "guided_grammar": grammar}
    return build[key](values[key], where + key)


def from_structured_outputs(spec: Mapping[str, Any], where: str = "structured_outputs") -> str | None:
    """vLLM's newer ``structured_outputs`` object: one of ``json``, ``regex``, ``choice``, ``grammar``,
    ``json_object``."""
    keys = {"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice", "grammar": "guided_grammar"}
    unknown = sorted(set(spec) - {*keys, "json_object"})
    if unknown:
        raise InvalidRequest(f"'{where}' has unknown fields {unknown}: it takes one of json, regex, choice, grammar, "
                             "json_object")
    given = [k for k in (*keys, "json_object") if spec.get(k) not in (None, False)]
    if len(given) > 1:
        raise InvalidRequest(f"only one constraint per request: got {', '.join(f'{where}.{k}' for k in given)}")
    if not given:
        return None
    if given[0] == "json_object":
        return json_object(f"{where}.json_object")
    return from_guided({keys[given[0]]: spec[given[0]]}, f"{where}.")


def from_response_format(fmt: Mapping[str, Any], where: str = "response_format") -> str | None:
    """OpenAI's ``response_format`` (``text``, ``json_object``, ``json_schema``) and TGI's (``json`` / ``regex``
    with a ``value``)."""
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":  # llama.cpp's (and older instructor's) schema beside the type
        schema = fmt.get("schema")
        return json_object(where) if schema is None else json_schema(schema, f"{where}.schema")
    if kind == "json_schema":
        spec = fmt.get("json_schema", fmt.get("value"))  # OpenAI's key, or TGI's
        if not isinstance(spec, dict):
            raise InvalidRequest(f"'{where}.json_schema' must be an object with a 'schema' (OpenAI's shape)")
        schema = spec.get("schema")
        return json_object(where) if schema is None else json_schema(schema, f"{where}.json_schema.schema")
    if kind in ("json", "regex"):  # TGI's grammar shape
        if "value" not in fmt:
            raise InvalidRequest(f"'{where}' of type {kind!r} needs a 'value'")
        return (json_schema if kind == "json" else regex)(fmt["value"], f"{where}.value")
    raise InvalidRequest(f"'{where}.type' must be one of 'text', 'json_object', 'json_schema' (OpenAI) or "
                         f"'json', 'regex' (TGI), got {kind!r}")


def one_of(*grammars: tuple[str, str | None]) -> str | None:
    """The one grammar among several fields' (name, grammar or None); two at once -> 400."""
    given = [(name, g) for name, g in grammars if g is not None]
    if len(given) > 1:
        raise InvalidRequest(f"only one constraint per request: got {', '.join(repr(n) for n, _ in given)}")
    return given[0][1] if given else None
