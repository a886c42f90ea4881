"""WorkerPool: spawns, watches and restarts one model's worker processes.

Design note: the pool is the ``WorkerListener`` of its workers and forwards their frames to the model's
batcher. A worker that dies is reported to the batcher (which retries or fails its requests) and is
restarted with exponential backoff: the delay doubles with each crash of a worker that had not yet stayed up
``stable_after_s`` (a crash loop backs off to 30 s between starts), and starts over after a worker that did.
A model whose workers fail to load ``max_load_attempts`` times in a row is FAILED with the reason and is not
retried again, so a broken model never spins the CPU; a failure the worker reports as permanent (a missing file,
a broken config.json or model.py: ``LoadFailed.permanent``) FAILs it at the first one.

Scaling down retires the idlest workers (fewest requests in flight; the newest on a tie): the batcher stops
giving them work at once, and each one is stopped only after its requests in flight finished, so no request
is lost or retried. ``update_init`` makes workers started later load with a changed configuration.

Devices (``serving.config.devices``): on GPUs each worker takes a free device group when it starts and gives it back
when it exits; it sees only that group (its own ``CUDA_VISIBLE_DEVICES``) and loads on its first device
(``device_id`` 0). The pool never runs more workers than there are groups.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any, Protocol

from serving.config.devices import DevicePlan, DeviceSlots
from serving.ipc.messages import Init, Message
from serving.worker.handle import WorkerHandle, WorkerLoadError
from serving.worker.launcher import Launcher, worker_env

log = logging.getLogger(__name__)


class WorkerEvents(Protocol):
    """What the pool tells the model's batcher (a batcher of ``serving.batching`` satisfies it structurally;
    the worker package never imports the batchers)."""

    def worker_ready(self, worker: WorkerHandle) -> None: ...
    def worker_lost(self, worker: WorkerHandle) -> None: ...
    def on_message(self, worker: WorkerHandle, msg: Message) -> None: ...
    def worker_load(self, worker: WorkerHandle) -> int: ...
    def retire(self, worker: WorkerHandle) -> None: ...

BACKOFF_S = (0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0)


class WorkerPool:
    """Owns the worker processes of one model. Event-loop only."""

    def __init__(self, model: str, init: Init, batcher: WorkerEvents, num_workers: int, loading_timeout_s: float,
                 on_failed: Callable[[str], None], max_load_attempts: int = 3,
                 env: Mapping[str, str] | None = None, stable_after_s: float = 60.0,
                 devices: DevicePlan | None = None, launcher: Launcher | None = None) -> None:
        self.model = model
        self._launcher = launcher
        self.devices = DeviceSlots(devices or DevicePlan())
        self._init = init
        self._env = worker_env(env or {})
        self._batcher = batcher
        self.target = self.devices.plan.max_workers(max(1, num_workers))
        self._loading_timeout_s = loading_timeout_s
        self._on_failed = on_failed
        self._max_load_attempts = max_load_attempts
        self._ids = itertools.count(1)
        self.workers: dict[int, WorkerHandle] = {}
        self._starting = 0
        self._load_failures = 0
        self._crashes = 0  # crashes in a row of workers that had not stayed up stable_after_s
        self._stable_after_s = stable_after_s
        self.num_restarts = 0
        self.restarts_by_cause: dict[str, int] = {"crash": 0, "watchdog": 0}  # the worker's exit_cause
        self.last_error: str | None = None
        self._stopping = False
        self._retiring: set[int] = set()
        self._scale_lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[None]] = set()
        self.info: dict[str, Any] = {}

    @property
    def num_starting(self) -> int:
        """Workers being spawned or loading right now."""
        return self._starting

    @property
    def num_serving(self) -> int:
        """Workers that take new requests (ready, not being retired)."""
        return sum(1 for wid in self.workers if wid not in self._retiring)

    def update_init(self, properties: dict[str, str]) -> None:
        """Workers started from now on load with these handler properties (a changed live knob)."""
        self._init = replace(self._init, properties=dict(properties))

    async def start(self) -> bool:
        """Start ``target`` workers; returns True once at least one is ready (False if loading failed)."""
        results = await asyncio.gather(*(self._start_one() for _ in range(self.target)))
        return any(results)

    async def _start_one(self) -> bool:
        while not self._stopping:
            wid = next(self._ids)
            try:
                group = self.devices.take(wid)
            except RuntimeError as exc:  # every group is held (workers still retiring): nothing to start on
                log.error("model %s: %s", self.model, exc)
                return False
            env = {**self._env, **self.devices.plan.worker_env(group)}
            handle = WorkerHandle(wid, replace(self._init, worker_id=wid, device_id=-1 if group is None else 0), env,
                                  self._launcher)
            self._starting += 1
            try:
                await handle.start(self, self._loading_timeout_s)
            except (WorkerLoadError, asyncio.TimeoutError, OSError) as exc:
                self.devices.release(wid)
                reason = str(exc) or f"model loading exceeded {self._loading_timeout_s:g}s"
                self._load_failures += 1
                self.last_error = reason
                permanent = isinstance(exc, WorkerLoadError) and exc.permanent
                log.error("model %s: worker %d failed to load (%s): %s", self.model, wid,
                          "not retried: it would fail again" if permanent
                          else f"{self._load_failures}/{self._max_load_attempts}", reason)
                if permanent or self._load_failures >= self._max_load_attempts:
                    self._on_failed(reason)
                    return False
                await asyncio.sleep(BACKOFF_S[min(self._load_failures, len(BACKOFF_S) - 1)])
                continue
            finally:
                self._starting -= 1
            if self._stopping:
                await handle.stop()
                self.devices.release(wid)
                return False
            self._load_failures = 0
            self.workers[wid] = handle
            self.info = handle.info
            log.info("model %s: worker %d ready (pid %s)", self.model, wid, handle.pid)
            self._batcher.worker_ready(handle)
            return True
        return False

    # --- WorkerListener ---
    def on_worker_message(self, worker: WorkerHandle, msg: Message) -> None:
        self._batcher.on_message(worker, msg)

    def on_worker_exit(self, worker: WorkerHandle) -> None:
        self.workers.pop(worker.worker_id, None)
        self.devices.release(worker.worker_id)
        self._batcher.worker_lost(worker)
        if self._stopping or worker.worker_id in self._retiring:
            self._retiring.discard(worker.worker_id)
            return
        if worker.ready_at is not None and time.monotonic() - worker.ready_at >= self._stable_after_s:
            self._crashes = 0  # it had been serving for a while: not a crash loop
        self._crashes += 1
        self.num_restarts += 1
        cause = getattr(worker, "exit_cause", "crash")
        self.restarts_by_cause[cause] = self.restarts_by_cause.get(cause, 0) + 1
        delay = BACKOFF_S[min(self._crashes - 1, len(BACKOFF_S) - 1)]
        log.warning("model %s: worker %d (pid %s) exited; restarting in %.1fs (cause: %s)", self.model,
                    worker.worker_id, worker.pid, delay, cause)
        self._spawn(self._restart_after(delay))

    async def _restart_after(self, delay: float) -> None:
        await asyncio.sleep(delay)
        if not self._stopping and self.num_serving + self._starting < self.target:
            await self._start_one()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --- management ---
    async def scale(self, num_workers: int) -> list[int]:
        """Grow or shrink to ``num_workers`` (>= 1) serving workers. Growing waits until the new workers are
        ready; shrinking retires the idlest workers in the background (see the module note). Returns the ids
        of the workers being retired."""
        async with self._scale_lock:
            self.target = self.devices.plan.max_workers(max(1, num_workers))
            extra = self.target - self.num_serving - self._starting
            if extra > 0:
                await asyncio.gather(*(self._start_one() for _ in range(extra)))
            retired: list[int] = []
            while self.num_serving > self.target:
                serving = [h for wid, h in self.workers.items() if wid not in self._retiring]
                handle = min(serving, key=lambda h: (self._batcher.worker_load(h), -h.worker_id))
                self._retiring.add(handle.worker_id)
                self._batcher.retire(handle)
                retired.append(handle.worker_id)
                log.info("model %s: retiring worker %d (pid %s) once its %d requests in flight finish", self.model,
                         handle.worker_id, handle.pid, self._batcher.worker_load(handle))
                self._spawn(self._retire(handle))
            return retired

    async def _retire(self, handle: WorkerHandle, poll_s: float = 0.02) -> None:
        while handle.alive and self._batcher.worker_load(handle) > 0:
            await asyncio.sleep(poll_s)
        await handle.stop()

    async def stop(self) -> None:
        self._stopping = True
        for t in list(self._tasks):
            t.cancel()
        with contextlib.suppress(Exception):
            await asyncio.gather(*(h.stop() for h in list(self.workers.values())), return_exceptions=True)
        self.workers.clear()

    def describe(self) -> list[dict[str, Any]]:
        return [{"id": wid, "pid": h.pid, "in_flight": self._batcher.worker_load(h),
                 "status": "STOPPED" if not h.alive else "RETIRING" if wid in self._retiring else "READY",
                 "devices": [f"gpu{d}" for d in self.devices.of(wid) or ()] or ["cpu"], "started_at": h.started_at}
                for wid, h in sorted(self.workers.items())]
