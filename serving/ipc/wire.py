"""A fixed codec between the IPC's typed values and msgpack's plain data, built from the dataclasses' annotations.

Design note: a message field holds typed values (``GenerationRequest``, ``TokenDelta``, ``BatchOutput``), never
loose dicts. ``encoder(tp)`` and ``decoder(tp)`` are built once per annotation and cached: a dataclass travels as
the list of its fields in declaration order (a field named in its ``LOCAL_FIELDS`` stays on its side and is
decoded as its default), tuples and lists as lists, a ``str`` enum as its value, ``dict[str, X]`` as a map, and
``Any`` as the plain data it holds. Both processes run the same package, so the order is the contract; a test
encodes and decodes every message type. The decoder checks every value against its annotation and raises
``WireError`` naming the path of the first bad one (``.deltas[3][1]``): a frame from a buggy or hostile peer is
refused, never turned into a value whose use fails later.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import types
import typing
from collections.abc import Callable
from typing import Any, Union

Encode = Callable[[Any], Any]
Decode = Callable[[Any], Any]


class WireError(ValueError):
    """A decoded value that does not fit its annotation; ``path`` locates it inside the field."""

    def __init__(self, path: str, why: str) -> None:
        super().__init__(f"{path}: {why}" if path else why)
        self.path = path
        self.why = why

    def at(self, step: str) -> WireError:
        return WireError(step + self.path, self.why)


def _same(v: Any) -> Any:
    return v


def _kind(v: Any) -> str:
    return type(v).__name__


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


@functools.cache
def encoder(tp: Any) -> Encode:
    """How a value of annotation ``tp`` becomes plain data (``_same`` where it already is)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        local = getattr(tp, "LOCAL_FIELDS", frozenset())
        hints = _hints(tp)
        parts = [(f.name, encoder(hints[f.name])) for f in dataclasses.fields(tp) if f.name not in local]
        # one generated function per type (as dataclasses builds __init__): a step's deltas are encoded per frame
        env = {f"e{i}": e for i, (_, e) in enumerate(parts)}
        items = ", ".join(f"v.{n}" if e is _same else f"e{i}(v.{n})" for i, (n, e) in enumerate(parts))
        return _compile(f"def encode(v):\n    return [{items}]\n", env, "encode")
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return lambda v: v.value
    if origin in (Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        one = encoder(inner[0]) if len(inner) == 1 else _same
        return _same if one is _same else (lambda v: None if v is None else one(v))
    if origin in (tuple, list):
        item = encoder(args[0]) if args and (origin is list or args[-1] is Ellipsis) else None
        if origin is tuple and args and args[-1] is not Ellipsis:  # a fixed tuple: (id, bias) pairs
            each = [encoder(a) for a in args]
            return lambda v: [e(x) for e, x in zip(each, v, strict=True)]
        if item is None or item is _same:
            return list
        return lambda v: [item(x) for x in v]
    if origin is dict:
        value = encoder(args[1]) if args else _same
        return dict if value is _same else (lambda v: {k: value(x) for k, x in v.items()})
    return _same


def _scalar(tp: Any) -> Decode | None:
    if tp is Any:
        return _same
    if tp is type(None):
        return _expect(lambda v: v is None, "null")
    if tp is bool:
        return _expect(lambda v: isinstance(v, bool), "a boolean")
    if tp is int:
        return _expect(lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer")
    if tp is float:  # msgpack keeps 1.0 a float, but a sender may write a whole number as an int
        return _number
    if tp is str:
        return _expect(lambda v: isinstance(v, str), "a string")
    return None


def _expect(ok: Callable[[Any], bool], what: str) -> Decode:
    def check(v: Any) -> Any:
        if not ok(v):
            raise WireError("", f"is a {_kind(v)}, not {what}")
        return v
    return check


def _number(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise WireError("", f"is a {_kind(v)}, not a number")
    return float(v)


@functools.cache
def decoder(tp: Any) -> Decode:
    """How plain data becomes a value of annotation ``tp``, checked. Raises ``WireError``."""
    scalar = _scalar(tp)
    if scalar is not None:
        return scalar
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return _dataclass_decoder(tp)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return _enum_decoder(tp)
    if origin in (Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if len(inner) != 1 or len(args) != 2:
            raise TypeError(f"no wire decoder for {tp!r}")
        one = decoder(inner[0])
        return lambda v: None if v is None else one(v)
    if origin in (tuple, list):
        return _sequence_decoder(origin, args)
    if origin is dict:
        value = decoder(args[1]) if args else _same

        def mapping(v: Any) -> dict[str, Any]:
            if not isinstance(v, dict):
                raise WireError("", f"is a {_kind(v)}, not a map")
            out = {}
            for k, x in v.items():
                if not isinstance(k, str):
                    raise WireError("", f"has a {_kind(k)} key, not a string")
                try:
                    out[k] = value(x)
                except WireError as exc:
                    raise exc.at(f"[{k!r}]") from None
            return out
        return mapping
    raise TypeError(f"no wire decoder for {tp!r}")


def _sequence_decoder(origin: Any, args: tuple[Any, ...]) -> Decode:
    fixed = origin is tuple and bool(args) and args[-1] is not Ellipsis
    items = [decoder(a) for a in args] if fixed else [decoder(args[0]) if args else _same]
    build = tuple if origin is tuple else list
    one = items[0]

    def checked(v: Any) -> Any:
        """Item by item, naming the one at fault."""
        if not isinstance(v, list):
            raise WireError("", f"is a {_kind(v)}, not a list")
        if fixed and len(v) != len(items):
            raise WireError("", f"has {len(v)} items, not {len(items)}")
        out = []
        for i, x in enumerate(v):
            try:
                out.append(items[i if fixed else 0](x))
            except WireError as exc:
                raise exc.at(f"[{i}]") from None
        return build(out)

    if fixed:
        return checked
    if one is _same:
        return lambda v: build(v) if v.__class__ is list else checked(v)

    def sequence(v: Any) -> Any:
        if v.__class__ is list:
            try:
                return build([one(x) for x in v])
            except WireError:
                pass  # decoded again, naming the item at fault
        return checked(v)
    return sequence


def _enum_decoder(cls: type[enum.Enum]) -> Decode:
    values = {m.value: m for m in cls}

    def member(v: Any) -> Any:
        try:
            return values[v]
        except (KeyError, TypeError):
            raise WireError("", f"{v!r} is no {cls.__name__}") from None
    return member


def _compile(source: str, env: dict[str, Any], name: str) -> Any:
    namespace: dict[str, Any] = {}
    exec(compile(source, f"<wire {name}>", "exec"), env, namespace)  # noqa: S102 - our own fixed source
    return namespace[name]


# the plain types a field is checked against inline in a generated decoder (their exact class: msgpack gives no
# subclasses, and an int is no bool)
_INLINE = {str: "str", int: "int", bool: "bool"}


def _dataclass_decoder(cls: Any) -> Decode:
    local = getattr(cls, "LOCAL_FIELDS", frozenset())
    hints = _hints(cls)
    parts = [(f.name, decoder(hints[f.name])) for f in dataclasses.fields(cls) if f.name not in local]
    slow = _checked_dataclass_decoder(cls, parts)
    # the fast path, generated once per type: exact-class checks inline, nested decoders called; any refusal is
    # decoded again by the slow path, which names the field at fault
    env: dict[str, Any] = {"cls": cls, "slow": slow, "WireError": WireError, "list": list}
    args = []
    for i, (name, dec) in enumerate(parts):
        tp = hints[name]
        if dec is _same:
            args.append(f"{name}=v[{i}]")
        elif tp in _INLINE:
            env[f"t{i}"] = tp
            args.append(f"{name}=v[{i}] if v[{i}].__class__ is t{i} else slow(v)")
        else:
            env[f"d{i}"] = dec
            args.append(f"{name}=d{i}(v[{i}])")
    source = (f"def build(v):\n"
              f"    if v.__class__ is not list or len(v) != {len(parts)}:\n"
              f"        return slow(v)\n"
              f"    try:\n"
              f"        return cls({', '.join(args)})\n"
              f"    except (WireError, TypeError):\n"
              f"        return slow(v)\n")
    return _compile(source, env, "build")  # type: ignore[no-any-return]


def _checked_dataclass_decoder(cls: Any, parts: list[tuple[str, Decode]]) -> Decode:
    def build(v: Any) -> Any:
        if not isinstance(v, list) or len(v) != len(parts):
            size = f"a list of {len(v)}" if isinstance(v, list) else f"a {_kind(v)}"
            raise WireError("", f"is {size}, not the {len(parts)} fields of a {cls.__name__}")
        kw = {}
        for (name, dec), x in zip(parts, v, strict=True):
            try:
                kw[name] = dec(x)
            except WireError as exc:
                raise exc.at(f".{name}") from None
        try:
            return cls(**kw)
        except TypeError as exc:
            raise WireError("", f"is no {cls.__name__}: {exc}") from None
    return build
