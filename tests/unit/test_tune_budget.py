"""``serving tune``'s budget on a simulated server: server starts and runs predicted from what was measured,
skipped when they would end after it, a run cut at the deadline, the head-to-head's time kept within it."""

from __future__ import annotations

from dataclasses import asdict, replace

import pytest

from serving.bench.run_metrics import Rec
from serving.tune import verify
from serving.tune.costs import LOAD_CONTENTION, REPORT_S, STOP_S, load_rounds, run_estimate, start_estimate
from serving.tune.policy import Skip, Tuner
from serving.tune.racing import race
from serving.tune.report import improvement_text
from serving.tune.runs import Run
from serving.tune.verify import VERIFY_SHARE
from tests.unit.tune_sim import D1, D2, R1, R2, SLO, Clock, FakeEvaluator, N, rolling, space, tuner

# test_tune_evaluator.py imports the simulator's names through this module
from tests.unit.tune_sim import LADDER as LADDER
from tests.unit.tune_sim import step_line as step_line


def test_start_estimate_from_measured_starts() -> None:
    ev = FakeEvaluator(Clock(), {}, {})
    ev.cores = 2
    assert start_estimate(ev, R1) is None
    ev.started = [(R1, 24.0)]
    # two workers load side by side on two cores, each slowed by the other (LOAD_CONTENTION)
    assert (start_estimate(ev, R1), start_estimate(ev, D1)) == (24.0, 24.0)
    assert start_estimate(ev, R2) == pytest.approx(24.0 * (1 + LOAD_CONTENTION))
    ev.started = [(R1, 24.0), (R2, 40.0), (R1, 30.0)]
    assert (start_estimate(ev, R1), start_estimate(ev, R2)) == (30.0, 40.0)
    assert start_estimate(ev, D2) == pytest.approx(40.0)  # the measured 2-worker start, not 2 x 30 s
    ev.cores = 1  # one core: the workers load one after the other
    ev.started = [(R1, 24.0)]
    assert start_estimate(ev, R2) == 48.0
    assert [load_rounds(w, 4) for w in (1, 2, 4, 5, 8)] == pytest.approx([1.0, 1.3, 1.9, 3.8, 3.8])


def test_run_estimate_before_and_after_a_full_run() -> None:
    ev = FakeEvaluator(Clock(), {}, {})
    assert run_estimate(ev, 0) == 8.0  # nothing seen: the 4 s span, twice
    ev.warm_e2e = [0.7, 1.2]
    assert run_estimate(ev, 0) == 4.0 + 1.2  # the longest warm-up request stands for the drain
    c = rolling(R1)
    stopped = Run(c, 2, 4.0, [Rec(0.0, [0.5, 3.5], end=3.5), Rec(0.25, [])], [2, 2], 3.0, True, 3.0)
    ev.order.append(stopped)
    assert run_estimate(ev, 0) == 4.0 + 3.5  # a stopped run's longest completed request
    full = Run(c, 3, 8.0, [Rec(0.0, [0.1], end=0.1)] * N, [1] * N, 0.5 + 0.75, False, 0.5)
    ev.order.append(full)
    assert run_estimate(ev, 1) == 2.0 + 0.75  # a full run's drain (its seconds past its span)


def test_budget_skips_a_server_start_that_would_overrun_and_the_search_ends_in_time() -> None:
    base = rolling(R1)
    sp = space(base, [R1, R2])
    clock = Clock()
    begin = clock.t
    ev = FakeEvaluator(clock, {R1: 3, R2: 3}, {1: 20.0, 2: 40.0})
    budget = 60.0
    t = tuner(sp, ev, clock, budget, patience=100)
    t.run()
    # R1: started (20 s), its baseline met the top rung, where the bisection starts (0.5+1 s): 21.5 s;
    # R2 would cost a stop (none measured yet: STOP_S) + 2 x 20 s + a run at the top rung
    assert [e[1] for e in ev.events if e[0] == "start"] == [R1.label]
    assert asdict(t.skipped[0]) == {"config_id": rolling(R2).id, "rung": 3, "rate_req_s": 8.0,
                            "server_start_s": STOP_S + 40.0, "run_s": 1.5,
                            "left_s": budget - 21.5 - STOP_S - REPORT_S}
    assert len(t.skipped) == 1  # recorded once, though checked each round
    # then trials in R1 (live knobs), 1.5 s each at the top rung, while one fits before the deadline (56 s in,
    # leaving STOP_S + REPORT_S for the finish): 21.5 + 23 x 1.5 = 56 s; a 24th would end at 57.5 s
    assert t.deadline() == begin + budget - STOP_S - REPORT_S
    assert clock.t - begin == 56.0
    assert len(t.outcomes) == 24 and all(o.config.group == R1 for o in t.outcomes.values())
    assert t.stop_reason == "budget spent"
    assert ev.cut == []


def test_a_run_predicted_too_long_is_skipped_not_run() -> None:
    base = rolling(R1)
    sp = space(base, [R1])
    clock = Clock()
    begin = clock.t
    ev = FakeEvaluator(clock, {R1: 1}, {1: 20.0})
    t = tuner(sp, ev, clock, 29.0)  # the search must end by 29 - STOP_S - REPORT_S = 25 s
    t.run()
    # the first start (20 s; nothing to predict it from), the top rung (missed: 0.5 s), rung 1 (predicted its
    # 2 s span + the longest request seen, 2.1 s: fits in 4.5 s; takes 3 s); rung 2 (1 s span + the 1 s drain
    # measured) would end 0.5 s after the deadline: skipped
    assert ev.events == [("start", R1.label), ("run", base.id, 3, R1.label), ("run", base.id, 1, R1.label)]
    assert t.skipped == [Skip(base.id, rung=2, rate_req_s=4.0, server_start_s=0.0, run_s=2.0, left_s=1.5)]
    assert clock.t - begin == 23.5 and ev.cut == []
    assert t.stop_reason == "budget spent"
    assert t.baseline_outcome().rung == 1
    assert improvement_text(t.baseline_outcome(), t.baseline_outcome(), SLO) == (
        "improvement: 1.00x the baseline's goodput (2.00 vs 2.00 req/s)")
    nothing = Tuner(t.plan, ev, lambda msg: None, 0.0).baseline_outcome()  # type: ignore[arg-type]
    assert (nothing.runs, nothing.best) == ([], None)
    assert improvement_text(nothing, t.baseline_outcome(), SLO) == (
        "improvement: not known: the baseline was not measured (the budget ran out before it); the chosen "
        "configuration's goodput is 2.00 req/s")


def test_a_run_cut_at_the_deadline_is_no_measurement() -> None:
    clock = Clock()
    c = rolling(R1)
    ev = FakeEvaluator(clock, {R1: 3}, {1: 0.0})
    ev.deadline = clock.t + 3.0  # a passing run at rung 1 takes 3 s, at rung 2: 2 s
    o = race(ev, c, SLO, 0)  # type: ignore[arg-type]
    assert [r.rung for r in o.runs] == [1]  # rung 1 measured (ends at the deadline); rung 2 cut
    assert o.best is not None and o.best.rung == 1
    assert [(r.rung, r.cut) for r in ev.cut] == [(2, True)]
    assert (c.id, 2) not in ev.runs and clock.t == ev.deadline


def test_the_search_leaves_the_head_to_head_its_time_within_the_budget() -> None:
    base = rolling(R1)
    clock = Clock()
    begin = clock.t
    ev = FakeEvaluator(clock, {R1: 3, base: 1}, {1: 20.0})  # every other configuration meets the top rung
    budget = 60.0
    t = tuner(space(base, [R1]), ev, clock, budget, patience=100)
    t.run()
    assert t.incumbent is not None and t.incumbent.config != base and t.stop_reason == "budget spent"
    reserve = verify.cost(ev, t.incumbent.config, base, 3)
    assert reserve == 4 * 1.5 and t.verify_reserve() == reserve
    t.verify()
    v = t.verification
    assert v is not None and v.done and v.kept == "chosen"
    assert clock.t <= begin + budget - STOP_S - REPORT_S and ev.cut == []
    # a head-to-head over VERIFY_SHARE of the budget is not reserved: it runs only if time is left
    t.plan = replace(t.plan, budget_s=reserve / VERIFY_SHARE - 1)
    assert t.verify_reserve() == 0.0
    t.verifying = False
    t.end = clock.t + t.finish_estimate() + 1.0
    t.verify()
    assert t.verification == verify.Verification(t.incumbent.config.id, 3, 8.0, 2, done=False,
                                                 why="predicted 6 s, 1 s left")
