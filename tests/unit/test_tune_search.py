"""``serving tune``'s search on a simulated server: groups ordered by promise and dropped when their seed misses
the SLO at the lowest rung, the folder's configuration measured in its group's server, and the moves from the best
configuration (a batch doubled when requests queued, a prefill budget halved or fitted to the step-cost line when
an ITL bound was missed, the line's knee)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from rollcore.step_cost import StepCost
from serving.bench.run_metrics import parse_slo
from serving.bench.scenario import load_scenario
from serving.tune.moves import STEP_SHARE
from serving.tune.plan import Plan, promise_order
from serving.tune.policy import Tuner
from serving.tune.racing import Outcome
from serving.tune.runs import missed_bounds
from tests.unit.tune_sim import D1, D2, R1, R2, SLO, Clock, FakeEvaluator, dynamic, rolling, space, step_line, tuner


def test_promise_order() -> None:
    groups = [R1, D1, R2, D2]
    assert promise_order(groups) == [R1, D1, R2, D2]  # fewer workers first (cheaper to start)
    assert promise_order(groups, current=D2) == [D2, R1, D1, R2]  # the running server first
    assert promise_order(groups, dropped={R1}) == [R2, D2, R1, D1]  # 1 worker x 2 threads failed: last
    assert promise_order(groups, best_mode="dynamic") == [D1, R1, D2, R2]
    assert promise_order(groups, baseline_group=D1) == [D1, R1, R2, D2]
    # measured starts: seconds, not worker counts
    assert promise_order(groups, start_estimate=lambda g: {R1: 30.0, D1: 30.0, R2: 10.0, D2: 50.0}[g]) == [
        R2, R1, D1, D2]


def test_baseline_is_raced_in_its_groups_server_with_no_start_of_its_own() -> None:
    # the folder runs 2 workers: its group starts first although a 1-worker group is cheaper (the improvement
    # is measured against the baseline), then the other group's seed is raced one rung above the best
    base = rolling(R2, 16, 512)
    sp = space(base, [R2, R1])
    clock = Clock()
    ev = FakeEvaluator(clock, {R1: 1, base: 3, R2: 2}, {1: 10.0, 2: 20.0})
    t = tuner(sp, ev, clock, 1000.0, max_trials=3)
    t.run()
    # the baseline's runs: a bisection from the top rung (nothing to race against yet), which it meets: one run
    assert ev.events[:3] == [("start", R2.label), ("run", base.id, 3, R2.label), ("start", R1.label)]
    assert ev.events[3] == ("run", rolling(R1).id, 3, R1.label)  # the best's rung is the top: raced there
    assert [e[1] for e in ev.events if e[0] == "start"][:2] == [R2.label, R1.label]  # no start for the baseline
    assert asdict(t.history[0]) == {"phase": "baseline", "config_id": base.id, "runs": 1, "rung": 3,
                            "score": round(t.outcomes[base.id].score, 4), "improved": True}
    assert t.baseline_outcome().rung == 3 and t.incumbent is t.outcomes[base.id]
    assert t.stop_reason == "3 configurations tried (--max-trials)"
    assert t.skipped == [] and t.dropped == []


def test_a_group_whose_seed_misses_the_lowest_rung_is_dropped_and_its_layout_goes_last() -> None:
    base = rolling(R1)
    sp = space(base, [R1, D1, R2, D2])
    clock = Clock()
    ev = FakeEvaluator(clock, {R1: -1, D1: 3, R2: 0, D2: -1}, {1: 10.0, 2: 20.0})
    t = tuner(sp, ev, clock, 1000.0, max_trials=4)
    t.run()
    # the baseline (no best yet): bisection from the top rung (3), then 1, then 0, missing all: R1 dropped
    assert ev.events[:4] == [("start", R1.label), ("run", base.id, 3, R1.label), ("run", base.id, 1, R1.label),
                             ("run", base.id, 0, R1.label)]
    assert t.dropped[0] == R1
    # next: R2 (another layout) before D1 (R1's layout), though R2 costs twice the start
    assert ev.events[4:6] == [("start", R2.label), ("run", rolling(R2).id, 3, R2.label)]
    # R2's seed misses rungs 3 and 1 with no best yet: bisection to rung 0, which it meets
    assert ev.events[6:8] == [("run", rolling(R2).id, 1, R2.label), ("run", rolling(R2).id, 0, R2.label)]
    starts = [e[1] for e in ev.events if e[0] == "start"]
    assert starts == [R1.label, R2.label, D2.label, D1.label]
    assert [g.label for g in t.dropped] == [R1.label]  # D2's seed was raced above R2's best: ranked, not dropped
    # no trial in the dropped group beyond its seed
    assert [o.config.id for o in t.outcomes.values() if o.config.group == R1] == [base.id]
    assert t.stop_reason == "4 configurations tried (--max-trials)"


def test_a_groups_first_trial_is_its_best_with_the_batch_doubled_when_requests_queued() -> None:
    base = rolling(R1, 16, 512)
    sp = space(base, [R1])
    clock = Clock()
    bigger = rolling(R1, 32, 1024)  # a rolling step doubles the sequences and the prefill tokens
    ev = FakeEvaluator(clock, {base: 1, bigger: 2, R1: 0}, {1: 10.0})
    t = tuner(sp, ev, clock, 1000.0, max_trials=3)
    t.run()
    runs = [e[1:3] for e in ev.events if e[0] == "run"]
    # the baseline's bisection (misses the top rung 3, meets 1, misses 2), then the doubled batch raced one rung
    # above: met, then 3
    assert runs[:5] == [(base.id, 3), (base.id, 1), (base.id, 2), (bigger.id, 2), (bigger.id, 3)]
    assert t.history[1].phase == "round 1 rolling 1w x 2t" and t.history[1].config_id == bigger.id
    assert t.incumbent is t.outcomes[bigger.id]
    # at the top of the range there is nothing to double: the halvings are the neighbours left
    top = tuner(space(rolling(R1, 64, 4096), [R1]), FakeEvaluator(Clock(), {}, {1: 10.0}), Clock(), 1000.0)
    top.outcomes[rolling(R1, 64, 4096).id] = Outcome(rolling(R1, 64, 4096), None, [], 0.0)
    assert top.moves(R1) == [{"max_rolling_batch_size": 64, "max_rolling_batch_prefill_tokens": 2048},
                             {"max_rolling_batch_size": 32, "max_rolling_batch_prefill_tokens": 4096}]
    assert top.step(R2) is None  # nothing measured in that group
    # with the sequences at their maximum, the prefill budget still doubles
    top.outcomes = {rolling(R1, 64, 512).id: Outcome(rolling(R1, 64, 512), None, [], 0.0)}
    assert top.step(R1) == {"max_rolling_batch_size": 64, "max_rolling_batch_prefill_tokens": 1024}
    t.outcomes = {base.id: t.outcomes[base.id]}
    assert t.step(R1) == {"max_rolling_batch_size": 32, "max_rolling_batch_prefill_tokens": 1024}


def test_a_missed_itl_bound_steps_to_a_smaller_prefill_budget_while_it_improves() -> None:
    """When the best configuration's failing run missed a decode bound (ITL), the running sequences waited on
    prefill chunks: the compass search tries a halved prefill budget first, recentres on each better one, and
    when no halving is better, the best's other neighbours (fewer sequences first)."""
    base = rolling(R1, 16, 512)
    half, quarter, eighth = rolling(R1, 16, 256), rolling(R1, 16, 128), rolling(R1, 16, 64)
    clock = Clock()
    ev = FakeEvaluator(clock, {base: 0, half: 1, quarter: 2, eighth: 2, R1: -1}, {1: 10.0},
                       slow_decode=frozenset({R1}))
    t = tuner(space(base, [R1]), ev, clock, 1000.0, max_trials=7)
    t.run()
    tried = [h.config_id for h in t.history]
    # the baseline, then 512 -> 256 -> 128 (each better), 128 -> 64 (no better), then the best's (128 tokens)
    # other neighbours: 8 sequences, 32 sequences with 256 tokens (256 alone was measured), 32 sequences alone
    assert tried == [base.id, half.id, quarter.id, eighth.id, rolling(R1, 8, 128).id, rolling(R1, 32, 256).id,
                     rolling(R1, 32, 128).id]
    assert t.incumbent is t.outcomes[quarter.id]
    assert missed_bounds(ev.runs[(base.id, 1)], SLO, True) == {"itl"}
    assert missed_bounds(ev.runs[(half.id, 2)], SLO, True) == {"itl"}
    # at the floor of the prefill budget (64 tokens: 32 sequences need 32), the sequences are halved
    floor = rolling(R1, 32, 64)
    ev2 = FakeEvaluator(Clock(), {floor: 0}, {1: 10.0}, slow_decode=frozenset({R1}))
    t2 = tuner(space(floor, [R1]), ev2, ev2.clock, 1000.0, max_trials=1)
    t2.run()
    assert t2.step(R1) == {"max_rolling_batch_size": 16, "max_rolling_batch_prefill_tokens": 64}
    # a late first token (TTFT) points the other way
    ev3 = FakeEvaluator(Clock(), {base: 0}, {1: 10.0})
    t3 = tuner(space(base, [R1]), ev3, ev3.clock, 1000.0, max_trials=1)
    t3.run()
    assert missed_bounds(ev3.runs[(base.id, 1)], SLO, True) == {"ttft"}
    assert t3.step(R1) == {"max_rolling_batch_size": 32, "max_rolling_batch_prefill_tokens": 1024}
    assert t3.moves(R1) == [{"max_rolling_batch_size": 32, "max_rolling_batch_prefill_tokens": 1024},
                            {"max_rolling_batch_size": 16, "max_rolling_batch_prefill_tokens": 1024},
                            {"max_rolling_batch_size": 32, "max_rolling_batch_prefill_tokens": 512},
                            {"max_rolling_batch_size": 16, "max_rolling_batch_prefill_tokens": 256},
                            {"max_rolling_batch_size": 8, "max_rolling_batch_prefill_tokens": 512}]


def test_a_missed_itl_bound_jumps_to_the_token_budget_the_step_cost_line_fits() -> None:
    """With the group's step-cost line measured, a missed ITL bound's first move is the token budget whose step
    the line puts within ``STEP_SHARE`` of the bound (one trial, where halving 2048 -> 128 takes four); the
    halvings follow. The line measured on the server (``Evaluator.read_step_cost``) is the group's own. With
    nothing meeting the SLO yet, the line's configuration is raced right after the seed's first run (at the top
    rung) missed ITL, before the rest of the seed's bisection down the ladder (the long runs)."""
    base = rolling(R1, 32, 2048)
    fitted = rolling(R1, 32, 140)  # (0.8 * 100 ms - 10 ms) / 0.5 ms a token
    assert STEP_SHARE == 0.8
    clock = Clock()
    ev = FakeEvaluator(clock, {base: 0, fitted: 2, R1: -1}, {1: 10.0}, slow_decode=frozenset({R1}))
    ev.step_costs[R1] = step_line(0.010, 0.0005)
    t = tuner(space(base, [R1]), ev, clock, 1000.0, max_trials=3)
    t.run()
    tried = [h.config_id for h in t.history]
    assert tried[:2] == [fitted.id, base.id]
    runs = [e[1:3] for e in ev.events if e[0] == "run"]
    # the seed's run at the top rung, the line's race (from the top: missed, met 1, met 2), then the seed's race
    # against it: one rung above (3), already measured: no run
    assert runs[:4] == [(base.id, 3), (fitted.id, 3), (fitted.id, 1), (fitted.id, 2)]
    assert t.incumbent is t.outcomes[fitted.id] and t.outcomes[base.id].best is None
    # with other groups to seed, the line's trial runs first, in the running server: a PUT, no start
    clock = Clock()
    ev4 = FakeEvaluator(clock, {base: 0, fitted: 2, R1: -1, D1: 1}, {1: 10.0}, slow_decode=frozenset({R1}))
    ev4.step_costs[R1] = step_line(0.010, 0.0005)
    t4 = tuner(space(base, [R1, D1]), ev4, clock, 1000.0, max_trials=3)
    t4.run()
    assert [h.config_id for h in t4.history][:3] == [fitted.id, base.id, dynamic(D1).id]
    assert t4.history[0].phase == "step-cost line rolling 1w x 2t"
    assert [e[1] for e in ev4.events if e[0] == "start"] == ["rolling 1w x 2t", "dynamic 1w x 2t"]
    # a baseline that meets no rung: the line's trial keeps its group from being dropped
    clock = Clock()
    ev5 = FakeEvaluator(clock, {base: -1, fitted: 1, R1: -1}, {1: 10.0}, slow_decode=frozenset({R1}))
    ev5.step_costs[R1] = step_line(0.010, 0.0005)
    t5 = tuner(space(base, [R1]), ev5, clock, 1000.0, max_trials=2)
    t5.run()
    assert [e[1:3] for e in ev5.events if e[0] == "run" and e[1] == fitted.id] == [(fitted.id, 3), (fitted.id, 1),
                                                                                  (fitted.id, 2)]
    assert t5.incumbent is t5.outcomes[fitted.id] and not t5.dropped
    # from the new best (its failing run missed ITL again), the line's budget is where it is: the halvings
    assert t.moves(R1)[0] == {"max_rolling_batch_size": 32, "max_rolling_batch_prefill_tokens": 70}

    # a line that leaves no room for the decodes and a chunk as large: the sequences are halved too
    ev2 = FakeEvaluator(Clock(), {base: 0}, {1: 10.0}, slow_decode=frozenset({R1}))
    ev2.step_costs[R1] = step_line(0.010, 0.002)  # 35 tokens a step
    t2 = tuner(space(base, [R1]), ev2, ev2.clock, 1000.0, max_trials=1)
    t2.run()
    assert t2.history[0].config_id == rolling(R1, 17, 64).id  # 35 tokens, clipped to the knob's 64
    # a line of another group, or none: the halvings as before
    ev6 = FakeEvaluator(Clock(), {base: 0}, {1: 10.0}, slow_decode=frozenset({R1}))
    ev6.step_costs = {R2: step_line(0.010, 0.002)}
    t6 = tuner(space(base, [R1]), ev6, ev6.clock, 1000.0, max_trials=1)
    t6.run()
    assert [h.config_id for h in t6.history] == [base.id]
    assert t6.step(R1) == {"max_rolling_batch_size": 32, "max_rolling_batch_prefill_tokens": 1024}
    # the seed's top-rung run missed TTFT (requests queued, as they do at the top rung): the line still says its
    # longest steps break the ITL bound, so its configuration goes first all the same
    ev3 = FakeEvaluator(Clock(), {base: 0}, {1: 10.0})
    ev3.step_costs[R1] = step_line(0.010, 0.0005)
    t3 = tuner(space(base, [R1]), ev3, ev3.clock, 1000.0, max_trials=1)
    t3.run()
    assert [h.config_id for h in t3.history] == [fitted.id, base.id]
    # once something meets the SLO, a late first token (TTFT) points to a bigger batch, not to the line
    ev3.step_costs = {}
    assert t3.step(R1) == {"max_rolling_batch_size": 64, "max_rolling_batch_prefill_tokens": 4096}
    # a server that never ran a step longer than the line allows: the budget is not what made steps long
    short = StepCost()
    for tokens in (10, 40, 12, 100, 33, 20, 60, 90):
        short.add(tokens, 0.010 + 0.0005 * tokens)
    ev7 = FakeEvaluator(Clock(), {base: 0}, {1: 10.0}, slow_decode=frozenset({R1}))
    ev7.step_costs[R1] = short
    t7 = tuner(space(base, [R1]), ev7, ev7.clock, 1000.0, max_trials=1)
    t7.run()
    assert [h.config_id for h in t7.history] == [base.id]


def test_the_line_knee_bounds_the_budget_when_the_decode_bound_is_loose() -> None:
    """``KNEE``: past the token budget at which the line's fixed part is a tenth of the step, a bigger step buys
    little throughput and stalls every running sequence for longer; with a loose ITL bound (or none) that knee
    is the line's move, tried in the running server right after a seed that met the SLO (before other
    groups' starts)."""
    base = rolling(R1, 32, 2048)
    knee = rolling(R1, 32, 180)  # 9 x 10 ms / 0.5 ms a token
    for spec in ("ttft_p99=1s,itl_p99=10s", "ttft_p99=1s"):
        clock = Clock()
        ev = FakeEvaluator(clock, {base: 3, knee: 3, D1: 3}, {1: 10.0})
        ev.step_costs[R1] = step_line(0.010, 0.0005)
        sp = space(base, [R1, D1])
        p = Plan(Path("model"), parse_slo(spec), load_scenario("tune"), sp, 1000.0, 3, 8, 0)
        t = Tuner(p, ev, lambda msg: None, clock.t + 1000.0, clock=clock)  # type: ignore[arg-type]
        t.run()
        assert [h.config_id for h in t.history] == [base.id, knee.id, dynamic(D1).id], spec
        assert [e[1] for e in ev.events if e[0] == "start"] == ["rolling 1w x 2t", "dynamic 1w x 2t"]
    # a line whose knee lies above the budget (a small model: the fixed part dominates every step): no move
    ev2 = FakeEvaluator(Clock(), {base: 3}, {1: 10.0})
    ev2.step_costs[R1] = step_line(0.010, 0.00001)  # knee 9000 tokens
    t2 = tuner(space(base, [R1]), ev2, ev2.clock, 1000.0, max_trials=1)
    t2.run()
    assert t2.line_step(R1) is None
