"""``serving tune``'s search on a simulated server: the budget (predicted server starts and runs, skipped when
they would end after it, a run cut at the deadline), the folder's configuration measured in its group's
server, groups ordered by promise and dropped when their seed misses the SLO at the lowest rung."""

from __future__ import annotations

from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import pytest

from rollcore.step_cost import StepCost
from serving.bench.metrics import Rec, parse_slo
from serving.bench.scenario import load_scenario
from serving.tune import verify
from serving.tune.costs import (
    LOAD_CONTENTION,
    REPORT_S,
    STOP_S,
    load_rounds,
    needs_start,
    run_estimate,
    start_estimate,
)
from serving.tune.moves import STEP_SHARE
from serving.tune.plan import Plan, promise_order
from serving.tune.policy import Skip, Tuner
from serving.tune.racing import Outcome, race
from serving.tune.report import improvement_text
from serving.tune.runs import Run, missed_bounds
from serving.tune.space import Config, Group, Space, make_config
from serving.tune.verify import VERIFY_SHARE

SLO = parse_slo("ttft_p99=1s,itl_p99=100ms")
LADDER = [1.0, 2.0, 4.0, 8.0]  # 4 requests a run: arrival spans 4, 2, 1, 0.5 s
N = 4
R1 = Group("rolling", 1, 2)
D1 = Group("dynamic", 1, 2)
R2 = Group("rolling", 2, 1)
D2 = Group("dynamic", 2, 1)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class FakeEvaluator:
    """``serving.tune.ports.Evaluator`` on a simulated server: a start of ``start_s[workers]`` seconds, a stop
    of ``stop_s``; a run of config at rung k meets the SLO when k <= ``top(config)`` and takes its arrival
    span + 1 s (a miss: 0.5 s, stopped early). The cost model predicts from its records as from a live one's."""

    def __init__(self, clock: Clock, top: dict[Any, int], start_s: dict[int, float], stop_s: float = 1.0,
                 slow_decode: frozenset[Any] = frozenset()) -> None:
        self.clock = clock
        self.top = top  # Config or Group -> highest passing rung (-1: none)
        self.slow_decode = slow_decode  # configs / groups whose misses are ITL gaps (else late first tokens)
        self.stream = True
        self.start_s = start_s
        self.stop_s = stop_s
        self.ladder = LADDER
        self.n_requests = N
        self.current: Config | None = None
        self.started: list[tuple[Group, float]] = []
        self.stops: list[float] = []
        self.runs: dict[tuple[str, int], Run] = {}
        self.order: list[Run] = []
        self.cut: list[Run] = []
        self.knob_changes = 0
        self.deadline: float | None = None
        self.warm_e2e: list[float] = []
        self.cores = 1  # the simulated starts grow with the workers: they load one after the other
        self.events: list[tuple[Any, ...]] = []  # ("start", label, clock after) / ("run", config id, rung, group)
        self.step_costs: dict[Group, StepCost] = {}  # set by a test: the group's step-cost line
        self.again_top: dict[Config, int] = {}  # set by a test: a configuration's top rung when measured again

    def apply(self, config: Config) -> None:
        if needs_start(self, config):  # type: ignore[arg-type]
            self.close()
            s = self.start_s[config.group.workers]
            self.clock.t += s
            self.current = config
            self.started.append((config.group, s))
            self.events.append(("start", config.group.label))
            return
        assert self.current is not None
        if self.current.knobs != config.knobs:
            self.knob_changes += 1
        self.current = config

    def close(self) -> None:
        if self.current is not None:
            self.clock.t += self.stop_s
            self.stops.append(self.stop_s)
            self.current = None

    def measure(self, config: Config, rung: int, again: bool = False) -> Run:
        key = (config.id, rung)
        if key in self.runs and not again:
            return self.runs[key]
        self.apply(config)
        top = self.top.get(config, self.top.get(config.group, -1))
        if again:  # measured again (the head-to-head): ``again_top`` simulates a search run that was lucky
            top = self.again_top.get(config, top)
        met = rung <= top
        rate = LADDER[rung]
        seconds = N / rate + 1.0 if met else 0.5
        if self.deadline is not None and self.clock.t + seconds > self.deadline:  # cut at the deadline
            run = Run(config, rung, rate, [], [3] * N, self.deadline - self.clock.t, True, 0.0, cut=True)
            self.clock.t = self.deadline
            self.cut.append(run)
            return run
        self.clock.t += seconds
        itl_miss = not met and (config in self.slow_decode or config.group in self.slow_decode)
        ttft = 0.2 if met or itl_miss else 2.0
        gap = 0.5 if itl_miss else 0.05
        recs = [Rec(i / rate, [i / rate + ttft + gap * j for j in range(3)], end=i / rate + ttft + 2 * gap)
                for i in range(N)]
        run = Run(config, rung, rate, recs, [3] * N, seconds, not met, seconds - 1.0)
        self.runs.setdefault(key, run)
        self.order.append(run)
        self.events.append(("run", config.id, rung, config.group.label))
        return run


def rolling(g: Group, size: int = 32, prefill: int = 2048) -> Config:
    return make_config(g, {"max_rolling_batch_size": size, "max_rolling_batch_prefill_tokens": prefill})


def dynamic(g: Group) -> Config:
    return make_config(g, {"batch_size": 8, "max_batch_delay": 50})


def seed_of(g: Group) -> Config:
    return rolling(g) if g.mode == "rolling" else dynamic(g)


def space(baseline: Config, groups: list[Group]) -> Space:
    return Space(tuple(groups), baseline, {g: baseline if g == baseline.group else seed_of(g) for g in groups})


def plan(sp: Space, budget_s: float, max_trials: int = 60, patience: int = 8) -> Plan:
    return Plan(Path("model"), SLO, load_scenario("tune"), sp, budget_s, max_trials, patience, 0)


def tuner(sp: Space, ev: FakeEvaluator, clock: Clock, budget_s: float, **kw: Any) -> Tuner:
    p = plan(sp, budget_s, **kw)
    return Tuner(p, ev, lambda msg: None, clock.t + budget_s, clock=clock)  # type: ignore[arg-type]


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


def test_improvement_text_of_a_raced_baseline() -> None:
    clock = Clock()
    base, other = rolling(R1), rolling(R2)
    ev = FakeEvaluator(clock, {base: -1, other: 2}, {1: 0.0, 2: 0.0})
    won = race(ev, other, SLO, -1, first=2)  # type: ignore[arg-type]
    lost = race(ev, base, SLO, 2)  # type: ignore[arg-type]
    assert [r.rung for r in lost.runs] == [3] and lost.best is None
    assert improvement_text(lost, won, SLO) == (
        "improvement: the baseline misses the SLO at 8 req/s (raced: not tried lower), which the chosen "
        "configuration meets (4.00 req/s goodput at 4 req/s offered)")


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


def step_line(fixed: float, per_token: float) -> StepCost:
    cost = StepCost()
    for tokens in (32, 300, 33, 2048, 40, 900, 31, 35):
        cost.add(tokens, fixed + per_token * tokens)
    return cost


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


def _pick_over(base: Config, pick: Config, ev: FakeEvaluator, budget: float = 1000.0) -> Tuner:
    """A tuner whose search measured the folder's configuration and a better one (the incumbent)."""
    t = tuner(space(base, [base.group, pick.group]), ev, ev.clock, budget)
    for c in (base, pick):
        t.evaluate(c, "search", first=3, allow_below=True)
    assert t.incumbent is t.outcomes[pick.id]
    return t


def test_the_pick_is_measured_again_against_the_folders_and_kept_when_it_holds() -> None:
    base, pick = rolling(R1), rolling(R1, 64, 4096)
    ev = FakeEvaluator(Clock(), {base: 1, pick: 2}, {1: 10.0})
    t = _pick_over(base, pick, ev)
    n = len(ev.events)
    t.verify()
    # two new runs each at the pick's rung, alternating, the pick first (the running server has its knobs):
    # live knob changes, no server start
    assert ev.events[n:] == [("run", pick.id, 2, R1.label), ("run", base.id, 2, R1.label),
                             ("run", base.id, 2, R1.label), ("run", pick.id, 2, R1.label)]
    v = t.verification
    assert v is not None and v.done and v.kept == "chosen" and (v.chosen_met, v.baseline_met) == (2, 0)
    assert t.incumbent is t.outcomes[pick.id]
    assert ev.runs[(base.id, 1)].rung == 1 and len(ev.order) == n - 1 + 4  # the search's runs stay cached
    assert improvement_text(t.baseline_outcome(), t.incumbent, SLO, v) == (
        "improvement: no ratio (the baseline's goodput was 0) (measured again head to head, 2 runs each at 4 req/s, "
        "alternating: mean 4.00 req/s for the search's pick (met the SLO in 2), 0.00 for the folder's (met in 0))")


def test_a_pick_that_does_not_hold_up_when_measured_again_gives_way_to_the_folders() -> None:
    base, pick = rolling(R1), rolling(R1, 64, 4096)
    ev = FakeEvaluator(Clock(), {base: 1, pick: 2}, {1: 10.0})
    ev.again_top = {pick: 1, base: 2}  # the pick's rung-2 run was lucky; the folder's meets rung 2 measured again
    t = _pick_over(base, pick, ev)
    t.verify()
    v = t.verification
    assert v is not None and v.done and v.kept == "baseline" and v.search_pick == pick.id
    assert (v.chosen_met, v.baseline_met) == (0, 2)
    assert t.incumbent is t.outcomes[base.id] is t.baseline_outcome()
    assert t.incumbent.best is not None and t.incumbent.best.rung == 2
    assert improvement_text(t.baseline_outcome(), t.incumbent, SLO, v).startswith(
        "improvement: none, so the folder's configuration is kept (measured again head to head, 2 runs each")
    # measured again, neither meets the SLO at the pick's rung: the pick did not hold up, and the folder's
    # configuration is kept with what the search measured of it
    ev3 = FakeEvaluator(Clock(), {base: 1, pick: 2}, {1: 10.0})
    ev3.again_top = {pick: 1}
    t3 = _pick_over(base, pick, ev3)
    t3.verify()
    v3 = t3.verification
    assert v3 is not None and v3.kept == "baseline" and (v3.chosen_met, v3.baseline_met) == (0, 0)
    assert t3.incumbent is t3.baseline_outcome() and t3.incumbent.best is ev3.runs[(base.id, 1)]
    # ... unless the folder's configuration met the SLO nowhere: the pick stays (nothing better is known)
    ev4 = FakeEvaluator(Clock(), {base: -1, pick: 2}, {1: 10.0})
    ev4.again_top = {pick: 1}
    t4 = _pick_over(base, pick, ev4)
    t4.verify()
    assert t4.verification is not None and t4.verification.kept == "chosen"
    assert t4.incumbent is t4.outcomes[pick.id]
    # in another group: a server start at each switch, the running one's configuration first
    other = rolling(R2)
    ev2 = FakeEvaluator(Clock(), {base: 1, other: 2}, {1: 10.0, 2: 20.0})
    t2 = _pick_over(base, other, ev2)
    n = len(ev2.events)
    assert verify.cost(ev2, other, base, 2) == (10.0 + 1.0) + (20.0 + 1.0) + 4 * run_estimate(ev2, 2)  # stop + start
    t2.verify()
    assert [e[:2] for e in ev2.events[n:]] == [("run", other.id), ("start", R1.label), ("run", base.id),
                                                ("run", base.id), ("start", R2.label), ("run", other.id)]


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
