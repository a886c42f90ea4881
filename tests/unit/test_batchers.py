"""DynamicBatcher and RollingBatcher against a fake Worker (no processes, no sockets): each test runs its
own event loop with ``asyncio.run``."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import pytest

from rollcore.errors import Cancelled, HandlerError, Overloaded, RequestTimeout, ServingError, WorkerFailed
from rollcore.types import FinishReason, GenerationRequest, TokenInfo
from serving.batching.rolling import RollingBatcher
from serving.ipc.messages import Abort, Batch, BatchResult, Deltas, Reject

# test_batchers_robust.py imports the fakes from here
from tests.unit.batcher_fakes import FakeWorker, added, delta, dynamic, ok_output, req, run, until

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
        assert [r.request_id for r in batch.requests] == ["r0", "r1", "r2"]
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
        assert [r.request_id for r in w.of(Batch)[0].requests] == ["a", "b"]
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
        bad = replace(ok_output("b"), error="boom")
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
        assert [r.request_id for r in w2.of(Batch)[0].requests] == ["a", "b"]  # order kept
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
        assert [r.request_id for r in w.of(Batch)[0].requests] == ["b"]
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


def test_rolling_worker_lost_reruns_what_no_client_saw_and_fails_a_sent_stream() -> None:
    async def main() -> None:
        b = RollingBatcher("m", max_rolling_batch_size=4, job_queue_size=10, predict_timeout_s=30)
        w1 = FakeWorker(1)
        b.worker_ready(w1)
        whole, fresh, sent = b.submit(req("a")), b.submit(req("b")), b.submit(req("s"))
        collecting = asyncio.ensure_future(whole.collect())  # a whole answer: nothing reaches its client before the end
        reader = sent.__aiter__()
        b.on_message(w1, Deltas(step=1, deltas=[delta("a", 1), delta("a", 2), delta("s", 7)]))
        assert (await reader.__anext__()).text == "t7"  # this stream's first delta went to its client
        await asyncio.sleep(0)  # collect() takes the dead worker's deltas before the loss
        w1.alive = False
        b.worker_lost(w1)
        with pytest.raises(WorkerFailed, match="already been sent"):
            await reader.__anext__()
        assert not whole.done and not fresh.done and b.describe()["waiting"] == 2
        w2 = FakeWorker(2)
        b.worker_ready(w2)
        assert added(w2) == ["a", "b"]  # in their arrival order, ahead of anything that came later
        b.on_message(w1, Deltas(step=2, deltas=[delta("a", 9, FinishReason.EOS)]))  # a late frame of the dead one
        b.on_message(w2, Deltas(step=1, deltas=[delta("a", 3), delta("a", 4, FinishReason.EOS)]))
        result = await collecting
        assert result.text == "t3t4" and [t.id for t in result.tokens] == [3, 4]  # the rerun's tokens only
        assert whole.num_tokens == 2 and b.describe()["retries_total"] == 2
        w2.alive = False
        b.worker_lost(w2)  # second loss: no more retries
        with pytest.raises(WorkerFailed, match="retried once already"):
            await fresh.collect()
        assert b.num_pending() == 0 and b.describe()["retries_total"] == 2
    run(main())


def test_a_health_probe_is_not_moved_to_another_worker() -> None:
    async def main() -> None:
        b = RollingBatcher("m", max_rolling_batch_size=4, job_queue_size=10, predict_timeout_s=30)
        w1, w2 = FakeWorker(1), FakeWorker(2)
        b.worker_ready(w1)
        b.worker_ready(w2)
        b.pin("probe-key", 1)
        probe = b.submit(replace(req("x"), client_id="health-probe-1", affinity="probe-key"))
        assert added(w1) == ["x"] and added(w2) == []
        w1.alive = False
        b.worker_lost(w1)
        with pytest.raises(WorkerFailed, match="checks that one worker"):
            await probe.collect()
        assert added(w2) == [] and b.describe()["retries_total"] == 0
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
        assert [r.request_id for r in w.of(Batch)[0].requests] == ["next"]
        b.on_message(w, BatchResult(batch_id=w.of(Batch)[0].batch_id, outputs=[ok_output("next")]))
        assert (await other.collect()).text == "out"
        await b.close()

    run(main())
