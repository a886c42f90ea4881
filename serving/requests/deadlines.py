"""A request's deadline, from what the client (or the proxy in front of us) sent: HTTP headers, Triton's ``timeout``.

Design note: a deadline is an absolute ``time.monotonic()`` (``GenerationRequest.deadline``) counted from the moment
the request arrived, as gRPC counts its own; the batchers refuse a request that cannot start before it and drop one
still queued at it (``serving.batching.deadline_admission``). HTTP has no standard header for it, so two are read:
``X-Request-Timeout-Ms`` for clients that call us directly (milliseconds, as the timing headers we answer with), and
``X-Envoy-Expected-Rq-Timeout-Ms``, which Envoy and the gateways built on it set on each request they forward to say
how long they will wait for it: a server behind one learns the deadline with no change to the clients. Given both,
the earlier wins. Triton's schedule-policy ``timeout`` request parameter (microseconds; 0: none) is read by the OIP
routes of both protocols (``triton_timeout``). ``DeadlineScope`` reads the headers once, as a request arrives, and
holds the outcome in ``REQUEST_DEADLINE`` for ``httpio.submit_all``, which applies it to every request it queues; a
bad value fails there with a 400 naming the header, in the route's own error shape.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, MutableMapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from rollcore.errors import InvalidRequest

TIMEOUT_HEADER = "X-Request-Timeout-Ms"
ENVOY_HEADER = "X-Envoy-Expected-Rq-Timeout-Ms"
HEADERS = (TIMEOUT_HEADER, ENVOY_HEADER)
MAX_TIMEOUT_MS = 999_999_999  # nine digits, as the other integer headers and options take
TRITON_TIMEOUT = "timeout"  # Triton's request parameter, in microseconds
MAX_TIMEOUT_US = MAX_TIMEOUT_MS * 1000


@dataclass(frozen=True, slots=True)
class HeaderDeadline:
    """What the deadline headers of one HTTP request said: a deadline, or why a value was refused."""

    at: float | None = None  # absolute time.monotonic(); None: no header
    problem: str | None = None  # a refused header value, raised as a 400 when the request is queued
    arrival: float | None = None  # when the request arrived (time.monotonic())

    def apply(self, deadline: float | None) -> float | None:
        """The earlier of the headers' deadline and ``deadline``; InvalidRequest for a refused header."""
        if self.problem is not None:
            raise InvalidRequest(self.problem)
        return earliest(self.at, deadline)


# the headers of the HTTP request being served (None outside one: a gRPC call, a warm-up)
REQUEST_DEADLINE: ContextVar[HeaderDeadline | None] = ContextVar("request_deadline", default=None)


def with_headers(deadline: float | None) -> float | None:
    """``deadline`` made no later than the deadline headers of the HTTP request being served; InvalidRequest for a
    refused header value."""
    headers = REQUEST_DEADLINE.get()
    return deadline if headers is None else headers.apply(deadline)


def earliest(a: float | None, b: float | None) -> float | None:
    """The earlier of two deadlines (None: none)."""
    if a is None:
        return b
    return a if b is None else min(a, b)


def arrival() -> float:
    """When the HTTP request being served arrived (now, outside one)."""
    headers = REQUEST_DEADLINE.get()
    return headers.arrival if headers is not None and headers.arrival is not None else time.monotonic()


def read_headers(headers: Iterable[tuple[bytes, bytes]], arrived: float) -> HeaderDeadline:
    """The deadline the ASGI ``headers`` (lower-case names) give, counted from ``arrived``."""
    pairs = list(headers)
    at: float | None = None
    for name in HEADERS:
        key = name.lower().encode("latin-1")
        values = [v.decode("latin-1").strip() for k, v in pairs if k == key]
        if not values:
            continue
        if len(values) > 1:
            return HeaderDeadline(problem=f"header {name} is given {len(values)} times: give it once",
                                  arrival=arrived)
        raw = values[0]
        if not (raw.isascii() and raw.isdigit()) or len(raw) > len(str(MAX_TIMEOUT_MS)) or int(raw) < 1:
            return HeaderDeadline(problem=f"header {name} must be a whole number of milliseconds from 1 to "
                                          f"{MAX_TIMEOUT_MS}, got {raw[:40]!r}", arrival=arrived)
        at = earliest(at, arrived + int(raw) / 1000.0)
    return HeaderDeadline(at=at, arrival=arrived)


def rest_timeout(value: Any) -> int:
    """Triton's ``parameters.timeout`` of a REST body, checked: microseconds >= 0."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TIMEOUT_US:
        raise InvalidRequest(f"'parameters.{TRITON_TIMEOUT}' must be a whole number of microseconds from 0 (none) to "
                             f"{MAX_TIMEOUT_US}, got {str(value)[:40]!r}")
    return value


def triton_timeout(parameters: Mapping[str, Any], arrived: float) -> float | None:
    """The deadline of Triton's ``timeout`` request parameter (an ``InferParameter`` of int64 or uint64
    microseconds; 0 or absent: none) counted from ``arrived``; InvalidRequest for another kind of value."""
    if TRITON_TIMEOUT not in parameters:
        return None
    param = parameters[TRITON_TIMEOUT]
    which = param.WhichOneof("parameter_choice")
    value = getattr(param, which) if which in ("int64_param", "uint64_param") else None
    if value is None or not 0 <= value <= MAX_TIMEOUT_US:
        raise InvalidRequest(f"parameter {TRITON_TIMEOUT!r} must be a whole number of microseconds from 0 (none) to "
                             f"{MAX_TIMEOUT_US} (int64_param)")
    return None if value == 0 else arrived + value / 1e6


Receive = Callable[[], Awaitable[Any]]
Send = Callable[[Any], Awaitable[None]]
ASGIApp = Callable[[MutableMapping[str, Any], Receive, Send], Awaitable[None]]


class DeadlineScope:
    """ASGI middleware: reads an HTTP request's deadline headers as it arrives and holds them in
    ``REQUEST_DEADLINE`` while the app serves it (the routes' handlers and their streamed bodies)."""

    def __init__(self, app: ASGIApp, clock: Callable[[], float] = time.monotonic) -> None:
        self.app = app
        self._clock = clock

    async def __call__(self, scope: MutableMapping[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        token = REQUEST_DEADLINE.set(read_headers(scope.get("headers") or (), self._clock()))
        try:
            await self.app(scope, receive, send)
        finally:
            REQUEST_DEADLINE.reset(token)
