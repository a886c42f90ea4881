"""ModelEndpoint: one served model: its config, state, batcher and worker pool.

Design note: frontends call ``submit`` and get a ``ResultStream``; they never see workers. The endpoint
picks the batcher from the config (dynamic or rolling), builds the worker pool and tracks the model's
lifecycle state (LOADING -> READY, or FAILED with a reason; DRAINING -> UNLOADED on removal). ``submit``
gives every request a server-generated id (the client's id stays for logs, headers and cancel-by-id; see
``serving.live_requests``). A model that turns FAILED, or is stopped, fails its pending requests at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from serving.batching.dynamic import DynamicBatcher
from serving.batching.ports import BatchObserver, Clock, NullObserver
from serving.batching.rolling import RollingBatcher
from serving.batching.streams import ResultStream
from serving.config import ModelConfig
from serving.errors import Unavailable
from serving.ipc.messages import Init
from serving.live_requests import LiveRequests
from serving.redact import scrub_paths
from serving.types import GenerationRequest, ModelState
from serving.worker.pool import WorkerPool

log = logging.getLogger(__name__)


class ModelEndpoint:
    """The unit frontends talk to. Event-loop only."""

    def __init__(self, config: ModelConfig, observer: BatchObserver | None = None,
                 clock: Clock = time.monotonic, env: Mapping[str, str] | None = None,
                 log_format: str = "text", live: LiveRequests | None = None) -> None:
        self.config = config
        self.name = config.name
        self._live = live if live is not None else LiveRequests()
        self.state = ModelState.PENDING
        self.reason: str | None = None
        self._observer = observer or NullObserver()
        self.load_time_s: float | None = None
        self._autoscaler: asyncio.Task[None] | None = None
        b = config.batching
        self.batcher: DynamicBatcher | RollingBatcher
        if b.rolling:
            self.batcher = RollingBatcher(self.name, b.max_rolling_batch_size, b.job_queue_size,
                                          config.predict_timeout_s, self._observer, clock,
                                          max_queue_time_s=b.max_queue_time_s,
                                          liveness_timeout_s=config.liveness_timeout_s)
        else:
            self.batcher = DynamicBatcher(self.name, b.batch_size, b.max_batch_delay_ms, b.job_queue_size,
                                          config.predict_timeout_s, self._observer, clock,
                                          max_queue_time_s=b.max_queue_time_s)
        if b.rolling_batch_requested == "auto" and not b.rolling:
            log.warning("model %s: option.rolling_batch=auto falls back to dynamic batching: %s", self.name,
                        b.rolling_batch_reason)
        else:
            log.info("model %s: %s batching: %s", self.name, "rolling" if b.rolling else "dynamic",
                     b.rolling_batch_reason)
        entry = config.entry_point
        if b.rolling and entry in ("huggingface", "djl_python.huggingface"):
            entry = "rolling"
        init = Init(model_name=self.name, model_dir=str(config.model_dir), entry_point=entry,
                    properties=config.handler_properties(), rolling=b.rolling, log_format=log_format)
        self.pool = WorkerPool(self.name, init, self.batcher, config.min_workers,
                               config.model_loading_timeout_s, on_failed=self._failed, env=env)

    @classmethod
    def failed(cls, name: str, reason: str) -> FailedEndpoint:
        return FailedEndpoint(name, reason)

    @property
    def rolling(self) -> bool:
        return self.config.batching.rolling

    @property
    def info(self) -> dict[str, Any]:
        """The handler's ``describe()`` (max_model_len, chat_template, ...) from the first ready worker."""
        return self.pool.info

    async def start(self) -> None:
        self.state = ModelState.LOADING
        t0 = time.monotonic()
        self.batcher.start()
        if await self.pool.start():
            self.state = ModelState.READY
            self.load_time_s = time.monotonic() - t0
            log.info("model %s ready in %.1fs (%s batching)", self.name, self.load_time_s,
                     "rolling" if self.rolling else "dynamic")
            if self.config.max_workers > self.pool.target:
                self._autoscaler = asyncio.create_task(self._autoscale())

    async def _autoscale(self, interval_s: float = 0.5) -> None:
        """DJL-style elasticity between minWorkers and maxWorkers: add a worker while requests keep
        queueing for two checks in a row; retire one after ``max_idle_time`` with nothing pending."""
        c = self.config
        busy_checks = 0
        idle_since = time.monotonic()
        while self.state is ModelState.READY:
            await asyncio.sleep(interval_s)
            now = time.monotonic()
            busy_checks = busy_checks + 1 if self.batcher.num_queued() > 0 else 0
            if self.batcher.num_pending():
                idle_since = now
            if busy_checks >= 2 and self.pool.target < c.max_workers:
                busy_checks = 0
                log.info("model %s: scaling up to %d workers (requests queueing)", self.name, self.pool.target + 1)
                await self.pool.scale(self.pool.target + 1)
            elif self.pool.target > max(1, c.min_workers) and now - idle_since >= c.max_idle_time_s:
                idle_since = now
                log.info("model %s: scaling down to %d workers (idle)", self.name, self.pool.target - 1)
                await self.pool.scale(self.pool.target - 1)

    def _failed(self, reason: str) -> None:
        self.state = ModelState.FAILED
        self.reason = scrub_paths(reason, {str(self.config.model_dir): self.name})
        self.batcher.fail_pending(Unavailable(f"model {self.name!r} is FAILED: {self.reason}"))

    def submit(self, request: GenerationRequest) -> ResultStream:
        """Queue ``request`` (its ``request_id`` is the client's id; see ``GenerationRequest``). Raises
        ``Unavailable`` unless READY, ``Conflict`` for a client id already live, ``Overloaded``."""
        if self.state is not ModelState.READY:
            detail = f": {self.reason}" if self.reason else ""
            raise Unavailable(f"model {self.name!r} is {self.state.value}{detail}", retry_after_s=5)
        client_id = request.client_id or request.request_id
        internal = self._live.claim(client_id, self)
        try:
            stream = self.batcher.submit(replace(request, request_id=internal, client_id=client_id))
        except BaseException:
            self._live.release(client_id, internal)
            raise
        stream.add_finish_callback(lambda _: self._live.release(client_id, internal))
        return stream

    def cancel(self, request_id: str) -> bool:
        """Cancel by the server's id (``serving.live_requests`` maps client ids to it)."""
        return self.batcher.cancel(request_id)

    async def scale(self, num_workers: int) -> None:
        await self.pool.scale(num_workers)

    async def drain(self, timeout_s: float) -> None:
        """Stop taking requests, wait up to ``timeout_s`` for in-flight ones, then stop the workers."""
        if self.state is ModelState.READY:
            self.state = ModelState.DRAINING
        deadline = time.monotonic() + timeout_s
        while self.batcher.num_pending() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await self.stop()

    async def stop(self) -> None:
        if self._autoscaler is not None:
            self._autoscaler.cancel()
        await self.pool.stop()
        await self.batcher.close(f"model {self.name!r} was unloaded before this request finished")
        self.state = ModelState.UNLOADED

    def describe(self) -> dict[str, Any]:
        c = self.config
        return {
            "model_name": self.name, "status": self.state.value, "reason": self.reason,
            "model_dir": c.model_dir.name, "entry_point": c.entry_point,
            "batching": "rolling" if self.rolling else "dynamic",
            "rolling_batch": c.batching.describe_rolling_batch(),
            "batch_size": c.batching.batch_size, "max_batch_delay": c.batching.max_batch_delay_ms,
            "job_queue_size": c.batching.job_queue_size, "min_workers": c.min_workers,
            "max_workers": c.max_workers, "target_workers": self.pool.target, "workers": self.pool.describe(),
            "worker_restarts": self.pool.num_restarts, "load_time_s": self.load_time_s,
            "config": c.handler_properties(), "batcher": self.batcher.describe(),
        }


class FailedEndpoint:
    """A model whose configuration could not be loaded: it only reports its reason."""

    def __init__(self, name: str, reason: str) -> None:
        self.name = name
        self.state = ModelState.FAILED
        self.reason = reason
        self.rolling = False
        self.info: dict[str, Any] = {}

    def submit(self, request: GenerationRequest) -> ResultStream:
        raise Unavailable(f"model {self.name!r} is FAILED: {self.reason}")

    def cancel(self, request_id: str) -> bool:
        return False

    async def start(self) -> None:
        pass

    async def drain(self, timeout_s: float) -> None:
        self.state = ModelState.UNLOADED

    async def stop(self) -> None:
        self.state = ModelState.UNLOADED

    async def scale(self, num_workers: int) -> None:
        raise Unavailable(f"model {self.name!r} is FAILED: {self.reason}")

    def describe(self) -> dict[str, Any]:
        return {"model_name": self.name, "status": self.state.value, "reason": self.reason, "workers": []}


AnyEndpoint = ModelEndpoint | FailedEndpoint
