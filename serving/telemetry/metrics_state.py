"""The gauges of current state, read from the model registry at scrape time (``serving.telemetry.metrics`` registers
it).

Design note: queue depth, running requests, KV blocks, workers, restarts (by cause), retries, load time and state
are read from every registered version of every model when Prometheus scrapes, so they never drift from the
truth; each series carries the ``model`` and ``version`` labels (the version's number, ``1``
for a model without versions).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from rollcore.types import ModelState
from serving.models.endpoint_protocol import Endpoint

VersionSource = Callable[[], Iterable[tuple[str, str, Endpoint]]]  # (name, version, endpoint) of every version


class StateCollector(Collector):
    """Current state read from the model registry at scrape time: queues, engines, workers, models."""

    def __init__(self, versions: VersionSource) -> None:
        self._versions = versions

    def collect(self) -> Iterator[Metric]:
        m = ["model", "version"]
        running = GaugeMetricFamily("rollserve_num_requests_running", "Requests running on workers", labels=m)
        waiting = GaugeMetricFamily("rollserve_num_requests_waiting", "Requests waiting (frontend queue and "
                                    "engine waiting queue)", labels=m)
        kv_ratio = GaugeMetricFamily("rollserve_kv_cache_usage_ratio", "Fraction of KV-cache blocks in use (0-1)",
                                     labels=m)
        kv_total = GaugeMetricFamily("rollserve_kv_cache_blocks", "KV-cache blocks (capacity)", labels=m)
        kv_used = GaugeMetricFamily("rollserve_kv_cache_used_blocks", "KV-cache blocks in use", labels=m)
        workers = GaugeMetricFamily("rollserve_workers", "Worker processes by state", labels=m + ["state"])
        restarts = CounterMetricFamily("rollserve_worker_restarts", "Worker processes restarted after an "
                                       "unexpected exit, by cause (crash; watchdog: no engine step for "
                                       "liveness_timeout)", labels=m + ["cause"])
        retries = CounterMetricFamily("rollserve_request_retries", "Requests run again on another worker after "
                                      "theirs died before their client received anything", labels=m)
        load_time = GaugeMetricFamily("rollserve_model_load_time_seconds", "Time the model took to load",
                                      labels=m)
        state = GaugeMetricFamily("rollserve_model_state", "1 for the model's current state", labels=m + ["state"])
        for name, version, ep in sorted(self._versions(), key=lambda item: (item[0], int(item[1]))):
            key = [name, version]
            for s in ModelState:
                state.add_metric([*key, s.value], 1.0 if ep.state is s else 0.0)
            if ep.load_time_s is not None:
                load_time.add_metric(key, ep.load_time_s)
            pool = ep.pool
            if pool is not None:
                ready = sum(1 for w in pool.workers.values() if w.alive)
                workers.add_metric([*key, "ready"], ready)
                workers.add_metric([*key, "starting"], pool.num_starting)
                workers.add_metric([*key, "stopped"], len(pool.workers) - ready)
                for cause, n in sorted(pool.restarts_by_cause.items()):
                    restarts.add_metric([*key, cause], n)
            batcher = ep.batcher
            if batcher is not None:
                d = batcher.describe()
                if "retries_total" in d:
                    retries.add_metric(key, d["retries_total"])
                _queues(key, d, batcher.num_pending(), running, waiting, kv_ratio, kv_total,
                        kv_used)
        yield from (running, waiting, kv_ratio, kv_total, kv_used, workers, restarts, retries, load_time, state)


def _queues(key: list[str], d: dict[str, Any], pending: int, running: GaugeMetricFamily,
            waiting: GaugeMetricFamily, kv_ratio: GaugeMetricFamily, kv_total: GaugeMetricFamily,
            kv_used: GaugeMetricFamily) -> None:
    if d.get("mode") != "rolling":
        queued = int(d.get("queued", 0))
        running.add_metric(key, pending - queued)
        waiting.add_metric(key, queued)
        return
    engines = list((d.get("engines") or {}).values())
    if not engines:
        running.add_metric(key, d.get("running", 0))
        waiting.add_metric(key, d.get("waiting", 0))
        return
    running.add_metric(key, sum(e.get("num_running", 0) for e in engines))
    waiting.add_metric(key, d.get("waiting", 0) + sum(e.get("num_waiting", 0) for e in engines))
    total = sum(e.get("kv_blocks_total", 0) for e in engines)
    used = sum(e.get("kv_blocks_used", 0) for e in engines)
    kv_total.add_metric(key, total)
    kv_used.add_metric(key, used)
    kv_ratio.add_metric(key, used / total if total else 0.0)
