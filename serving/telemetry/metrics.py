"""ServingMetrics: the server's Prometheus metrics, on a registry of its own.

Design note: runs in the frontend process, on the event loop. Workers never touch Prometheus: a rolling
worker's engine statistics arrive with every ``Deltas`` frame over the existing IPC and reach ``on_step``;
everything else is observed in the frontend (batchers call the ``BatchObserver`` hooks, the HTTP wrapper
records each inference request's status class). Gauges that describe *current* state (queue depth,
running requests, KV blocks, workers, model states) are read from the model registry at scrape time, so
they can never drift from the truth (``serving.telemetry.metrics_state``). Label values are bounded: ``model`` is a
registered model's name (a request naming any other model counts under ``__unknown__``), ``version`` one of its
versions (``serving.models.versions``: ``1`` for a model without versions; empty for ``__unknown__``),
``reason``/``status_class``/``kind``/``finished_reason``/``state`` come from closed sets; no request ids,
paths or user strings as labels.
``*_created`` series are dropped when rendering (registry-local; no process-global switch). Each endpoint's
batcher reports through ``for_version(version)``, an observer that adds the version label; an HTTP request's
version is the one its route resolved (``serving.frontends.http.httpio.note_model``: the request's state).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest
from prometheus_client.metrics_core import Metric
from starlette.requests import Request
from starlette.responses import Response

from rollcore.errors import ErrorKind
from serving.batching.streams import ResultStream
from serving.models.endpoint_protocol import Endpoint
from serving.models.served_version import DEFAULT_VERSION
from serving.telemetry.metrics_gateway import GatewayCollector
from serving.telemetry.metrics_state import StateCollector, VersionSource

log = logging.getLogger("serving.requests")

UNKNOWN_MODEL = "__unknown__"
REJECT_REASONS = ("queue_full", "queue_timeout", "invalid", "cancelled", "timeout", "deadline_refused",
                  "deadline_expired")
# a route sets ``request.state.model`` and ``request.state.model_version`` once it resolved the endpoint
MODEL_STATE_KEY = "model"
MODEL_VERSION_STATE_KEY = "model_version"
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

ModelSource = Callable[[], Mapping[str, Endpoint]]


def status_class(status: int) -> str:
    """HTTP status -> ``"2xx"`` .. ``"5xx"`` (anything else -> ``"5xx"``)."""
    return f"{status // 100}xx" if 100 <= status < 600 else "5xx"


class ServingMetrics:
    """Every rollserve metric family; implements ``serving.batching.ports.BatchObserver``.

    ``models`` returns the registry's endpoints by name (read at scrape time and to bound the ``model``
    label); ``registry`` is the CollectorRegistry to register on (a fresh one by default, never the
    process-global ``prometheus_client.REGISTRY``). Event-loop only.
    """

    def __init__(self, registry: CollectorRegistry | None = None, models: ModelSource = dict,
                 versions: VersionSource | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self._models = models
        self._engine_totals: dict[tuple[str, str, int], dict[str, float]] = {}
        r = self.registry
        m = ["model", "version"]
        self.requests = Counter("rollserve_requests", "Inference requests by HTTP status class",
                                m + ["status_class"], registry=r)
        self.rejected = Counter("rollserve_requests_rejected", "Requests rejected or ended early, by reason "
                                "(queue_full, queue_timeout, invalid, cancelled, timeout; deadline_refused: could not "
                                "start before its deadline; deadline_expired: its deadline passed before it reached a "
                                "worker)", m + ["reason"], registry=r)
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
        self.burst_paused = Counter("rollserve_burst_paused_steps", "Engine steps that prefilled a burst's prompts "
                                    "while running sequences waited to decode (option.burst_prefill_first)", m,
                                    registry=r)
        self.itl_over_steps = Counter("rollserve_itl_target_exceeded_steps", "Engine steps whose streams waited "
                                      "longer than the inter-token latency target (option.max_itl_ms) for their "
                                      "token", m, registry=r)
        self.itl_over_seconds = Counter("rollserve_itl_target_excess_seconds", "Sum over those steps of how much "
                                        "longer than the target the streams waited", m, registry=r)
        self.prefix_queries = Counter("rollserve_prefix_cache_queries", "Prompt blocks looked up in the prefix "
                                      "cache", m, registry=r)
        self.prefix_hits = Counter("rollserve_prefix_cache_hits", "Prompt blocks found in the prefix cache", m,
                                   registry=r)
        self.spec_drafts = Counter("rollserve_spec_decode_num_draft_tokens", "Tokens guessed by speculative "
                                   "decoding (option.speculative_draft)", m, registry=r)
        self.spec_accepted = Counter("rollserve_spec_decode_num_accepted_tokens", "Guessed tokens the model "
                                     "confirmed", m, registry=r)
        state = StateCollector(versions if versions is not None else self._default_versions)
        r.register(state)
        # the same gauges under the names gateways' endpoint pickers scrape (vLLM's: serving.telemetry.metrics_gateway)
        r.register(GatewayCollector(state, versions if versions is not None else self._default_versions))

    def _default_versions(self) -> list[tuple[str, str, Endpoint]]:
        return [(n, ep.version, ep) for n, ep in self._models().items()]

    def for_version(self, version: str) -> VersionObserver:
        """The ``BatchObserver`` of one version's batcher: these metrics, with its ``version`` label."""
        return VersionObserver(self, version)

    # --- model label ---
    def model_label(self, model: str | None) -> str:
        """``model`` if it is a registered model, else ``__unknown__`` (keeps the label bounded)."""
        return model if model is not None and model in self._models() else UNKNOWN_MODEL

    def version_label(self, model: str, version: str | None) -> str:
        """The version that answered (else the model's default one); empty for ``__unknown__``."""
        if model == UNKNOWN_MODEL:
            return ""
        if version is None:
            ep = self._models().get(model)
            version = ep.version if ep is not None else DEFAULT_VERSION
        return version

    # --- frontends ---
    def record_request(self, model: str | None, status: int, version: str | None = None) -> None:
        """One inference request answered with HTTP ``status`` (frontends; unknown models are bucketed)."""
        label = self.model_label(model)
        v = self.version_label(label, version)
        self.requests.labels(label, v, status_class(status)).inc()
        if status in INVALID_STATUSES:
            self.rejected.labels(label, v, "invalid").inc()

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
                self.record_request(model, seen["status"], state.get(MODEL_VERSION_STATE_KEY))
                log.info("request %s model %s: %s -> %d in %.1f ms", seen["rid"], model, scope.get("path", ""),
                         seen["status"], (time.monotonic() - start) * 1000.0,
                         extra={"request_id": seen["rid"], "model": model})
        return wrapped

    # --- BatchObserver (batchers) ---
    def on_batch(self, model: str, size: int, version: str = DEFAULT_VERSION) -> None:
        self.batch_size.labels(model, version).observe(size)

    def on_rejected(self, model: str, reason: str, version: str = DEFAULT_VERSION) -> None:
        self.rejected.labels(model, version, reason if reason in REJECT_REASONS else "other").inc()

    def on_step(self, model: str, worker_id: int, stats: dict[str, Any], step_s: float, num_deltas: int,
                version: str = DEFAULT_VERSION) -> None:
        """One rolling-engine step: its time, and the growth of the engine's cumulative counters."""
        self.step_time.labels(model, version).observe(step_s)
        last = self._engine_totals.setdefault((model, version, worker_id), {})
        for key, counter in (("num_preemptions_total", self.preemptions),
                             ("num_burst_paused_steps_total", self.burst_paused),
                             ("itl_over_target_steps_total", self.itl_over_steps),
                             ("itl_over_target_seconds_total", self.itl_over_seconds),
                             ("prefix_cache_queries_total", self.prefix_queries),
                             ("prefix_cache_hits_total", self.prefix_hits),
                             ("spec_draft_tokens_total", self.spec_drafts),
                             ("spec_accepted_tokens_total", self.spec_accepted)):
            value = stats.get(key)
            if not isinstance(value, (int, float)):
                continue
            previous = last.get(key, 0.0)
            grown = value - previous if value >= previous else value  # a restarted engine starts from 0
            child = counter.labels(model, version)  # the series exists (at 0) from the first step on
            if grown > 0:
                child.inc(grown)
            last[key] = value

    def on_finished(self, model: str, stream: ResultStream, version: str = DEFAULT_VERSION) -> None:
        """A request's stream ended (success, error or cancel); called exactly once per stream."""
        v = version
        if stream.num_tokens:
            self.generation_tokens.labels(model, v).inc(stream.num_tokens)
        if stream.prompt_tokens:
            self.prompt_tokens.labels(model, v).inc(stream.prompt_tokens)
        if stream.error is not None:
            kind = stream.error.kind
            self.failures.labels(model, v, kind.value).inc()
            if kind is ErrorKind.CANCELLED:
                self.rejected.labels(model, v, "cancelled").inc()
            elif kind is ErrorKind.TIMEOUT:  # before dispatch: it waited past its deadline in the queue
                self.rejected.labels(model, v, "timeout" if stream.dispatched is not None else "deadline_expired").inc()
            return
        t = stream.timings()
        self.e2e.labels(model, v).observe(t.e2e_s)
        self.queue.labels(model, v).observe(t.queue_s)
        self.ttft.labels(model, v).observe(t.ttft_s)
        self.prefill.labels(model, v).observe(t.prefill_s)
        self.decode.labels(model, v).observe(t.decode_s)
        if stream.token_gaps_s and stream.num_tokens > 1:  # tokens streamed one by one (not a whole batch)
            self.tpot.labels(model, v).observe((t.e2e_s - t.ttft_s) / (stream.num_tokens - 1))
        itl = self.itl.labels(model, v)
        for gap in stream.token_gaps_s:
            itl.observe(gap)
        self.request_prompt_tokens.labels(model, v).observe(stream.prompt_tokens)
        self.request_generation_tokens.labels(model, v).observe(stream.num_tokens)
        reason = stream.finish_reason.value if stream.finish_reason is not None else "length"
        self.success.labels(model, v, reason).inc()

    # --- exposition ---
    def render(self) -> bytes:
        """The text exposition format (0.0.4) without ``*_created`` series."""
        return generate_latest(_WithoutCreated(self.registry))  # type: ignore[arg-type]

    async def route(self, request: Request) -> Response:
        """``GET /metrics`` (Starlette endpoint)."""
        return Response(self.render(), media_type=CONTENT_TYPE_PLAIN_0_0_4)


def _hist(registry: CollectorRegistry, name: str, doc: str, buckets: Iterable[float]) -> Histogram:
    return Histogram(name, doc, ["model", "version"], buckets=tuple(buckets), registry=registry)


class VersionObserver:
    """A ``BatchObserver`` for one version's batcher: forwards to ``ServingMetrics`` with the version label."""

    def __init__(self, metrics: ServingMetrics, version: str) -> None:
        self._metrics = metrics
        self.version = version

    def on_batch(self, model: str, size: int) -> None:
        self._metrics.on_batch(model, size, self.version)

    def on_step(self, model: str, worker_id: int, stats: dict[str, Any], step_s: float, num_deltas: int) -> None:
        self._metrics.on_step(model, worker_id, stats, step_s, num_deltas, self.version)

    def on_rejected(self, model: str, reason: str) -> None:
        self._metrics.on_rejected(model, reason, self.version)

    def on_finished(self, model: str, stream: ResultStream) -> None:
        self._metrics.on_finished(model, stream, self.version)


class _WithoutCreated:
    """A registry view whose families carry no ``*_created`` samples."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        for family in self._registry.collect():
            family.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield family
