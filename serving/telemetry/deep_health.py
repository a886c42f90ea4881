"""The deep health check (``GET /health/generate``): one real token through every worker of every ready model.

Design note: readiness (``serving.telemetry.health``) says the models are loaded and have workers; it cannot tell a
worker wedged mid-decode from a working one. The deep check sends each serving worker of each available model a
one-token greedy probe (pinned to that worker on rolling batching; one probe per model on dynamic batching,
whose batches go to any idle worker) and waits at most ``timeout_s`` for the answers. It answers 200 when
every probe produced its token, else 503 naming the models and workers that failed and why (no token in time,
an error, a worker that died under it). A worker the liveness watchdog sees holding requests without a step
is reported with its silent seconds. The result is cached for ``interval_s`` and concurrent callers share one
run, so a probe storm cannot load the models. Not ready (loading, draining) answers 503 at once, unprobed.

It is a separate route rather than ``/ping`` because SageMaker wants ``/ping`` answered within two seconds and
orchestrators poll readiness often; TGI's ``/health`` likewise runs a one-token generation, and vLLM's only
checks that its engine loop lives. A probe is never moved to another worker when its own dies
(``serving.batching.retry``), so the death is reported, not hidden.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from rollcore.errors import ServingError
from rollcore.types import GenerationRequest, SamplingParams
from serving.batching.retry import PROBE_PREFIX
from serving.batching.rolling import RollingBatcher
from serving.models.endpoint_protocol import Endpoint
from serving.models.reload import TEXT_ENTRY_POINTS
from serving.models.reload import WARMUP_PROMPT as PROMPT
from serving.telemetry.health import Health

log = logging.getLogger(__name__)


class DeepCheck:
    """Runs and caches the deep check. Event loop only."""

    def __init__(self, health: Health, interval_s: float, timeout_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.health = health
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._clock = clock
        self._last: tuple[float, bool, dict[str, Any]] | None = None  # (finished at, healthy, body)
        self._running: asyncio.Task[tuple[bool, dict[str, Any]]] | None = None

    async def result(self) -> tuple[bool, dict[str, Any]]:
        """(healthy, body): the cached result while younger than ``interval_s``, else a fresh run."""
        if self.health.state.draining:
            return False, {"status": "draining", "models": self.health.models()}
        if not self.health.ready():
            return False, {"status": "Unhealthy", "reason": "not ready (ping_requires "
                           f"{self.health.ping_requires})", "models": self.health.models()}
        now = self._clock()
        if self._last is not None and now - self._last[0] < self.interval_s:
            at, healthy, body = self._last
            return healthy, {**body, "age_s": round(now - at, 3)}
        if self._running is None or self._running.done():  # a done one is a run whose callers all went away
            self._running = asyncio.ensure_future(self._run())
        task = self._running
        try:
            healthy, body = await asyncio.shield(task)
        finally:
            if self._running is task and task.done():
                self._running = None
        return healthy, {**body, "age_s": 0.0}

    async def _run(self) -> tuple[bool, dict[str, Any]]:
        probes: list[tuple[str, int | None, asyncio.Future[dict[str, Any]]]] = []
        models: dict[str, dict[str, Any]] = {}
        for name, ep in sorted(self.health.registry.endpoints.items()):
            if not ep.available:
                models[name] = {"status": ep.state.value, "probed": False}
                continue
            models[name] = {"status": "ok", "workers": {}}
            for wid in _worker_ids(ep):
                probes.append((name, wid, asyncio.ensure_future(self._probe(ep, wid))))
        if probes:
            await asyncio.wait([f for _, _, f in probes])
        failed: list[str] = []
        for name, wid, future in probes:
            outcome = future.result()
            entry = models[name]
            entry["workers"][str(outcome.pop("worker", wid) or "any")] = outcome
            if not outcome["ok"]:
                entry["status"] = "failed"
                if name not in failed:
                    failed.append(name)
        healthy = not failed
        body: dict[str, Any] = {"status": "Healthy" if healthy else "Unhealthy", "models": models,
                                "timeout_s": self.timeout_s, "interval_s": self.interval_s}
        if failed:
            body["failed"] = failed
        self._last = (self._clock(), healthy, body)
        return healthy, body

    async def _probe(self, ep: Endpoint, wid: int | None) -> dict[str, Any]:
        """One greedy token through ``ep`` (on worker ``wid`` when given: a rolling model's); never raises."""
        key = f"{PROBE_PREFIX}{uuid.uuid4().hex}"
        batcher = ep.batcher if isinstance(ep.batcher, RollingBatcher) else None
        if wid is not None and batcher is not None:
            batcher.pin(key, wid)
        t0 = self._clock()
        outcome: dict[str, Any] = {"ok": False}
        stream = None
        try:
            stream = ep.submit(_request(ep, key, affinity=key if wid is not None else None))
            result = await asyncio.wait_for(stream.collect(), self.timeout_s)
            outcome = {"ok": result.timings.generated_tokens > 0 or result.payload is not None
                       or stream.embedding is not None}
            if not outcome["ok"]:
                outcome["error"] = "the model answered without a token"
        except asyncio.TimeoutError:
            outcome["error"] = f"no token within {self.timeout_s:g}s (health_generate_timeout)"
        except ServingError as exc:
            outcome["error"] = f"{exc.kind.value}: {exc.message}"
        except Exception as exc:  # noqa: BLE001 - a bug on the probe's path is a failed check, not a 500
            log.exception("model %s: the deep health probe failed", ep.name)
            outcome["error"] = f"internal error: {type(exc).__name__}"
        finally:
            if stream is not None and not stream.done:
                stream.cancel()
            if wid is not None and batcher is not None:
                batcher.forget_affinity(key)
        outcome["seconds"] = round(self._clock() - t0, 3)
        served = stream.worker_id if stream is not None and stream.worker_id is not None else wid
        if served is not None:
            outcome["worker"] = served
            silent = batcher.silent_s(served) if batcher is not None else None
            if silent is not None:
                outcome["silent_s"] = round(silent, 3)  # seconds since the worker's last engine step
        return outcome


def _worker_ids(ep: Endpoint) -> list[int | None]:
    """The workers to probe one by one (rolling: pinned probes), or [None]: one probe for the model."""
    pool = ep.pool
    if pool is None or not isinstance(ep.batcher, RollingBatcher) or ep.successor is not None:
        return [None]
    ids: list[int | None] = [w["id"] for w in pool.describe() if w["status"] == "READY"]
    return ids or [None]


def _request(ep: Endpoint, request_id: str, affinity: str | None) -> GenerationRequest:
    if ep.info.get("tasks") == ["embedding"]:  # an embedding model's one forward pass
        return GenerationRequest(request_id=request_id, model=ep.name, prompt=PROMPT,
                                 params=SamplingParams(embed=True), affinity=affinity)
    text = ep.entry_point in TEXT_ENTRY_POINTS
    payload = None if text else {"inputs": PROMPT, "parameters": {"max_new_tokens": 1}}
    return GenerationRequest(request_id=request_id, model=ep.name, prompt=PROMPT,
                             params=SamplingParams(max_new_tokens=1), payload=payload, affinity=affinity)
