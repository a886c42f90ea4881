"""What becomes of the requests a rolling worker held when it died (a crash, or the liveness watchdog killed it).

Design note: a request whose client has received nothing yet -- a whole answer (assembled only at its end), or a
stream whose first delta was not handed to its frontend -- runs again from its prompt on another worker (or the
restarted one), once: whatever the dead worker had computed is dropped (``ResultStream.restart``), so a greedy
answer is the one an undisturbed run gives. A stream that already reached its client cannot be taken back and
fails with ``WorkerFailed`` (its frontend ends it with a clear error event), as does a request already retried
once (a request that kills every worker it runs on must not take down the whole pool) and a health probe (it
checks one worker: moving it elsewhere would hide the death it exists to report).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Protocol

from rollcore.errors import WorkerFailed
from serving.batching.streams import ResultStream

log = logging.getLogger(__name__)

MAX_RETRIES = 1
PROBE_PREFIX = "health-probe-"  # the request ids of the deep health check (serving.telemetry.deep_health)


class Lost(Protocol):
    """A request that was running on the dead worker (the rolling batcher's entry)."""

    @property
    def stream(self) -> ResultStream: ...


def retryable(stream: ResultStream, client_id: str) -> bool:
    return not stream.delivered and stream.num_retries < MAX_RETRIES and not client_id.startswith(PROBE_PREFIX)


class Retries:
    """Splits a dead worker's requests into those run again and those failed; counts the retries."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.num_retried = 0  # requests run again after their worker died (Prometheus: rollserve_request_retries)

    def split(self, lost: Iterable[tuple[str, Lost]], cause: str) -> list[Lost]:
        """Restart the retryable requests of ``lost`` ((client id, entry) pairs) and return them in order; fail
        the others with ``WorkerFailed`` naming ``cause`` (why the worker died)."""
        again: list[Lost] = []
        for client_id, entry in lost:
            stream = entry.stream
            if stream.done:
                continue
            if retryable(stream, client_id):
                stream.restart()
                stream.num_retries += 1
                self.num_retried += 1
                again.append(entry)
                continue
            why = ("part of its answer had already been sent" if stream.delivered
                   else "it was retried once already" if stream.num_retries else "it checks that one worker")
            log.warning("model %s: request %s failed with its worker (%s); not retried: %s", self.model, client_id,
                        cause, why)
            stream.fail(WorkerFailed(f"the worker serving this request {cause}; not retried: {why}"))
        if again:
            log.warning("model %s: %d request(s) of a worker that %s run again on another worker", self.model,
                        len(again), cause)
        return again
