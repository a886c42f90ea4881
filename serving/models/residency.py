"""Residency: which models hold memory, under the host's budget for models (``model_memory_budget``).

Design note: every registered version has a ``Residence`` (its keys: ``load_on_demand``, ``pin``, ``idle_ttl``).
A model with ``load_on_demand`` is registered at start but loads on its first request; the others load at start
as before. Loads on demand go one at a time, so each decision sees what the others hold: a model holds the
largest proportional set size measured of its workers since it loaded (``serving.config.memory_budget``), or, before a
measurement, what it is predicted to take: the engine's memory plan (``handlers.preflight.planned_memory``) plus
a worker's own overhead; for a model the engine does not plan, an earlier load's measured peak, else its
checkpoint's size. When the prediction does not fit beside what
the others hold, idle models (nothing queued or running) are unloaded least recently used first; pinned ones never,
and a busy one is waited for (its requests in flight finish first). A model that cannot fit even with every
unpinned model unloaded fails its own requests with a 503 naming both figures; the others are untouched.

Requests wait for their model's load up to ``model_load_wait`` seconds (the frontends call ``ensure``); when the
load would take longer, judged from the time it took before (or an earlier load of the same weights), they get 503
with a ``Retry-After`` of that time while it loads on. A monitor samples every loaded model's memory, unloads a
model idle for its ``idle_ttl``, and unloads idle models while what all of them hold exceeds the budget (a model
whose memory grows as it serves: its KV cache filling pages it had not touched).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollcore.errors import ConfigError, Unavailable
from rollcore.types import ModelState
from serving.config.memory_budget import PROC, human, tree_pss
from serving.models.endpoint_protocol import Endpoint

log = logging.getLogger(__name__)

# A worker's own memory besides its model (interpreter, torch's pages shared with the fork server, buffers):
# what the memory plan leaves out, added to its prediction until a load of the same weights was measured.
WORKER_OVERHEAD = 192 << 20
FIRST_LOAD_S = 10.0  # Retry-After for a model no load of which was timed yet
# A sample reads each worker's smaps_rollup: the kernel walks the worker's page tables (about 40 ms for a 135M
# model in fp32, more for larger ones), time taken from the core the engine may share and a stall of its steps.
SAMPLE_EVERY_S = 1.0  # while the budget has something to decide (a model that loads on demand is registered)
QUIET_SAMPLE_EVERY_S = 30.0  # otherwise: only the figures of GET /models and /metrics depend on it
NOT_RESIDENT = (ModelState.PENDING, ModelState.UNLOADED)
RESIDENT = (ModelState.LOADING, ModelState.READY, ModelState.DRAINING)

Versions = Callable[[], Iterable[tuple[str, str, Any]]]  # (name, version, endpoint) of every registered version


@dataclass
class Residence:
    """One version's residency: its keys, what it holds and how it was used."""

    on_demand: bool
    pinned: bool
    idle_ttl_s: float | None
    weights: str  # what an earlier load of the same model tells about this one: the weights and their options
    predicted_bytes: int
    predicted_from: str  # preflight | measured | checkpoint
    memory_bytes: int = 0  # measured at the last sample
    peak_bytes: int = 0  # the largest sample since it loaded
    last_used: float | None = None  # wall clock, for the API
    last_used_at: float = 0.0  # monotonic, for the LRU order
    loads: int = 0
    unloads: dict[str, int] = field(default_factory=dict)  # by reason: budget, idle_ttl
    load_seconds: float = 0.0  # all loads
    refusal: str | None = None  # why it cannot load under the budget
    task: asyncio.Task[None] | None = None

    @property
    def evictable(self) -> bool:
        """The budget unloads models that load on demand (they come back the same way), never a pinned one."""
        return self.on_demand and not self.pinned

    def holds(self, resident: bool) -> int:
        """What it counts against the budget: its measured peak once measured, else its prediction."""
        return (self.peak_bytes or self.predicted_bytes) if resident else 0


def state_of(ep: Endpoint) -> str:
    """The residency state the API reports: registered, loading, ready, unloaded or failed."""
    return {ModelState.PENDING: "registered", ModelState.LOADING: "loading", ModelState.READY: "ready",
            ModelState.DRAINING: "ready", ModelState.FAILED: "failed"}.get(ep.state, "unloaded")


class Residency:
    """The budget and the residence of every version. Event-loop only."""

    def __init__(self, budget_bytes: int, budget_from: str, wait_s: float, versions: Versions,
                 retiring: Callable[[], Iterable[Any]] = tuple, proc: Path = PROC) -> None:
        self.budget = budget_bytes
        self.budget_from = budget_from
        self.wait_s = wait_s
        self._versions = versions
        self._retiring = retiring
        self._proc = proc
        self._lock = asyncio.Lock()
        self._peak: dict[str, int] = {}  # weights -> the largest peak a load of them reached
        self._load_s: dict[str, float] = {}  # weights -> the last load's seconds
        self._monitor: asyncio.Task[None] | None = None
        self._quiet_sampled_at = -math.inf

    # --- registration ---
    def manage(self, ep: Endpoint) -> None:
        """Give a freshly built endpoint its residence (a FAILED one has none)."""
        cfg = ep.config
        extra = cfg.extra
        ttl = float(extra["idle_ttl"]) if extra.get("idle_ttl") else None
        weights = f"{cfg.model_id or cfg.model_dir}|{sorted(cfg.options.items())}|{cfg.min_workers}"
        predicted, source = self._predict(cfg, weights)
        ep.residence = Residence(on_demand=extra.get("load_on_demand") == "true", pinned=extra.get("pin") == "true",
                                 idle_ttl_s=ttl or None, weights=weights, predicted_bytes=predicted,
                                 predicted_from=source)
        ep.residency = self

    def _predict(self, cfg: Any, weights: str) -> tuple[int, str]:
        """The engine's plan (an upper bound: its KV cache at full size); for a model it does not plan, an earlier
        load's measured peak, else the checkpoint's size."""
        workers = max(1, cfg.min_workers)
        if cfg.batching.rolling:
            from handlers.preflight import planned_memory  # torch-free

            try:
                plan = planned_memory(cfg.model_dir, cfg.model_id, cfg.handler_properties())
            except ConfigError:
                plan = None
            if plan is not None:
                one = (plan.weight_bytes + plan.prepack_bytes + plan.activation_bytes + plan.kv_cache_bytes
                       + WORKER_OVERHEAD * plan.tensor_parallel_degree)
                return workers * one, "preflight"
        if weights in self._peak:
            return self._peak[weights], "measured"
        files = sum(p.stat().st_size for p in Path(cfg.model_dir).glob("*.safetensors") if p.is_file())
        return workers * (files + WORKER_OVERHEAD), "checkpoint"

    def defers(self, ep: Endpoint) -> bool:
        """Whether the registry leaves ``ep`` unloaded until a request needs it."""
        residence = ep.residence
        return residence is not None and residence.on_demand

    # --- requests ---
    def touch(self, ep: Endpoint) -> None:
        r = ep.residence
        r.last_used, r.last_used_at = time.time(), time.monotonic()

    async def ensure(self, ep: Endpoint) -> None:
        """Return once ``ep`` is READY, loading it on demand; raises ``Unavailable`` (503 with Retry-After) when it
        would not be within ``model_load_wait``, or cannot load under the budget."""
        if ep.residence is None or ep.residency is not self:
            return
        self.touch(ep)
        if not self._wanted(ep):
            return  # READY; or FAILED, DRAINING, loading at start: the route's own check says so
        task = self._demand(ep)
        expected = self.expected_load_s(ep)
        if ep.state is not ModelState.LOADING and expected > self.wait_s:
            raise self._busy(ep, expected)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(task), self.wait_s)
        if ep.state is not ModelState.READY:
            self.refuse(ep)

    def queues(self, ep: Endpoint) -> bool:
        """Whether a request submitted to ``ep``, which is not READY, waits in its queue for a load on demand:
        a model that loaded before (what its handler serves is known) and is loading again or unloaded."""
        r = ep.residence
        if r is None:
            return False
        self.touch(ep)  # every request submits here, whatever its route: the LRU order sees them all
        if not self._wanted(ep) or not ep.info or r.refusal:
            return False
        self._demand(ep)
        return True

    def refuse(self, ep: Endpoint, load: bool = True) -> None:
        """Raise the ``Unavailable`` that says why ``ep`` is not READY; with ``load`` (a request) it loads on demand
        meanwhile, without (a readiness check, a route reading the model's template) nothing starts."""
        r = ep.residence
        if r is None or not self._wanted(ep):
            return
        if r.refusal:
            raise Unavailable(f"model {ep.name!r}: {r.refusal}")
        if load:
            self._demand(ep)
        raise self._busy(ep, self.expected_load_s(ep))

    @staticmethod
    def _wanted(ep: Endpoint) -> bool:
        """Whether a request for ``ep`` is one for residency: the model was unloaded, waits for its first request, or
        loads on demand now (not one registered a moment ago that loads at start)."""
        r = ep.residence
        if ep.state is ModelState.LOADING:
            return r.task is not None and not r.task.done()
        return ep.state is ModelState.UNLOADED or (ep.state is ModelState.PENDING and r.on_demand)

    def _busy(self, ep: Endpoint, expected_s: float) -> Unavailable:
        task = ep.residence.task
        if task is None or task.done():
            why = f"is {state_of(ep)}: it loads on its first request, in about {expected_s:.0f}s"
        elif expected_s > self.wait_s:
            why = (f"is {state_of(ep)}: it loads on demand, in about {expected_s:.0f}s (longer than model_load_wait, "
                   f"{self.wait_s:g}s)")
        else:
            why = f"is still loading (model_load_wait, {self.wait_s:g}s, passed)"
        return Unavailable(f"model {ep.name!r} {why}", retry_after_s=max(1, math.ceil(expected_s)))

    def expected_load_s(self, ep: Endpoint) -> float:
        """How long a load of ``ep`` takes: its last load, an earlier one of the same weights, else a guess."""
        return ep.load_time_s or self._load_s.get(ep.residence.weights) or FIRST_LOAD_S

    def _demand(self, ep: Endpoint) -> asyncio.Task[None]:
        r = ep.residence
        if r.task is None or r.task.done():
            r.task = asyncio.create_task(self._load(ep), name=f"load-on-demand-{ep.name}")
        return r.task

    async def _load(self, ep: Endpoint) -> None:
        r = ep.residence
        async with self._lock:
            if ep.state not in NOT_RESIDENT or ep.residency is not self:
                return
            if r.predicted_from != "preflight" and r.weights in self._peak:  # no plan: what it took last time
                r.predicted_bytes, r.predicted_from = self._peak[r.weights], "measured"
            if not await self._make_room(ep):
                return
            r.refusal = None
            t0 = time.monotonic()
            log.info("model %s (version %s): loading on demand (%s predicted, from %s; %s of the %s budget held)",
                     ep.name, ep.version, human(r.predicted_bytes), r.predicted_from, human(self.held()),
                     human(self.budget))
            await ep.start()
            self.loaded(ep, time.monotonic() - t0)

    def loaded(self, ep: Endpoint, seconds: float | None = None) -> None:
        """Record a load of ``ep`` (on demand, at start or by a reload) and measure what it holds."""
        r = ep.residence
        if r is None or ep.state is not ModelState.READY:
            return  # FAILED: its own requests fail with the reason
        seconds = seconds if seconds is not None else ep.load_time_s or 0.0
        r.loads += 1
        r.load_seconds += seconds
        self._load_s[r.weights] = seconds
        r.peak_bytes = 0
        self.sample(ep)

    async def _make_room(self, ep: Endpoint) -> bool:
        """Unload idle models, least recently used first, until ``ep``'s prediction fits; False (and the refusal
        recorded) when it cannot fit even with every unpinned model unloaded."""
        r = ep.residence
        need = r.predicted_bytes
        others = [o for o in self._resident() if o is not ep]
        fixed = sum(o.residence.holds(True) for o in others if not o.residence.evictable) + self._retiring_bytes()
        if fixed + need > self.budget:
            pinned = f", {human(fixed)} of it held by models it may not unload" if fixed else ""
            r.refusal = (f"it needs {human(need)} ({r.predicted_from}) and the model memory budget is "
                         f"{human(self.budget)} (model_memory_budget{pinned}): it cannot load on this host")
            log.error("model %s (version %s): %s", ep.name, ep.version, r.refusal)
            ep.batcher.fail_pending(Unavailable(f"model {ep.name!r}: {r.refusal}"))
            return False
        while self.held(but=ep) + need > self.budget:
            idle = [o for o in self._resident() if o is not ep and o.residence.evictable
                    and o.state is ModelState.READY and not o.batcher.num_pending()]
            if idle:
                await self.unload(min(idle, key=lambda o: o.residence.last_used_at), "budget")
                continue
            await asyncio.sleep(0.05)  # every unpinned model is busy: their requests in flight finish first
        return True

    async def unload(self, ep: Endpoint, reason: str) -> None:
        r = ep.residence
        log.info("model %s (version %s): unloading (%s): it held %s, idle since %s", ep.name, ep.version, reason,
                 human(r.holds(True)), time.strftime("%H:%M:%S", time.gmtime(r.last_used)) if r.last_used else
                 "its load")
        r.unloads[reason] = r.unloads.get(reason, 0) + 1  # counted as its state turns: readers see both at once
        r.memory_bytes = 0
        await ep.unload()

    # --- what models hold ---
    def deciding(self) -> bool:
        """Whether the budget may have to act: a model that loads on demand is registered (its load, or the growth
        of what the others hold, may call for unloading one); without one, nothing is ever unloaded for it."""
        return any(ep.residence is not None and ep.residence.on_demand for _, _, ep in self._versions())

    def _resident(self) -> list[Any]:
        return [ep for _, _, ep in self._versions() if ep.residence is not None
                and ep.state in RESIDENT]

    def _retiring_bytes(self) -> int:
        return sum(ep.residence.holds(ep.state in RESIDENT) for ep in self._retiring()
                   if ep.residence is not None)

    def held(self, but: Endpoint | None = None) -> int:
        """What the loaded models (and those a reload retires) hold of the budget, ``but`` left out."""
        return sum(ep.residence.holds(True) for ep in self._resident() if ep is not but) + self._retiring_bytes()

    def measured(self) -> int:
        """What the loaded models' workers hold now, measured (the sum of their last samples)."""
        return sum(ep.residence.memory_bytes for ep in self._resident())

    def sample(self, ep: Endpoint) -> int:
        """Measure what ``ep``'s workers hold now (PSS of their process trees)."""
        return self._record(ep, tree_pss(self._pids(ep), self._proc))

    @staticmethod
    def _pids(ep: Endpoint) -> list[int]:
        return [h.pid for h in ep.pool.workers.values() if h.pid]

    def _record(self, ep: Endpoint, size: int) -> int:
        r = ep.residence
        r.memory_bytes = size
        r.peak_bytes = max(r.peak_bytes, r.memory_bytes)
        if r.peak_bytes:
            self._peak[r.weights] = max(self._peak.get(r.weights, 0), r.peak_bytes)
        return r.memory_bytes

    # --- the monitor ---
    def start(self) -> None:
        if self._monitor is None:
            self._monitor = asyncio.create_task(self._watch(), name="residency-monitor")

    async def close(self) -> None:
        if self._monitor is not None:
            self._monitor.cancel()
            await asyncio.gather(self._monitor, return_exceptions=True)
            self._monitor = None

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(SAMPLE_EVERY_S)
            try:
                await self.check()
            except Exception:  # noqa: BLE001 -- the monitor must outlive one bad sample
                log.exception("residency: the memory check failed")

    async def check(self) -> None:
        """Sample every loaded model; unload those idle past their ``idle_ttl``, then idle ones (least recently
        used first) while what the models hold exceeds the budget."""
        now = time.monotonic()
        loaded = [(ep, self._pids(ep)) for ep in self._resident() if ep.state is ModelState.READY]
        if not self.deciding() and now - self._quiet_sampled_at < QUIET_SAMPLE_EVERY_S:
            loaded = [(ep, pids) for ep, pids in loaded if not ep.residence.memory_bytes]  # never sampled yet
        else:
            self._quiet_sampled_at = now
        # read in a thread: /proc of many processes is no work for the event loop
        sizes = await asyncio.to_thread(lambda: [tree_pss(pids, self._proc) for _, pids in loaded])
        for (ep, _), size in zip(loaded, sizes, strict=True):
            if ep.state is ModelState.READY:  # not unloaded meanwhile
                self._record(ep, size)
        async with self._lock:
            for ep in self._resident():
                r = ep.residence
                idle_s = now - max(r.last_used_at, self._ready_at(ep))
                if (r.idle_ttl_s is not None and not r.pinned and ep.state is ModelState.READY
                        and not ep.batcher.num_pending() and idle_s >= r.idle_ttl_s):
                    await self.unload(ep, "idle_ttl")
            while self.held() > self.budget:
                idle = [o for o in self._resident() if o.residence.evictable and o.state is ModelState.READY
                        and not o.batcher.num_pending()]
                if not idle:
                    break
                await self.unload(min(idle, key=lambda o: o.residence.last_used_at), "budget")

    @staticmethod
    def _ready_at(ep: Endpoint) -> float:
        times = [h.ready_at for h in ep.pool.workers.values() if getattr(h, "ready_at", None) is not None]
        return max(times) if times else 0.0

    # --- reporting ---
    def describe(self, ep: Endpoint) -> dict[str, Any]:
        """``GET /models/{name}``'s ``residency`` object."""
        r = ep.residence
        resident = ep.state in RESIDENT
        return {"state": state_of(ep), "load_on_demand": r.on_demand, "pinned": r.pinned, "idle_ttl": r.idle_ttl_s,
                "memory_bytes": r.memory_bytes if resident else 0, "peak_memory_bytes": r.peak_bytes if resident else 0,
                "held_bytes": r.holds(resident), "predicted_bytes": r.predicted_bytes,
                "predicted_from": r.predicted_from, "last_used": r.last_used, "loads": r.loads,
                "unloads": dict(r.unloads), "load_seconds": round(r.load_seconds, 3), "refusal": r.refusal,
                "budget_bytes": self.budget}

    def summary(self) -> dict[str, Any]:
        return {"budget_bytes": self.budget, "budget_from": self.budget_from, "held_bytes": self.held(),
                "measured_bytes": self.measured()}

