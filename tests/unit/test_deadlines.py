"""Request deadlines without processes or sockets: the headers and Triton's ``timeout`` read into a deadline, the
queue's predicted wait, and both batchers refusing (503 + Retry-After) or dropping (504) on a fake clock, with the
refused and expired requests counted per model."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from rollcore.errors import InvalidRequest, Overloaded, RequestTimeout
from rollcore.types import FinishReason, GenerationRequest
from serving.batching.deadline_admission import admit, predicted_wait_s
from serving.batching.dynamic import DynamicBatcher
from serving.batching.rolling import RollingBatcher
from serving.frontends.http.httpio import submit_all
from serving.frontends.proto.gen.inference import grpc_service_pb2 as pb
from serving.ipc.messages import Batch, BatchResult, Deltas
from serving.requests.deadlines import (
    REQUEST_DEADLINE,
    DeadlineScope,
    HeaderDeadline,
    read_headers,
    rest_timeout,
    triton_timeout,
)
from tests.unit.batcher_fakes import FakeWorker, added, delta, ok_output, run, until
from tests.unit.test_metrics import metrics, scrape, value


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Rejections:
    """A BatchObserver that keeps the reasons of refusals."""

    def __init__(self) -> None:
        self.reasons: list[str] = []

    def on_batch(self, model: str, size: int) -> None:
        pass

    def on_step(self, model: str, worker_id: int, stats: dict[str, Any], step_s: float, num_deltas: int) -> None:
        pass

    def on_rejected(self, model: str, reason: str) -> None:
        self.reasons.append(reason)

    def on_finished(self, model: str, stream: Any) -> None:
        pass


def timed(rid: str, deadline: float | None = None) -> GenerationRequest:
    return GenerationRequest(request_id=rid, model="m", prompt="p", deadline=deadline)


# --- headers and Triton's parameter -> a deadline ---

def test_headers_give_a_deadline_counted_from_arrival_and_the_earlier_wins() -> None:
    assert read_headers([], 100.0) == HeaderDeadline(arrival=100.0)
    assert read_headers([(b"x-request-timeout-ms", b"1500")], 100.0).at == 101.5
    assert read_headers([(b"x-envoy-expected-rq-timeout-ms", b" 250 ")], 100.0).at == 100.25
    both = [(b"x-request-timeout-ms", b"2000"), (b"x-envoy-expected-rq-timeout-ms", b"500")]
    assert read_headers(both, 100.0).at == 100.5
    assert read_headers([(b"x-request-timeout-ms", b"999999999")], 0.0).at == 999999.999


@pytest.mark.parametrize("raw", [b"0", b"-5", b"1.5", b"abc", b"", b"1000000000", b"\xd9\xa3", b"1e3"])
@pytest.mark.parametrize("name", ["X-Request-Timeout-Ms", "X-Envoy-Expected-Rq-Timeout-Ms"])
def test_a_bad_header_value_is_refused_naming_the_header(name: str, raw: bytes) -> None:
    found = read_headers([(name.lower().encode(), raw)], 100.0)
    assert found.at is None and found.problem is not None
    assert found.problem.startswith(f"header {name} must be a whole number of milliseconds from 1 to 999999999")
    with pytest.raises(InvalidRequest, match=f"header {name} must"):
        found.apply(None)


def test_a_header_given_twice_is_refused() -> None:
    found = read_headers([(b"x-request-timeout-ms", b"10"), (b"x-request-timeout-ms", b"20")], 0.0)
    assert found.problem == "header X-Request-Timeout-Ms is given 2 times: give it once"


def test_tritons_timeout_parameter_is_microseconds_and_zero_is_none() -> None:
    request = pb.ModelInferRequest()
    assert triton_timeout(request.parameters, 10.0) is None
    request.parameters["timeout"].int64_param = 2_500_000
    assert triton_timeout(request.parameters, 10.0) == 12.5
    request.parameters["timeout"].uint64_param = 0
    assert triton_timeout(request.parameters, 10.0) is None
    request.parameters["timeout"].string_param = "5"
    with pytest.raises(InvalidRequest, match="parameter 'timeout' must be a whole number of microseconds"):
        triton_timeout(request.parameters, 10.0)
    assert rest_timeout(0) == 0 and rest_timeout(7) == 7
    for bad in (-1, 1.5, True, "7", None):
        with pytest.raises(InvalidRequest, match="'parameters.timeout' must be a whole number of microseconds"):
            rest_timeout(bad)


def test_the_middleware_holds_the_headers_while_the_app_serves_and_submit_applies_them() -> None:
    submitted: list[GenerationRequest] = []

    class Endpoint:
        def submit(self, r: GenerationRequest) -> Any:
            submitted.append(r)
            return object()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        header = REQUEST_DEADLINE.get()
        assert header is not None and header.at == 50.25
        submit_all(Endpoint(), [timed("a"), timed("b", deadline=50.1)])

    async def bad_app(scope: Any, receive: Any, send: Any) -> None:
        with pytest.raises(InvalidRequest, match="header X-Request-Timeout-Ms must"):
            submit_all(Endpoint(), [timed("c")])

    async def main() -> None:
        scope = {"type": "http", "headers": [(b"x-request-timeout-ms", b"250")]}
        await DeadlineScope(app, clock=lambda: 50.0)(scope, None, None)  # type: ignore[arg-type]
        await DeadlineScope(bad_app, clock=lambda: 50.0)(  # type: ignore[arg-type]
            {"type": "http", "headers": [(b"x-request-timeout-ms", b"soon")]}, None, None)
        assert REQUEST_DEADLINE.get() is None  # reset after the request

    run(main())
    assert [(r.request_id, r.deadline) for r in submitted] == [("a", 50.25), ("b", 50.1)]  # nothing of "c" queued


# --- the predicted wait and admission ---

@pytest.mark.parametrize(("ahead", "free", "slots", "mean", "wait"), [
    (0, 1, 4, None, 0.0),  # a free slot: no wait, measured or not
    (2, 3, 4, 1.0, 0.0),
    (0, 0, 4, None, None),  # nothing measured yet: no prediction
    (3, 0, 2, 1.0, 2.0),  # four to go, two slots each freeing once a second
    (3, 1, 2, 1.0, 1.5),
    (0, 0, 0, 1.0, None),  # no live worker
])
def test_predicted_wait(ahead: int, free: int, slots: int, mean: float | None, wait: float | None) -> None:
    assert predicted_wait_s(ahead, free, slots, mean) == wait


def test_admission_refuses_with_retry_after_or_times_out_an_expired_request() -> None:
    seen = Rejections()
    admit("m", timed("a"), 10.0, 99.0, seen)  # no deadline: nothing to check
    admit("m", timed("b", deadline=12.0), 10.0, None, seen)  # no prediction: queued
    admit("m", timed("c", deadline=12.0), 10.0, 2.0, seen)  # just fits
    with pytest.raises(Overloaded, match="the requests ahead of it should take 2500 ms and its deadline is 2000 ms "
                                         "away") as refused:
        admit("m", timed("d", deadline=12.0), 10.0, 2.5, seen)
    assert refused.value.retry_after_s == 1
    with pytest.raises(Overloaded) as far:
        admit("m", timed("e", deadline=10.5), 10.0, 500.0, seen)
    assert far.value.retry_after_s == 60  # clamped
    with pytest.raises(RequestTimeout, match="passed before it could be queued"):
        admit("m", timed("f", deadline=10.0), 10.0, 0.0, seen)
    assert seen.reasons == ["deadline_refused", "deadline_refused", "deadline_expired"]


# --- the batchers ---

def test_rolling_refuses_what_cannot_start_in_time_and_never_admits_an_expired_request() -> None:
    clock = FakeClock()
    m = metrics("m")

    async def main() -> None:
        b = RollingBatcher("m", max_rolling_batch_size=1, job_queue_size=10, predict_timeout_s=600, observer=m,
                           clock=clock)
        w = FakeWorker()
        b.worker_ready(w)
        first = b.submit(timed("first"))
        clock.now += 2.0  # the first request holds its slot for 2 s
        b.on_message(w, Deltas(step=1, deltas=[delta("first", 1, FinishReason.LENGTH)]))
        await first.collect()
        assert b.describe()["predicted_wait_ms"] == 0.0  # the slot is free again
        b.submit(timed("busy"))
        assert b.describe()["predicted_wait_ms"] == 2000.0
        with pytest.raises(Overloaded) as refused:
            b.submit(timed("hasty", deadline=clock.now + 1.0))
        assert refused.value.retry_after_s == 1
        late = b.submit(timed("late", deadline=clock.now + 3.0))  # fits the prediction: queued
        with pytest.raises(Overloaded):
            b.submit(timed("behind", deadline=clock.now + 3.0))  # one more ahead: 4 s
        clock.now += 5.0  # the busy request runs past late's deadline; its timer has not run on the real loop
        b.on_message(w, Deltas(step=2, deltas=[delta("busy", 1, FinishReason.LENGTH)]))
        with pytest.raises(RequestTimeout, match="passed while it waited in the queue; it never reached a worker"):
            await late.collect()
        assert added(w) == ["first", "busy"]
        assert b.num_pending() == 0
        await b.close()

    run(main())
    s = scrape(m)
    assert value(s, "rollserve_requests_rejected_total", model="m", reason="deadline_refused") == 2
    assert value(s, "rollserve_requests_rejected_total", model="m", reason="deadline_expired") == 1
    assert value(s, "rollserve_requests_rejected_total", model="m", reason="timeout") == 0


def test_dynamic_refuses_what_cannot_start_in_time_and_drops_an_expired_request_before_its_batch() -> None:
    clock = FakeClock()
    m = metrics("m")

    async def main() -> None:
        b = DynamicBatcher("m", batch_size=1, max_batch_delay_ms=0, job_queue_size=10, predict_timeout_s=600,
                           observer=m, clock=clock)
        b.start()
        w = FakeWorker()
        b.worker_ready(w)
        first = b.submit(timed("first"))
        await until(lambda: len(w.of(Batch)) == 1)
        clock.now += 2.0
        b.on_message(w, BatchResult(batch_id=w.of(Batch)[0].batch_id, outputs=[ok_output("first")]))
        await first.collect()
        busy = b.submit(timed("busy"))
        await until(lambda: len(w.of(Batch)) == 2)
        assert b.describe()["predicted_wait_ms"] == 2000.0
        with pytest.raises(Overloaded) as refused:
            b.submit(timed("hasty", deadline=clock.now + 0.5))
        assert refused.value.retry_after_s == 2
        late = b.submit(timed("late", deadline=clock.now + 3.0))
        clock.now += 5.0
        b.on_message(w, BatchResult(batch_id=w.of(Batch)[1].batch_id, outputs=[ok_output("busy")]))
        await busy.collect()
        with pytest.raises(RequestTimeout, match="never reached a worker"):
            await late.collect()
        after = b.submit(timed("after"))
        await until(lambda: len(w.of(Batch)) == 3)
        assert [r.request_id for batch in w.of(Batch) for r in batch.requests] == ["first", "busy", "after"]
        b.on_message(w, BatchResult(batch_id=w.of(Batch)[2].batch_id, outputs=[ok_output("after")]))
        await after.collect()
        await b.close()

    run(main())
    s = scrape(m)
    assert value(s, "rollserve_requests_rejected_total", model="m", reason="deadline_refused") == 1
    assert value(s, "rollserve_requests_rejected_total", model="m", reason="deadline_expired") == 1
    assert value(s, "rollserve_requests_rejected_total", model="m", reason="timeout") == 0


def test_dynamic_deadline_of_an_in_flight_request_is_a_timeout_counted_once() -> None:
    m = metrics("m")

    async def main() -> None:
        loop = asyncio.get_running_loop()
        b = DynamicBatcher("m", batch_size=1, max_batch_delay_ms=0, job_queue_size=10, predict_timeout_s=600,
                           observer=m)
        b.start()
        w = FakeWorker()
        b.worker_ready(w)
        s = b.submit(timed("slow", deadline=loop.time() + 0.5))
        await until(lambda: len(w.of(Batch)) == 1)
        with pytest.raises(RequestTimeout, match="passed before it completed"):
            await s.collect()
        await b.close()

    run(main())
    s = scrape(m)
    assert value(s, "rollserve_requests_rejected_total", model="m", reason="timeout") == 1
    assert value(s, "rollserve_requests_rejected_total", model="m", reason="deadline_expired") == 0
