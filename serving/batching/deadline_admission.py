"""Deadlines at admission: refuse a request that cannot start before its deadline, keep an expired one from workers.

Design note: a request's ``deadline`` (absolute ``time.monotonic()``: gRPC's deadline, an HTTP deadline header or
Triton's ``timeout`` parameter, ``serving.requests.deadlines``) is checked when the batcher is handed it. The wait
it would have is predicted from what the batcher measured: ``ServiceTimes`` keeps how long a worker slot held its
last pieces of work (a rolling request from dispatch to its last token; a dynamic batch from dispatch to its
results). A model's ``num_slots`` (live workers x ``max_rolling_batch_size``, or x ``batch_size``) drain the queue
at ``num_slots / mean`` requests a second (Little's law), so a request with ``k`` requests queued ahead and ``f``
free slots waits ``(k + 1 - f) * mean / num_slots`` seconds when ``k + 1 > f``, and nothing otherwise. A wait
longer than the time left refuses it with 503 + ``Retry-After`` (the seconds after which the queue ahead should have
shrunk enough: it drains at the same rate). Before anything was measured there is no prediction: the request is
queued, and its deadline still drops it from the queue (504) if no slot frees in time; ``overdue`` lets a batcher
keep such a request from a worker even when its timer has not fired yet.
"""

from __future__ import annotations

import collections
import math

from rollcore.errors import Overloaded, RequestTimeout
from rollcore.types import GenerationRequest
from serving.batching.pacing import MAX_RETRY_AFTER_S, MIN_RETRY_AFTER_S
from serving.batching.ports import BatchObserver

REFUSED = "deadline_refused"  # the rejected-requests reason of a refusal at admission (503)
EXPIRED = "deadline_expired"  # ... of a request whose deadline passed before it reached a worker (504)
SERVICE_SAMPLES = 64  # completions the mean service time is taken over: recent enough to follow a change of load


class ServiceTimes:
    """How long a worker slot held each of its last pieces of work (seconds). Event loop only."""

    def __init__(self, size: int = SERVICE_SAMPLES) -> None:
        self._times: collections.deque[float] = collections.deque(maxlen=size)

    def record(self, seconds: float) -> None:
        if seconds >= 0:
            self._times.append(seconds)

    def mean_s(self) -> float | None:
        """The mean of the recorded times, or None before the first."""
        return sum(self._times) / len(self._times) if self._times else None


def predicted_wait_s(num_ahead: int, num_free: int, num_slots: int, mean_service_s: float | None) -> float | None:
    """Seconds a request queued behind ``num_ahead`` others waits for a slot (0 when a free one is left for it);
    None when it cannot be told (nothing measured yet, or no live worker)."""
    if num_ahead + 1 <= num_free:
        return 0.0
    if mean_service_s is None or num_slots <= 0:
        return None
    return (num_ahead + 1 - num_free) * mean_service_s / num_slots


def as_ms(seconds: float | None) -> float | None:
    """A predicted wait as reported (``describe``): milliseconds, or None when it cannot be told."""
    return None if seconds is None else round(seconds * 1000.0, 1)


def admit(model: str, request: GenerationRequest, now: float, wait_s: float | None, observer: BatchObserver) -> None:
    """Raise ``Overloaded`` (503 + Retry-After) when ``request`` would wait past its deadline, ``RequestTimeout``
    (504) when the deadline has passed already; the observer counts either. No deadline: nothing to check."""
    if request.deadline is None:
        return
    left_s = request.deadline - now
    if left_s <= 0:
        observer.on_rejected(model, EXPIRED)
        raise RequestTimeout("the request's deadline passed before it could be queued")
    if wait_s is not None and wait_s > left_s:
        observer.on_rejected(model, REFUSED)
        retry_s = max(MIN_RETRY_AFTER_S, min(MAX_RETRY_AFTER_S, math.ceil(wait_s - left_s)))
        raise Overloaded(f"model {model!r} cannot start this request before its deadline: the requests ahead of it "
                         f"should take {wait_s * 1000:.0f} ms and its deadline is {left_s * 1000:.0f} ms away",
                         retry_after_s=retry_s)


def overdue(request: GenerationRequest, now: float) -> bool:
    """True once ``request``'s deadline has passed."""
    return request.deadline is not None and now >= request.deadline


def expired_while_queued() -> RequestTimeout:
    """The error of a request dropped from the queue at its deadline (it never reached a worker)."""
    return RequestTimeout("the request's deadline passed while it waited in the queue; it never reached a worker")
