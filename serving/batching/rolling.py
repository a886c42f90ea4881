"""RollingBatcher: admits requests into workers' running engines and demuxes their per-step deltas.

Design note: the scheduling policy (which sequences run each step, KV blocks, preemption) lives in the
worker's engine; this side only bounds admission. Up to ``max_rolling_batch_size`` requests are admitted
per worker (``Add``); the rest wait in a queue of ``job_queue_size`` (full -> Overloaded). Each ``Deltas``
frame is split into the requests' streams; a finished request frees its slot and the next waiting one is
admitted at once. Cancel sends ``Abort`` so the engine frees the request's KV blocks before its next step.
A dead worker's requests whose clients have received nothing are run again once on another worker
(``serving.batching.retry``); the others fail definitely.

No request waits forever: a watch task (``serving.batching.rolling_watch``) fails requests queued longer than
``max_queue_time_s`` and kills a worker that holds requests but makes no step (frames still buffered from it are
ignored). A FAILED or unregistered model fails its requests at once.

``configure`` changes ``max_rolling_batch_size``, ``job_queue_size`` and the engines' live options
(``serving.batching.engine_options``) on the running model: admission follows the new size at once (nothing is
preempted), and each worker gets a ``Configure`` frame after the ``Add`` frames the new size admitted. ``retire``
stops admitting into a worker being scaled away; ``worker_load`` tells how many of its requests still run.

Routing (``serving.batching.routing``): the worker holding the prompt's longest cached prefix, the least loaded
on a tie, within an imbalance bound; a request with an ``affinity`` key (a session, an OpenAI ``user`` or
``prompt_cache_key``) sticks to its key's worker while it lives and the bound allows (``serving.batching.affinity``).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Mapping
from typing import Any

from rollcore.errors import (
    ErrorKind,
    HandlerError,
    Overloaded,
    RequestTimeout,
    ServingError,
    Unavailable,
    error_from_kind,
)
from rollcore.types import GenerationRequest, TokenDelta
from serving.batching import placement, rolling_report, rolling_watch
from serving.batching.affinity import Affinity
from serving.batching.deadline_admission import (
    ServiceTimes,
    admit,
    expired_while_queued,
    overdue,
    predicted_wait_s,
)
from serving.batching.engine_options import EngineOptions
from serving.batching.pacing import ServiceRate, send_each
from serving.batching.ports import DEFAULT_CLOCK, BatchObserver, Clock, NullObserver, Worker
from serving.batching.retry import Retries
from serving.batching.routing import Router
from serving.batching.streams import ResultStream
from serving.ipc.messages import Abort, Add, Configured, Deltas, Reject

log = logging.getLogger(__name__)


class _Admitted:
    __slots__ = ("request", "stream", "worker", "timer", "keys")

    def __init__(self, request: GenerationRequest, stream: ResultStream, worker: Worker | None = None) -> None:
        self.request = request
        self.stream = stream
        self.worker = worker
        self.timer: asyncio.TimerHandle | None = None
        self.keys: list[int] | None = None  # its prompt's prefix-cache keys, once routing computed them


class RollingBatcher:
    """Runs on the event loop; all methods but ``close`` are synchronous (sends are buffered writes)."""

    def __init__(self, model: str, max_rolling_batch_size: int, job_queue_size: int, predict_timeout_s: float,
                 observer: BatchObserver | None = None, clock: Clock = DEFAULT_CLOCK, *,
                 max_queue_time_s: float | None = None, liveness_timeout_s: float | None = None,
                 router: Router[Worker] | None = None) -> None:
        self.model = model
        self.max_rolling_batch_size = max_rolling_batch_size
        self.job_queue_size = job_queue_size
        self.predict_timeout_s = predict_timeout_s
        self.max_queue_time_s = max_queue_time_s
        self.liveness_timeout_s = liveness_timeout_s
        self._observer = observer or NullObserver()
        self._clock = clock
        self._waiting: collections.OrderedDict[str, _Admitted] = collections.OrderedDict()
        self._running: dict[str, _Admitted] = {}
        self._workers: list[Worker] = []
        self._load: dict[int, int] = {}
        self._progress: dict[int, float] = {}  # worker id -> when it last stepped (or got work while idle)
        self._rate = ServiceRate(clock)
        self._service = ServiceTimes()  # dispatch to last token: the queue's predicted wait (batching.deadlines)
        self._watch_task: asyncio.Task[None] | None = None
        self.engine_stats: dict[int, dict[str, Any]] = {}
        self.num_steps = 0
        self.num_watchdog_kills = 0
        self.last_watchdog: dict[str, Any] | None = None  # the latest kill: worker, seconds without a step
        self._retries = Retries(model)
        self._options = EngineOptions(model)  # the engines' live options and adapters, changed over the API
        self._retiring: set[int] = set()  # worker ids admitting nothing new (scaled away)
        self._affinity = Affinity()  # affinity key (a SageMaker session) -> the worker its requests go to
        self.router: Router[Worker] = router if router is not None else Router()

    def start(self) -> None:
        limits = [t for t in (self.max_queue_time_s, self.liveness_timeout_s) if t]
        if limits and self._watch_task is None:
            interval = max(0.05, min(1.0, min(limits) / 4))
            self._watch_task = asyncio.create_task(rolling_watch.watch(self, interval),
                                                   name=f"rolling-watch-{self.model}")

    async def close(self, reason: str = "") -> None:
        """Stop the watch task and fail every request still pending (the model is going away)."""
        if self._watch_task is not None:
            self._watch_task.cancel()
            await asyncio.gather(self._watch_task, return_exceptions=True)
            self._watch_task = None
        self.fail_pending(Unavailable(reason or f"model {self.model!r} was unloaded", retry_after_s=5))

    # --- requests ---
    def submit(self, request: GenerationRequest) -> ResultStream:
        if len(self._waiting) >= self.job_queue_size:
            self._observer.on_rejected(self.model, "queue_full")
            raise Overloaded(f"model {self.model!r} queue is full ({self.job_queue_size} requests waiting)",
                             retry_after_s=self._rate.retry_after_s(len(self._waiting)))
        admit(self.model, request, self._clock(), self._predicted_wait_s(), self._observer)
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
        queued = request_id in self._waiting and overdue(entry.request, self._clock())
        err = expired_while_queued() if queued else RequestTimeout(
            f"request exceeded its deadline ({self.predict_timeout_s:g}s predict timeout or the client's deadline)")
        entry.stream.fail(err)  # the observer counts it (timeout; deadline_expired if still queued) as it ends
        self.cancel(request_id)  # dequeue or abort: the engine frees its KV blocks before the next step

    def fail_pending(self, error: ServingError) -> None:
        """Fail every waiting and running request with ``error`` (running ones are aborted on live workers)."""
        for rid in list(self._running) + list(self._waiting):
            entry = self._waiting.get(rid) or self._running.get(rid)
            if entry is not None:
                entry.stream.fail(error)
                self.cancel(rid)

    def num_pending(self) -> int:
        return len(self._waiting) + len(self._running)

    def num_queued(self) -> int:
        """Requests waiting for a free slot in some worker's running batch."""
        return len(self._waiting)

    def describe(self) -> dict[str, Any]:
        return rolling_report.describe(self)

    # --- live knobs ---
    def configure(self, max_rolling_batch_size: int | None = None, job_queue_size: int | None = None,
                  engine_options: Mapping[str, int] | None = None,
                  adapters: Mapping[str, str] | None = None) -> dict[int, asyncio.Future[Configured | None]]:
        """Apply new values (None keeps one). ``engine_options`` (``max_rolling_batch_size``,
        ``max_rolling_batch_prefill_tokens``) go to every worker's engine after the requests the new size
        admits; returns one future per worker id, resolved with its ``Configured`` answer (None when the
        worker went away first). A smaller ``job_queue_size`` refuses new requests while more wait; it drops none."""
        if job_queue_size is not None:
            self.job_queue_size = job_queue_size
        if max_rolling_batch_size is not None:
            self.max_rolling_batch_size = max_rolling_batch_size
        self._pump()  # a raised size admits waiting requests now: their Add frames go before the Configure
        if not engine_options and adapters is None:
            return {}
        self._options.update(engine_options, adapters)
        return {w.worker_id: self._options.send(w) for w in self._workers if w.alive}

    @property
    def engine_options(self) -> dict[str, int]:
        return self._options.options

    @property
    def adapters(self) -> dict[str, str] | None:
        return self._options.adapters

    def worker_load(self, worker: Worker) -> int:
        """Requests admitted into ``worker`` that have not finished."""
        return self._load.get(worker.worker_id, 0)

    def retire(self, worker: Worker) -> None:
        """Admit nothing new into ``worker``; its running requests finish as usual (see ``worker_load``)."""
        self._retiring.add(worker.worker_id)

    # --- workers ---
    def worker_ready(self, worker: Worker) -> None:
        self._workers.append(worker)
        self._load[worker.worker_id] = 0
        self._progress[worker.worker_id] = self._clock()
        if self._options:  # changed over the API since this worker's Init: before any Add
            self._options.send(worker)
        self._pump()

    def worker_lost(self, worker: Worker) -> None:
        self._drop(worker, "died during generation")

    def _drop(self, worker: Worker, cause: str) -> None:
        """Forget ``worker`` (dead, or killed by the watchdog); its requests are retried or failed."""
        if worker in self._workers:
            self._workers.remove(worker)
        self._retiring.discard(worker.worker_id)
        self._load.pop(worker.worker_id, None)
        self._progress.pop(worker.worker_id, None)
        self.engine_stats.pop(worker.worker_id, None)
        self.router.index.forget(worker.worker_id)
        self._options.forget(worker.worker_id)
        self._requeue_from(worker, cause)
        self._pump()

    def _requeue_from(self, worker: Worker, cause: str) -> None:
        """``worker``'s requests go back to the head of the queue, or fail (``serving.batching.retry``)."""
        lost: list[tuple[str, _Admitted]] = []
        for rid, entry in list(self._running.items()):
            if entry.worker is worker:
                del self._running[rid]
                entry.worker = None
                lost.append((entry.request.client_id or rid, entry))
        requeue = self._retries.split(lost, cause)
        for _, entry in lost:
            if entry.stream.done:
                self._finish_entry(entry)
        for entry in reversed(requeue):
            self._waiting[entry.request.request_id] = entry
            self._waiting.move_to_end(entry.request.request_id, last=False)

    def pin(self, key: str, worker_id: int) -> None:
        """Requests with affinity ``key`` go to worker ``worker_id`` (the deep health check probes each worker)."""
        self._affinity.pin(key, worker_id)

    def silent_s(self, worker_id: int) -> float | None:
        """Seconds since ``worker_id`` last stepped while it holds requests; None when it holds none."""
        if not self._load.get(worker_id):
            return None
        return self._clock() - self._progress.get(worker_id, self._clock())

    def on_message(self, worker: Worker, msg: Any) -> None:
        if worker not in self._workers:
            return  # taken away by the watchdog: its requests run elsewhere now
        self._progress[worker.worker_id] = self._clock()
        if isinstance(msg, Deltas):
            self.num_steps += 1
            self.engine_stats[worker.worker_id] = msg.stats
            if msg.prefix:
                self.router.index.update(worker.worker_id, msg.prefix)
            self._observer.on_step(self.model, worker.worker_id, msg.stats, msg.step_s, len(msg.deltas))
            for d in msg.deltas:
                self._deliver(worker, d)
            self._pump()
        elif isinstance(msg, Configured):
            self._options.answered(worker.worker_id, msg, self.engine_stats)
        elif isinstance(msg, Reject):
            entry = self._running.get(msg.request_id)
            if entry is not None and entry.worker is worker:
                del self._running[msg.request_id]
                self._release(entry)
                self._finish_entry(entry)
                if msg.kind == ErrorKind.INVALID.value:  # an engine failure is not the client's fault
                    self._observer.on_rejected(self.model, "invalid")
                entry.stream.fail(error_from_kind(msg.kind, msg.message))
                self._pump()

    def _deliver(self, worker: Worker, delta: TokenDelta) -> None:
        """One delta into its stream; a malformed one (decoded as its error: ``serving.ipc.messages``) fails its
        request, never the frame's others."""
        entry = self._running.get(delta.request_id)
        if entry is None or entry.worker is not worker:
            return  # aborted meanwhile
        if delta.error is not None:  # a handler bug fails its own request
            log.error("request %s model %s: %s", entry.request.client_id, self.model, delta.error)
            entry.stream.fail(HandlerError("the model's worker sent a malformed answer for this request"))
            self.cancel(entry.request.request_id)
            return
        entry.stream.push(delta)
        if delta.finish_reason is not None:
            del self._running[delta.request_id]
            self._release(entry)
            self._finish_entry(entry)
            self._rate.record()
            if entry.stream.dispatched is not None:
                self._service.record(self._clock() - entry.stream.dispatched)

    def _finish_entry(self, entry: _Admitted) -> None:
        if entry.timer is not None:
            entry.timer.cancel()
            entry.timer = None

    def _release(self, entry: _Admitted) -> None:
        if entry.worker is not None and entry.worker.worker_id in self._load:
            self._load[entry.worker.worker_id] -= 1

    # --- admission ---
    def forget_affinity(self, key: str) -> None:
        """``key``'s requests may go to any worker again (its session closed or expired)."""
        self._affinity.forget(key)

    def _pump(self) -> None:
        adds: dict[int, list[_Admitted]] = {}
        for rid in list(self._waiting):  # in arrival order; one pinned to a full worker waits, the others pass it
            entry = self._waiting[rid]
            if not entry.stream.done and overdue(entry.request, self._clock()):  # its timer has not run yet
                self._finish_entry(entry)
                entry.stream.fail(expired_while_queued())
            if entry.stream.done:
                del self._waiting[rid]
                continue
            key = entry.request.affinity
            worker, full = placement.place(self, entry)
            if full:
                break  # every worker is full
            if worker is None:
                continue  # its key's worker is full: it waits there while others pass
            del self._waiting[rid]
            if key is not None:
                self._affinity.went_to(key, worker.worker_id)
            if self._load[worker.worker_id] == 0:
                self._progress[worker.worker_id] = self._clock()  # the watchdog counts from the first work
            entry.worker = worker
            entry.stream.worker_id = worker.worker_id
            self._load[worker.worker_id] += 1
            self._running[rid] = entry
            entry.stream.mark_dispatched()
            adds.setdefault(worker.worker_id, []).append(entry)
        for entries in adds.values():
            worker = entries[0].worker
            assert worker is not None
            try:
                send_each(worker.send, lambda reqs: Add(requests=reqs), entries, lambda e: e.request,
                          self._fail_unsent)
            except ConnectionError:
                pass  # worker_lost will requeue them

    def _predicted_wait_s(self) -> float | None:
        """How long a request submitted now would wait for a slot (``serving.batching.deadline_admission``)."""
        live = [w for w in self._workers if w.alive and w.worker_id not in self._retiring]
        free = sum(max(0, self.max_rolling_batch_size - self._load.get(w.worker_id, 0)) for w in live)
        return predicted_wait_s(len(self._waiting), free, len(live) * self.max_rolling_batch_size,
                                self._service.mean_s())

    def _fail_unsent(self, entry: _Admitted, error: ServingError) -> None:
        self._running.pop(entry.request.request_id, None)
        self._release(entry)
        self._finish_entry(entry)
        entry.stream.fail(error)

    # --- watch: queue-wait limit and liveness watchdog (serving.batching.rolling_watch) ---
    def check_queue_time(self) -> None:
        rolling_watch.check_queue_time(self)

    def check_liveness(self) -> None:
        rolling_watch.check_liveness(self)
