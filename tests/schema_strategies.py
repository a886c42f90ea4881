"""Hypothesis strategies read from ``/openapi.json``'s request schemas (never from the pydantic models): bodies
valid per the document, and bodies with one value out of its documented range.

The document is the contract under test, so this module interprets its JSON Schema itself (the subset the
document uses: type, minimum/maximum/exclusiveMinimum, minLength/maxLength, minItems/maxItems,
maxProperties, const, enum, anyOf/oneOf, properties/required, items, $ref). ``Caps`` bounds the sizes a
test can afford (a prompt of a million characters is valid but slow); ``ROUTE_RULES`` are the cross-field
rules the document states in words (each rule quotes its field's description).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from hypothesis import strategies as st

Schema = Mapping[str, Any]
Path = tuple[str, ...]  # property names; "[]" for the items of a list


TOKEN_ID_MAX = 2**31 - 1


@dataclass(frozen=True)
class Caps:
    """What a test can afford: string, list and integer sizes; ``vocab``: token ids (integers documented as
    0..2^31-1) are drawn below it, as the document asks for "ids of the model's vocabulary"; ``by_name``:
    strategies for properties of that name."""

    max_text: int = 24
    max_items: int = 3
    max_int: int = 10**6
    vocab: int | None = None
    by_name: Mapping[str, st.SearchStrategy[Any]] = field(default_factory=dict)


TEXT = st.text(st.characters(exclude_categories=("Cs",)), min_size=0, max_size=64)


class Document:
    """The request schemas of an OpenAPI document (``components.schemas``)."""

    def __init__(self, document: Mapping[str, Any]) -> None:
        self.document = document
        self.components: Mapping[str, Any] = document["components"]["schemas"]

    def request_schema(self, path: str) -> Schema:
        """The request body schema of ``POST path``."""
        return self.document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]

    def resolve(self, node: Schema) -> Schema:
        while "$ref" in node:
            node = self.components[node["$ref"].rsplit("/", 1)[-1]]
        return node

    def plain(self, node: Schema) -> Schema:
        """``node`` resolved, a nullable ``anyOf [X, null]`` reduced to X."""
        node = self.resolve(node)
        branches = node.get("anyOf")
        if isinstance(branches, list):
            rest = [b for b in branches if b != {"type": "null"}]
            if len(rest) == 1:
                return {**{k: v for k, v in node.items() if k != "anyOf"}, **self.plain(rest[0])}
        return node

    def properties(self, node: Schema) -> dict[str, Schema]:
        return dict(self.plain(node).get("properties", {}))

    # --- valid values ---------------------------------------------------------------------------------
    def valid(self, node: Schema, caps: Caps, path: Path = ()) -> st.SearchStrategy[Any]:
        if path and path[-1] in caps.by_name:
            return caps.by_name[path[-1]]
        node = self.resolve(node)
        for key in ("anyOf", "oneOf"):
            if key in node:
                return st.one_of([self.valid(b, caps, path) for b in node[key]])
        if "const" in node:
            return st.just(node["const"])
        if "enum" in node:
            return st.sampled_from(node["enum"])
        kind = node.get("type")
        if kind == "null":
            return st.none()
        if kind == "boolean":
            return st.booleans()
        if kind == "integer":
            lo, hi = _int_bounds(node)
            if caps.vocab is not None and (lo, hi) == (0, TOKEN_ID_MAX):
                return st.integers(0, caps.vocab - 1)
            if path and path[-1] in ("seed",):  # the full range: the values a cap would hide
                return st.integers(lo, hi)
            lo = -caps.max_int if lo is None else lo
            return st.integers(lo, min(hi, lo + caps.max_int) if hi is not None else lo + caps.max_int)
        if kind == "number":
            lo = node.get("exclusiveMinimum", node.get("minimum", -1e6))
            hi = node.get("exclusiveMaximum", node.get("maximum", 1e6))
            return st.floats(lo, hi, exclude_min="exclusiveMinimum" in node, exclude_max="exclusiveMaximum" in node,
                             allow_nan=False, allow_infinity=False)
        if kind == "string" and "pattern" in node:
            return st.from_regex(node["pattern"], fullmatch=True)
        if kind == "string":
            least = node.get("minLength", 0)
            return st.text(st.characters(exclude_categories=("Cs",)), min_size=least,
                           max_size=max(least, min(node.get("maxLength", caps.max_text), caps.max_text)))
        if kind == "array":
            least = node.get("minItems", 0)
            most = max(least, min(node.get("maxItems", caps.max_items), caps.max_items))
            return st.lists(self.valid(node.get("items", {}), caps, (*path, "[]")), min_size=least, max_size=most)
        if kind == "object" or "properties" in node:
            if node.get("maxProperties") == 0:
                return st.just({})
            props = node.get("properties", {})
            required = set(node.get("required", ()))
            return st.fixed_dictionaries(
                {k: self.valid(v, caps, (*path, k)) for k, v in props.items() if k in required},
                optional={k: self.valid(v, caps, (*path, k)) for k, v in props.items() if k not in required})
        return st.none() | st.booleans() | st.integers() | TEXT  # {}: anything

    def example(self, node: Schema) -> Any:
        """One small valid value, deterministically (the first of each choice)."""
        node = self.plain(node)
        for key in ("anyOf", "oneOf"):
            if key in node:
                return self.example(node[key][0])
        if "const" in node:
            return node["const"]
        if "enum" in node:
            return node["enum"][0]
        kind = node.get("type")
        if kind == "integer":
            lo, hi = _int_bounds(node)
            return lo if lo is not None else (hi if hi is not None and hi < 1 else 1)
        if kind == "number":
            if "exclusiveMinimum" in node:
                return node["exclusiveMinimum"] + (node.get("maximum", node["exclusiveMinimum"] + 2)
                                                   - node["exclusiveMinimum"]) / 2
            return node.get("minimum", node.get("maximum", 1.0))
        if kind == "boolean":
            return False
        if kind == "string" and "pattern" in node:
            return next(c for c in ("0", "x", "a") if re.fullmatch(node["pattern"], c))
        if kind == "string":
            return "x" * max(1, node.get("minLength", 1)) if node.get("maxLength", 1) else ""
        if kind == "array":
            return [self.example(node.get("items", {}))] * node.get("minItems", 0)
        if kind == "object" or "properties" in node:
            props = node.get("properties", {})
            return {k: self.example(props[k]) for k in node.get("required", ())}
        return None

    # --- values out of their documented range ---------------------------------------------------------
    def constrained(self, node: Schema, path: Path = (), depth: int = 0) -> Iterator[tuple[Path, Schema]]:
        """Every (path, schema) under ``node`` with a bound a value can break: a range, a length, a count, a
        const or an enum. Paths go through object properties and list items ("[]")."""
        node = self.plain(node)
        if depth > 6:
            return
        if any(k in node for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "maxLength",
                                   "minLength", "maxItems", "minItems", "const", "enum", "maxProperties",
                                   "pattern")):
            yield path, node
        for branch in node.get("oneOf", ()):
            yield from self.constrained(branch, path, depth + 1)
        for name, prop in node.get("properties", {}).items():
            yield from self.constrained(prop, (*path, name), depth + 1)
        if isinstance(node.get("items"), dict):
            yield from self.constrained(node["items"], (*path, "[]"), depth + 1)

    def breaking(self, node: Schema) -> st.SearchStrategy[Any]:
        """Values of the node's type that break one of its bounds (sizes above 10 000 are left out)."""
        node = self.plain(node)
        options: list[st.SearchStrategy[Any]] = []
        kind = node.get("type")
        if kind == "integer":
            lo, hi = _int_bounds(node)
            if hi is not None:
                options.append(st.integers(hi + 1, hi + 10**9) | st.just(2**80))
            if lo is not None:
                options.append(st.integers(lo - 10**9, lo - 1))
        if kind == "number":
            if "maximum" in node:
                options.append(st.floats(node["maximum"], node["maximum"] + 1e9, exclude_min=True))
            if "minimum" in node:
                options.append(st.floats(node["minimum"] - 1e9, node["minimum"], exclude_max=True))
            if "exclusiveMinimum" in node:
                options.append(st.floats(node["exclusiveMinimum"] - 1e9, node["exclusiveMinimum"]))
        if kind == "string" and "pattern" in node:
            options.append(st.sampled_from(["", "y", "-1", "0x"]).filter(
                lambda v: not re.fullmatch(node["pattern"], v)))
        if kind == "string":
            if 0 < node.get("minLength", 0):
                options.append(st.just(""))
            if node.get("maxLength", math.inf) < 10_000:
                options.append(st.integers(node["maxLength"] + 1, node["maxLength"] + 20).map(lambda n: "y" * n))
        if kind == "array":
            item = self.example(node.get("items", {}))
            if 0 < node.get("minItems", 0):
                options.append(st.just([]))
            if node.get("maxItems", math.inf) < 10_000:
                options.append(st.integers(node["maxItems"] + 1, node["maxItems"] + 5).map(lambda n: [item] * n))
        if kind == "object" and node.get("maxProperties", math.inf) < 10:
            options.append(st.just({f"k{i}": 1 for i in range(node["maxProperties"] + 1)}))
        if "const" in node or "enum" in node:
            allowed = [node["const"]] if "const" in node else list(node["enum"])
            if kind == "string" or isinstance(allowed[0], str):
                options.append(st.text("abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=12).filter(
                    lambda s: s not in allowed))
            elif isinstance(allowed[0], bool):
                options.append(st.just(not allowed[0]))
            elif isinstance(allowed[0], (int, float)):
                options.append(st.sampled_from([0.5, 2, 3.5, -1]).filter(lambda v: v not in allowed))
        return st.one_of(options) if options else st.nothing()


def _int_bounds(node: Schema) -> tuple[int | None, int | None]:
    lo = node.get("minimum")
    if "exclusiveMinimum" in node:
        lo = math.floor(node["exclusiveMinimum"]) + 1
    hi = node.get("maximum")
    if "exclusiveMaximum" in node:
        hi = math.ceil(node["exclusiveMaximum"]) - 1
    return lo, hi


def put(body: Any, path: Path, value: Any) -> Any:
    """``body`` with ``value`` at ``path`` ("[]" = the first entry of a list, created if needed)."""
    if not path:
        return value
    head, rest = path[0], path[1:]
    if head == "[]":
        items = list(body) if isinstance(body, list) and body else [None]
        items[0] = put(items[0] if isinstance(items[0], (dict, list)) else {}, rest, value) if rest else value
        return items
    out = dict(body) if isinstance(body, dict) else {}
    child = out.get(head)
    out[head] = put(child if isinstance(child, (dict, list)) else ([] if rest and rest[0] == "[]" else {}),
                    rest, value)
    return out
