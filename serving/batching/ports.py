"""Ports: what the batchers need from the rest of the system, as small protocols.

The batchers never import the worker package: a ``WorkerHandle`` satisfies ``Worker`` structurally and
tests use fakes. ``BatchObserver`` receives batch/step statistics (the metrics object implements it).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

from rollcore.types import GenerationRequest
from serving.batching.streams import ResultStream


class Worker(Protocol):
    """A backend worker as a batcher sees it."""

    worker_id: int
    alive: bool
    info: dict[str, Any]

    def send(self, msg: Any) -> None: ...
    def kill_soon(self, cause: str = "crash") -> None: ...


class BatchObserver(Protocol):
    """Receives statistics as requests flow (all methods are called on the event loop)."""

    def on_batch(self, model: str, size: int) -> None: ...
    def on_step(self, model: str, worker_id: int, stats: dict[str, Any], step_s: float, num_deltas: int) -> None: ...
    def on_rejected(self, model: str, reason: str) -> None: ...
    def on_finished(self, model: str, stream: ResultStream) -> None:
        """Called exactly once per stream when it ends: success, error, timeout or cancel."""


class NullObserver:
    """Observer that records nothing."""

    def on_batch(self, model: str, size: int) -> None:
        pass

    def on_step(self, model: str, worker_id: int, stats: dict[str, Any], step_s: float, num_deltas: int) -> None:
        pass

    def on_rejected(self, model: str, reason: str) -> None:
        pass

    def on_finished(self, model: str, stream: ResultStream) -> None:
        pass


class Batcher(Protocol):
    """What an endpoint needs from a batcher (dynamic or rolling)."""

    def submit(self, request: GenerationRequest) -> ResultStream: ...
    def cancel(self, request_id: str) -> bool: ...
    def worker_ready(self, worker: Worker) -> None: ...
    def worker_lost(self, worker: Worker) -> None: ...
    def on_message(self, worker: Worker, msg: Any) -> None: ...
    def describe(self) -> dict[str, Any]: ...
    def num_pending(self) -> int: ...
    def num_queued(self) -> int: ...
    def worker_load(self, worker: Worker) -> int: ...
    def retire(self, worker: Worker) -> None: ...


Clock = Callable[[], float]
DEFAULT_CLOCK: Clock = time.monotonic
