"""``serving tune``'s search on a simulated server, for its tests: a fake evaluator whose runs meet the SLO up to
a given rung and whose starts and runs advance a fake clock, and the configurations, spaces and tuners over it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rollcore.step_cost import StepCost
from serving.bench.run_metrics import Rec, parse_slo
from serving.bench.scenario import load_scenario
from serving.tune.costs import needs_start
from serving.tune.plan import Plan
from serving.tune.policy import Tuner
from serving.tune.runs import Run
from serving.tune.space import Config, Group, Space, make_config

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
    """``serving.tune.protocols.Evaluator`` on a simulated server: a start of ``start_s[workers]`` seconds, a stop
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


def step_line(fixed: float, per_token: float) -> StepCost:
    cost = StepCost()
    for tokens in (32, 300, 33, 2048, 40, 900, 31, 35):
        cost.add(tokens, fixed + per_token * tokens)
    return cost
