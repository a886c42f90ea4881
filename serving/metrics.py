"""ServingMetrics: the server's Prometheus metrics, on a registry of its own.

Design note: runs in the frontend process, on the event loop. Workers never touch Prometheus: a rolling
worker's engine statistics arrive with every ``Deltas`` frame over the existing IPC and reach ``on_step``;
everything else is observed in the frontend (batchers call the ``BatchObserver`` hooks, the HTTP wrapper
records each inference request's status class). Gauges that describe *current* state (queue depth,
running requests, KV blocks, workers, model states) are read from the model registry at scrape time, so
they can never drift from the truth. Label values are bounded: ``model`` is a registered model's name
(a request naming any other model counts under ``__unknown__``), ``reason``/``status_class``/``kind``/
``finished_reason``/``state`` come from closed sets; no request ids, paths or user strings as labels.
``*_created`` series are dropped when rendering (registry-local; no process-global switch).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import Response

from rollcore.errors import ErrorKind
from rollcore.types import ModelState
from serving.batching.streams import ResultStream

log = logging.getLogger("serving.requests")

UNKNOWN_MODEL = "__unknown__"
REJECT_REASONS = ("queue_full", "queue_timeout", "invalid", "cancelled", "timeout")
MODEL_STATE_KEY = "model"  # a route sets ``request.state.model = ep.name`` once it resolved the model
REQUEST_ID_HEADER = b"x-request-id"
INVALID_STATUSES = (400, 413, 422)

# Request-level latencies: 1 ms up to ~10 minutes.
LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                     1.5, 2.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
# Per-token latencies: 0.5 ms up to a minute.
TOKEN_LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
                           0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 60.0)
BATCH_SIZE_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256, 512)
TOKEN_COUNT_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)

ModelSource = Callable[[], Mapping[str, Any]]


def status_class(status: int) -> str:
    """HTTP status -> ``"2xx"`` .. ``"5xx"`` (anything else -> ``"5xx"``)."""
    return f"{status // 100}xx" if 100 <= status < 600 else "5xx"


class ServingMetrics:
    """Every rollserve metric family; implements ``serving.batching.ports.BatchObserver``.

    ``models`` returns the registry's endpoints by name (read at scrape time and to bound the ``model``
    label); ``registry`` is the CollectorRegistry to register on (a fresh one by default, never the
    process-global ``prometheus_client.REGISTRY``). Event-loop only.
    """

    def __init__(self, registry: CollectorRegistry | None = None, models: ModelSource = dict) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self._models = models
        self._engine_totals: dict[tuple[str, int], dict[str, float]] = {}
        r = self.registry
        m = ["model"]
        self.requests = Counter("rollserve_requests", "Inference requests by HTTP status class",
                                m + ["status_class"], registry=r)
        self.rejected = Counter("rollserve_requests_rejected", "Requests rejected or ended early, by reason "
                                "(queue_full, queue_timeout, invalid, cancelled, timeout)", m + ["reason"], registry=r)
        self.success = Counter("rollserve_request_success", "Requests that finished, by finish reason",
                               m + ["finished_reason"], registry=r)
        self.failures = Counter("rollserve_request_failures", "Requests that ended in an error, by error kind",
                                m + ["kind"], registry=r)
        self.prompt_tokens = Counter("rollserve_prompt_tokens", "Prompt tokens processed", m, registry=r)
        self.generation_tokens = Counter("rollserve_generation_tokens", "Tokens generated", m, registry=r)
        self.e2e = _hist(r, "rollserve_e2e_request_latency_seconds", "Arrival to last token", LATENCY_BUCKETS_S)
        self.queue = _hist(r, "rollserve_request_queue_time_seconds", "Arrival to dispatch to a worker",
                           LATENCY_BUCKETS_S)
        self.ttft = _hist(r, "rollserve_time_to_first_token_seconds", "Arrival to first token", LATENCY_BUCKETS_S)
        self.prefill = _hist(r, "rollserve_request_prefill_time_seconds", "Dispatch to first token",
                             LATENCY_BUCKETS_S)
        self.decode = _hist(r, "rollserve_request_decode_time_seconds", "First to last token", LATENCY_BUCKETS_S)
        self.itl = _hist(r, "rollserve_inter_token_latency_seconds", "Gap between successive token deliveries",
                         TOKEN_LATENCY_BUCKETS_S)
        self.tpot = _hist(r, "rollserve_time_per_output_token_seconds", "(e2e - ttft) / (tokens - 1) per request",
                          TOKEN_LATENCY_BUCKETS_S)
        self.request_prompt_tokens = _hist(r, "rollserve_request_prompt_tokens", "Prompt tokens per request",
                                           TOKEN_COUNT_BUCKETS)
        self.request_generation_tokens = _hist(r, "rollserve_request_generation_tokens",
                                               "Generated tokens per request", TOKEN_COUNT_BUCKETS)
        self.batch_size = _hist(r, "rollserve_batch_size", "Requests per dynamic batch sent to a worker",
                                BATCH_SIZE_BUCKETS)
        self.step_time = _hist(r, "rollserve_engine_step_duration_seconds", "Rolling-batch engine step time",
                               TOKEN_LATENCY_BUCKETS_S)
        self.preemptions = Counter("rollserve_num_preemptions", "Sequences preempted (KV cache exhausted)", m,
                                   registry=r)
        self.prefix_queries = Counter("rollserve_prefix_cache_queries", "Prompt blocks looked up in the prefix "
                                      "cache", m, registry=r)
        self.prefix_hits = Counter("rollserve_prefix_cache_hits", "Prompt blocks found in the prefix cache", m,
                                   registry=r)
        self.spec_drafts = Counter("rollserve_spec_decode_num_draft_tokens", "Tokens guessed by speculative "
                                   "decoding (option.speculative_draft)", m, registry=r)
        self.spec_accepted = Counter("rollserve_spec_decode_num_accepted_tokens", "Guessed tokens the model "
                                     "confirmed", m, registry=r)
        r.register(_StateCollector(models))

    # --- model label ---
    def model_label(self, model: str | None) -> str:
        """``model`` if it is a registered model, else ``__unknown__`` (keeps the label bounded)."""
        return model if model is not None and model in self._models() else UNKNOWN_MODEL

    # --- frontends ---
    def record_request(self, model: str | None, status: int) -> None:
        """One inference request answered with HTTP ``status`` (frontends; unknown models are bucketed)."""
        label = self.model_label(model)
        self.requests.labels(label, status_class(status)).inc()
        if status in INVALID_STATUSES:
            self.rejected.labels(label, "invalid").inc()

    def instrument(self, app: Any) -> Callable[..., Any]:
        """Wrap an ASGI inference app: count every POST by model and status class and log one line per
        request with its id, model, status and duration (never its body)."""
        async def wrapped(scope: dict[str, Any], receive: Any, send: Any) -> None:
            if scope.get("type") != "http" or scope.get("method") != "POST":
                await app(scope, receive, send)
                return
            state = scope.setdefault("state", {})
            seen: dict[str, Any] = {"status": 500, "rid": "-"}
            start = time.monotonic()

            async def send_wrapper(message: dict[str, Any]) -> None:
                if message.get("type") == "http.response.start":
                    seen["status"] = int(message.get("status", 500))
                    for k, v in message.get("headers") or ():
                        if k.lower() == REQUEST_ID_HEADER:
                            seen["rid"] = v.decode("latin-1")
                await send(message)

            try:
                await app(scope, receive, send_wrapper)
            finally:
                model = self.model_label(state.get(MODEL_STATE_KEY))
                self.record_request(model, seen["status"])
                log.info("request %s model %s: %s -> %d in %.1f ms", seen["rid"], model, scope.get("path", ""),
                         seen["status"], (time.monotonic() - start) * 1000.0,
                         extra={"request_id": seen["rid"], "model": model})
        return wrapped

    # --- BatchObserver (batchers) ---
    def on_batch(self, model: str, size: int) -> None:
        self.batch_size.labels(model).observe(size)

    def on_rejected(self, model: str, reason: str) -> None:
        self.rejected.labels(model, reason if reason in REJECT_REASONS else "other").inc()

    def on_step(self, model: str, worker_id: int, stats: dict[str, Any], step_s: float, num_deltas: int) -> None:
        """One rolling-engine step: its time, and the growth of the engine's cumulative counters."""
        self.step_time.labels(model).observe(step_s)
        last = self._engine_totals.setdefault((model, worker_id), {})
        for key, counter in (("num_preemptions_total", self.preemptions),
                             ("prefix_cache_queries_total", self.prefix_queries),
                             ("prefix_cache_hits_total", self.prefix_hits),
                             ("spec_draft_tokens_total", self.spec_drafts),
                             ("spec_accepted_tokens_total", self.spec_accepted)):
            value = stats.get(key)
            if not isinstance(value, (int, float)):
                continue
            previous = last.get(key, 0.0)
            grown = value - previous if value >= previous else value  # a restarted engine starts from 0
            child = counter.labels(model)  # the series exists (at 0) from the first step on
            if grown > 0:
                child.inc(grown)
            last[key] = value

    def on_finished(self, model: str, stream: ResultStream) -> None:
        """A request's stream ended (success, error or cancel); called exactly once per stream."""
        if stream.num_tokens:
            self.generation_tokens.labels(model).inc(stream.num_tokens)
        if stream.prompt_tokens:
            self.prompt_tokens.labels(model).inc(stream.prompt_tokens)
        if stream.error is not None:
            kind = stream.error.kind
            self.failures.labels(model, kind.value).inc()
            if kind is ErrorKind.CANCELLED:
                self.rejected.labels(model, "cancelled").inc()
            elif kind is ErrorKind.TIMEOUT:
                self.rejected.labels(model, "timeout").inc()
            return
        t = stream.timings()
        self.e2e.labels(model).observe(t.e2e_s)
        self.queue.labels(model).observe(t.queue_s)
        self.ttft.labels(model).observe(t.ttft_s)
        self.prefill.labels(model).observe(t.prefill_s)
        self.decode.labels(model).observe(t.decode_s)
        if stream.token_gaps_s and stream.num_tokens > 1:  # tokens streamed one by one (not a whole batch)
            self.tpot.labels(model).observe((t.e2e_s - t.ttft_s) / (stream.num_tokens - 1))
        itl = self.itl.labels(model)
        for gap in stream.token_gaps_s:
            itl.observe(gap)
        self.request_prompt_tokens.labels(model).observe(stream.prompt_tokens)
        self.request_generation_tokens.labels(model).observe(stream.num_tokens)
        reason = stream.finish_reason.value if stream.finish_reason is not None else "length"
        self.success.labels(model, reason).inc()

    # --- exposition ---
    def render(self) -> bytes:
        """The text exposition format (0.0.4) without ``*_created`` series."""
        return generate_latest(_WithoutCreated(self.registry))  # type: ignore[arg-type]

    async def route(self, request: Request) -> Response:
        """``GET /metrics`` (Starlette endpoint)."""
        return Response(self.render(), media_type=CONTENT_TYPE_PLAIN_0_0_4)


def _hist(registry: CollectorRegistry, name: str, doc: str, buckets: Iterable[float]) -> Histogram:
    return Histogram(name, doc, ["model"], buckets=tuple(buckets), registry=registry)


class _WithoutCreated:
    """A registry view whose families carry no ``*_created`` samples."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        for family in self._registry.collect():
            family.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield family


class _StateCollector(Collector):
    """Current state read from the model registry at scrape time: queues, engines, workers, models."""

    def __init__(self, models: ModelSource) -> None:
        self._models = models

    def collect(self) -> Iterator[Metric]:
        m = ["model"]
        running = GaugeMetricFamily("rollserve_num_requests_running", "Requests running on workers", labels=m)
        waiting = GaugeMetricFamily("rollserve_num_requests_waiting", "Requests waiting (frontend queue and "
                                    "engine waiting queue)", labels=m)
        kv_ratio = GaugeMetricFamily("rollserve_kv_cache_usage_ratio", "Fraction of KV-cache blocks in use (0-1)",
                                     labels=m)
        kv_total = GaugeMetricFamily("rollserve_kv_cache_blocks", "KV-cache blocks (capacity)", labels=m)
        kv_used = GaugeMetricFamily("rollserve_kv_cache_used_blocks", "KV-cache blocks in use", labels=m)
        workers = GaugeMetricFamily("rollserve_workers", "Worker processes by state", labels=m + ["state"])
        restarts = CounterMetricFamily("rollserve_worker_restarts", "Worker processes restarted after an "
                                       "unexpected exit", labels=m)
        load_time = GaugeMetricFamily("rollserve_model_load_time_seconds", "Time the model took to load",
                                      labels=m)
        state = GaugeMetricFamily("rollserve_model_state", "1 for the model's current state", labels=m + ["state"])
        for name, ep in sorted(self._models().items()):
            for s in ModelState:
                state.add_metric([name, s.value], 1.0 if ep.state is s else 0.0)
            load_s = getattr(ep, "load_time_s", None)
            if load_s is not None:
                load_time.add_metric([name], load_s)
            pool = getattr(ep, "pool", None)
            if pool is not None:
                ready = sum(1 for w in pool.workers.values() if w.alive)
                workers.add_metric([name, "ready"], ready)
                workers.add_metric([name, "starting"], getattr(pool, "num_starting", 0))
                workers.add_metric([name, "stopped"], len(pool.workers) - ready)
                restarts.add_metric([name], pool.num_restarts)
            batcher = getattr(ep, "batcher", None)
            if batcher is not None:
                self._queues(name, batcher.describe(), batcher.num_pending(), running, waiting,
                             kv_ratio, kv_total, kv_used)
        yield from (running, waiting, kv_ratio, kv_total, kv_used, workers, restarts, load_time, state)

    @staticmethod
    def _queues(name: str, d: dict[str, Any], pending: int, running: GaugeMetricFamily,
                waiting: GaugeMetricFamily, kv_ratio: GaugeMetricFamily, kv_total: GaugeMetricFamily,
                kv_used: GaugeMetricFamily) -> None:
        if d.get("mode") != "rolling":
            queued = int(d.get("queued", 0))
            running.add_metric([name], pending - queued)
            waiting.add_metric([name], queued)
            return
        engines = list((d.get("engines") or {}).values())
        if not engines:
            running.add_metric([name], d.get("running", 0))
            waiting.add_metric([name], d.get("waiting", 0))
            return
        running.add_metric([name], sum(e.get("num_running", 0) for e in engines))
        waiting.add_metric([name], d.get("waiting", 0) + sum(e.get("num_waiting", 0) for e in engines))
        total = sum(e.get("kv_blocks_total", 0) for e in engines)
        used = sum(e.get("kv_blocks_used", 0) for e in engines)
        kv_total.add_metric([name], total)
        kv_used.add_metric([name], used)
        kv_ratio.add_metric([name], used / total if total else 0.0)
