"""Request models: one definition that both validates a request and documents it in ``/openapi.json``.

Design note: every request body (and the sampling parameters every protocol shares) is a pydantic model
deriving from ``StrictModel``. ``serving.requests.validation.RequestSchema`` validates a decoded JSON value against
one and turns the first error into the project's message; ``json_schemas`` gives the same models' JSON schemas for the
OpenAPI document. The rules:

- strict types: JSON ``true`` is never a number, ``"2"`` never an integer, ``1`` never a boolean; an
  integral number (``2.0``) is an integer, as JSON Schema says (``INTEGER``); NaN and infinities are refused;
  a string with a lone surrogate is refused (``TEXT``).
- unknown fields are refused, all of them listed (``option.strict_parameters=false`` on a model drops them
  instead); ``null`` means "the default" for every optional field.
- caps that the server configuration decides (``Limits``) are declared with ``Cap("max_stop_sequences")``:
  checked against the ``Limits`` given as validation context, written into the document from the same
  ``Limits`` (with ``x-limit`` naming the setting).
- a value rollserve cannot honour is accepted only at its neutral value (``Only``, ``Empty``), with a
  message saying why; never silently ignored.
- a union is told apart by the JSON shape of the value (``ByShape``: a string, a list of strings, a list of
  integers, ...), so an error comes from the one branch the value meant, never from every branch.
- every error becomes one message naming the field by its JSON path (``'messages[0].role'``; ``parameter
  'top_p'`` inside a sampling-parameters object) and quoting the rule of the document (``must be > 0 and <=
  1``). Unknown fields come first, then the first error in the order of the model's fields.

Kernel module: imports nothing of the project but ``rollcore.errors``.
"""

from __future__ import annotations

import copy
import math
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, GetCoreSchemaHandler
from pydantic.json_schema import GenerateJsonSchema, GetJsonSchemaHandler, JsonSchemaValue, models_json_schema
from pydantic_core import CoreSchema, PydanticCustomError, core_schema


class StrictModel(BaseModel):
    """Base of every request model: strict types, no unknown fields, no NaN or infinity."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, frozen=True)


def _integral(value: Any) -> Any:
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return value


def _unicode(value: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise PydanticCustomError("string_unicode", "invalid Unicode") from None
    return value


INTEGER = BeforeValidator(_integral)
"""Last in ``Annotated[int, Field(...), INTEGER]``: ``2.0`` is the integer 2 (JSON Schema's rule)."""
TEXT = AfterValidator(_unicode)
"""A client string: valid Unicode (no lone surrogate, which no tokenizer or wire can carry)."""


@dataclass(frozen=True)
class Cap:
    """At most the value of the ``Limits`` field ``limit`` (the validation context): a number's maximum, a
    string's length or a list's number of entries. The document shows the number and ``x-limit``."""

    limit: str

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
        return core_schema.with_info_after_validator_function(self._check, handler(source))

    def __get_pydantic_json_schema__(self, schema: CoreSchema, handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        out = handler(schema)
        out["x-limit"] = self.limit
        return out

    def _check(self, value: Any, info: core_schema.ValidationInfo) -> Any:
        cap = getattr(info.context, self.limit)  # an AttributeError: validated without Limits (a bug)
        if isinstance(value, (int, float)):
            if value > cap:
                raise PydanticCustomError("less_than_equal", "too large", {"le": cap})
        elif len(value) > cap:
            kind = "string_too_long" if isinstance(value, str) else "too_long"
            raise PydanticCustomError(kind, "too long", {"max_length": cap, "actual_length": len(value)})
        return value


@dataclass(frozen=True)
class Only:
    """A field rollserve accepts only at ``values`` (its neutral value(s); null is the field's default):
    ``why`` completes the message ``'<field>' <why>, got <value>``."""

    values: tuple[Any, ...]
    why: str

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
        return core_schema.no_info_after_validator_function(self._check, handler(source))

    def __get_pydantic_json_schema__(self, schema: CoreSchema, handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        out = handler(schema)
        if len(self.values) == 1:
            out["const"] = self.values[0]
        else:
            out["enum"] = list(self.values)
        return out

    def _check(self, value: Any) -> Any:
        if not any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in self.values):
            raise PydanticCustomError("unsupported", "not supported", {"why": self.why})
        return value


@dataclass(frozen=True)
class Empty:
    """A list or object field rollserve accepts only empty (``[]`` / ``{}``, or null)."""

    why: str

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
        return core_schema.no_info_after_validator_function(self._check, handler(source))

    def __get_pydantic_json_schema__(self, schema: CoreSchema, handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        out = handler(schema)
        out["maxProperties" if out.get("type") == "object" else "maxItems"] = 0
        return out

    def _check(self, value: Any) -> Any:
        if value:
            raise PydanticCustomError("unsupported", "not supported", {"why": self.why})
        return value


# --- unions told apart by the JSON shape of the value -------------------------------------------------
def _shape_of_type(tp: Any) -> str:
    """The shape tag of a Python type: ``string``, ``integer``, ``number``, ``boolean``, ``object``,
    ``list[<shape>]``. It must equal ``shape_of_schema`` of the type's JSON schema."""
    while typing.get_origin(tp) is typing.Annotated:
        tp = typing.get_args(tp)[0]
    origin = typing.get_origin(tp)
    if origin is list:
        return f"list[{_shape_of_type(typing.get_args(tp)[0])}]"
    if origin is dict or (isinstance(tp, type) and issubclass(tp, BaseModel)):
        return "object"
    names = {str: "string", bool: "boolean", int: "integer", float: "number"}
    if tp in names:
        return names[tp]
    raise TypeError(f"ByShape cannot tell {tp!r} apart")


def shape_of_schema(node: Mapping[str, Any]) -> str:
    kind = node.get("type")
    if kind == "array":
        return f"list[{shape_of_schema(node.get('items', {}))}]"
    if kind in ("string", "integer", "number", "boolean"):
        return str(kind)
    return "object"  # an object or a $ref to a model


def _fits(value: Any, shape: str) -> bool:
    if shape.startswith("list["):
        return isinstance(value, list)
    if shape == "string":
        return isinstance(value, str)
    if shape in ("integer", "number"):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if shape == "boolean":
        return isinstance(value, bool)
    return isinstance(value, dict)


def _pick(shapes: tuple[str, ...], value: Any) -> str | None:
    """The branch a value means: by its JSON type, and for a list by its first entry (a list whose first
    entry fits no branch, or an empty list, goes to the first list branch, which names the problem)."""
    lists = [s for s in shapes if s.startswith("list[")]
    if isinstance(value, list):
        if not lists:
            return None
        for shape in lists:
            if value and _fits(value[0], shape[5:-1]):
                return shape
        return lists[0]
    for shape in shapes:
        if shape not in lists and _fits(value, shape):
            return shape
    return None


class ByShape:
    """Metadata for ``Annotated[A | B, BY_SHAPE]``: a union whose branches have distinct JSON shapes,
    validated as a tagged union (the tag is the shape; only the chosen branch reports errors)."""

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
        branches = typing.get_args(source)
        shapes = tuple(_shape_of_type(b) for b in branches)
        if len(set(shapes)) != len(shapes):
            raise TypeError(f"ByShape branches must differ in shape, got {shapes}")
        choices: dict[Any, CoreSchema] = {s: handler.generate_schema(b) for s, b in zip(shapes, branches, strict=True)}

        def shape(value: Any) -> str | None:
            return _pick(shapes, value)

        return core_schema.tagged_union_schema(choices, discriminator=shape)


BY_SHAPE = ByShape()


# --- JSON schemas -------------------------------------------------------------------------------------
class SchemaGenerator(GenerateJsonSchema):
    """pydantic's generator without a title on every property (the document reads better without)."""

    def field_title_should_be_set(self, schema: Any) -> bool:
        return False


def resolve_caps(schema: Any, limits: Any) -> Any:
    """A copy of ``schema`` with each ``x-limit`` (a ``Cap``) written out from ``limits``: ``maximum``,
    ``maxLength``, ``maxItems`` or ``maxProperties`` by the node's type."""
    out = copy.deepcopy(schema)
    stack = [out]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            limit = node.get("x-limit")
            if isinstance(limit, str):
                key = {"integer": "maximum", "number": "maximum", "string": "maxLength",
                       "object": "maxProperties"}.get(node.get("type", ""), "maxItems")
                node[key] = getattr(limits, limit)
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return out


def json_schemas(models: Sequence[type[BaseModel]], limits: Any, ref_prefix: str = "#/components/schemas/"
                 ) -> dict[str, Any]:
    """The JSON schemas of ``models`` and every model they use, by name, refs under ``ref_prefix``, caps from
    ``limits``: what the OpenAPI document's ``components.schemas`` holds."""
    _, top = models_json_schema([(m, "validation") for m in models], ref_template=ref_prefix + "{model}",
                                schema_generator=SchemaGenerator)
    return dict(resolve_caps(top.get("$defs", {}), limits))
