"""Typed messages of the frontend <-> worker IPC protocol.

Design note: every frame is one msgpack map with a type tag ``t``; these dataclasses are the only
shapes allowed on the channel (``decode_message`` rejects anything else), so nothing received can
execute code. Requests, outputs and deltas are the core's typed values (``GenerationRequest``, ``BatchOutput``,
``TokenDelta``), encoded and checked from their annotations by ``serving.ipc.wire``: a field of another type is a
``ProtocolError`` naming it. One output or delta that does not fit its type fails its own request only (its
batch-mates are answered): it decodes as a failure of that request (``malformed``).

Frontend -> worker: Init, Batch (dynamic), Add / Abort / Configure (rolling), Shutdown.
Worker -> frontend: Ready, LoadFailed, BatchResult, Deltas, Reject, Configured (rolling).
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Union

from rollcore.types import BatchOutput, FinishReason, GenerationRequest, TokenDelta
from serving.ipc.wire import Decode, Encode, WireError, decoder, encoder


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
    """A dynamic batch."""

    TAG: ClassVar[str] = "batch"
    batch_id: int
    requests: list[GenerationRequest]


@dataclass(frozen=True, slots=True)
class BatchResult:
    """One output per request of batch ``batch_id``, in order."""

    TAG: ClassVar[str] = "batch_result"
    batch_id: int
    outputs: list[BatchOutput]


@dataclass(frozen=True, slots=True)
class Add:
    """Rolling: admit these requests into the worker's running engine."""

    TAG: ClassVar[str] = "add"
    requests: list[GenerationRequest]


@dataclass(frozen=True, slots=True)
class Abort:
    TAG: ClassVar[str] = "abort"
    request_ids: list[str]


@dataclass(frozen=True, slots=True)
class Deltas:
    """Rolling: everything one engine step produced plus engine stats."""

    TAG: ClassVar[str] = "deltas"
    step: int
    deltas: list[TokenDelta]
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
    """The message as a tagged map of plain data (its typed fields encoded by ``serving.ipc.wire``)."""
    d = {name: getattr(msg, name) if enc is None else enc(getattr(msg, name)) for name, enc, _ in _CODECS[type(msg)]}
    d["t"] = msg.TAG
    return d


def _malformed_output(raw: Any, exc: WireError) -> BatchOutput:
    return BatchOutput.failure(_request_id(raw), f"the model's handler returned a malformed output ({exc})")


def _malformed_delta(raw: Any, exc: WireError) -> TokenDelta:
    return TokenDelta(request_id=_request_id(raw), finish_reason=FinishReason.ERROR,
                      error=f"the model's worker sent a malformed answer for this request ({exc})")


def _request_id(raw: Any) -> str:
    """The request id of an output or delta that did not decode (its first field), or ""."""
    return raw[0] if isinstance(raw, list) and raw and isinstance(raw[0], str) else ""


# list fields whose items fail alone: a bad item becomes its request's failure, the others decode
_ITEMWISE: dict[tuple[type, str], Callable[[Any, WireError], Any]] = {
    (BatchResult, "outputs"): _malformed_output, (Deltas, "deltas"): _malformed_delta}


def _itemwise(item: Decode, bad: Callable[[Any, WireError], Any]) -> Decode:
    def decode(v: Any) -> list[Any]:
        if not isinstance(v, list):
            raise WireError("", f"is a {type(v).__name__}, not a list")
        out = []
        for raw in v:
            try:
                out.append(item(raw))
            except WireError as exc:
                out.append(bad(raw, exc))
        return out
    return decode


def _codecs(cls: type) -> tuple[tuple[str, Encode | None, Decode], ...]:
    """Per field: its encoder (None: already plain data) and its checking decoder."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in fields(cls):
        tp = hints[f.name]
        enc = encoder(tp)
        bad = _ITEMWISE.get((cls, f.name))
        dec = _itemwise(decoder(typing.get_args(tp)[0]), bad) if bad is not None else decoder(tp)
        out.append((f.name, None if enc is _PLAIN else enc, dec))
    return tuple(out)


_PLAIN = encoder(Any)
_CODECS: dict[type, tuple[tuple[str, Encode | None, Decode], ...]] = {
    cls: _codecs(cls) for cls in MESSAGE_TYPES.values()}


def message_from_dict(d: Any) -> Message:
    if not isinstance(d, dict) or not isinstance(d.get("t"), str):
        raise ProtocolError("frame is not a tagged map")
    cls = MESSAGE_TYPES.get(d["t"])
    if cls is None:
        raise ProtocolError(f"unknown message type {d['t']!r}")
    codecs = _CODECS[cls]
    names = {name for name, _, _ in codecs}
    kw = {k: v for k, v in d.items() if k != "t"}
    if not kw.keys() <= names:
        raise ProtocolError(f"unexpected fields {sorted(kw.keys() - names)} in {d['t']!r}")
    for name, _, dec in codecs:
        if name in kw:
            try:
                kw[name] = dec(kw[name])
            except WireError as exc:
                raise ProtocolError(f"bad {d['t']!r} message: field {name!r}{exc.path} {exc.why}") from None
    try:
        return cls(**kw)  # type: ignore[no-any-return]
    except TypeError as exc:
        raise ProtocolError(f"bad {d['t']!r} message: {exc}") from None
