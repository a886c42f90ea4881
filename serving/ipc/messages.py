"""Typed messages of the frontend <-> worker IPC protocol.

Design note: every frame is one msgpack map with a type tag ``t``; these dataclasses are the only
shapes allowed on the channel (``decode_message`` rejects anything else), so nothing received can
execute code. Requests and deltas travel in the dict forms defined in ``rollcore.types``.

Frontend -> worker: Init, Batch (dynamic), Add / Abort / Configure (rolling), Shutdown.
Worker -> frontend: Ready, LoadFailed, BatchResult, Deltas, Reject, Configured (rolling).
"""

from __future__ import annotations

import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Union


@dataclass(frozen=True, slots=True)
class Init:
    """First frame to a new worker: which model to load and how."""

    TAG: ClassVar[str] = "init"
    model_name: str
    model_dir: str
    entry_point: str
    properties: dict[str, str]
    rolling: bool = False
    device_id: int = -1
    worker_id: int = 0
    log_format: str = "text"


@dataclass(frozen=True, slots=True)
class Ready:
    """The handler loaded; ``info`` is the handler's ``describe()``; ``live_options`` the options its
    ``configure`` changes while it runs (rolling handlers)."""

    TAG: ClassVar[str] = "ready"
    pid: int
    info: dict[str, Any] = field(default_factory=dict)
    live_options: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class LoadFailed:
    TAG: ClassVar[str] = "load_failed"
    reason: str
    permanent: bool = False  # another try cannot succeed (a missing file, a broken config or model.py): no retry


@dataclass(frozen=True, slots=True)
class Batch:
    """A dynamic batch: ``requests`` are ``GenerationRequest.to_wire()`` dicts."""

    TAG: ClassVar[str] = "batch"
    batch_id: int
    requests: list[dict[str, Any]]


@dataclass(frozen=True, slots=True)
class BatchResult:
    """One output dict per request of batch ``batch_id``, in order (see ``worker.main.output_to_wire``)."""

    TAG: ClassVar[str] = "batch_result"
    batch_id: int
    outputs: list[dict[str, Any]]


@dataclass(frozen=True, slots=True)
class Add:
    """Rolling: admit these requests into the worker's running engine."""

    TAG: ClassVar[str] = "add"
    requests: list[dict[str, Any]]


@dataclass(frozen=True, slots=True)
class Abort:
    TAG: ClassVar[str] = "abort"
    request_ids: list[str]


@dataclass(frozen=True, slots=True)
class Deltas:
    """Rolling: everything one engine step produced (``TokenDelta.to_wire()`` dicts) plus engine stats."""

    TAG: ClassVar[str] = "deltas"
    step: int
    deltas: list[dict[str, Any]]
    stats: dict[str, Any] = field(default_factory=dict)
    step_s: float = 0.0
    # the prefix-cache keys registered and evicted since the last frame (RollingHandler.prefix_events), or None
    prefix: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class Reject:
    """Rolling: a request the engine refused at ``add`` time (kind is an ``ErrorKind`` value)."""

    TAG: ClassVar[str] = "reject"
    request_id: str
    kind: str
    message: str


@dataclass(frozen=True, slots=True)
class Configure:
    """Rolling: new values of live options (``max_rolling_batch_size``, ...), applied between two steps,
    after every frame sent before it. ``seq`` numbers the change; the worker answers ``Configured``."""

    TAG: ClassVar[str] = "configure"
    seq: int
    options: dict[str, int]
    adapters: dict[str, str] | None = None  # LoRA adapters registered over the API, name -> folder (None: unchanged)


@dataclass(frozen=True, slots=True)
class Configured:
    """Rolling: change ``seq`` is in force from the next step on (``stats``: the engine's right after it), or
    was refused (``error``; nothing changed)."""

    TAG: ClassVar[str] = "configured"
    seq: int
    stats: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


@dataclass(frozen=True, slots=True)
class Shutdown:
    TAG: ClassVar[str] = "shutdown"


Message = Union[Init, Ready, LoadFailed, Batch, BatchResult, Add, Abort, Deltas, Reject, Configure, Configured,
                Shutdown]
MESSAGE_TYPES: dict[str, type] = {
    cls.TAG: cls for cls in (Init, Ready, LoadFailed, Batch, BatchResult, Add, Abort, Deltas, Reject, Configure,
                             Configured, Shutdown)
}


class ProtocolError(ValueError):
    """A frame that is not a well-formed message of this protocol."""


def message_to_dict(msg: Message) -> dict[str, Any]:
    """The message's fields as a tagged map, shallow: every field already holds plain data (str, numbers,
    lists, dicts). ``dataclasses.asdict`` deep-copies every nested list and dict instead, which cost 1.6 ms
    per rolling step of 32 sequences (a tenth of a decode step of the default model)."""
    d = {name: getattr(msg, name) for name in _field_names(type(msg))}
    d["t"] = msg.TAG
    return d


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def _field_names(cls: type) -> tuple[str, ...]:
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = tuple(f.name for f in fields(cls))
    return names


Check = Callable[[Any], bool]


def _checker(tp: Any) -> Check:
    """A predicate for a value decoded from msgpack against a field's annotation (str, int, float, bool, None,
    lists, string-keyed dicts, unions, Any), built once per field: a frame with a wrongly typed field is a
    ``ProtocolError`` naming it, never a message whose handler fails later on a surprise type."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return lambda v: True
    if tp is type(None):
        return lambda v: v is None
    if tp is bool:
        return lambda v: isinstance(v, bool)
    if tp is int:
        return lambda v: isinstance(v, int) and not isinstance(v, bool)
    if tp is float:  # msgpack keeps 1.0 as a float, but a sender may write a whole number as an int
        return lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
    if tp is str:
        return lambda v: isinstance(v, str)
    if origin in (Union, types.UnionType):
        options = [_checker(a) for a in args]
        return lambda v: any(c(v) for c in options)
    if origin is list:
        item = _checker(args[0]) if args else _checker(Any)
        return lambda v: isinstance(v, list) and all(item(x) for x in v)
    if origin is dict:
        value = _checker(args[1]) if args else _checker(Any)
        return lambda v: isinstance(v, dict) and all(isinstance(k, str) and value(x) for k, x in v.items())
    raise TypeError(f"no wire check for {tp!r}")


_CHECKS: dict[type, tuple[tuple[str, Check], ...]] = {
    cls: tuple((f.name, _checker(typing.get_type_hints(cls)[f.name])) for f in fields(cls))
    for cls in MESSAGE_TYPES.values()
}


def message_from_dict(d: Any) -> Message:
    if not isinstance(d, dict) or not isinstance(d.get("t"), str):
        raise ProtocolError("frame is not a tagged map")
    cls = MESSAGE_TYPES.get(d["t"])
    if cls is None:
        raise ProtocolError(f"unknown message type {d['t']!r}")
    names = _field_names(cls)
    kw = {k: v for k, v in d.items() if k != "t"}
    if not kw.keys() <= set(names):
        raise ProtocolError(f"unexpected fields {sorted(kw.keys() - set(names))} in {d['t']!r}")
    try:
        msg = cls(**kw)
    except TypeError as exc:
        raise ProtocolError(f"bad {d['t']!r} message: {exc}") from None
    for name, check in _CHECKS[cls]:
        if name in kw and not check(kw[name]):
            raise ProtocolError(f"bad {d['t']!r} message: field {name!r} is a {type(kw[name]).__name__}, "
                                f"not {typing.get_type_hints(cls)[name]}")
    return msg  # type: ignore[no-any-return]
