"""No request waits forever and one request never takes its neighbours down: batchers against fake
workers (no processes) -- unencodable requests, malformed outputs, queue-wait limit with a measured
Retry-After, the rolling liveness watchdog, FAILED/unloaded models."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from rollcore.errors import HandlerError, InvalidRequest, Overloaded, Unavailable, WorkerFailed
from rollcore.types import FinishReason, GenerationRequest, SamplingParams
from serving.batching.dynamic import DynamicBatcher
from serving.batching.pacing import ServiceRate
from serving.batching.rolling import RollingBatcher
from serving.ipc import codec
from serving.ipc.messages import Abort, Add, Batch, BatchResult, Deltas, message_from_dict, message_to_dict
from serving.ipc.wire import decoder, encoder
from tests.unit.test_batchers import FakeWorker, added, delta, ok_output, req, run, until


class EncodingWorker(FakeWorker):
    """Encodes every frame as the real channel does (so a value msgpack cannot carry raises here)."""

    def send(self, msg: Any) -> None:
        codec.encode(msg)
        super().send(msg)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def huge(rid: str) -> GenerationRequest:
    return GenerationRequest(request_id=rid, model="m", prompt="p", payload={"x": 2**70})


def test_dynamic_unencodable_request_fails_alone_and_the_loop_lives_on() -> None:
    async def main() -> None:
        b = DynamicBatcher("m", 4, 20, 100, 30)
        b.start()
        w = EncodingWorker()
        b.worker_ready(w)
        good, bad = b.submit(req("good")), b.submit(huge("bad"))
        await until(lambda: w.of(Batch))
        with pytest.raises(InvalidRequest, match="64 bits"):
            await bad.collect()
        batch = w.of(Batch)[0]
        assert [r.request_id for r in batch.requests] == ["good"]
        b.on_message(w, BatchResult(batch_id=batch.batch_id, outputs=[ok_output("good")]))
        assert (await good.collect()).text == "out"
        later = b.submit(req("later"))  # the batching loop is still alive
        await until(lambda: len(w.of(Batch)) == 2)
        b.on_message(w, BatchResult(batch_id=w.of(Batch)[1].batch_id, outputs=[ok_output("later")]))
        assert (await later.collect()).text == "out"
        await b.close()
    run(main())


def test_dynamic_malformed_output_fails_its_request_and_batch_mates_are_answered() -> None:
    async def main() -> None:
        b = DynamicBatcher("m", 2, 50, 100, 30)
        b.start()
        w = FakeWorker()
        b.worker_ready(w)
        first, second = b.submit(req("a")), b.submit(req("b"))
        await until(lambda: w.of(Batch))
        frame = message_to_dict(BatchResult(batch_id=w.of(Batch)[0].batch_id, outputs=[ok_output("a"), ok_output("b")]))
        frame["outputs"][0][3] = [["not-an-int", "x", None, []]]  # a's tokens: an id that is not an integer
        b.on_message(w, message_from_dict(frame))  # as the worker's frame is decoded
        with pytest.raises(HandlerError, match="malformed"):
            await first.collect()
        assert (await second.collect()).text == "out"
        await b.close()
    run(main())


def test_dynamic_queue_wait_limit_answers_503_with_a_measured_retry_after() -> None:
    async def main() -> None:
        clock = FakeClock()
        b = DynamicBatcher("m", 1, 1, 100, 30, clock=clock, max_queue_time_s=5)
        b.start()
        w = FakeWorker()
        b.worker_ready(w)
        for i in range(4):  # four served in 2 s: 2 per second
            s = b.submit(req(f"r{i}"))
            await until(lambda i=i: len(w.of(Batch)) == i + 1)
            b.on_message(w, BatchResult(batch_id=w.of(Batch)[-1].batch_id, outputs=[ok_output(f"r{i}")]))
            await s.collect()
            clock.now += 0.5
        busy = b.submit(req("busy"))  # occupies the worker
        await until(lambda: len(w.of(Batch)) == 5)
        waiting = [b.submit(req(f"w{i}")) for i in range(6)]
        clock.now += 5.0
        b.check_queue_time()
        for s in waiting:
            with pytest.raises(Overloaded, match="max_queue_time") as err:
                await s.collect()
            assert err.value.retry_after_s is not None and 1 <= err.value.retry_after_s <= 60
        assert not busy.done
        await b.close()
        with pytest.raises(Unavailable, match="unloaded"):
            await busy.collect()
    run(main())


def test_service_rate_retry_after() -> None:
    clock = FakeClock()
    rate = ServiceRate(clock, window_s=30)
    assert rate.retry_after_s(10) == 5  # nothing measured yet
    for _ in range(10):
        rate.record()
        clock.now += 1.0
    assert rate.per_second() == pytest.approx(1.0)
    assert rate.retry_after_s(20) == 20 and rate.retry_after_s(0) == 1 and rate.retry_after_s(10**6) == 60


def test_dynamic_failed_model_fails_queued_requests_at_once() -> None:
    async def main() -> None:
        b = DynamicBatcher("m", 1, 1, 100, 30)
        b.start()
        queued = [b.submit(req(f"q{i}")) for i in range(3)]  # no worker: they wait
        b.fail_pending(Unavailable("model 'm' is FAILED: boom"))
        for s in queued:
            with pytest.raises(Unavailable, match="FAILED"):
                await s.collect()
        await b.close()
    run(main())


def test_rolling_unencodable_request_fails_alone() -> None:
    async def main() -> None:
        b = RollingBatcher("m", 4, 10, 30)
        w = EncodingWorker()
        b.worker_ready(w)
        bad, good = b.submit(huge("bad")), b.submit(req("good"))
        with pytest.raises(InvalidRequest, match="64 bits"):
            await bad.collect()
        b.submit(req("next"))
        assert added(w) == ["good", "next"] and b.describe()["running"] == 2
        b.on_message(w, Deltas(step=1, deltas=[delta("good", 1, FinishReason.EOS)]))
        assert (await good.collect()).text == "t1"
    run(main())


def test_rolling_malformed_delta_fails_its_request_only() -> None:
    async def main() -> None:
        b = RollingBatcher("m", 4, 10, 30)
        w = FakeWorker()
        b.worker_ready(w)
        bad, good = b.submit(req("bad")), b.submit(req("good"))
        frame = message_to_dict(Deltas(step=1, deltas=[delta("bad", 1), delta("good", 2, FinishReason.EOS)]))
        frame["deltas"][0][1] = "garbage"  # bad's tokens
        b.on_message(w, message_from_dict(frame))  # as the worker's frame is decoded
        with pytest.raises(HandlerError, match="malformed"):
            await bad.collect()
        assert (await good.collect()).text == "t2"
        assert w.of(Abort) == [Abort(request_ids=["bad"])] and b.num_pending() == 0
    run(main())


def test_rolling_watchdog_kills_a_worker_without_progress_and_reruns_or_fails_its_requests() -> None:
    async def main() -> None:
        clock = FakeClock()
        b = RollingBatcher("m", 4, 10, 300, clock=clock, liveness_timeout_s=10)
        stuck, healthy = FakeWorker(1), FakeWorker(2)
        b.worker_ready(stuck)
        b.worker_ready(healthy)
        a, c, s = b.submit(req("a")), b.submit(req("c")), b.submit(req("s"))  # a and s on the stuck worker
        assert added(stuck) == ["a", "s"] and added(healthy) == ["c"]
        b.on_message(stuck, Deltas(step=1, deltas=[delta("a", 1), delta("s", 1)]))
        reader = s.__aiter__()
        await reader.__anext__()  # s is a stream its client has seen a token of
        clock.now += 6
        b.on_message(healthy, Deltas(step=1, deltas=[delta("c", 1)]))
        clock.now += 6  # stuck: 12 s without a step; healthy: 6 s
        b.check_liveness()
        assert stuck.killed and stuck.kill_cause == "watchdog" and not healthy.killed
        assert b.describe()["last_watchdog"] == {"worker": 1, "silent_s": 12.0, "requests": 2}
        with pytest.raises(WorkerFailed, match="liveness_timeout"):
            await reader.__anext__()
        assert added(healthy) == ["c", "a"] and not a.done and not c.done  # a's client saw nothing: run again
        b.on_message(stuck, Deltas(step=2, deltas=[delta("a", 5, FinishReason.EOS)]))  # buffered before the kill
        assert not a.done
        b.on_message(healthy, Deltas(step=2, deltas=[delta("a", 2, FinishReason.EOS)]))
        assert (await a.collect()).text == "t2"
        after = b.submit(req("after"))  # new work goes to the live worker only
        assert added(healthy) == ["c", "a", "after"] and not after.done
        idle = FakeWorker(3)
        b.worker_ready(idle)
        clock.now += 100
        b.on_message(healthy, Deltas(step=2, deltas=[]))
        b.check_liveness()
        assert not idle.killed  # no work, no watchdog
    run(main())


def test_rolling_queue_wait_limit_and_close() -> None:
    async def main() -> None:
        clock = FakeClock()
        b = RollingBatcher("m", 1, 10, 300, clock=clock, max_queue_time_s=3)
        w = FakeWorker()
        b.worker_ready(w)
        running, queued = b.submit(req("run")), b.submit(req("wait"))
        clock.now += 3
        b.check_queue_time()
        with pytest.raises(Overloaded, match="max_queue_time"):
            await queued.collect()
        assert not running.done
        await b.close()
        with pytest.raises(Unavailable):
            await running.collect()
        assert w.of(Abort) == [Abort(request_ids=["run"])]
        assert [r.request_id for m in w.of(Add) for r in m.requests] == ["run"]
    run(main())


def test_sampling_params_round_trip_is_unchanged() -> None:
    p = SamplingParams(top_k=5, stop_token_ids=(1, 2))
    assert decoder(SamplingParams)(encoder(SamplingParams)(p)) == p
    asyncio.run(asyncio.sleep(0))
