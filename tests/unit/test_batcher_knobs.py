"""Live knobs of the batchers (``PUT /models/{name}`` reaches them as ``configure``) and retiring workers,
against a fake Worker: a new batch size, delay or queue size applies from the next batch on; a lowered rolling
size admits nothing until fewer run and aborts none; a retired worker gets no new work and drains."""

from __future__ import annotations

import asyncio

import pytest

from rollcore.errors import Overloaded
from rollcore.types import FinishReason
from serving.batching.dynamic import DynamicBatcher
from serving.batching.rolling import RollingBatcher
from serving.ipc.messages import Abort, Batch, BatchResult, Configure, Configured, Deltas
from tests.unit.batcher_fakes import FakeWorker, added, delta, dynamic, ok_output, req, run, until


def batch_ids(w: FakeWorker) -> list[list[str]]:
    return [[r.request_id for r in m.requests] for m in w.of(Batch)]


def answer(b: DynamicBatcher, w: FakeWorker, batch: Batch) -> None:
    b.on_message(w, BatchResult(batch_id=batch.batch_id, outputs=[ok_output(r.request_id) for r in batch.requests]))


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
        assert [r.request_id for r in w.sent[2].requests] == ["r2", "r3", "r4"]
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
