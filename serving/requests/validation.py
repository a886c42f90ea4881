"""Validating a request against its model (``serving.requests.schema``) and turning the first error into one message
that names the field by its JSON path (``'messages[0].role'``; ``parameter 'top_p'`` inside a sampling
parameters object) and quotes the rule of the document (``must be > 0 and <= 1``). Unknown fields come first
(every one by its dotted path, ``messages.0.foo``, as ``X-Ignored-Parameters`` names them; unknown parameters of a
sampling parameters object by their names), then the first error in the order of the model's fields. Parts of
a request that take other keys (``extra="allow"``) name them the same way after validation.

Kernel module: imports nothing of the project but ``rollcore.errors`` and ``serving.requests.schema``.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Generic, TypeVar

from pydantic import BaseModel, ValidationError

from rollcore.errors import InvalidRequest
from serving.requests.schema import SchemaGenerator, resolve_caps, shape_of_schema

M = TypeVar("M", bound=BaseModel)
_UNIT = {True: "characters", False: "entries"}


class RequestSchema(Generic[M]):
    """Validates JSON values against ``model`` with the project's messages. ``params_at``: where a sampling
    parameters object sits (``("parameters",)``; ``()`` when the model is one), whose fields are named
    ``parameter 'x'`` and whose unknown names are "unknown parameters"."""

    def __init__(self, model: type[M], params_at: tuple[str, ...] | None = None) -> None:
        self.model = model
        self.params_at = params_at
        self._schemas: dict[Any, dict[str, Any]] = {}

    def validate(self, value: Any, limits: Any, *, strict: bool = True, ignored: list[str] | None = None) -> M:
        """``value`` as a ``model`` instance, or ``InvalidRequest`` naming the first problem. Not ``strict``:
        unknown fields are dropped instead of refused, their paths added to ``ignored``."""
        try:
            return self._open_parts(self.model.model_validate(value, context=limits), strict, ignored)
        except ValidationError as exc:
            errors = exc.errors(include_url=False)
        unknown = [e["loc"] for e in errors if e["type"] == "extra_forbidden"]
        if unknown and not strict:
            try:
                valid = self.model.model_validate(_without(value, unknown), context=limits)
            except ValidationError as exc:
                errors = exc.errors(include_url=False)
            else:
                if ignored is not None:
                    schema = self.schema(limits)
                    ignored.extend(sorted(".".join(map(str, _locate(schema, loc)[0])) for loc in unknown))
                return self._open_parts(valid, strict, ignored)
        raise InvalidRequest(self.message(errors, limits)) from None

    @staticmethod
    def _open_parts(valid: M, strict: bool, ignored: list[str] | None) -> M:
        """Parts that take other keys (``extra="allow"``: what OpenAI clients send back) name them too: refused when
        ``strict``, else added to ``ignored`` (dotted paths, ``messages.0.refusal``)."""
        extra = sorted(".".join(map(str, path)) for path in _extras(valid, ()))
        if extra and strict:
            raise InvalidRequest(f"unknown fields: {', '.join(extra)}")
        if extra and ignored is not None:
            ignored.extend(extra)
        return valid

    def schema(self, limits: Any) -> dict[str, Any]:
        """The model's JSON schema (``$defs`` inline) with the caps of ``limits``."""
        schema = self._schemas.get(limits)
        if schema is None:
            schema = resolve_caps(self.model.model_json_schema(schema_generator=SchemaGenerator), limits)
            if len(self._schemas) < 16:
                self._schemas[limits] = schema
        return schema

    def message(self, errors: list[Any], limits: Any) -> str:
        """The message of a failed validation: unknown fields (all of one object), else the first error."""
        schema = self.schema(limits)
        unknown = [e for e in errors if e["type"] == "extra_forbidden"]
        if unknown:
            parent = unknown[0]["loc"][:-1]
            names = sorted(str(e["loc"][-1]) for e in unknown if e["loc"][:-1] == parent)
            path, _ = _locate(schema, parent)
            if self.params_at is not None and tuple(path) == self.params_at:
                return f"unknown parameters: {', '.join(names)}"
            # every one outside the parameters, by its dotted path (as X-Ignored-Parameters names it)
            paths = (_locate(schema, e["loc"])[0] for e in unknown)
            dotted = sorted({".".join(map(str, p)) for p in paths
                             if self.params_at is None or tuple(p[:len(self.params_at)]) != self.params_at})
            return f"unknown fields: {', '.join(dotted)}"
        err = errors[0]
        path, node = _locate(schema, err["loc"])
        return explain(err["type"], self._name(path), node, err.get("input"), err.get("ctx") or {})

    def _name(self, path: list[str | int]) -> str:
        at = self.params_at
        if at is not None and len(path) > len(at) and tuple(path[:len(at)]) == at:
            return f"parameter {_quote(path[len(at):])}"
        return _quote(path) if path else "request body"


def _extras(value: Any, path: tuple[str | int, ...]) -> Iterator[tuple[str | int, ...]]:
    """The JSON paths of the other keys a validated model holds, at any depth (fields by their JSON names)."""
    if isinstance(value, BaseModel):
        for key in value.model_extra or ():
            yield (*path, key)
        for name, info in type(value).model_fields.items():
            yield from _extras(getattr(value, name), (*path, info.alias or name))
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _extras(item, (*path, i))


def _without(value: Any, locs: list[tuple[Any, ...]]) -> Any:
    """A copy of ``value`` without the (unknown) keys at ``locs``; the containers on the way are copied (a
    step that is no key of the value is a ``ByShape`` tag: it names a branch, not a container)."""
    out = copy.copy(value)
    for loc in locs:
        parent = out
        for part in loc[:-1]:
            if isinstance(parent, dict) and part in parent or isinstance(parent, list) and isinstance(part, int):
                child = copy.copy(parent[part])
                parent[part] = child
                parent = child
        if isinstance(parent, dict):
            parent.pop(loc[-1], None)
    return out


def _quote(path: Sequence[str | int]) -> str:
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return f"'{text}'"


def _plain(node: Any, defs: Mapping[str, Any]) -> dict[str, Any]:
    """``node`` with its ``$ref`` resolved and a nullable ``anyOf [X, null]`` reduced to X."""
    for _ in range(8):
        if not isinstance(node, dict):
            return {}
        ref = node.get("$ref")
        if isinstance(ref, str):
            node = {**defs.get(ref.rsplit("/", 1)[-1], {}), **{k: v for k, v in node.items() if k != "$ref"}}
            continue
        branches = node.get("anyOf")
        if isinstance(branches, list):
            rest = [b for b in branches if b != {"type": "null"}]
            if len(rest) == 1:
                node = {**{k: v for k, v in node.items() if k != "anyOf"}, **rest[0]}
                continue
        return node
    return node


def _locate(schema: Mapping[str, Any], loc: Sequence[Any]) -> tuple[list[str | int], dict[str, Any]]:
    """An error location -> (the JSON path as the client wrote it, the schema node there). Branch tags of
    ``ByShape`` unions are steps of the location but not of the path."""
    defs = schema.get("$defs", {})
    node = _plain(schema, defs)
    path: list[str | int] = []
    for part in loc:
        branches = node.get("oneOf")
        if isinstance(branches, list) and isinstance(part, str):
            node = next((_plain(b, defs) for b in branches if shape_of_schema(_plain(b, defs)) == part), {})
            continue
        path.append(part)
        if isinstance(part, int):
            node = _plain(node.get("items", {}), defs)
        else:
            node = _plain(node.get("properties", {}).get(part, {}), defs)
    return path, node


def explain(kind: str, name: str, node: Mapping[str, Any], value: Any, ctx: Mapping[str, Any]) -> str:
    """One validation error as the project's message (``name`` is the quoted field)."""
    if kind == "missing":
        return f"missing field {name}"
    if kind == "unsupported":
        return f"{name} {ctx['why']}, got {show(value)}"
    if kind == "none_required":
        return f"{name} is not supported: only null is accepted, got {show(value)}"
    if kind == "string_unicode":
        return f"{name} contains invalid Unicode (a lone surrogate)"
    if kind == "finite_number":
        return f"{name} must be finite, got {value!r}"
    if kind == "string_pattern_mismatch":
        return f"{name} must match {ctx['pattern']}, got {show(value)}"
    if kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        return f"{name} must be {bounds(node, ctx)}, got {show(value)}"
    if kind in ("too_long", "string_too_long"):
        text = isinstance(value, str)
        limit = f" ({node['x-limit']})" if isinstance(node.get("x-limit"), str) else ""
        return f"{name} has {len(value)} {_UNIT[text]}; at most {ctx['max_length']}{limit}"
    if kind in ("too_short", "string_too_short"):
        least = ctx.get("min_length", 1)
        if least == 1:
            return f"{name} must not be empty"
        return f"{name} must have at least {least} {_UNIT[isinstance(value, str)]}"
    if kind == "literal_error" or kind.endswith("_type") or kind.startswith("union_tag"):
        expected = "a JSON object" if name == "request body" else describe(node)
        got = show(value) if kind == "literal_error" else kind_of(value)
        return f"{name} must be {expected}, got {got}"
    return f"{name}: {kind}"


def bounds(node: Mapping[str, Any], ctx: Mapping[str, Any]) -> str:
    """``>= 0 and <= 2`` from the schema node (the violated bound from ``ctx`` if the node has none)."""
    parts = []
    for open_key, closed_key, open_op, closed_op, ctx_open, ctx_closed in (
            ("exclusiveMinimum", "minimum", ">", ">=", "gt", "ge"),
            ("exclusiveMaximum", "maximum", "<", "<=", "lt", "le")):
        if open_key in node:
            parts.append(f"{open_op} {_number(node[open_key])}")
        elif closed_key in node:
            parts.append(f"{closed_op} {_number(node[closed_key])}")
        elif ctx_open in ctx:
            parts.append(f"{open_op} {_number(ctx[ctx_open])}")
        elif ctx_closed in ctx:
            parts.append(f"{closed_op} {_number(ctx[ctx_closed])}")
    return " and ".join(parts)


def _number(x: Any) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


_NAMES = {"string": "a string", "integer": "an integer", "number": "a number", "boolean": "a boolean",
          "object": "an object", "null": "null"}
_PLURALS = {"string": "strings", "integer": "integers", "number": "numbers", "boolean": "booleans",
            "object": "objects"}


def describe(node: Mapping[str, Any]) -> str:
    """What a schema node accepts, in words: ``a string or a list of strings``, ``one of 'a' or 'b'``."""
    if "const" in node:
        return show(node["const"])
    if "enum" in node:
        values = [show(v) for v in node["enum"]]
        return "one of " + _either(values)
    branches = node.get("oneOf") or node.get("anyOf")
    if isinstance(branches, list):
        return _either([describe(b) for b in branches])
    kind = node.get("type")
    if kind == "array":
        items = node.get("items")
        return f"a list of {_plural(items)}" if isinstance(items, dict) and items else "a list"
    return _NAMES.get(str(kind), "an object")


def _plural(node: Mapping[str, Any]) -> str:
    kind = node.get("type")
    if kind == "array" and isinstance(node.get("items"), dict):
        return f"lists of {_plural(node['items'])}"
    return _PLURALS.get(str(kind), "objects")


def _either(words: list[str]) -> str:
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


def kind_of(value: Any) -> str:
    """The JSON kind of a value, for messages: ``a string``, ``an integer``, ``a list``, ``null``."""
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
            dict: "an object", type(None): "null"}.get(type(value), type(value).__name__)


def show(value: Any) -> str:
    """A value for a message: an integer's digits (or its size when huge), else a ``repr`` cut at 80."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def type_error(name: str, expected: str, value: Any) -> InvalidRequest:
    """The message of a type error found outside a model (same words as the models' messages)."""
    return InvalidRequest(f"'{name}' must be {expected}, got {kind_of(value)}")

