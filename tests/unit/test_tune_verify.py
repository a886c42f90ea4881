"""``serving tune``'s head-to-head on a simulated server: the search's pick measured again against the folder's
configuration, kept when it holds up, and the improvement text of each outcome."""

from __future__ import annotations

from serving.tune import verify
from serving.tune.costs import run_estimate
from serving.tune.policy import Tuner
from serving.tune.racing import race
from serving.tune.report import improvement_text
from serving.tune.space import Config
from tests.unit.tune_sim import R1, R2, SLO, Clock, FakeEvaluator, rolling, space, tuner


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
