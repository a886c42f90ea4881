"""The rolling worker's engine loop: drain Add/Abort, step, send one ``Deltas`` frame per step.

Design note: runs on the worker's main thread and owns the handler. An engine step that raises fails only
the requests it can blame. Requests added since they last produced a delta ("fresh": nothing reached
their client yet) are the suspects: on a failed step they are taken out of the engine and re-admitted one
at a time ("probation"); if a step fails while exactly one of them is on probation, that one is failed
(``Reject``, the exception text scrubbed of paths) and the others carry on. A blame is verified by the
next step, run without a new suspect when other requests are running; a failed step with no suspect
fails the requests it ran. ``max_step_failures`` failures in a row that no verified blame explains (a
broken engine blames everyone), or a handler that reports itself unhealthy (a dead tensor-parallel rank),
end the loop with ``WorkerUnhealthy``: the worker exits and its pool restarts it (requests that had
produced nothing are retried once there, the others fail definitely).

``Configure`` (``PUT /models/{name}``) is applied where it stands in the inbox, between two steps: the
requests added before it are in the engine when the new limits take effect, and the next step plans with
them. The loop answers ``Configured`` with the engine's stats right after the change (or the refusal).
"""

from __future__ import annotations

import collections
import logging
import queue
import time
from collections.abc import Callable
from typing import Any, Protocol

from rollcore.errors import ErrorKind, ServingError
from rollcore.types import GenerationRequest
from serving.ipc.messages import Abort, Add, Configure, Configured, Deltas, Message, Reject, Shutdown

log = logging.getLogger("serving.worker")

MAX_STEP_FAILURES = 3


class WorkerUnhealthy(Exception):
    """The worker cannot go on (repeated step failures, a dead tensor-parallel rank): restart it."""


class Channel(Protocol):
    inbox: queue.Queue[Message | None]

    def send(self, msg: Message) -> None: ...


class RollingLoop:
    """Drives one ``RollingHandler``. ``to_input`` turns a request into the handler's ``Input``;
    ``redact`` scrubs texts that go to clients."""

    def __init__(self, conn: Channel, handler: Any, to_input: Callable[[GenerationRequest], Any],
                 model: str = "-", redact: Callable[[str], str] = str,
                 max_step_failures: int = MAX_STEP_FAILURES) -> None:
        self.conn = conn
        self.handler = handler
        self.to_input = to_input
        self.model = model
        self.redact = redact
        self.max_step_failures = max_step_failures
        self.active: set[str] = set()  # in the engine: added, not yet finished, aborted or failed
        self.fresh: dict[str, GenerationRequest] = {}  # active and no delta yet: safe to take out and re-add
        self.probation: collections.deque[GenerationRequest] = collections.deque()
        self.on_probation: str | None = None  # the one suspect in the engine
        self.unverified_blame = False  # a suspect was failed and no step has succeeded since
        self.num_unexplained_failures = 0
        self.step = 0

    def run(self) -> None:
        """Serve until Shutdown or the frontend goes away. Raises ``WorkerUnhealthy``."""
        while True:
            aborted = self._drain_inbox()
            if aborted is None:
                return
            self._check_health()
            self._admit_probation()
            if not self.handler.has_work():
                if aborted:  # no step will follow: publish the freed blocks now
                    self.conn.send(Deltas(step=self.step, deltas=[], stats=self.handler.stats(),
                                          prefix=self.handler.prefix_events()))
                continue
            self._step()

    # --- inbox ---
    def _drain_inbox(self) -> bool | None:
        """Apply queued frames (blocking only when idle). None: stop serving; else whether something aborted."""
        block = not self.handler.has_work() and not self.probation
        aborted = False
        while True:
            try:
                msg = self.conn.inbox.get(block=block, timeout=None)
            except queue.Empty:
                return aborted
            block = False
            if msg is None or isinstance(msg, Shutdown):
                return None
            if isinstance(msg, Add):
                for d in msg.requests:
                    if self.probation:  # keep suspects apart until the one on probation is cleared
                        self.probation.append(d)
                    else:
                        self._add(d)
            elif isinstance(msg, Abort):
                gone = set(msg.request_ids)
                for rid in gone:
                    self._forget(rid)
                    self.handler.abort(rid)
                self.probation = collections.deque(d for d in self.probation if d.request_id not in gone)
                aborted = True
            elif isinstance(msg, Configure):
                self._configure(msg)

    def _add(self, d: GenerationRequest) -> bool:
        """Queue one request in the engine; a refused one is answered with Reject. True if accepted."""
        rid = d.request_id
        try:
            self.handler.add(self.to_input(d))
        except ServingError as exc:
            self._reject(rid, exc.kind.value, exc.message)
            return False
        except Exception as exc:  # noqa: BLE001 - a handler bug refuses this request only
            log.exception("request %s model %s: add failed", rid, self.model,
                          extra={"request_id": rid, "model": self.model})
            self._reject(rid, ErrorKind.HANDLER.value, f"{type(exc).__name__}: {exc}")
            return False
        self.active.add(rid)
        self.fresh[rid] = d
        return True

    def _configure(self, msg: Configure) -> None:
        """Apply the options the handler can change live (the frontend enforces the others itself)."""
        live: frozenset[str] = getattr(self.handler, "live_options", frozenset())
        options = {key: value for key, value in msg.options.items() if key in live}
        try:
            if msg.adapters is not None:
                set_adapters = getattr(self.handler, "set_adapters", None)
                if set_adapters is None:
                    raise ValueError("this handler serves no LoRA adapters")
                set_adapters(msg.adapters)
            if options:
                self.handler.configure(options)
        except Exception as exc:  # noqa: BLE001 - a refused change leaves the engine as it was
            log.exception("model %s: configure %s failed", self.model, options)
            self.conn.send(Configured(seq=msg.seq, error=self.redact(f"{type(exc).__name__}: {exc}")))
            return
        self.conn.send(Configured(seq=msg.seq, stats=self.handler.stats()))

    def _reject(self, rid: str, kind: str, message: str) -> None:
        self.conn.send(Reject(request_id=rid, kind=kind, message=self.redact(message)))

    def _forget(self, rid: str) -> None:
        self.active.discard(rid)
        self.fresh.pop(rid, None)
        if self.on_probation == rid:
            self.on_probation = None

    # --- probation and health ---
    def _admit_probation(self) -> None:
        if self.unverified_blame and self.handler.has_work():
            return  # first a step with the requests that were fine: it confirms the blame
        while self.probation and self.on_probation is None:
            d = self.probation.popleft()
            if self._add(d):
                self.on_probation = d.request_id

    def _check_health(self) -> None:
        healthy = getattr(self.handler, "healthy", None)
        if healthy is not None and not healthy():
            raise WorkerUnhealthy("the handler reports itself unhealthy (e.g. a tensor-parallel rank died)")

    # --- step ---
    def _step(self) -> None:
        t0 = time.perf_counter()
        try:
            deltas = self.handler.step()
        except Exception as exc:  # noqa: BLE001 - blame what can be blamed, keep the worker if possible
            self._step_failed(exc)
            return
        self.num_unexplained_failures = 0
        self.unverified_blame = False
        self.step += 1
        refused = [d for d in deltas if d.error is not None]  # a request the engine refused after admitting it
        for d in refused:
            self._forget(d.request_id)
            self._reject(d.request_id, ErrorKind.INVALID.value, d.error or "")
        if refused:
            deltas = [d for d in deltas if d.error is None]
        for d in deltas:
            self.fresh.pop(d.request_id, None)
            if d.request_id == self.on_probation:
                self.on_probation = None
            if d.finish_reason is not None:
                self.active.discard(d.request_id)
        self.conn.send(Deltas(step=self.step, deltas=list(deltas), stats=self.handler.stats(),
                              step_s=time.perf_counter() - t0, prefix=self.handler.prefix_events()))

    def _step_failed(self, exc: Exception) -> None:
        self._check_health()  # a dead rank explains the failure: restart instead of failing requests
        text = f"{type(exc).__name__}: {exc}"
        if self.on_probation is not None:
            rid = self.on_probation
            log.error("request %s model %s: engine step failed with it on probation: %s; failing it", rid,
                      self.model, text, extra={"request_id": rid, "model": self.model})
            self.handler.abort(rid)
            self._forget(rid)
            self._reject(rid, ErrorKind.HANDLER.value, f"the engine step failed on this request: {text}")
            if self.unverified_blame:  # two blames in a row with no good step between: suspect the engine
                self._count_unexplained(text)
            self.unverified_blame = True
            return
        self._count_unexplained(text)
        if self.fresh:
            log.warning("model %s: engine step failed (%s); re-admitting its %d new requests one at a time",
                        self.model, text, len(self.fresh))
            for rid, d in list(self.fresh.items()):
                self.handler.abort(rid)
                self._forget(rid)
                self.probation.append(d)
        else:
            rids = sorted(self.active)
            log.error("request %s model %s: engine step failed: %s; failing its %d requests", ",".join(rids),
                      self.model, text, len(rids), exc_info=exc, extra={"request_id": ",".join(rids),
                                                                         "model": self.model})
            for rid in rids:
                self.handler.abort(rid)
                self._forget(rid)
                self._reject(rid, ErrorKind.HANDLER.value, f"engine step failed: {text}")

    def _count_unexplained(self, text: str) -> None:
        self.num_unexplained_failures += 1
        if self.num_unexplained_failures >= self.max_step_failures:
            raise WorkerUnhealthy(f"{self.num_unexplained_failures} engine steps in a row failed: {text}")
