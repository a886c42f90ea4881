"""``serving tune``'s evaluator of real servers (``LiveEvaluator``) with its client calls replaced: a run cut
at the deadline, a start stopped at the deadline, the step cost read from every engine, the warm-up."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from serving.bench.run_metrics import Rec
from serving.tune import evaluator as live
from serving.tune.evaluator import LiveEvaluator
from serving.tune.racing import race
from tests.unit.test_tune_budget import LADDER, R1, R2, SLO, N, rolling, step_line


def test_evaluator_cuts_a_run_at_its_deadline_without_settling(tmp_path: Path, monkeypatch: Any) -> None:
    import time


    c = rolling(R1)
    w = SimpleNamespace(requests=[SimpleNamespace(max_new_tokens=3, index=i) for i in range(N)],
                        arrivals=lambda rate: [i / rate for i in range(N)])
    w.fresh = lambda variant: w
    ev = LiveEvaluator(tmp_path, tmp_path, w, LADDER, "lmi", [SLO])  # type: ignore[arg-type]
    ev.server = SimpleNamespace(url="http://x", name="m", grpc_target="x:1", tokens={})  # type: ignore[assignment]
    ev.current = c
    calls: list[int] = []

    def fake_run_requests(api: str, target: Any, requests: Any, arrivals: list[float], stream: bool,
                          timeout_s: float = 0.0, should_abort: Any = None) -> list[Rec]:
        calls.append(len(requests))
        recs = [Rec(0.0, [0.1])] + [Rec(0.0) for _ in range(N - 1)]  # nothing late: only the deadline stops it
        assert should_abort is not None and should_abort(recs, 0.2) is (ev.deadline is not None)
        return recs

    monkeypatch.setattr(live, "run_requests", fake_run_requests)
    ev.deadline = time.monotonic() - 1.0
    run = ev.measure(c, 1)
    assert (run.cut, run.aborted, calls) == (True, True, [N])  # no settle request after it
    assert ev.cut == [run] and ev.runs == {} and ev.order == []
    assert race(ev, c, SLO, 0).runs == []  # type: ignore[arg-type]


def test_a_server_start_still_loading_at_the_deadline_is_stopped(tmp_path: Path, monkeypatch: Any) -> None:
    """A start predicted to fit the budget but slower than predicted (measured: a 2-worker 110m server whose
    workers each wrote a 4.5 GiB KV cache, 178 s of a 174 s budget) is given only the time left; stopped at the
    deadline it yields a cut run (no measurement), not an error. Without a deadline a failed start still raises."""
    import time


    c = rolling(R2)
    w = SimpleNamespace(requests=[SimpleNamespace(max_new_tokens=3, index=i) for i in range(N)],
                        arrivals=lambda rate: [i / rate for i in range(N)])
    w.fresh = lambda variant: w
    ev = LiveEvaluator(tmp_path, tmp_path, w, LADDER, "lmi", [SLO])  # type: ignore[arg-type]
    timeouts: list[float] = []

    def slow_start(*args: Any, timeout_s: float, **kw: Any) -> Any:
        timeouts.append(timeout_s)
        time.sleep(min(timeout_s, 0.3))  # not ready within the time it was given (0.3 s stands for the full 600)
        raise RuntimeError("model m not ready in time")

    monkeypatch.setattr(live.LocalServer, "start", slow_start)
    ev.deadline = time.monotonic() + 0.2
    run = ev.measure(c, 1)
    assert timeouts[0] <= 0.2 and (run.cut, run.recs, ev.cut, ev.runs) == (True, [], [run], {})
    assert race(ev, c, SLO, 0).runs == []  # type: ignore[arg-type]
    ev.deadline = None
    with pytest.raises(RuntimeError, match="not ready in time"):
        ev.measure(c, 2)
    assert timeouts[-1] == ev.server_timeout_s


def test_evaluator_reads_the_step_cost_of_every_engine(tmp_path: Path) -> None:
    """``read_step_cost``: the engines' sums of ``GET /models/{name}`` added (two workers), kept for the
    running group; a dynamic model (no engines) or a failed request leaves what was known."""
    ev = LiveEvaluator(tmp_path, tmp_path, SimpleNamespace(requests=[]), LADDER, "lmi", [SLO])  # type: ignore[arg-type]
    one, two = step_line(0.01, 0.001), step_line(0.02, 0.001)
    answers: list[Any] = [{"batcher": {"engines": {"1": {"step_cost": one.as_dict()},
                                                   "2": {"step_cost": two.as_dict()}}}},
                          {"batcher": {"mode": "dynamic"}}, RuntimeError("connection refused")]

    def describe() -> dict[str, Any]:
        a = answers.pop(0)
        if isinstance(a, Exception):
            raise a
        return dict(a)

    ev.server = SimpleNamespace(describe=describe)  # type: ignore[assignment]
    ev.current = rolling(R2)
    ev.read_step_cost()
    assert ev.step_costs == {R2: one + two}
    ev.read_step_cost()
    ev.read_step_cost()
    assert ev.step_costs == {R2: one + two}


def test_warm_up_ends_with_a_burst_of_the_whole_workload(tmp_path: Path, monkeypatch: Any) -> None:
    """After a start the evaluator warms the server with every request of the workload at once, a few tokens
    each (a first run right after a start was measured far slower than the next ones), and only the short
    warm-up requests stand for the drain estimate."""
    from serving.bench.workload import BenchRequest, build_workload, load_tokenizer
    from tests.integration.harness import DEFAULT_MODEL

    w = build_workload(load_tokenizer(DEFAULT_MODEL), 5, 0, FixedLengths([10, 11, 12, 13, 14]),
                       FixedLengths([30, 31, 32, 33, 34]))
    calls: list[list[tuple[int, int]]] = []
    prompts: list[list[str]] = []

    def fake_run(api: str, target: Any, reqs: list[BenchRequest], arrivals: list[float], stream: bool,
                 **kw: Any) -> list[Rec]:
        assert arrivals == [0.0] * len(reqs)
        calls.append([(r.index, r.max_new_tokens) for r in reqs])
        prompts.append([r.prompt for r in reqs])
        return [Rec(0.0, [0.1, 0.2], end=0.25) for _ in reqs]

    monkeypatch.setattr(live, "run_requests", fake_run)
    ev = LiveEvaluator(tmp_path, tmp_path, w, LADDER, "lmi", [SLO])
    ev.server = SimpleNamespace(url="http://x", name="m", grpc_target="x", tokens={})  # type: ignore[assignment]
    ev._warm()
    assert calls == [[(0, 4)], [(0, 4), (1, 4)], [(i, live.WARM_BURST_TOKENS) for i in range(5)]]
    # the burst sends new prompts of the same lengths; the first timed run newer ones still
    assert prompts[2] == [r.prompt for r in w.fresh(1).requests]
    assert not set(prompts[2]) & {r.prompt for r in w.requests}
    assert ev.fresh().requests == w.fresh(2).requests
    assert ev.warm_e2e == [0.25, 0.25]  # the two short requests, not the burst


class FixedLengths:
    """A length distribution that returns its values in turn (one per request)."""

    def __init__(self, values: list[int]) -> None:
        self.values = list(values)

    def sample(self, rng: Any) -> int:
        return self.values.pop(0)

    def bounds(self) -> tuple[int, int]:
        return (1, 1000)


def test_evaluator_without_abort_slos_runs_to_the_end(tmp_path: Path, monkeypatch: Any) -> None:
    """tune_quality's confirmation measures full runs: an evaluator given no SLO to abort on never stops one
    early (it used to stop every run at once: no SLO left unviolated read as all of them violated)."""

    c = rolling(R1)
    w = SimpleNamespace(requests=[SimpleNamespace(max_new_tokens=3, index=i) for i in range(N)],
                        arrivals=lambda rate: [i / rate for i in range(N)])
    w.fresh = lambda variant: w
    ev = LiveEvaluator(tmp_path, tmp_path, w, LADDER, "lmi", [])  # type: ignore[arg-type]
    ev.server = SimpleNamespace(url="http://x", name="m", grpc_target="x:1", tokens={})  # type: ignore[assignment]
    ev.current = c
    answers: list[bool] = []

    def fake_run_requests(api: str, target: Any, requests: Any, arrivals: list[float], stream: bool,
                          timeout_s: float = 0.0, should_abort: Any = None) -> list[Rec]:
        recs = [Rec(0.0, [0.1], end=0.2) for _ in range(N)]
        answers.append(should_abort(recs, 0.1))
        return recs

    monkeypatch.setattr(live, "run_requests", fake_run_requests)
    run = ev.measure(c, 1)
    assert answers == [False] and not run.aborted


