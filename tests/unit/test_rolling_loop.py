"""The rolling worker loop against a fake handler and a fake channel (no processes): an engine step that
raises fails only the request it can blame; a step that keeps failing, or a dead rank, restarts the worker."""

from __future__ import annotations

import queue
from typing import Any

import pytest

from rollcore.errors import InvalidRequest
from rollcore.types import FinishReason, GenerationRequest, TokenDelta, TokenInfo
from serving.ipc.messages import Abort, Add, Configure, Configured, Deltas, Message, Reject, Shutdown
from serving.worker.rolling_loop import RollingLoop, WorkerUnhealthy


class Channel:
    def __init__(self) -> None:
        self.inbox: queue.Queue[Message | None] = queue.Queue()
        self.sent: list[Message] = []

    def send(self, msg: Message) -> None:
        self.sent.append(msg)

    def rejects(self) -> dict[str, str]:
        return {m.request_id: m.message for m in self.sent if isinstance(m, Reject)}

    def finished(self) -> list[str]:
        return [d.request_id for m in self.sent if isinstance(m, Deltas) for d in m.deltas if d.finish_reason]


class FakeEngine:
    """Two tokens per request; a step raises while a 'boom' request is in it, forever once 'wedge' ran."""

    def __init__(self) -> None:
        self.requests: dict[str, list[Any]] = {}
        self.wedged = False
        self.alive = True
        self.steps = 0

    def add(self, inp: Any) -> None:
        if inp.prompt == "invalid":
            raise InvalidRequest("bad prompt")
        self.requests[inp.request_id] = [inp, 0]

    def abort(self, rid: str) -> None:
        self.requests.pop(rid, None)

    def has_work(self) -> bool:
        return bool(self.requests)

    def healthy(self) -> bool:
        return self.alive

    def stats(self) -> dict[str, Any]:
        return {"num_running": len(self.requests)}

    def prefix_events(self) -> dict[str, Any] | None:
        return None  # no prefix cache

    def step(self) -> list[TokenDelta]:
        self.steps += 1
        if self.wedged or any(r[0].prompt == "wedge" for r in self.requests.values()):
            self.wedged = True
            raise RuntimeError("wedged at /opt/engine/secret.py")
        if any(r[0].prompt == "boom" for r in self.requests.values()):
            raise ValueError("boom in /opt/engine/kernels.py")
        out = []
        for rid, entry in list(self.requests.items()):
            entry[1] += 1
            done = entry[1] >= 2
            out.append(TokenDelta(rid, (TokenInfo(entry[1], "x"),), "x", FinishReason.LENGTH if done else None))
            if done:
                del self.requests[rid]
        return out


class Inp:
    def __init__(self, d: GenerationRequest) -> None:
        self.request_id = d.request_id
        self.prompt = d.prompt


def wire(rid: str, prompt: str = "ok") -> GenerationRequest:
    return GenerationRequest(request_id=rid, model="m", prompt=prompt)


def run_loop(frames: list[Message], engine: FakeEngine | None = None) -> tuple[Channel, FakeEngine]:
    """Feed ``frames``, then step until the engine and probation are empty."""
    ch, engine = Channel(), engine or FakeEngine()
    for f in frames:
        ch.inbox.put(f)
    loop = RollingLoop(ch, engine, Inp, redact=lambda t: t.replace("/opt/engine/", "<path>/"))
    assert loop._drain_inbox() is not None
    for _ in range(50):
        loop._admit_probation()
        if not engine.has_work():
            break
        loop._step()
        if not ch.inbox.empty():
            assert loop._drain_inbox() is not None
    return ch, engine


def test_a_poison_request_is_blamed_alone_and_its_batch_mates_finish() -> None:
    ch, engine = run_loop([Add(requests=[wire("a"), wire("p", "boom"), wire("b")])])
    assert set(ch.rejects()) == {"p"}
    assert "engine step failed on this request: ValueError: boom in <path>/kernels.py" in ch.rejects()["p"]
    assert sorted(ch.finished()) == ["a", "b"] and not engine.requests


def test_old_requests_survive_a_poison_added_later() -> None:
    ch, engine = Channel(), FakeEngine()
    loop = RollingLoop(ch, engine, Inp)
    ch.inbox.put(Add(requests=[wire("old")]))
    loop._drain_inbox()
    loop._step()  # old produced its first token: no longer a suspect
    ch.inbox.put(Add(requests=[wire("p", "boom"), wire("new")]))
    loop._drain_inbox()
    for _ in range(8):
        loop._admit_probation()
        if engine.has_work():
            loop._step()
    assert set(ch.rejects()) == {"p"} and sorted(ch.finished()) == ["new", "old"]
    assert loop.num_unexplained_failures == 0


def test_add_refusal_and_abort_of_a_request_on_probation() -> None:
    ch, engine = run_loop([Add(requests=[wire("i", "invalid"), wire("a")]), Abort(request_ids=["zzz"])])
    assert ch.rejects() == {"i": "bad prompt"} and ch.finished() == ["a"]


def test_a_step_that_keeps_failing_restarts_the_worker() -> None:
    ch, engine = Channel(), FakeEngine()
    loop = RollingLoop(ch, engine, Inp, max_step_failures=3)
    ch.inbox.put(Add(requests=[wire("a"), wire("w", "wedge")]))
    with pytest.raises(WorkerUnhealthy, match="3 engine steps in a row failed"):
        for i in range(20):
            loop._drain_inbox()
            loop._admit_probation()
            if engine.has_work():
                loop._step()
            ch.inbox.put(Add(requests=[wire(f"n{i}")]))
    assert "w" in ch.rejects()  # the request that wedged the engine was blamed before the restart


def test_a_dead_rank_restarts_the_worker_before_blaming_anyone() -> None:
    ch, engine = Channel(), FakeEngine()
    loop = RollingLoop(ch, engine, Inp)
    ch.inbox.put(Add(requests=[wire("a")]))
    loop._drain_inbox()
    engine.alive = False
    engine.wedged = True
    with pytest.raises(WorkerUnhealthy, match="unhealthy"):
        loop._step()
    assert ch.rejects() == {}


def test_run_returns_on_shutdown() -> None:
    ch, engine = Channel(), FakeEngine()
    ch.inbox.put(Add(requests=[wire("a")]))
    ch.inbox.put(Shutdown())
    RollingLoop(ch, engine, Inp).run()
    assert ch.inbox.empty()


def test_two_poisons_among_running_requests_are_both_blamed_without_a_restart() -> None:
    ch, engine = Channel(), FakeEngine()
    loop = RollingLoop(ch, engine, Inp, max_step_failures=2)
    ch.inbox.put(Add(requests=[wire("old1"), wire("old2")]))
    loop._drain_inbox()
    loop._step()
    ch.inbox.put(Add(requests=[wire("p1", "boom"), wire("p2", "boom"), wire("fine")]))
    loop._drain_inbox()
    for _ in range(12):
        loop._admit_probation()
        if not engine.has_work() and not loop.probation:
            break
        if engine.has_work():
            loop._step()
    assert set(ch.rejects()) == {"p1", "p2"} and sorted(ch.finished()) == ["fine", "old1", "old2"]


class ConfigurableEngine(FakeEngine):
    """A FakeEngine whose batch limit changes live; it records what was in it when each change came."""

    live_options = frozenset({"max_rolling_batch_size"})

    def __init__(self) -> None:
        super().__init__()
        self.changes: list[tuple[dict[str, int], list[str]]] = []

    def configure(self, options: dict[str, int]) -> None:
        if options.get("max_rolling_batch_size") == 13:
            raise ValueError("13 refused in /opt/engine/limits.py")
        self.changes.append((dict(options), sorted(self.requests)))

    def stats(self) -> dict[str, Any]:
        return {"num_running": len(self.requests), "changes": len(self.changes)}


def test_configure_applies_between_steps_after_the_requests_sent_before_it() -> None:
    engine = ConfigurableEngine()
    ch, _ = run_loop([Add(requests=[wire("a")]), Add(requests=[wire("b")]),
                      Configure(seq=1, options={"max_rolling_batch_size": 4, "max_rolling_batch_prefill_tokens": 99}),
                      Add(requests=[wire("c")])], engine)
    # only the options the handler changes live reach it; a and b were in the engine, c not yet
    assert engine.changes == [({"max_rolling_batch_size": 4}, ["a", "b"])]
    answers = [m for m in ch.sent if isinstance(m, Configured)]
    assert answers == [Configured(seq=1, stats={"num_running": 2, "changes": 1})]
    assert ch.sent.index(answers[0]) == 0  # before the first step's Deltas
    assert sorted(ch.finished()) == ["a", "b", "c"]


def test_a_refused_configure_is_answered_with_the_reason_and_the_loop_goes_on() -> None:
    engine = ConfigurableEngine()
    ch, _ = run_loop([Add(requests=[wire("a")]), Configure(seq=7, options={"max_rolling_batch_size": 13})], engine)
    (answer,) = [m for m in ch.sent if isinstance(m, Configured)]
    assert answer == Configured(seq=7, error="ValueError: 13 refused in <path>/limits.py")
    assert engine.changes == [] and ch.finished() == ["a"]


def test_a_handler_without_live_options_is_answered_without_being_called() -> None:
    ch, engine = run_loop([Configure(seq=2, options={"max_rolling_batch_size": 4}), Add(requests=[wire("a")])])
    assert [m for m in ch.sent if isinstance(m, Configured)] == [Configured(seq=2, stats={"num_running": 0})]
    assert ch.finished() == ["a"]
