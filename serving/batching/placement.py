"""Which worker a waiting request of a rolling model goes to: its affinity key's worker while that one lives, takes
work and stays within the imbalance bound (``serving.batching.affinity``), else the router's choice by cached prefix
and load (``serving.batching.routing``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from serving.batching.ports import Worker

if TYPE_CHECKING:
    from serving.batching.rolling import RollingBatcher, _Admitted


def place(b: RollingBatcher, entry: _Admitted) -> tuple[Worker | None, bool]:
    """``(worker, full)``: the worker for ``entry``; ``(None, True)`` when every worker is full; ``(None, False)``
    when its key's worker is full (it waits for a slot there)."""
    key = entry.request.affinity
    worker = pinned(b, key)
    if worker is not None and b._affinity.routed(key) and \
            not b.router.within_bound(b._load[worker.worker_id], floor(b)):
        worker = None  # its worker is too far ahead of the least loaded one: the key moves
    if worker is None:
        worker = route(b, entry)
        if worker is None:
            return None, True
        if key is not None:
            b._affinity.note_routed(key)
        return worker, False
    if b._load.get(worker.worker_id, 0) >= b.max_rolling_batch_size:
        return None, False
    return worker, False


def pinned(b: RollingBatcher, key: str | None) -> Worker | None:
    """The live worker that ``key``'s earlier requests went to, or None (no key, or that worker is gone)."""
    wid = b._affinity.worker_id(key)
    if wid is None or wid in b._retiring:
        return None
    return next((w for w in b._workers if w.worker_id == wid and w.alive), None)


def open_workers(b: RollingBatcher) -> list[Worker]:
    return [w for w in b._workers if w.alive and w.worker_id not in b._retiring]


def floor(b: RollingBatcher) -> int:
    """The load of the least loaded worker that takes work."""
    return min((b._load[w.worker_id] for w in open_workers(b)), default=0)


def route(b: RollingBatcher, entry: _Admitted) -> Worker | None:
    """The worker for ``entry`` by prefix and load (``routing.Router``); None when every worker is full."""
    if entry.keys is None:
        entry.keys = b.router.prompt_keys(entry.request)
    candidates = [(w, w.worker_id, b._load[w.worker_id]) for w in open_workers(b)]
    return b.router.choose(candidates, b.max_rolling_batch_size, entry.keys)
