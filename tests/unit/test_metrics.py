"""ServingMetrics: families move as requests flow through real batchers with fake workers; the exposition
is parsed with prometheus_client's own parser. No processes, no sockets."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from types import SimpleNamespace
from typing import Any

import prometheus_client
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from rollcore.errors import InvalidRequest, Overloaded
from rollcore.types import BatchOutput, FinishReason, GenerationRequest, ModelState, TokenDelta, TokenInfo
from serving.batching.dynamic import DynamicBatcher
from serving.batching.rolling import RollingBatcher
from serving.ipc.messages import Batch, BatchResult, Deltas, Reject
from serving.models.endpoint import FailedEndpoint
from serving.telemetry.metrics import UNKNOWN_MODEL, ServingMetrics
from serving.telemetry.metrics_gateway import PROTOCOL_NAMES


class FakeWorker:
    def __init__(self, worker_id: int = 1) -> None:
        self.worker_id = worker_id
        self.alive = True
        self.info: dict[str, Any] = {}
        self.sent: list[Any] = []

    def send(self, msg: Any) -> None:
        self.sent.append(msg)

    def kill_soon(self) -> None:
        self.alive = False


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 10))


def scraped(state: ModelState, **kw: Any) -> SimpleNamespace:
    """An endpoint as a scrape reads it (``serving.models.endpoint_protocol``): no workers or batcher unless given."""
    return SimpleNamespace(**{"state": state, "version": "1", "load_time_s": None, "pool": None, "batcher": None,
                              "info": {}, **kw})


def metrics(*names: str, endpoints: dict[str, Any] | None = None) -> ServingMetrics:
    eps = endpoints if endpoints is not None else {n: scraped(ModelState.READY) for n in names}
    return ServingMetrics(CollectorRegistry(), models=lambda: eps)


def scrape(m: ServingMetrics) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    out = {}
    for family in text_string_to_metric_families(m.render().decode()):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    """A sample by its labels; a model's series carry its ``version`` (1 here unless named; empty for unknown)."""
    if "model" in labels:
        labels.setdefault("version", "" if labels["model"] == UNKNOWN_MODEL else "1")
    return samples.get((name, frozenset(labels.items())), 0.0)


def req(rid: str, model: str = "m") -> GenerationRequest:
    return GenerationRequest(request_id=rid, model=model, prompt="a b c")


def output(rid: str, n: int = 3) -> BatchOutput:
    return BatchOutput(request_id=rid, text="x " * n, tokens=tuple(TokenInfo(i, "x") for i in range(n)),
                       prompt_tokens=2)


def step(request_ids: list[str], last: bool, stats: dict[str, Any]) -> Deltas:
    deltas = [TokenDelta(request_id=rid, tokens=(TokenInfo(7, "t"),), text="t",
                         finish_reason=FinishReason.LENGTH if last else None, prompt_tokens=5)
              for rid in request_ids]
    return Deltas(step=0, deltas=deltas, stats=stats, step_s=0.01)


async def until(cond: Any) -> None:
    for _ in range(400):
        if cond():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("condition not met in time")


def test_dynamic_requests_move_every_request_family() -> None:
    m = metrics("m")

    async def main() -> None:
        b = DynamicBatcher("m", batch_size=4, max_batch_delay_ms=20, job_queue_size=100, predict_timeout_s=30,
                           observer=m)
        b.start()
        w = FakeWorker()
        b.worker_ready(w)
        streams = [b.submit(req(f"r{i}")) for i in range(6)]
        for _ in range(2):
            await until(lambda: any(isinstance(x, Batch) for x in w.sent))
            batch = [x for x in w.sent if isinstance(x, Batch)][0]
            w.sent.clear()
            b.on_message(w, BatchResult(batch_id=batch.batch_id,
                                        outputs=[output(r.request_id) for r in batch.requests]))
        await asyncio.gather(*(s.collect() for s in streams))
        await b.close()

    run(main())
    s = scrape(m)
    for family in ("rollserve_e2e_request_latency_seconds", "rollserve_request_queue_time_seconds",
                   "rollserve_time_to_first_token_seconds", "rollserve_request_prompt_tokens",
                   "rollserve_request_generation_tokens"):
        assert value(s, family + "_count", model="m") == 6, family
        assert value(s, family + "_bucket", model="m", le="+Inf") == 6, family
    assert value(s, "rollserve_request_success_total", model="m", finished_reason="length") == 6
    assert value(s, "rollserve_prompt_tokens_total", model="m") == 12
    assert value(s, "rollserve_generation_tokens_total", model="m") == 18
    assert value(s, "rollserve_batch_size_count", model="m") == 2
    assert value(s, "rollserve_batch_size_sum", model="m") == 6
    # whole answers arrive at once: no inter-token gaps, no time-per-output-token
    assert value(s, "rollserve_inter_token_latency_seconds_count", model="m") == 0


def test_rolling_steps_move_token_latency_and_engine_counters() -> None:
    m = metrics("m")
    ids = ["a", "b", "c"]

    async def main() -> None:
        b = RollingBatcher("m", max_rolling_batch_size=8, job_queue_size=10, predict_timeout_s=30, observer=m)
        w = FakeWorker(1)
        b.worker_ready(w)
        streams = [b.submit(req(rid)) for rid in ids]
        for i in range(4):  # 4 tokens per request; engine counters grow each step
            stats = {"num_preemptions_total": i, "prefix_cache_queries_total": 10 * (i + 1),
                     "prefix_cache_hits_total": 3 * (i + 1), "spec_draft_tokens_total": 8 * i,
                     "spec_accepted_tokens_total": 5 * i, "num_burst_paused_steps_total": 2 * i, "num_running": 3,
                     "num_waiting": 0}
            b.on_message(w, step(ids, last=i == 3, stats=stats))
            await asyncio.sleep(0.002)
        await asyncio.gather(*(s.collect() for s in streams))
        # a restarted engine (new worker) counts from zero again
        w2 = FakeWorker(2)
        b.worker_ready(w2)
        b.on_message(w2, Deltas(step=0, deltas=[], stats={"num_preemptions_total": 2}, step_s=0.01))

    run(main())
    s = scrape(m)
    assert value(s, "rollserve_time_to_first_token_seconds_count", model="m") == 3
    assert value(s, "rollserve_inter_token_latency_seconds_count", model="m") == 3 * 3
    assert value(s, "rollserve_time_per_output_token_seconds_count", model="m") == 3
    assert value(s, "rollserve_generation_tokens_total", model="m") == 12
    assert value(s, "rollserve_prompt_tokens_total", model="m") == 15
    assert value(s, "rollserve_engine_step_duration_seconds_count", model="m") == 5
    assert value(s, "rollserve_num_preemptions_total", model="m") == 3 + 2
    assert value(s, "rollserve_burst_paused_steps_total", model="m") == 6
    assert value(s, "rollserve_prefix_cache_queries_total", model="m") == 40
    assert value(s, "rollserve_prefix_cache_hits_total", model="m") == 12
    assert value(s, "rollserve_spec_decode_num_draft_tokens_total", model="m") == 24
    assert value(s, "rollserve_spec_decode_num_accepted_tokens_total", model="m") == 15


def test_rejections_by_reason() -> None:
    m = metrics("m")

    async def main() -> None:
        b = RollingBatcher("m", max_rolling_batch_size=1, job_queue_size=2, predict_timeout_s=0.05, observer=m)
        w = FakeWorker(1)
        b.worker_ready(w)
        running = b.submit(req("run"))
        b.submit(req("q1"))
        queued = b.submit(req("q2"))
        with pytest.raises(Overloaded):
            b.submit(req("q3"))  # queue full
        queued.cancel()  # client left
        b.on_message(w, Reject(request_id="run", kind="invalid_request", message="prompt too long"))
        with pytest.raises(InvalidRequest):
            await running.collect()
        await asyncio.sleep(0.15)  # q1 was admitted after the reject and times out

    run(main())
    s = scrape(m)
    for reason in ("queue_full", "cancelled", "invalid", "timeout"):
        assert value(s, "rollserve_requests_rejected_total", model="m", reason=reason) == 1, reason
    assert value(s, "rollserve_request_failures_total", model="m", kind="timeout") == 1
    assert value(s, "rollserve_e2e_request_latency_seconds_count", model="m") == 0


def test_dynamic_queue_full_moves_the_rejected_counter() -> None:
    m = metrics("m")

    async def main() -> None:
        b = DynamicBatcher("m", batch_size=1, max_batch_delay_ms=1, job_queue_size=3, predict_timeout_s=30,
                           observer=m)
        for i in range(3):
            b.submit(req(f"r{i}"))
        for i in range(5):
            with pytest.raises(Overloaded):
                b.submit(req(f"x{i}"))

    run(main())
    assert value(scrape(m), "rollserve_requests_rejected_total", model="m", reason="queue_full") == 5


def test_state_gauges_are_read_at_scrape_time() -> None:
    rolling = SimpleNamespace(describe=lambda: {"mode": "rolling", "waiting": 2, "running": 5, "retries_total": 4,
                                                "engines": {
        "1": {"num_running": 3, "num_waiting": 1, "kv_blocks_total": 100, "kv_blocks_used": 25,
              "blocks_held": {"secret-request-id": 3}},
        "2": {"num_running": 1, "num_waiting": 0, "kv_blocks_total": 100, "kv_blocks_used": 15}}},
        num_pending=lambda: 7)
    dynamic = SimpleNamespace(describe=lambda: {"mode": "dynamic", "queued": 4}, num_pending=lambda: 6)
    pool = SimpleNamespace(workers={1: SimpleNamespace(alive=True), 2: SimpleNamespace(alive=False)},
                           num_starting=1, num_restarts=3, restarts_by_cause={"crash": 2, "watchdog": 1})
    eps = {"r": scraped(ModelState.READY, load_time_s=2.5, pool=pool, batcher=rolling),
           "d": scraped(ModelState.LOADING, pool=pool, batcher=dynamic),
           "f": FailedEndpoint("f", "its configuration failed")}
    m = metrics(endpoints=eps)
    s = scrape(m)
    assert value(s, "rollserve_num_requests_running", model="r") == 4
    assert value(s, "rollserve_num_requests_waiting", model="r") == 3
    assert value(s, "rollserve_num_requests_running", model="d") == 2
    assert value(s, "rollserve_num_requests_waiting", model="d") == 4
    assert value(s, "rollserve_kv_cache_blocks", model="r") == 200
    assert value(s, "rollserve_kv_cache_used_blocks", model="r") == 40
    assert value(s, "rollserve_kv_cache_usage_ratio", model="r") == pytest.approx(0.2)
    assert value(s, "rollserve_workers", model="r", state="ready") == 1
    assert value(s, "rollserve_workers", model="r", state="starting") == 1
    assert value(s, "rollserve_workers", model="r", state="stopped") == 1
    assert value(s, "rollserve_worker_restarts_total", model="r", cause="crash") == 2
    assert value(s, "rollserve_worker_restarts_total", model="r", cause="watchdog") == 1
    assert value(s, "rollserve_request_retries_total", model="r") == 4

    assert value(s, "rollserve_model_load_time_seconds", model="r") == 2.5
    assert value(s, "rollserve_model_state", model="d", state="LOADING") == 1
    assert value(s, "rollserve_model_state", model="f", state="FAILED") == 1
    assert value(s, "rollserve_model_state", model="f", state="READY") == 0
    assert "secret-request-id" not in m.render().decode()


def test_exposition_conventions() -> None:
    m = metrics("m")
    m.on_batch("m", 2)
    m.on_rejected("m", "something-odd")
    m.record_request("m", 200)
    text = m.render().decode()
    assert "_created" not in text
    families = list(text_string_to_metric_families(text))
    # rollserve's own, and the gateway protocol's vLLM names (serving.telemetry.metrics_gateway)
    assert families and all(f.name.startswith("rollserve_") or f.name in PROTOCOL_NAMES for f in families)
    for f in families:
        if f.type == "counter":
            assert all(s.name.endswith("_total") for s in f.samples), f.name
    assert value(scrape(m), "rollserve_requests_rejected_total", model="m", reason="other") == 1
    # its own registry: nothing leaks into the process-global one
    assert "rollserve_" not in prometheus_client.generate_latest().decode()


def test_instrumented_app_counts_status_classes_and_buckets_unknown_models(caplog: Any) -> None:
    m = metrics("m")

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = scope["path"]
        status = int(path.rsplit("/", 1)[-1])
        if path.startswith("/known/"):
            scope["state"]["model"] = "m"
        elif path.startswith("/user/"):
            scope["state"]["model"] = "user-chosen-name"
        await send({"type": "http.response.start", "status": status, "headers": [(b"x-request-id", b"rid-1")]})
        await send({"type": "http.response.body", "body": b"{}"})

    client = TestClient(m.instrument(app))
    caplog.set_level(logging.INFO, logger="serving.requests")
    for path in ("/known/200", "/known/200", "/known/400", "/known/503", "/nope/404", "/user/200"):
        client.post(path, content=b"{}")
    client.get("/known/200")  # not an inference request
    s = scrape(m)
    assert value(s, "rollserve_requests_total", model="m", status_class="2xx") == 2
    assert value(s, "rollserve_requests_total", model="m", status_class="4xx") == 1
    assert value(s, "rollserve_requests_total", model="m", status_class="5xx") == 1
    assert value(s, "rollserve_requests_total", model=UNKNOWN_MODEL, status_class="4xx") == 1
    assert value(s, "rollserve_requests_total", model=UNKNOWN_MODEL, status_class="2xx") == 1
    assert value(s, "rollserve_requests_rejected_total", model="m", reason="invalid") == 1
    assert "user-chosen-name" not in m.render().decode()
    lines = [r for r in caplog.records if r.name == "serving.requests"]
    assert len(lines) == 6
    assert all(r.request_id == "rid-1" and r.model for r in lines)
