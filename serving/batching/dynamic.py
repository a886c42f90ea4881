"""DynamicBatcher: a bounded queue per model and batches of up to ``batch_size`` sent to idle workers.

Design note: the loop first waits for an idle worker and a first request, then gathers more requests
until ``batch_size`` or ``max_batch_delay_ms`` after the first was picked up, and sends one ``Batch``.
Results come back per item, so one item's failure never fails its batch-mates. A worker that dies with a
batch in flight gets each request retried once (nothing reached the client yet), then failed. A request
whose client left before dispatch is dropped when the batch is gathered.

``configure`` changes ``batch_size``, ``max_batch_delay`` and ``job_queue_size`` of the live batcher: the
batch being gathered is re-checked at once (its delay counts from its first request with the new value, and
requests beyond a lowered size go back to the front of the queue), so every batch dispatched afterwards
follows the new values. ``retire`` stops sending batches to a worker that is being scaled away;
``worker_load`` tells how many of its requests are still in flight.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
from typing import Any

from rollcore.errors import (
    HandlerError,
    Overloaded,
    RequestTimeout,
    ServingError,
    Unavailable,
    WorkerFailed,
    error_from_kind,
)
from rollcore.types import BatchOutput, GenerationRequest, TokenDelta
from serving.batching.deadline_admission import (
    ServiceTimes,
    admit,
    as_ms,
    expired_while_queued,
    overdue,
    predicted_wait_s,
)
from serving.batching.pacing import ServiceRate, send_each
from serving.batching.ports import DEFAULT_CLOCK, BatchObserver, Clock, NullObserver, Worker
from serving.batching.streams import ResultStream
from serving.ipc.messages import Batch, BatchResult

log = logging.getLogger(__name__)


class _Pending:
    __slots__ = ("request", "stream")

    def __init__(self, request: GenerationRequest, stream: ResultStream) -> None:
        self.request = request
        self.stream = stream


class DynamicBatcher:
    """Runs on the event loop; ``start()`` launches its gathering task."""

    def __init__(self, model: str, batch_size: int, max_batch_delay_ms: int, job_queue_size: int,
                 predict_timeout_s: float, observer: BatchObserver | None = None,
                 clock: Clock = DEFAULT_CLOCK, *, max_queue_time_s: float | None = None) -> None:
        self.model = model
        self.batch_size = batch_size
        self.max_batch_delay_s = max_batch_delay_ms / 1000.0
        self.job_queue_size = job_queue_size
        self.predict_timeout_s = predict_timeout_s
        self._observer = observer or NullObserver()
        self._clock = clock
        self._queue: collections.deque[_Pending] = collections.deque()
        self._idle: collections.deque[Worker] = collections.deque()
        self._inflight: dict[int, tuple[Worker, list[_Pending], asyncio.TimerHandle]] = {}
        self._gathering: list[_Pending] = []  # taken off the queue, not yet dispatched: still pending
        self._current_worker: Worker | None = None  # the idle worker the batch being gathered is for
        self._batch_ids = itertools.count(1)
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._watch_task: asyncio.Task[None] | None = None
        self.max_queue_time_s = max_queue_time_s
        self._rate = ServiceRate(clock)
        self._service = ServiceTimes()  # dispatch to results of each batch: the queue's predicted wait
        self._retiring: set[int] = set()  # worker ids that get no new batch (scaled away)
        self.num_batches = 0
        self.num_retried = 0  # requests run again after their worker died (Prometheus: rollserve_request_retries)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"dynamic-batcher-{self.model}")
        if self.max_queue_time_s:
            interval = max(0.05, min(1.0, self.max_queue_time_s / 4))
            self._watch_task = asyncio.create_task(self._watch(interval), name=f"dynamic-watch-{self.model}")

    async def close(self, reason: str = "") -> None:
        """Stop the loop and fail every request still pending (the model is going away)."""
        for task in (self._task, self._watch_task):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self._task = self._watch_task = None
        self.fail_pending(Unavailable(reason or f"model {self.model!r} was unloaded", retry_after_s=5))

    def fail_pending(self, error: ServingError) -> None:
        """Fail every queued, gathering and in-flight request with ``error``."""
        pending = list(self._queue) + list(self._gathering)
        self._queue.clear()
        for batch_id, (_, batch, timer) in list(self._inflight.items()):
            del self._inflight[batch_id]
            timer.cancel()
            pending.extend(batch)
        for p in pending:
            p.stream.fail(error)

    async def _watch(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            self.check_queue_time()

    def check_queue_time(self) -> None:
        """Fail requests queued for ``max_queue_time_s``: 503 + Retry-After from the measured rate."""
        if not self.max_queue_time_s:
            return
        now = self._clock()
        expired = [p for p in self._queue if now - p.stream.arrival >= self.max_queue_time_s]
        for p in expired:
            self._queue.remove(p)
            self._observer.on_rejected(self.model, "queue_timeout")
            p.stream.fail(Overloaded(f"the request waited {self.max_queue_time_s:g}s for a worker of model "
                                     f"{self.model!r} (max_queue_time)",
                                     retry_after_s=self._rate.retry_after_s(len(self._queue))))

    # --- requests ---
    def submit(self, request: GenerationRequest) -> ResultStream:
        if len(self._queue) >= self.job_queue_size:
            self._observer.on_rejected(self.model, "queue_full")
            raise Overloaded(f"model {self.model!r} queue is full ({self.job_queue_size} requests waiting)",
                             retry_after_s=self._rate.retry_after_s(len(self._queue)))
        admit(self.model, request, self._clock(), self._predicted_wait_s(), self._observer)
        stream = ResultStream(request.request_id, self._clock, on_cancel=self.cancel, on_finish=self._finished)
        self._queue.append(_Pending(request, stream))
        if request.deadline is not None:
            delay = max(0.0, request.deadline - self._clock())
            asyncio.get_running_loop().call_later(delay, self._on_deadline, stream)
        self._changed.set()
        return stream

    def _on_deadline(self, stream: ResultStream) -> None:
        """The client's deadline passed: fail the request (counted as its stream ends); a queued one never reaches
        a worker, an in-flight one's result is dropped."""
        if stream.done:
            return
        stream.fail(expired_while_queued() if stream.dispatched is None else
                    RequestTimeout("the request's deadline passed before it completed"))

    def _predicted_wait_s(self) -> float | None:
        """How long a request submitted now would wait for a batch slot (``serving.batching.deadline_admission``)."""
        busy = {id(w) for w, _, _ in self._inflight.values()}
        gathering = self._current_worker is not None
        num_workers = len(self._idle) + len(busy) + (1 if gathering else 0)
        free = self.batch_size * len(self._idle) + (max(0, self.batch_size - len(self._gathering)) if gathering else 0)
        return predicted_wait_s(len(self._queue), free, num_workers * self.batch_size, self._service.mean_s())

    def cancel(self, request_id: str) -> bool:
        """Drop a queued request (an in-flight batch cannot be interrupted; its result is discarded)."""
        for p in self._queue:
            if p.request.request_id == request_id:
                self._queue.remove(p)
                p.stream.cancel()
                return True
        return any(p.request.request_id == request_id for _, b, _ in self._inflight.values() for p in b)

    def _finished(self, stream: ResultStream) -> None:
        self._observer.on_finished(self.model, stream)  # once per stream: success, error or cancel

    def num_pending(self) -> int:
        return len(self._queue) + len(self._gathering) + sum(len(b) for _, b, _ in self._inflight.values())

    def num_queued(self) -> int:
        """Requests waiting for a worker (not yet in a batch)."""
        return len(self._queue)

    def describe(self) -> dict[str, Any]:
        return {"mode": "dynamic", "queued": len(self._queue), "in_flight_batches": len(self._inflight),
                "idle_workers": len(self._idle), "batches_total": self.num_batches, "batch_size": self.batch_size,
                "predicted_wait_ms": as_ms(self._predicted_wait_s()),  # for a request submitted now
                "max_batch_delay": round(self.max_batch_delay_s * 1000), "job_queue_size": self.job_queue_size,
                "retries_total": self.num_retried}

    # --- live knobs ---
    def configure(self, batch_size: int | None = None, max_batch_delay_ms: int | None = None,
                  job_queue_size: int | None = None) -> None:
        """New values from the batch being gathered on (None keeps a value). A smaller ``job_queue_size``
        refuses new requests while more wait; it never drops a queued one."""
        if batch_size is not None:
            self.batch_size = batch_size
        if max_batch_delay_ms is not None:
            self.max_batch_delay_s = max_batch_delay_ms / 1000.0
        if job_queue_size is not None:
            self.job_queue_size = job_queue_size
        self._changed.set()  # the gathering loop re-checks its batch against the new values

    def worker_load(self, worker: Worker) -> int:
        """Requests of ``worker``'s batches in flight (and of the batch being gathered for it)."""
        load = sum(len(b) for w, b, _ in self._inflight.values() if w is worker)
        return load + (len(self._gathering) if self._current_worker is worker else 0)

    def retire(self, worker: Worker) -> None:
        """Send ``worker`` no new batch; its batches in flight finish as usual (see ``worker_load``)."""
        self._retiring.add(worker.worker_id)
        if worker in self._idle:
            self._idle.remove(worker)
        self._changed.set()

    # --- workers ---
    def worker_ready(self, worker: Worker) -> None:
        self._idle.append(worker)
        self._changed.set()

    def worker_lost(self, worker: Worker) -> None:
        self._retiring.discard(worker.worker_id)
        if worker in self._idle:
            self._idle.remove(worker)
        for batch_id, (w, batch, timer) in list(self._inflight.items()):
            if w is worker:
                del self._inflight[batch_id]
                timer.cancel()
                self._retry_or_fail(batch, "the worker serving this request died")

    def _retry_or_fail(self, batch: list[_Pending], reason: str) -> None:
        for p in reversed(batch):
            if p.stream.done:
                continue
            if p.stream.num_retries == 0:
                p.stream.num_retries += 1
                self.num_retried += 1
                self._queue.appendleft(p)
            else:
                p.stream.fail(WorkerFailed(f"{reason}; retried once already"))
        self._changed.set()

    def on_message(self, worker: Worker, msg: Any) -> None:
        if not isinstance(msg, BatchResult):
            return
        entry = self._inflight.pop(msg.batch_id, None)
        if entry is None:
            return
        _, batch, timer = entry
        timer.cancel()
        sent = [p.stream.dispatched for p in batch if p.stream.dispatched is not None]
        if sent:
            self._service.record(self._clock() - max(sent))
        by_id = {o.request_id: o for o in msg.outputs}
        for p in batch:
            out = by_id.get(p.request.request_id)
            if out is None:
                p.stream.fail(ServingError("the handler returned no output for this request"))
                continue
            try:
                _deliver(p.stream, out)
            except Exception as exc:  # noqa: BLE001 - a malformed output fails its own request only
                log.error("request %s model %s: malformed output from the handler: %s", p.request.client_id,
                          self.model, type(exc).__name__)
                p.stream.fail(HandlerError("the model's handler returned a malformed answer for this request"))
            self._rate.record()
        if worker.alive and worker.worker_id not in self._retiring:
            self._idle.append(worker)
        self._changed.set()

    def _on_timeout(self, batch_id: int) -> None:
        entry = self._inflight.pop(batch_id, None)
        if entry is None:
            return
        worker, batch, _ = entry
        for p in batch:
            p.stream.fail(RequestTimeout(f"prediction exceeded option.predict_timeout={self.predict_timeout_s:g}s"))
        # The worker is stuck in a handler call: it is killed and restarted by its pool.
        kill = getattr(worker, "kill_soon", None)
        if kill is not None:
            kill()

    # --- the gathering loop ---
    async def _run(self) -> None:
        while True:
            try:
                await self._gather_and_dispatch()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the loop must outlive any one bad batch
                log.exception("model %s: dynamic batching loop error; failing the batch being gathered",
                              self.model)
                gathering, self._gathering = self._gathering, []
                for p in gathering:
                    p.stream.fail(ServingError("internal error while batching this request"))
                worker, self._current_worker = self._current_worker, None
                if worker is not None and worker.alive and worker not in self._idle and \
                        worker.worker_id not in self._retiring and \
                        all(w is not worker for w, _, _ in self._inflight.values()):
                    self._idle.append(worker)

    async def _gather_and_dispatch(self) -> None:
        while not (self._idle and self._live_queue()):
            self._changed.clear()
            await self._changed.wait()
        worker = self._idle.popleft()
        if not worker.alive:
            return
        self._current_worker = worker
        batch = self._gathering = [self._queue.popleft()]
        started = self._clock()
        # batch_size and max_batch_delay_s are read on every pass: configure() wakes this loop
        while len(batch) < self.batch_size and worker.worker_id not in self._retiring:
            if self._live_queue():
                batch.append(self._queue.popleft())
                continue
            remaining = started + self.max_batch_delay_s - self._clock()
            if remaining <= 0:
                break
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except asyncio.TimeoutError:
                break
        while len(batch) > self.batch_size:  # the size was lowered meanwhile: the newest go back, in order
            self._queue.appendleft(batch.pop())
        for p in batch:
            if overdue(p.request, self._clock()):  # its deadline timer has not run yet
                self._on_deadline(p.stream)
        batch = [p for p in batch if not p.stream.done]
        self._gathering = []
        self._current_worker = None
        if worker.worker_id in self._retiring:  # scaled away meanwhile: the batch waits for another worker
            for p in reversed(batch):
                self._queue.appendleft(p)
            self._changed.set()
            return
        if not batch:
            self._idle.appendleft(worker)
            return
        if not worker.alive:
            self._retry_or_fail(batch, "the worker died before the batch was sent")
            return
        self._dispatch(worker, batch)

    def _live_queue(self) -> bool:
        while self._queue and self._queue[0].stream.done:
            self._queue.popleft()
        return bool(self._queue)

    def _dispatch(self, worker: Worker, batch: list[_Pending]) -> None:
        batch_id = next(self._batch_ids)
        for p in batch:
            p.stream.mark_dispatched()
            p.stream.worker_id = worker.worker_id
        timer = asyncio.get_running_loop().call_later(self.predict_timeout_s, self._on_timeout, batch_id)
        self._inflight[batch_id] = (worker, batch, timer)
        self.num_batches += 1
        self._observer.on_batch(self.model, len(batch))
        try:
            sent = send_each(worker.send, lambda wires: Batch(batch_id=batch_id, requests=wires), batch,
                             lambda p: p.request, lambda p, err: p.stream.fail(err))
        except ConnectionError:
            self._inflight.pop(batch_id, None)
            timer.cancel()
            self._retry_or_fail(batch, "the worker died before the batch was sent")
            return
        if len(sent) != len(batch):
            batch[:] = sent  # the in-flight entry holds only what the worker will answer
            if not sent:
                self._inflight.pop(batch_id, None)
                timer.cancel()
                self._idle.appendleft(worker)


def _deliver(stream: ResultStream, out: BatchOutput) -> None:
    """One handler output into its stream (an output that did not decode carries its error: ``malformed``)."""
    if out.error:
        stream.fail(error_from_kind(out.error_kind.value, out.error))
        return
    stream.set_payload(out.payload)
    stream.push(TokenDelta(request_id=stream.request_id, tokens=out.tokens, text=out.text,
                           finish_reason=out.finish_reason, prompt_tokens=out.prompt_tokens,
                           prompt_logprobs=out.prompt_logprobs, embedding=out.embedding))
