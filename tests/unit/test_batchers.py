"""DynamicBatcher and RollingBatcher against a fake Worker (no processes, no sockets): each test runs its
own event loop with ``asyncio.run``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import Any

import pytest

from rollcore.errors import Cancelled, HandlerError, Overloaded, RequestTimeout, ServingError, WorkerFailed
from rollcore.types import FinishReason, GenerationRequest, TokenDelta, TokenInfo
from serving.batching.dynamic import DynamicBatcher
from serving.batching.rolling import RollingBatcher
from serving.ipc.messages import Abort, Add, Batch, BatchResult, Configure, Configured, Deltas, Reject


class FakeWorker:
    """What a batcher sees of a worker: records every message it is sent."""

    def __init__(self, worker_id: int = 1) -> None:
        self.worker_id = worker_id
        self.alive = True
        self.info: dict[str, Any] = {}
        self.sent: list[Any] = []
        self.killed = False

    def send(self, msg: Any) -> None:
        if not self.alive:
            raise ConnectionError("worker is not running")
        self.sent.append(msg)

    def kill_soon(self) -> None:
        self.killed = True

    def of(self, kind: type) -> list[Any]:
        return [m for m in self.sent if isinstance(m, kind)]


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 10))


def req(rid: str, prompt: str = "p") -> GenerationRequest:
    return GenerationRequest(request_id=rid, model="m", prompt=prompt)


def ok_output(rid: str, text: str = "out") -> dict[str, Any]:
    return {"request_id": rid, "text": text, "finish_reason": "length", "tokens": [[1, text, None]],
            "prompt_tokens": 1, "payload": None, "error": None, "error_kind": None}


async def until(cond: Any, timeout_s: float = 2.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)


def dynamic(**kw: Any) -> DynamicBatcher:
    args: dict[str, Any] = {"batch_size": 4, "max_batch_delay_ms": 50, "job_queue_size": 100, "predict_timeout_s": 30}
    args.update(kw)
    b = DynamicBatcher("m", **args)
    b.start()
    return b


# --- DynamicBatcher ---------------------------------------------------------------------------------

def test_dynamic_full_batch_goes_out_without_waiting_for_the_delay() -> None:
    # The delay is an hour and the whole test has 10 s (run()): a batch that goes out went because it was full.
    async def main() -> None:
        b = dynamic(batch_size=3, max_batch_delay_ms=3_600_000)
        w = FakeWorker()
        b.worker_ready(w)
        streams = [b.submit(req(f"r{i}")) for i in range(4)]
        await until(lambda: w.of(Batch))
        (batch,) = w.of(Batch)
        assert [r["request_id"] for r in batch.requests] == ["r0", "r1", "r2"]
        b.on_message(w, BatchResult(batch_id=batch.batch_id, outputs=[ok_output(f"r{i}", f"t{i}") for i in range(3)]))
        results = [await s.collect() for s in streams[:3]]
        assert [r.text for r in results] == ["t0", "t1", "t2"]
        assert results[0].tokens == (TokenInfo(1, "t0", None),)
        await asyncio.sleep(0.05)
        assert len(w.of(Batch)) == 1 and b.num_pending() == 1  # the 4th waits for batch-mates or the delay
        assert b.describe()["batches_total"] == 1
        await b.close()
    run(main())


def test_dynamic_partial_batch_waits_for_the_delay() -> None:
    async def main() -> None:
        b = dynamic(batch_size=8, max_batch_delay_ms=200)
        w = FakeWorker()
        b.worker_ready(w)
        t0 = time.monotonic()
        b.submit(req("a"))
        await asyncio.sleep(0.05)
        b.submit(req("b"))
        await until(lambda: w.of(Batch))
        assert time.monotonic() - t0 >= 0.2  # not before the delay (a lower bound: no machine is too slow)
        assert [r["request_id"] for r in w.of(Batch)[0].requests] == ["a", "b"]
        await b.close()
    run(main())


def test_dynamic_request_being_gathered_still_counts_as_pending() -> None:
    # Regression: a request taken off the queue while the batcher waits out max_batch_delay was in no
    # count, so a graceful drain (which waits for num_pending() == 0) stopped the server under it.
    async def main() -> None:
        b = dynamic(batch_size=4, max_batch_delay_ms=300)
        w = FakeWorker()
        b.worker_ready(w)
        b.submit(req("a"))
        await asyncio.sleep(0.05)  # the loop has taken "a" and is waiting for batch-mates
        assert not w.of(Batch)
        assert b.num_pending() == 1
        await until(lambda: w.of(Batch))
        assert b.num_pending() == 1  # now in flight
        await b.close()
    run(main())


def test_dynamic_one_items_error_does_not_fail_its_batch_mates() -> None:
    async def main() -> None:
        b = dynamic(batch_size=3, max_batch_delay_ms=1)
        w = FakeWorker()
        b.worker_ready(w)
        streams = [b.submit(req(r)) for r in ("a", "b", "c")]
        await until(lambda: w.of(Batch))
        bad = {**ok_output("b"), "error": "boom", "error_kind": "handler_error"}
        # outputs matched by request id (order-independent); "c" gets none at all
        b.on_message(w, BatchResult(batch_id=w.of(Batch)[0].batch_id, outputs=[bad, ok_output("a")]))
        assert (await streams[0].collect()).text == "out"
        with pytest.raises(HandlerError, match="boom"):
            await streams[1].collect()
        with pytest.raises(ServingError, match="no output"):
            await streams[2].collect()
        assert b.describe()["idle_workers"] == 1  # the worker is reusable
        await b.close()
    run(main())


def test_dynamic_worker_lost_retries_once_then_fails() -> None:
    async def main() -> None:
        b = dynamic(batch_size=2, max_batch_delay_ms=1)
        w1 = FakeWorker(1)
        b.worker_ready(w1)
        streams = [b.submit(req("a")), b.submit(req("b"))]
        await until(lambda: w1.of(Batch))
        w1.alive = False
        b.worker_lost(w1)
        assert b.describe()["queued"] == 2 and not any(s.done for s in streams)
        w2 = FakeWorker(2)
        b.worker_ready(w2)
        await until(lambda: w2.of(Batch))
        assert [r["request_id"] for r in w2.of(Batch)[0].requests] == ["a", "b"]  # order kept
        w2.alive = False
        b.worker_lost(w2)
        for s in streams:
            with pytest.raises(WorkerFailed, match="retried once"):
                await s.collect()
        assert b.num_pending() == 0
        await b.close()
    run(main())


def test_dynamic_queue_full_is_overloaded_with_retry_after() -> None:
    async def main() -> None:
        b = dynamic(job_queue_size=2)  # no worker: everything stays queued
        b.submit(req("a"))
        b.submit(req("b"))
        with pytest.raises(Overloaded) as info:
            b.submit(req("c"))
        assert info.value.retry_after_s is not None and info.value.retry_after_s >= 1
        await b.close()
    run(main())


def test_dynamic_cancelled_request_is_dropped_before_dispatch() -> None:
    async def main() -> None:
        b = dynamic(batch_size=2, max_batch_delay_ms=1)
        s = b.submit(req("a"))
        b.submit(req("b"))
        assert b.cancel("a")
        with pytest.raises(Cancelled):
            await s.collect()
        w = FakeWorker()
        b.worker_ready(w)
        await until(lambda: w.of(Batch))
        assert [r["request_id"] for r in w.of(Batch)[0].requests] == ["b"]
        await b.close()
    run(main())


def test_dynamic_timeout_fails_batch_and_kills_stuck_worker() -> None:
    async def main() -> None:
        b = dynamic(batch_size=1, max_batch_delay_ms=1, predict_timeout_s=0.05)
        w = FakeWorker()
        b.worker_ready(w)
        s = b.submit(req("a"))
        with pytest.raises(RequestTimeout):
            await s.collect()
        assert w.killed
        await b.close()
    run(main())


# --- RollingBatcher ---------------------------------------------------------------------------------

def delta(rid: str, tok: int, finish: FinishReason | None = None) -> dict[str, Any]:
    return TokenDelta(request_id=rid, tokens=(TokenInfo(tok, f"t{tok}"),), text=f"t{tok}",
                      finish_reason=finish, prompt_tokens=1).to_wire()


def added(w: FakeWorker) -> list[str]:
    return [r["request_id"] for m in w.of(Add) for r in m.requests]


def test_rolling_admission_is_bounded_and_slots_are_refilled() -> None:
    async def main() -> None:
        b = RollingBatcher("m", max_rolling_batch_size=2, job_queue_size=10, predict_timeout_s=30)
        w = FakeWorker()
        b.worker_ready(w)
        streams = {r: b.submit(req(r)) for r in ("a", "b", "c", "d")}
        assert added(w) == ["a", "b"]
        assert b.describe()["running"] == 2 and b.describe()["waiting"] == 2
        b.on_message(w, Deltas(step=1, deltas=[delta("a", 1), delta("b", 1, FinishReason.EOS)]))
        assert added(w) == ["a", "b", "c"]  # b's slot went to c at once
        b.on_message(w, Deltas(step=2, deltas=[delta("a", 2, FinishReason.LENGTH), delta("c", 5)]))
        assert added(w) == ["a", "b", "c", "d"]
        a = await streams["a"].collect()
        assert a.text == "t1t2" and [t.id for t in a.tokens] == [1, 2] and a.finish_reason is FinishReason.LENGTH
        assert (await streams["b"].collect()).finish_reason is FinishReason.EOS
        assert b.describe()["running"] == 2 and b.num_steps == 2
    run(main())


def test_rolling_cancel_running_sends_abort_and_frees_slot() -> None:
    async def main() -> None:
        b = RollingBatcher("m", max_rolling_batch_size=1, job_queue_size=10, predict_timeout_s=30)
        w = FakeWorker()
        b.worker_ready(w)
        s = b.submit(req("a"))
        b.submit(req("b"))
        assert b.cancel("a")
        assert w.of(Abort) == [Abort(request_ids=["a"])]
        assert added(w) == ["a", "b"]
        with pytest.raises(Cancelled):
            await s.collect()
        # a late delta for the aborted request is ignored
        b.on_message(w, Deltas(step=1, deltas=[delta("a", 1, FinishReason.EOS)]))
        assert not b.cancel("zzz")
    run(main())


def test_rolling_stream_cancel_from_client_side_aborts() -> None:
    async def main() -> None:
        b = RollingBatcher("m", max_rolling_batch_size=4, job_queue_size=10, predict_timeout_s=30)
        w = FakeWorker()
        b.worker_ready(w)
        s = b.submit(req("a"))
        s.cancel()  # what the HTTP layer does on disconnect
        assert w.of(Abort) == [Abort(request_ids=["a"])]
        assert b.num_pending() == 0
    run(main())


def test_rolling_queue_full_is_overloaded() -> None:
    async def main() -> None:
        b = RollingBatcher("m", max_rolling_batch_size=1, job_queue_size=1, predict_timeout_s=30)
        w = FakeWorker()
        b.worker_ready(w)
        b.submit(req("a"))  # running
        b.submit(req("b"))  # waiting
        with pytest.raises(Overloaded):
            b.submit(req("c"))
    run(main())


def test_rolling_worker_lost_requeues_unstarted_and_fails_started() -> None:
    async def main() -> None:
        b = RollingBatcher("m", max_rolling_batch_size=4, job_queue_size=10, predict_timeout_s=30)
        w1 = FakeWorker(1)
        b.worker_ready(w1)
        started, fresh = b.submit(req("a")), b.submit(req("b"))
        b.on_message(w1, Deltas(step=1, deltas=[delta("a", 1)]))
        w1.alive = False
        b.worker_lost(w1)
        with pytest.raises(WorkerFailed):
            await started.collect()
        assert not fresh.done and b.describe()["waiting"] == 1
        w2 = FakeWorker(2)
        b.worker_ready(w2)
        assert added(w2) == ["b"]
        w2.alive = False
        b.worker_lost(w2)  # second loss: no more retries
        with pytest.raises(WorkerFailed):
            await fresh.collect()
        assert b.num_pending() == 0
    run(main())


def test_rolling_reject_fails_only_that_request() -> None:
    async def main() -> None:
        b = RollingBatcher("m", max_rolling_batch_size=4, job_queue_size=10, predict_timeout_s=30)
        w = FakeWorker()
        b.worker_ready(w)
        bad, good = b.submit(req("a")), b.submit(req("b"))
        b.on_message(w, Reject(request_id="a", kind="invalid_request", message="prompt too long"))
        b.on_message(w, Deltas(step=1, deltas=[delta("b", 3, FinishReason.EOS)]))
        with pytest.raises(ServingError, match="prompt too long") as info:
            await bad.collect()
        assert info.value.kind.value == "invalid_request"
        assert (await good.collect()).text == "t3"
    run(main())


def test_rolling_timeout_aborts_the_running_request() -> None:
    async def main() -> None:
        b = RollingBatcher("m", max_rolling_batch_size=4, job_queue_size=10, predict_timeout_s=0.05)
        w = FakeWorker()
        b.worker_ready(w)
        s = b.submit(req("a"))
        with pytest.raises(RequestTimeout):
            await s.collect()
        assert w.of(Abort) == [Abort(request_ids=["a"])]
        assert b.num_pending() == 0
    run(main())


def test_dynamic_client_deadline_fails_a_queued_request_and_it_never_reaches_a_worker() -> None:
    async def main() -> None:
        b = dynamic(batch_size=1)
        w = FakeWorker()
        s = b.submit(GenerationRequest(request_id="late", model="m", prompt="p", deadline=time.monotonic() + 0.05))
        with pytest.raises(RequestTimeout):
            await s.collect()
        b.worker_ready(w)
        other = b.submit(req("next"))
        await until(lambda: w.of(Batch))
        assert [r["request_id"] for r in w.of(Batch)[0].requests] == ["next"]
        b.on_message(w, BatchResult(batch_id=w.of(Batch)[0].batch_id, outputs=[ok_output("next")]))
        assert (await other.collect()).text == "out"
        await b.close()

    run(main())


# --- live knobs (PUT /models/{name}) and retiring workers --------------------------------------------

def batch_ids(w: FakeWorker) -> list[list[str]]:
    return [[r["request_id"] for r in m.requests] for m in w.of(Batch)]


def answer(b: DynamicBatcher, w: FakeWorker, batch: Batch) -> None:
    b.on_message(w, BatchResult(batch_id=batch.batch_id, outputs=[ok_output(r["request_id"]) for r in batch.requests]))


def test_dynamic_new_batch_size_applies_from_the_next_batch_on() -> None:
    async def main() -> None:
        b = dynamic(batch_size=4, max_batch_delay_ms=3_600_000)  # a batch goes out only when full
        w = FakeWorker()
        b.worker_ready(w)
        for i in range(11):
            b.submit(req(f"r{i}"))
        await until(lambda: len(w.of(Batch)) == 1)
        b.configure(batch_size=2)
        assert b.describe()["batch_size"] == 2
        for n in (2, 3):
            answer(b, w, w.of(Batch)[-1])
            await until(lambda n=n: len(w.of(Batch)) == n)  # type: ignore[misc]
        b.configure(batch_size=5)
        answer(b, w, w.of(Batch)[-1])
        await asyncio.sleep(0.05)
        assert len(w.of(Batch)) == 3  # r8..r10 wait for two batch-mates
        b.submit(req("r11"))
        b.submit(req("r12"))
        await until(lambda: len(w.of(Batch)) == 4)
        assert batch_ids(w) == [["r0", "r1", "r2", "r3"], ["r4", "r5"], ["r6", "r7"], ["r8", "r9", "r10", "r11", "r12"]]
        await b.close()
    run(main())


def test_dynamic_lowered_batch_size_cuts_the_batch_being_gathered_and_keeps_the_order() -> None:
    async def main() -> None:
        b = dynamic(batch_size=8, max_batch_delay_ms=3_600_000)
        w = FakeWorker()
        b.worker_ready(w)
        for i in range(5):
            b.submit(req(f"r{i}"))
        await asyncio.sleep(0.05)
        assert not w.of(Batch) and b.num_pending() == 5  # gathering: 5 of 8, for an hour
        b.configure(batch_size=3)
        await until(lambda: w.of(Batch))
        assert batch_ids(w) == [["r0", "r1", "r2"]]
        assert b.num_queued() == 2  # r3 and r4 went back to the queue's front
        answer(b, w, w.of(Batch)[0])
        b.submit(req("r5"))
        await until(lambda: len(w.of(Batch)) == 2)
        assert batch_ids(w)[1] == ["r3", "r4", "r5"]
        await b.close()
    run(main())


def test_dynamic_new_delay_applies_to_the_batch_being_gathered() -> None:
    async def main() -> None:
        b = dynamic(batch_size=8, max_batch_delay_ms=3_600_000)
        w = FakeWorker()
        b.worker_ready(w)
        b.submit(req("lonely"))
        await asyncio.sleep(0.05)
        assert not w.of(Batch)  # an hour of delay: nothing but the change can send it within the test
        b.configure(max_batch_delay_ms=10)
        await until(lambda: w.of(Batch))
        assert batch_ids(w) == [["lonely"]] and b.describe()["max_batch_delay"] == 10
        await b.close()
    run(main())


def test_dynamic_smaller_job_queue_refuses_new_requests_and_keeps_the_queued() -> None:
    async def main() -> None:
        b = dynamic(batch_size=1, max_batch_delay_ms=1, job_queue_size=10)
        streams = [b.submit(req(f"r{i}")) for i in range(4)]  # no worker: all wait
        b.configure(job_queue_size=2)
        with pytest.raises(Overloaded, match="queue is full \\(2 requests waiting\\)"):
            b.submit(req("late"))
        assert b.num_queued() == 4 and not any(s.done for s in streams)
        w = FakeWorker()
        b.worker_ready(w)
        for i in range(4):
            await until(lambda i=i: len(w.of(Batch)) == i + 1)  # type: ignore[misc]
            answer(b, w, w.of(Batch)[i])
        assert [(await s.collect()).text for s in streams] == ["out"] * 4
        await b.close()
    run(main())


def test_dynamic_retired_worker_gets_no_new_batch_and_its_load_drains() -> None:
    async def main() -> None:
        b = dynamic(batch_size=2, max_batch_delay_ms=3_600_000)
        old, new = FakeWorker(1), FakeWorker(2)
        b.worker_ready(old)
        b.submit(req("a"))
        b.submit(req("b"))
        await until(lambda: old.of(Batch))
        b.submit(req("c"))
        assert b.worker_load(old) == 2
        b.retire(old)
        b.worker_ready(new)
        b.submit(req("d"))
        await until(lambda: new.of(Batch))
        answer(b, old, old.of(Batch)[0])
        assert b.worker_load(old) == 0
        await asyncio.sleep(0.05)
        assert len(old.of(Batch)) == 1 and batch_ids(new) == [["c", "d"]]
        await b.close()
    run(main())


def configures(w: FakeWorker) -> list[dict[str, int]]:
    return [m.options for m in w.of(Configure)]


def test_rolling_lowered_size_admits_nothing_until_fewer_run_and_aborts_none() -> None:
    async def main() -> None:
        b = RollingBatcher("m", max_rolling_batch_size=4, job_queue_size=100, predict_timeout_s=30)
        w = FakeWorker()
        b.worker_ready(w)
        streams = {f"r{i}": b.submit(req(f"r{i}")) for i in range(8)}
        assert added(w) == ["r0", "r1", "r2", "r3"]
        acks = b.configure(max_rolling_batch_size=2, engine_options={"max_rolling_batch_size": 2})
        assert configures(w) == [{"max_rolling_batch_size": 2}] and set(acks) == {w.worker_id}
        b.on_message(w, Configured(seq=w.of(Configure)[0].seq, stats={"max_num_seqs": 2}))
        assert (await acks[w.worker_id]) == Configured(seq=1, stats={"max_num_seqs": 2})
        assert b.engine_stats[w.worker_id] == {"max_num_seqs": 2}
        b.on_message(w, Deltas(step=1, deltas=[delta("r0", 1, FinishReason.EOS)]))  # 3 run: > 2
        b.on_message(w, Deltas(step=2, deltas=[delta("r1", 1, FinishReason.EOS)]))  # 2 run: = 2
        assert added(w) == ["r0", "r1", "r2", "r3"] and not w.of(Abort)
        b.on_message(w, Deltas(step=3, deltas=[delta("r2", 1, FinishReason.EOS)]))  # 1 runs: one more
        assert added(w) == ["r0", "r1", "r2", "r3", "r4"]
        assert b.describe()["running"] == 2 and b.describe()["max_rolling_batch_size"] == 2
        for rid in ("r0", "r1", "r2"):
            assert (await streams[rid].collect()).finish_reason is FinishReason.EOS
    run(main())


def test_rolling_raised_size_sends_the_admitted_before_the_new_limits() -> None:
    async def main() -> None:
        b = RollingBatcher("m", max_rolling_batch_size=2, job_queue_size=100, predict_timeout_s=30)
        w = FakeWorker()
        b.worker_ready(w)
        for i in range(6):
            b.submit(req(f"r{i}"))
        acks = b.configure(max_rolling_batch_size=5, engine_options={"max_rolling_batch_size": 5,
                                                                     "max_rolling_batch_prefill_tokens": 64})
        # r0 and r1 went at submit; r2..r4 go before the new limits, so the engine's next step sees them
        assert [type(m).__name__ for m in w.sent] == ["Add", "Add", "Add", "Configure"]
        assert [r["request_id"] for r in w.sent[2].requests] == ["r2", "r3", "r4"]
        assert added(w) == ["r0", "r1", "r2", "r3", "r4"] and b.num_queued() == 1
        assert configures(w) == [{"max_rolling_batch_size": 5, "max_rolling_batch_prefill_tokens": 64}]
        b.worker_lost(w)  # no answer: the future resolves with None, never hangs
        assert (await acks[w.worker_id]) is None
    run(main())


def test_rolling_worker_started_later_gets_the_changed_options_before_any_request() -> None:
    async def main() -> None:
        b = RollingBatcher("m", max_rolling_batch_size=2, job_queue_size=100, predict_timeout_s=30)
        first = FakeWorker(1)
        b.worker_ready(first)
        assert b.configure(job_queue_size=50) == {}  # no engine option: no frame
        assert not first.of(Configure) and b.describe()["job_queue_size"] == 50
        b.configure(max_rolling_batch_size=3, engine_options={"max_rolling_batch_size": 3})
        b.submit(req("a"))
        second = FakeWorker(2)
        b.worker_ready(second)
        b.submit(req("b"))
        assert [type(m).__name__ for m in second.sent][0] == "Configure"
        assert configures(second) == [{"max_rolling_batch_size": 3}]
    run(main())


def test_rolling_retired_worker_admits_nothing_new() -> None:
    async def main() -> None:
        b = RollingBatcher("m", max_rolling_batch_size=2, job_queue_size=100, predict_timeout_s=30)
        old, new = FakeWorker(1), FakeWorker(2)
        b.worker_ready(old)
        b.submit(req("a"))
        b.retire(old)
        b.submit(req("b"))
        assert added(old) == ["a"] and b.worker_load(old) == 1 and b.num_queued() == 1
        b.worker_ready(new)
        assert added(new) == ["b"]
        b.on_message(old, Deltas(step=1, deltas=[delta("a", 1, FinishReason.EOS)]))
        assert b.worker_load(old) == 0 and added(old) == ["a"]
    run(main())
