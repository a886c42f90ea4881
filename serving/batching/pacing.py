"""What both batchers share: the measured service rate (for ``Retry-After``) and sends that fail per request.

Design note: ``ServiceRate`` counts requests a model finished over a sliding window, so a 503 can tell the
client how long the requests ahead of it should take (queue length / rate, clamped to 1..60 s) instead of
a constant. ``send_each`` sends one frame that carries several requests; if the frame cannot be encoded
(a value the wire cannot carry slipped past validation), it finds the requests at fault by encoding each
alone, fails only those, and sends the rest: one request never takes its batch-mates or the batcher down.
"""

from __future__ import annotations

import collections
import logging
import math
from collections.abc import Callable, Sequence
from typing import TypeVar

from rollcore.errors import InvalidRequest, ServingError
from rollcore.types import GenerationRequest
from serving.batching.ports import Clock
from serving.ipc import codec
from serving.ipc.messages import Message

log = logging.getLogger(__name__)

MIN_RETRY_AFTER_S = 1
MAX_RETRY_AFTER_S = 60


class ServiceRate:
    """Finished requests per second over the last ``window_s`` seconds. Event loop only."""

    def __init__(self, clock: Clock, window_s: float = 30.0) -> None:
        self._clock = clock
        self.window_s = window_s
        self._times: collections.deque[float] = collections.deque()

    def record(self) -> None:
        now = self._clock()
        self._times.append(now)
        self._trim(now)

    def _trim(self, now: float) -> None:
        while self._times and self._times[0] < now - self.window_s:
            self._times.popleft()

    def per_second(self) -> float:
        """Measured completions per second (0.0 before any)."""
        now = self._clock()
        self._trim(now)
        if not self._times:
            return 0.0
        span = max(now - self._times[0], 1.0)
        return len(self._times) / span

    def retry_after_s(self, num_ahead: int) -> int:
        """Seconds until ``num_ahead`` requests should have been served at the measured rate (1..60; 5
        when nothing finished lately)."""
        rate = self.per_second()
        if rate <= 0:
            return 5
        return max(MIN_RETRY_AFTER_S, min(MAX_RETRY_AFTER_S, math.ceil(num_ahead / rate)))


T = TypeVar("T")


def send_each(send: Callable[[Message], None], build: Callable[[list[GenerationRequest]], Message],
              items: Sequence[T], wire: Callable[[T], GenerationRequest],
              fail: Callable[[T, ServingError], None]) -> list[T]:
    """Send ``build([wire(i) for i in items])``; on an encoding error fail the items that cannot be encoded
    alone (``fail(item, InvalidRequest)``) and send the others. Returns the items that were sent.
    ``ConnectionError`` propagates (the worker is gone: the caller retries or fails them)."""
    try:
        send(build([wire(i) for i in items]))
        return list(items)
    except ConnectionError:
        raise
    except Exception as exc:  # noqa: BLE001 - an unencodable request must fail alone
        log.warning("a frame of %d requests could not be encoded (%s); finding the requests at fault",
                    len(items), type(exc).__name__)
    good: list[T] = []
    for item in items:
        try:
            codec.encode(build([wire(item)]))
        except Exception as exc:  # noqa: BLE001
            fail(item, InvalidRequest(f"the request holds a value that cannot be sent to the model's worker "
                                      f"({type(exc).__name__}); integers must fit in 64 bits"))
        else:
            good.append(item)
    if good:
        try:
            send(build([wire(i) for i in good]))
        except ConnectionError:
            raise
        except Exception as exc:  # noqa: BLE001
            log.error("a frame failed to encode although each request encodes alone: %s", type(exc).__name__)
            for item in good:
                fail(item, ServingError("the request could not be sent to the model's worker"))
            return []
    return good
