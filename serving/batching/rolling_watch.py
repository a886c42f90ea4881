"""The rolling batcher's watch: the queue-wait limit and the forward-progress watchdog, checked every interval.

Design note: a request that waited ``max_queue_time_s`` for a slot fails with 503 and a ``Retry-After`` from the
measured service rate; a worker that holds requests but reported no engine step for ``liveness_timeout_s`` is
taken out of routing (its requests retried elsewhere or failed as a dead worker's are) and killed, and its pool
restarts it with the cause ``watchdog``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

from rollcore.errors import Overloaded

if TYPE_CHECKING:
    from serving.batching.rolling import RollingBatcher

log = logging.getLogger("serving.batching.rolling")


async def watch(batcher: RollingBatcher, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        try:
            check_queue_time(batcher)
            check_liveness(batcher)
        except Exception:  # noqa: BLE001 - the watch must outlive any one bad check
            log.exception("model %s: rolling watch check failed", batcher.model)


def check_queue_time(b: RollingBatcher) -> None:
    """Fail requests that waited ``max_queue_time_s`` for a slot: 503 + Retry-After (measured)."""
    if not b.max_queue_time_s:
        return
    now = b._clock()
    expired = [rid for rid, e in b._waiting.items() if now - e.stream.arrival >= b.max_queue_time_s]
    for rid in expired:
        entry = b._waiting[rid]
        b._observer.on_rejected(b.model, "queue_timeout")
        entry.stream.fail(Overloaded(
            f"the request waited {b.max_queue_time_s:g}s for a free slot of model {b.model!r} (max_queue_time)",
            retry_after_s=b._rate.retry_after_s(len(b._waiting))))
        b.cancel(rid)


def check_liveness(b: RollingBatcher) -> None:
    """Kill a worker that has requests but reported no step for ``liveness_timeout_s``; its requests are retried
    elsewhere or failed as a dead worker's are."""
    if not b.liveness_timeout_s:
        return
    for worker in list(b._workers):
        silent = b.silent_s(worker.worker_id)
        if silent is None or silent < b.liveness_timeout_s:
            continue
        b.num_watchdog_kills += 1
        b.last_watchdog = {"worker": worker.worker_id, "silent_s": round(silent, 3),
                           "requests": b._load[worker.worker_id]}
        log.error("model %s: worker %d made no progress for %.1fs with %d requests (liveness_timeout); restarting "
                  "it", b.model, worker.worker_id, silent, b._load[worker.worker_id])
        # no new work until the pool replaces it; its requests run elsewhere
        b._drop(worker, f"made no engine step for {silent:.1f}s (liveness_timeout {b.liveness_timeout_s:g}s) and "
                        "is being restarted")
        with contextlib.suppress(ProcessLookupError):
            worker.kill_soon("watchdog")
