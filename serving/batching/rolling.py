"""RollingBatcher: admits requests into workers' running engines and demuxes their per-step deltas.

Design note: the scheduling policy (which sequences run each step, KV blocks, preemption) lives in the
worker's engine; this side only bounds admission. Up to ``max_rolling_batch_size`` requests are admitted
per worker (``Add``); the rest wait in a queue of ``job_queue_size`` (full -> Overloaded). Each ``Deltas``
frame is split into the requests' streams; a finished request frees its slot and the next waiting one is
admitted at once. Cancel sends ``Abort`` so the engine frees the request's KV blocks before its next step.
A dead worker's requests that had produced nothing are retried once; the others fail definitely.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import Any

from serving.batching.ports import DEFAULT_CLOCK, BatchObserver, Clock, NullObserver, Worker
from serving.batching.streams import ResultStream
from serving.errors import ErrorKind, Overloaded, RequestTimeout, WorkerFailed, error_from_kind
from serving.types import GenerationRequest, TokenDelta
from serving.worker.messages import Abort, Add, Deltas, Reject

log = logging.getLogger(__name__)


class _Admitted:
    __slots__ = ("request", "stream", "worker", "timer")

    def __init__(self, request: GenerationRequest, stream: ResultStream, worker: Worker | None = None) -> None:
        self.request = request
        self.stream = stream
        self.worker = worker
        self.timer: asyncio.TimerHandle | None = None


class RollingBatcher:
    """Runs on the event loop; all methods are synchronous (sends are buffered writes)."""

    def __init__(self, model: str, max_rolling_batch_size: int, job_queue_size: int, predict_timeout_s: float,
                 observer: BatchObserver | None = None, clock: Clock = DEFAULT_CLOCK) -> None:
        self.model = model
        self.max_rolling_batch_size = max_rolling_batch_size
        self.job_queue_size = job_queue_size
        self.predict_timeout_s = predict_timeout_s
        self._observer = observer or NullObserver()
        self._clock = clock
        self._waiting: collections.OrderedDict[str, _Admitted] = collections.OrderedDict()
        self._running: dict[str, _Admitted] = {}
        self._workers: list[Worker] = []
        self._load: dict[int, int] = {}
        self.engine_stats: dict[int, dict[str, Any]] = {}
        self.num_steps = 0

    def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    # --- requests ---
    def submit(self, request: GenerationRequest) -> ResultStream:
        if len(self._waiting) >= self.job_queue_size:
            self._observer.on_rejected(self.model, "queue_full")
            raise Overloaded(f"model {self.model!r} queue is full ({self.job_queue_size} requests waiting)",
                             retry_after_s=1)
        stream = ResultStream(request.request_id, self._clock, on_cancel=self.cancel,
                              on_finish=lambda st: self._observer.on_finished(self.model, st))
        entry = _Admitted(request, stream)
        timeout = self.predict_timeout_s
        if request.deadline is not None:
            timeout = min(timeout, max(0.0, request.deadline - self._clock()))
        entry.timer = asyncio.get_running_loop().call_later(timeout, self._on_timeout, request.request_id)
        self._waiting[request.request_id] = entry
        self._pump()
        return stream

    def cancel(self, request_id: str) -> bool:
        """Remove a waiting request or abort a running one (its KV blocks are freed before the next step)."""
        entry = self._waiting.pop(request_id, None)
        if entry is None:
            entry = self._running.pop(request_id, None)
            if entry is None:
                return False
            self._release(entry)
            if entry.worker is not None and entry.worker.alive:
                try:
                    entry.worker.send(Abort(request_ids=[request_id]))
                except ConnectionError:
                    pass
        if entry.timer is not None:
            entry.timer.cancel()
        entry.stream.cancel()
        self._pump()
        return True

    def _on_timeout(self, request_id: str) -> None:
        entry = self._waiting.get(request_id) or self._running.get(request_id)
        if entry is None:
            return
        entry.timer = None
        err = RequestTimeout(f"request exceeded its deadline ({self.predict_timeout_s:g}s predict timeout "
                             "or the client's deadline)")
        entry.stream.fail(err)  # the observer counts it as rejected (timeout) when the stream ends
        self.cancel(request_id)  # dequeue or abort: the engine frees its KV blocks before the next step

    def num_pending(self) -> int:
        return len(self._waiting) + len(self._running)

    def num_queued(self) -> int:
        """Requests waiting for a free slot in some worker's running batch."""
        return len(self._waiting)

    def describe(self) -> dict[str, Any]:
        return {"mode": "rolling", "waiting": len(self._waiting), "running": len(self._running),
                "max_rolling_batch_size": self.max_rolling_batch_size, "steps_total": self.num_steps,
                "engines": {str(k): v for k, v in self.engine_stats.items()}}

    # --- workers ---
    def worker_ready(self, worker: Worker) -> None:
        self._workers.append(worker)
        self._load[worker.worker_id] = 0
        self._pump()

    def worker_lost(self, worker: Worker) -> None:
        if worker in self._workers:
            self._workers.remove(worker)
        self._load.pop(worker.worker_id, None)
        self.engine_stats.pop(worker.worker_id, None)
        requeue: list[_Admitted] = []
        for rid, entry in list(self._running.items()):
            if entry.worker is not worker:
                continue
            del self._running[rid]
            entry.worker = None
            if not entry.stream.started and entry.stream.num_retries == 0:
                entry.stream.num_retries += 1
                requeue.append(entry)
            else:
                self._finish_entry(entry)
                entry.stream.fail(WorkerFailed("the worker serving this request died during generation"))
        for entry in reversed(requeue):
            self._waiting[entry.request.request_id] = entry
            self._waiting.move_to_end(entry.request.request_id, last=False)
        self._pump()

    def on_message(self, worker: Worker, msg: Any) -> None:
        if isinstance(msg, Deltas):
            self.num_steps += 1
            self.engine_stats[worker.worker_id] = msg.stats
            self._observer.on_step(self.model, worker.worker_id, msg.stats, msg.step_s, len(msg.deltas))
            for d in msg.deltas:
                delta = TokenDelta.from_wire(d)
                entry = self._running.get(delta.request_id)
                if entry is None:
                    continue  # aborted meanwhile
                entry.stream.push(delta)
                if delta.finish_reason is not None:
                    del self._running[delta.request_id]
                    self._release(entry)
                    self._finish_entry(entry)
            self._pump()
        elif isinstance(msg, Reject):
            entry = self._running.pop(msg.request_id, None)
            if entry is not None:
                self._release(entry)
                self._finish_entry(entry)
                if msg.kind == ErrorKind.INVALID.value:  # an engine failure is not the client's fault
                    self._observer.on_rejected(self.model, "invalid")
                entry.stream.fail(error_from_kind(msg.kind, msg.message))
                self._pump()

    def _finish_entry(self, entry: _Admitted) -> None:
        if entry.timer is not None:
            entry.timer.cancel()
            entry.timer = None

    def _release(self, entry: _Admitted) -> None:
        if entry.worker is not None and entry.worker.worker_id in self._load:
            self._load[entry.worker.worker_id] -= 1

    # --- admission ---
    def _pump(self) -> None:
        adds: dict[int, list[_Admitted]] = {}
        while self._waiting:
            worker = self._least_loaded()
            if worker is None:
                break
            rid, entry = self._waiting.popitem(last=False)
            if entry.stream.done:
                continue
            entry.worker = worker
            self._load[worker.worker_id] += 1
            self._running[rid] = entry
            entry.stream.mark_dispatched()
            adds.setdefault(worker.worker_id, []).append(entry)
        for entries in adds.values():
            worker = entries[0].worker
            assert worker is not None
            try:
                worker.send(Add(requests=[e.request.to_wire() for e in entries]))
            except ConnectionError:
                pass  # worker_lost will requeue them

    def _least_loaded(self) -> Worker | None:
        best: Worker | None = None
        for w in self._workers:
            if w.alive and self._load.get(w.worker_id, 0) < self.max_rolling_batch_size:
                if best is None or self._load[w.worker_id] < self._load[best.worker_id]:
                    best = w
        return best
