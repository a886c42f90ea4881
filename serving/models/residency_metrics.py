"""Prometheus series of residency (``serving.models.residency``), read at scrape time: what each version's workers
hold (measured), what it counts against the budget, its loads, unloads and load seconds, its last use, and the
budget. Labels: ``model`` and ``version`` as every per-model series; ``reason`` of an unload is ``budget`` or
``idle_ttl``."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from serving.models.residency import RESIDENT, Residency, Versions

UNLOAD_REASONS = ("budget", "idle_ttl")


class ResidencyCollector(Collector):
    def __init__(self, versions: Versions, residency: Residency) -> None:
        self._versions = versions
        self._residency = residency

    def collect(self) -> Iterator[Metric]:
        m = ["model", "version"]
        memory = GaugeMetricFamily("rollserve_model_memory_bytes", "Memory the model's workers hold, measured (the "
                                   "PSS of their process trees; 0 while unloaded)", labels=m)
        held = GaugeMetricFamily("rollserve_model_memory_held_bytes", "What the model counts against "
                                 "model_memory_budget: its measured peak, or its prediction while it loads", labels=m)
        loads = CounterMetricFamily("rollserve_model_loads", "Loads of the model (at start, on demand, by a reload)",
                                    labels=m)
        unloads = CounterMetricFamily("rollserve_model_unloads", "Unloads of the model to make room under the budget "
                                      "or after idle_ttl", labels=[*m, "reason"])
        seconds = CounterMetricFamily("rollserve_model_load_seconds", "Seconds spent loading the model", labels=m)
        last_used = GaugeMetricFamily("rollserve_model_last_used_timestamp_seconds", "When a request last asked for "
                                      "the model (Unix time)", labels=m)
        budget = GaugeMetricFamily("rollserve_model_memory_budget_bytes", "model_memory_budget: the memory the "
                                   "models' workers may hold together")
        budget.add_metric([], self._residency.budget)
        for name, version, ep in sorted(self._versions(), key=lambda item: (item[0], int(item[1]))):
            r = ep.residence
            if r is None:
                continue
            key = [name, version]
            resident = ep.state in RESIDENT
            memory.add_metric(key, r.memory_bytes if resident else 0)
            held.add_metric(key, r.holds(resident))
            loads.add_metric(key, r.loads)
            for reason in UNLOAD_REASONS:
                unloads.add_metric([*key, reason], r.unloads.get(reason, 0))
            seconds.add_metric(key, r.load_seconds)
            if r.last_used is not None:
                last_used.add_metric(key, r.last_used)
        yield from (memory, held, loads, unloads, seconds, last_used, budget)
