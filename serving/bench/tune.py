"""``serving tune MODEL_DIR --slo SPEC``: the serving.properties with the highest goodput meeting an SLO.

    serving tune examples/models/tiny-llama --slo "ttft_p99=2s,itl_p99=200ms" [--scenario FILE] [--budget 20m]
    serving tune examples/models/tiny-llama --slo "ttft_p99=2s,itl_p99=200ms" --dry-run        # the plan only

It starts the model and searches on the live server (``serving.bench.search``: knobs changed with
``PUT /models/{name}``, restarts only for another batching mode, worker count or thread count):

1. with a relative ladder, a burst pass of the folder's configuration (the baseline) calibrates it;
2. one server start per group (mode x workers x threads) in order of promise (``promise_order``: the running
   server's group, the folder's first, then the cheapest to start, a layout that failed in a dropped group
   last; a start is predicted from measured ones, the workers loading side by side, one a core); the group's
   seed (for the folder's group: the baseline, measured in that server) is raced against the best so far
   (bisection on the ladder from its top rung while nothing meets the SLO); a group whose seed misses the
   SLO at the lowest rung is dropped;
3. successive halving over the groups left: each round keeps the better half (by their best goodput) and
   gives each survivor twice as many trials as the round before: first a compass search from the group's
   best (each knob doubled or halved, the way its missed bound points first: a decode bound, ITL or TPOT, a
   smaller prefill budget, then fewer sequences; otherwise a bigger batch), recentred whenever a neighbour is
   better; once the best's neighbours are measured, what a TPE sampler (optuna) per group proposes, learning
   from every measured configuration of its group; the last group goes on until the budget or
   ``--max-trials`` is spent, or ``--patience`` trials in a row found nothing better;
4. head to head (``Tuner.verify``): the chosen configuration and the folder's, measured again, alternating,
   at the chosen one's rung; the folder's is kept unless the pick holds up, and the improvement printed is
   this comparison's (a pick is chosen for its best run among many noisy ones, which flatters it).

``--budget`` counts from the process's start and keeps a server stop and the report for the end: before a
server start or a run the tune predicts its cost (measured starts, workers loading side by side; arrival span plus the
slowest drain seen) and skips what would end after it (the report lists each skip); a run still going at
the deadline is cut.

A configuration's goodput is that of the highest ladder rung at which it meets the SLO (goodput = requests
meeting the SLO per second, vLLM's definition). Writes ``OUT/serving.properties`` (the folder's file with the
chosen values, each with the measurement behind it as a comment), ``OUT/tune-report.yaml`` (every run) and
``OUT/tune-report.png`` (explored runs, Pareto front, baseline and chosen), and prints the improvement over
the folder's configuration.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from serving.bench.metrics import Slo, format_duration, parse_slo
from serving.bench.scenario import Scenario, ScenarioError, load_scenario
from serving.bench.search import (
    KNOBS,
    Config,
    Evaluator,
    Group,
    Outcome,
    Space,
    better,
    build_space,
    knobs_of,
    make_config,
    missed_bounds,
    race,
)
from serving.step_cost import StepCost

_BUDGET = re.compile(r"^(?P<n>\d+(?:\.\d+)?)\s*(?P<unit>s|m|min|h)?$")


def parse_budget(text: str) -> float:
    """``'20m'``, ``'90s'``, ``'1.5h'``, ``'600'`` (seconds) -> seconds. Raises ``ValueError``."""
    m = _BUDGET.match(text.strip().lower())
    if not m:
        raise ValueError(f"--budget {text!r}: expected a duration such as 20m, 90s or 1h")
    n = float(m["n"]) * {"s": 1, None: 1, "m": 60, "min": 60, "h": 3600}[m["unit"]]
    if n <= 0:
        raise ValueError("--budget must be > 0")
    return n


def _ints(text: str, what: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{what}: expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{what}: expected integers >= 1, got {text!r}")
    return values


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("model_dir", type=Path, help="the model folder (its serving.properties is the baseline)")
    ap.add_argument("--slo", required=True, help='bounds, e.g. "ttft_p99=2s,itl_p99=200ms" (ttft, tpot, itl, '
                                                 'e2e; pNN or mean; s or ms)')
    ap.add_argument("--scenario", "-s", default="tune",
                    help="preset or YAML file; its sweep is the load ladder (default: the tune preset)")
    ap.add_argument("--budget", default="20m",
                    help="wall-clock budget of the whole command, from its start (default 20m)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    ap.add_argument("--out", "-o", type=Path, help="output folder (default ./tune-MODEL)")
    ap.add_argument("--modes", help="batching modes to explore: rolling,dynamic (default: every mode the model "
                                    "can run)")
    ap.add_argument("--workers", type=lambda s: _ints(s, "--workers"),
                    help="worker counts to explore (default: each count w with w x threads = the cores)")
    ap.add_argument("--threads", type=lambda s: _ints(s, "--threads"), help="threads per worker to explore")
    ap.add_argument("--max-trials", type=int, default=60, help="at most this many configurations (default 60)")
    ap.add_argument("--patience", type=int, default=8,
                    help="in the last group, stop after this many trials in a row without a better one (8)")
    ap.add_argument("--seed", type=int, default=0, help="the sampler's seed")
    ap.add_argument("--num-requests", "-n", type=int, help="requests per run (default: the scenario's)")


# -------------------------------------------------------------------------------------------------- plan
STOP_S = 2.0  # a server's stop, before one was measured
REPORT_S = 2.0  # writing the report and its figure (matplotlib's import included)
# The share of a decode bound (ITL, TPOT) that the longest step may take by the step-cost line: the rest is
# the line's error (attention grows with the context, which it averages) and the way from the engine to the
# client (the worker's pipe, the frontend's streaming).
STEP_SHARE = 0.8
# The knee of the step-cost line: the token budget at which the fixed part (reading every weight once) is 10%
# of a step. A CPU's matmuls are compute-bound from a few dozen rows on, so a step 10x the knee computes its
# tokens at most 10% cheaper while every running sequence waits the whole step: on the 110M model at two
# threads (fixed ~58 ms, 2.2 ms a token: knee ~240 tokens) the tune-quality grid's best point for both SLOs
# was a 256-token budget, the folder's 2048 far behind (benchmarks/README.md, tune quality, Run 8).
KNEE = 9
# The head-to-head at the end (``Tuner.verify``): runs of the chosen configuration and of the folder's each,
# alternating, at the chosen one's rung. A configuration is chosen for its best run among many noisy ones,
# so that run flatters it: on 2 AVX2 cores one configuration of the default model measured 2-21 req/s at one
# rate in five runs (benchmarks/README.md, tune quality, Run 9), and a tune printed 1.71x over the folder's
# configuration where measured again the two were level. The search leaves the head-to-head its time when it
# costs at most VERIFY_SHARE of the budget; otherwise it runs only if time is left.
VERIFY_RUNS = 2
VERIFY_SHARE = 0.25


def promise_order(groups: list[Group] | tuple[Group, ...], *, current: Group | None = None,
                  dropped: set[Group] | frozenset[Group] = frozenset(), best_mode: str | None = None,
                  baseline_group: Group | None = None,
                  start_estimate: Callable[[Group], float | None] | None = None) -> list[Group]:
    """``groups`` in the order a tune tries them: the group whose server runs now (no start); then groups
    whose layout (workers x threads) has not failed in a dropped group; then the cheapest to start (the
    estimate, else fewer workers); then the best configuration's batching mode; then the folder's group;
    then the given order."""
    failed_layouts = {(g.workers, g.threads) for g in dropped}
    index = {g: i for i, g in enumerate(groups)}

    def cost(g: Group) -> float:
        est = start_estimate(g) if start_estimate is not None else None
        return float(g.workers) if est is None else est

    return sorted(groups, key=lambda g: (g != current, (g.workers, g.threads) in failed_layouts, cost(g),
                                         best_mode is not None and g.mode != best_mode, g != baseline_group,
                                         index[g]))


@dataclass
class Plan:
    model_dir: Path
    slo: Slo
    scenario: Scenario
    space: Space
    budget_s: float
    max_trials: int
    patience: int
    seed: int

    def ladder_spec(self) -> list[str]:
        return [str(p.rate) for p in self.scenario.passes if p.sweep_index is not None]

    @property
    def calibrates(self) -> bool:
        return any(s.endswith("x") for s in self.ladder_spec())

    def text(self) -> str:
        b = self.space.baseline
        order = promise_order(self.space.groups, current=b.group, baseline_group=b.group)
        lines = [f"serving tune {self.model_dir}: SLO {self.slo}, budget {self.budget_s / 60:.1f} min, at most "
                 f"{self.max_trials} configurations",
                 f"scenario {self.scenario.name} ({self.scenario.source}): {self.scenario.num_requests} requests a "
                 f"run, api {self.scenario.api}; load ladder (Poisson rates): {', '.join(self.ladder_spec())}"
                 + ("  (x = times the baseline's burst throughput, measured first)" if self.calibrates else ""),
                 f"baseline (the folder's configuration, measured in its group's server): {b.id}",
                 ""]
        n = 1
        if self.calibrates:
            lines.append(f"{n}. calibrate: a burst pass of the baseline (the first server) makes the relative rates "
                         f"req/s")
            n += 1
        lines += [f"{n}. one server start per group, in order of promise (the running server's group first: the "
                  f"baseline's, then",
                  "   the cheapest to start; a group whose workers x threads failed in a dropped group goes last); "
                  "its seed configuration",
                  "   is raced against the best so far (first run one rung above the best's; with no best yet, "
                  "bisection",
                  f"   from the top rung, {len(self.ladder_spec()) - 1}); a group whose seed misses the SLO at the "
                  f"lowest rung is dropped:"]
        for g in order:
            seed = self.space.seeds[g]
            lines.append(f"     {seed.id}{'  (the baseline)' if seed == b else ''}")
        n += 1
        lines += [f"{n}. successive halving over the groups left: keep the better half, double the trials per "
                  f"group each round",
                  "   (the running server's group first); a group's first trials are a compass search from its "
                  "best: each knob",
                  "   doubled or halved, the way the missed bound points first (ITL/TPOT: a smaller prefill budget, "
                  "then fewer",
                  "   sequences; TTFT/E2E: a bigger batch), recentred on a better neighbour; once the best's "
                  "neighbours are measured,",
                  "   TPE (optuna) proposes its live knobs, changed with PUT /models/{name} (no restart):"]
        for mode in sorted({g.mode for g in self.space.groups}):
            for k in knobs_of(mode):
                lines.append(f"     {mode:8s} {k.name} in [{k.lo}, {k.hi}]{' (log scale)' if k.log else ''}")
        lines += [f"   the last group continues until the budget, {self.max_trials} configurations, or "
                  f"{self.patience} trials in a row without a better one",
                  f"   budget: counted from the process's start, {REPORT_S:.0f} s and a server stop kept for the "
                  f"end; before a",
                  "   server start or a run its cost is predicted (measured starts, workers loading side by side; "
                  "the run's",
                  "   arrival span plus the slowest drain seen) and what would end after the budget is skipped "
                  "(listed in the report);",
                  "   a run still going at the deadline is cut, a server start still loading then is stopped",
                  f"{n + 1}. head to head: the chosen configuration and the baseline measured again, "
                  f"{VERIFY_RUNS} runs each, alternating,",
                  "   at the chosen one's rung (its time kept from the search when it costs at most "
                  f"{VERIFY_SHARE:.0%} of the budget); the pick must hold",
                  "   up (meet the SLO in a run, with the higher mean goodput or more runs meeting it), else the "
                  "baseline is kept",
                  f"{n + 2}. write serving.properties (annotated), tune-report.yaml, tune-report.png; print the "
                  f"improvement over the baseline"]
        return "\n".join(lines)


def process_started() -> float:
    """``time.monotonic()`` when this process started (Linux: ``/proc/self/stat``'s start time against
    ``/proc/uptime``), so that ``--budget`` counts the interpreter's start and the imports; now elsewhere."""
    try:
        ticks = os.sysconf("SC_CLK_TCK")
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        age = float(Path("/proc/uptime").read_text().split()[0]) - int(fields[19]) / ticks
    except (OSError, ValueError, IndexError):
        return time.monotonic()
    return time.monotonic() - min(max(age, 0.0), 3600.0)


# ------------------------------------------------------------------------------------------------ search
@dataclass
class Tuner:
    """The search. ``end``: ``clock()`` by which the whole tune (its report written) should be done."""

    plan: Plan
    ev: Evaluator
    log: Any
    end: float
    clock: Callable[[], float] = time.monotonic
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    incumbent: Outcome | None = None
    history: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[dict[str, Any]] = field(default_factory=list)
    dropped: list[Group] = field(default_factory=list)
    stop_reason: str = ""
    lines_told: set[tuple[Group, int]] = field(default_factory=set)  # step-cost moves already logged
    verifying: bool = False  # the head-to-head runs now: the search's reserve for it is free
    verification: dict[str, Any] | None = None  # what ``verify`` found (None: nothing to verify)

    @property
    def slo(self) -> Slo:
        return self.plan.slo

    def finish_estimate(self) -> float:
        """The tune's end after the search: the last server's stop and the report."""
        return (max(self.ev.stops) if self.ev.stops else STOP_S) + REPORT_S

    def deadline(self) -> float:
        """When the search must be over (the head-to-head's reserve kept: ``verify_reserve``)."""
        return self.end - self.finish_estimate() - (0.0 if self.verifying else self.verify_reserve())

    def start_cost(self, group: Group) -> float:
        """A server start for ``group`` (0 for the first one: nothing to predict it from), with the running
        server's stop."""
        est = self.ev.start_estimate(group)
        stop = (max(self.ev.stops) if self.ev.stops else STOP_S) if self.ev.server is not None else 0.0
        return (est or 0.0) + stop

    def cost(self, config: Config, rung: int) -> tuple[float, float]:
        """(a server start if ``config``'s group is not the running one, a run at ``rung``): predicted seconds."""
        start = self.start_cost(config.group) if self.ev.needs_start(config) else 0.0
        return start, self.ev.estimated_seconds(rung)

    def out_of_time(self, rung: int, config: Config, record: bool = True) -> bool:
        """Would a run of ``config`` at ``rung`` (with a server start when its group is not the running one)
        end after the deadline? Records what it skips."""
        start, run = self.cost(config, rung)
        left = self.deadline() - self.clock()
        if start + run <= left:
            return False
        if record and not any(x["config_id"] == config.id and x["rung"] == rung for x in self.skipped):
            self.skipped.append({"config_id": config.id, "rung": rung, "rate_req_s": round(self.ev.ladder[rung], 4),
                                 "server_start_s": round(start, 1), "run_s": round(run, 1),
                                 "left_s": round(max(left, 0.0), 1)})
            self.log(f"  skipped for budget: {config.id} at {self.ev.ladder[rung]:.3g}/s"
                     f"{f' (with a server start, {start:.0f} s)' if start else ''}: predicted {start + run:.0f} s, "
                     f"{max(left, 0.0):.0f} s left")
        return True

    def evaluate(self, config: Config, phase: str, first: int | None = None, allow_below: bool = False) -> Outcome:
        """Race ``config`` (cached once measured; a configuration skipped for budget is not cached)."""
        if config.id in self.outcomes:
            return self.outcomes[config.id]
        inc = self.incumbent.rung if self.incumbent is not None else -1
        self.ev.deadline = self.deadline()
        o = race(self.ev, config, self.slo, inc, first=first, allow_below=allow_below,
                 out_of_time=lambda k: self.out_of_time(k, config))
        if not o.runs:
            return o
        self.outcomes[config.id] = o
        improved = o.best is not None and better(o, self.incumbent, self.slo)
        if improved:
            self.incumbent = o
        rate = f"{self.ev.ladder[o.rung]:.3g}/s" if o.best is not None else "-"
        self.log(f"  [{phase}] {config.id}: {len(o.runs)} run(s), best rung {o.rung} ({rate}), score "
                 f"{o.score:.3f}{'  <- best so far' if improved else ''}")
        self.history.append({"phase": phase, "config_id": config.id, "runs": len(o.runs), "rung": o.rung,
                             "score": round(o.score, 4), "improved": improved})
        return o

    def trials(self) -> int:
        return len(self.outcomes)

    def budget_left(self) -> bool:
        """Room for another trial in the running server's group."""
        if self.trials() >= self.plan.max_trials:
            self.stop_reason = f"{self.plan.max_trials} configurations tried (--max-trials)"
            return False
        top = len(self.ev.ladder) - 1
        inc = self.incumbent.rung if self.incumbent is not None else -1
        rung = min(inc + 1, top)
        if self.ev.estimated_seconds(rung) > self.deadline() - self.clock():
            self.stop_reason = "budget spent"
            return False
        return True

    def affordable(self, g: Group) -> bool:
        """Can a run in ``g`` (with its server's start, unless it is the running one) end before the deadline?"""
        if self.ev.current is not None and self.ev.current.group == g:
            return True
        inc = self.incumbent.rung if self.incumbent is not None else -1
        return not self.out_of_time(min(inc + 1, len(self.ev.ladder) - 1), self.plan.space.seeds[g])

    def pruned(self, g: Group) -> bool:
        """No configuration of ``g`` met the SLO at any rung tried, and one missed it at the lowest rung."""
        os_ = [o for o in self.outcomes.values() if o.config.group == g]
        return bool(os_) and all(o.best is None for o in os_) and any(r.rung == 0 for o in os_ for r in o.runs)

    def order(self, groups: list[Group]) -> list[Group]:
        """``promise_order``; before the first start the folder's group counts as the running one: the baseline
        is measured first (the improvement is against it, and a calibration runs it)."""
        current = self.ev.current.group if self.ev.current is not None else None
        if current is None and not self.ev.started:
            current = self.plan.space.baseline.group
        return promise_order(groups, current=current,
                             dropped=set(self.dropped),
                             best_mode=self.incumbent.config.group.mode if self.incumbent is not None else None,
                             baseline_group=self.plan.space.baseline.group, start_estimate=self.ev.start_estimate)

    def run(self) -> None:
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        space = self.plan.space
        studies = {g: optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(
            seed=self.plan.seed + i, n_startup_trials=3, multivariate=True)) for i, g in enumerate(space.groups)}
        dists: dict[Group, dict[str, optuna.distributions.BaseDistribution]] = {
            g: {k.name: optuna.distributions.IntDistribution(k.lo, k.hi, log=k.log) for k in knobs_of(g.mode)}
            for g in space.groups}

        def tell(g: Group, o: Outcome) -> None:
            params = dict(o.config.knobs)
            if all(k.lo <= params[k.name] <= k.hi for k in knobs_of(g.mode)):  # a folder value outside: not told
                studies[g].add_trial(optuna.trial.create_trial(params=params, distributions=dists[g], value=o.score))

        # 1. a seed per group, in order of promise (the baseline is its group's seed: measured in that server)
        pending = list(space.groups)
        while pending:
            g = self.order(pending)[0]
            pending.remove(g)
            if self.trials() >= self.plan.max_trials:
                self.stop_reason = f"{self.plan.max_trials} configurations tried (--max-trials)"
                return
            seed = space.seeds[g]
            phase = "baseline" if seed == space.baseline else f"seed {g.label}"
            line = self.probe_line(g, seed) if self.incumbent is None else None
            if line is not None:
                lo = self.evaluate(line, f"step-cost line {g.label}", first=len(self.ev.ladder) - 1, allow_below=True)
                if lo.runs:
                    tell(g, lo)
            if self.incumbent is None:  # nothing to race against: bisection on the ladder from its top rung,
                # the shortest run (the arrivals span 1/12 of the lowest rung's): passing there ends it at once
                o = self.evaluate(seed, phase, first=len(self.ev.ladder) - 1, allow_below=True)
            else:
                o = self.evaluate(seed, phase)
            if not o.runs:
                continue  # skipped for budget (recorded); a group whose server runs may still fit
            tell(g, o)
            # A missed decode bound with the group's step-cost line measured: the budget the line allows, tried
            # now in the running server (a PUT, no start), before the other groups' seeds (starts) take the time.
            line_knobs = self.line_step(g)
            if line_knobs is not None and self.trials() < self.plan.max_trials:
                lo = self.evaluate(make_config(g, line_knobs), f"step-cost line {g.label}")
                if lo.runs:
                    tell(g, lo)
            if self.pruned(g):
                self.dropped.append(g)
                self.log(f"  dropped {g.label}: its seed misses the SLO at the lowest rung "
                         f"({self.ev.ladder[0]:.3g}/s)")
        # 2. successive halving over the measured groups left
        alive = [g for g in space.groups if g not in self.dropped and self.group_best(g)[0] > -2]
        if not alive:
            self.stop_reason = self.stop_reason or ("every group dropped" if self.dropped else "budget spent")
            return
        per_group, rnd = 2, 1
        while alive:
            fit = [g for g in alive if self.affordable(g)]
            if not fit:
                self.stop_reason = "budget spent"
                return
            ranked = sorted(fit, key=lambda g: self.group_best(g), reverse=True)
            alive = ranked[:max(1, math.ceil(len(ranked) / 2))] if len(ranked) > 1 else ranked
            alive = self.order(alive)  # the group whose server runs now first (one restart fewer)
            last = len(alive) == 1
            self.log(f"  round {rnd}: {', '.join(g.label for g in alive)}"
                     + (" (last group: until budget/patience)" if last else f", {per_group} trial(s) each"))
            for g in alive:
                stale = n = repeats = 0
                while last or n < per_group:
                    if not self.budget_left():
                        return
                    # a compass search first: the best's neighbours, the way its missed bound points first,
                    # recentred whenever one is better (``moves``); once none is left to measure, the sampler's
                    step = self.step(g)
                    if step is not None:
                        studies[g].enqueue_trial(step)
                    trial = studies[g].ask(dists[g])
                    config = make_config(g, dict(trial.params))
                    seen = config.id in self.outcomes
                    before = self.incumbent
                    o = self.evaluate(config, f"round {rnd} {g.label}")
                    if not o.runs:  # skipped for budget (its server's start, or the run, does not fit)
                        studies[g].tell(trial, state=optuna.trial.TrialState.FAIL)
                        if last:
                            self.stop_reason = "budget spent"
                            return
                        break
                    studies[g].tell(trial, o.score)
                    n += not seen
                    repeats = repeats + 1 if seen else 0
                    if not seen:  # patience counts measured configurations
                        stale = stale + 1 if self.incumbent is before else 0
                    if last and stale >= self.plan.patience:
                        self.stop_reason = f"{self.plan.patience} trials in a row without a better configuration"
                        return
                    if repeats >= 20:  # the sampler keeps proposing measured configurations: the group is done
                        if last:
                            self.stop_reason = f"the sampler found nothing new in {g.label}"
                            return
                        break
            if last:
                return
            per_group *= 2
            rnd += 1

    # --- the head-to-head at the end ---
    def verify_pair(self) -> tuple[Config, Config, int] | None:
        """(the chosen configuration, the folder's, the chosen one's rung) when they differ and the chosen one
        met the SLO; None: nothing to verify."""
        chosen, base = self.incumbent, self.plan.space.baseline
        if chosen is None or chosen.best is None or chosen.config == base:
            return None
        return chosen.config, base, chosen.best.rung

    def verify_sequence(self, chosen: Config, base: Config) -> list[Config]:
        """``VERIFY_RUNS`` runs each, alternating (ABBA...), starting with the one the running server has."""
        a, b = (base, chosen) if self.ev.needs_start(chosen) and not self.ev.needs_start(base) else (chosen, base)
        return [x for i in range(VERIFY_RUNS) for x in ((a, b) if i % 2 == 0 else (b, a))]

    def verify_cost(self, chosen: Config, base: Config, rung: int) -> float:
        """Predicted seconds of the head-to-head: its runs, and a server start (with the stop before it) at
        every switch between groups."""
        stop = max(self.ev.stops) if self.ev.stops else STOP_S
        running = self.ev.current.group if self.ev.server is not None and self.ev.current is not None else None
        total = 0.0
        for c in self.verify_sequence(chosen, base):
            if c.group != running:
                total += (self.ev.start_estimate(c.group) or 0.0) + (stop if running is not None else 0.0)
                running = c.group
            total += self.ev.estimated_seconds(rung)
        return total

    def verify_reserve(self) -> float:
        """The time the search leaves for the head-to-head of the best so far: its predicted cost while that
        is at most ``VERIFY_SHARE`` of the budget, else nothing (it then runs only if time is left)."""
        pair = self.verify_pair()
        if pair is None:
            return 0.0
        cost = self.verify_cost(*pair)
        return cost if cost <= VERIFY_SHARE * self.plan.budget_s else 0.0

    def verify(self) -> None:
        """The chosen configuration against the folder's, measured again: ``VERIFY_RUNS`` new runs each,
        alternating, at the chosen one's rung. The pick must hold up: meet the SLO in one of its runs at least,
        with a mean goodput at least the folder's or more runs meeting the SLO; otherwise the folder's
        configuration is kept (when it met the SLO somewhere: in these runs, or in the search's). The result,
        and the improvement it measures, go to ``verification``."""
        pair = self.verify_pair()
        if pair is None:
            return
        chosen, base, rung = pair
        self.verifying = True
        rate = self.ev.ladder[rung]
        info: dict[str, Any] = {"search_pick": chosen.id, "rung": rung, "rate_req_s": round(rate, 4),
                                "runs_each": VERIFY_RUNS}
        self.verification = info
        cost, left = self.verify_cost(chosen, base, rung), self.deadline() - self.clock()
        if cost > left:
            info["done"] = False
            info["why"] = f"predicted {cost:.0f} s, {max(left, 0.0):.0f} s left"
            self.log(f"  head-to-head with the folder's configuration skipped for budget ({info['why']})")
            return
        self.ev.deadline = self.deadline()
        runs: dict[str, list[Any]] = {chosen.id: [], base.id: []}
        for c in self.verify_sequence(chosen, base):
            r = self.ev.measure(c, rung, again=True)
            if r.cut:
                info["done"] = False
                info["why"] = "a run was cut at the deadline"
                self.log("  head-to-head with the folder's configuration cut at the deadline")
                return
            runs[c.id].append(r)
        good = {cid: [r.goodput(self.slo) for r in rs] for cid, rs in runs.items()}
        met = {cid: sum(r.met(self.slo) for r in rs) for cid, rs in runs.items()}
        mean_c = sum(good[chosen.id]) / len(good[chosen.id])
        mean_b = sum(good[base.id]) / len(good[base.id])
        holds = met[chosen.id] >= 1 and (mean_c >= mean_b or met[chosen.id] > met[base.id])
        old = self.outcomes.get(base.id)
        base_met = met[base.id] >= 1 or (old is not None and old.best is not None)
        keep_base = not holds and base_met
        info.update({"done": True, "chosen_goodput_req_s": [round(g, 4) for g in good[chosen.id]],
                     "baseline_goodput_req_s": [round(g, 4) for g in good[base.id]],
                     "chosen_met": met[chosen.id], "baseline_met": met[base.id],
                     "ratio": round(mean_c / mean_b, 4) if mean_b > 0 else None,
                     "kept": "baseline" if keep_base else "chosen"})
        self.log(f"  head-to-head at {rate:.3g}/s, {VERIFY_RUNS} runs each: chosen "
                 f"{', '.join(f'{g:.2f}' for g in good[chosen.id])} req/s (met {met[chosen.id]}), folder's "
                 f"{', '.join(f'{g:.2f}' for g in good[base.id])} (met {met[base.id]})"
                 + ("  -> the folder's configuration is kept" if keep_base else ""))
        if keep_base:
            passed = [r for r in runs[base.id] if r.met(self.slo)]
            if passed:  # it met the SLO at the pick's rung: that is its best now
                best = max(passed, key=lambda r: r.goodput(self.slo))
                o = Outcome(base, best, (old.runs if old else []) + runs[base.id], best.goodput(self.slo))
            else:  # what the search measured of it stands
                assert old is not None and old.best is not None
                o = Outcome(base, old.best, old.runs + runs[base.id], old.score)
            self.outcomes[base.id] = o
            self.incumbent = o

    def baseline_outcome(self) -> Outcome:
        """The folder's configuration's outcome (not measured when the budget never reached its group)."""
        b = self.plan.space.baseline
        return self.outcomes.get(b.id) or Outcome(b, None, [], 0.0)

    def moves(self, g: Group) -> list[dict[str, int]]:
        """The neighbours of ``g``'s best measured configuration (each knob doubled or halved, clipped to its
        range), the most promising first by the bound its best missed; empty when nothing was measured in ``g``.

        The evidence is the best configuration's lowest failing run above its passing rung (with no passing
        rung, its lowest run): which bounds it missed (``missed_bounds``).
        * A decode bound (ITL, TPOT) missed: the running sequences waited on the step. Rolling: a smaller
          ``max_rolling_batch_prefill_tokens`` first (a prefill chunk stalls every running decode), then fewer
          sequences; dynamic: a smaller ``batch_size`` first.
        * Otherwise (TTFT, E2E: the requests queued), or no failing run: a bigger batch first, for a rolling
          group both the sequences and the prefill tokens (a step's sequences and its tokens), then each alone.
        Before all of them, for a rolling group whose step-cost line is measured, the line's budget
        (``fitted_move``). The other directions follow. Run 6 of the tune-quality benchmark
        (benchmarks/README.md): the default model's grid found a prefill budget of 4096 tokens better than
        the folder's 2048 (TTFT bound), while the 110m model's tight SLO (ITL p99) was met best with 256."""
        evidence = self.evidence(g)
        if evidence is None:
            return []
        params, decode_bound = evidence
        knobs = knobs_of(g.mode)
        first, second = knobs[0].name, knobs[1].name  # sequences / batch; prefill tokens / delay

        def moved(**factors: float) -> dict[str, int]:
            out = dict(params)
            for name, f in factors.items():
                out[name] = int(out[name] * f)
                if name == "max_batch_delay" and f > 1 and params[name] == 0:
                    out[name] = 10  # doubling a delay of 0 ms: 10 ms
            return out

        if g.mode == "rolling":
            up = [moved(**{first: 2, second: 2}), moved(**{second: 2}), moved(**{first: 2})]
            down = [moved(**{second: 0.5}), moved(**{first: 0.5})]
            fitted = self.fitted_move(g, params, first, second)
            if fitted is not None:  # the line's budget first, whichever bound was missed
                up.insert(0, fitted)
                down.insert(0, fitted)
        else:
            up = [moved(**{first: 2}), moved(**{second: 0.5}), moved(**{second: 2})]
            down = [moved(**{first: 0.5})]
        here = make_config(g, params)
        out: list[dict[str, int]] = []
        for m in (down + up if decode_bound else up + down):
            c = make_config(g, m)
            if c != here and all(dict(c.knobs) != x for x in out):
                out.append(dict(c.knobs))
        return out

    def evidence(self, g: Group) -> tuple[dict[str, int], bool] | None:
        """``g``'s best measured configuration's knobs (clipped to their ranges) and whether its lowest failing
        run above its passing rung missed a decode bound (ITL, TPOT); None when nothing was measured in ``g``."""
        os_ = [o for o in self.outcomes.values() if o.config.group == g]
        if not os_:
            return None
        best = max(os_, key=lambda o: (o.rung, o.score))
        params = clipped_knobs(best.config)
        failing = sorted((r for r in best.runs if r.rung > best.rung and not r.met(self.slo)), key=lambda r: r.rung)
        decode_bound = bool(failing) and bool(missed_bounds(failing[0], self.slo, self.ev.stream) & {"itl", "tpot"})
        return params, decode_bound

    def probe_line(self, g: Group, seed: Config) -> Config | None:
        """With nothing meeting the SLO yet: ``seed``'s run at the top rung (the shortest; the seed's race
        reuses it), and when it missed the SLO, the configuration the group's step-cost line (read from the
        server just started) allows for the SLO's decode bound; None otherwise. Any missed bound will do: at
        the top rung requests queue, so TTFT is what a run misses first, while the line already says that
        the seed's longest steps break the ITL bound at any rate. That configuration is raced before the rest of the
        seed's bisection: on a tight budget the seed's runs down the ladder (the long ones) would otherwise
        take the time (the 110m model's tight SLO: a 97 s budget, 55 s of it the folder's bisection to the
        lowest rung), and the seed is then raced against what it found."""
        top = len(self.ev.ladder) - 1
        if g.mode != "rolling" or self.trials() >= self.plan.max_trials or self.out_of_time(top, seed):
            return None
        self.ev.deadline = self.deadline()
        probe = self.ev.measure(seed, top)
        if probe.cut or probe.met(self.slo):
            return None
        first, second = (k.name for k in knobs_of(g.mode))
        params = clipped_knobs(seed)
        move = self.fitted_move(g, params, first, second)
        config = None if move is None else make_config(g, move)
        return None if config is None or config == seed or config.id in self.outcomes else config

    def line_step(self, g: Group) -> dict[str, int] | None:
        """The step-cost line's move from ``g``'s best (``fitted_move``) when it is not measured yet; else None."""
        evidence = self.evidence(g)
        if g.mode != "rolling" or evidence is None:
            return None
        first, second = (k.name for k in knobs_of(g.mode))
        move = self.fitted_move(g, evidence[0], first, second)
        if move is None:
            return None
        config = make_config(g, move)
        return None if config.id in self.outcomes else dict(config.knobs)

    def fitted_move(self, g: Group, params: dict[str, int], seqs_knob: str, tokens_knob: str) -> dict[str, int] | None:
        """A rolling group's token budget cut to what its step-cost line (``serving.step_cost``, measured on
        the group's server) says is worth a step: at most the knee (``KNEE``: beyond it a bigger step adds
        little throughput but stalls every running sequence for longer), and with a decode bound (ITL, TPOT)
        in the SLO, what a step may compute within ``STEP_SHARE`` of the tightest one. One trial where halving
        the budget a measured run at a time takes several. None without a line, or when the budget is already
        below that (or the server never ran a step that long); the sequences are halved as well when the
        running ones alone would fill the step."""
        cost = self.ev.step_costs.get(g)
        line = None if cost is None else cost.fit()
        if cost is None or line is None:
            return None
        fixed, per_token = line
        knee = math.ceil(KNEE * fixed / per_token - 1e-6)  # 1e-6: a whole number of tokens stays whole
        limits = [b.limit_s for b in self.slo.bounds if b.metric in ("itl", "tpot")]
        fit = cost.tokens_within(STEP_SHARE * min(limits)) if limits else None
        tokens = knee if fit is None else min(knee, fit)
        if tokens >= params[tokens_knob] or tokens >= cost.max_tokens:
            return None  # the budget is below it, or no step the server ran was that long
        seqs = params[seqs_knob]
        if tokens < 2 * seqs:  # room for the decodes and a prefill chunk as large as them
            seqs = max(1, tokens // 2)
        if (g, tokens) not in self.lines_told:
            self.lines_told.add((g, tokens))
            bound = "" if fit is None else f", {fit} fit {STEP_SHARE:.0%} of {1000 * min(limits):g} ms"
            self.log(f"  step-cost line of {g.label}: {1000 * fixed:.1f} ms + {1000 * per_token:.3f} ms a token "
                     f"({cost.steps} steps, up to {cost.max_tokens} tokens): knee {knee} tokens{bound}")
        return {**params, seqs_knob: seqs, tokens_knob: tokens}

    def step(self, g: Group) -> dict[str, int] | None:
        """The first of ``moves(g)`` not measured yet (None: the best's neighbourhood is explored)."""
        return next((m for m in self.moves(g) if make_config(g, m).id not in self.outcomes), None)

    def group_best(self, g: Group) -> tuple[int, float]:
        os_ = [o for o in self.outcomes.values() if o.config.group == g]
        return max(((o.rung, o.score) for o in os_), default=(-2, 0.0))


# ------------------------------------------------------------------------------------------------ report
def _fmt_ms(v: float) -> str:
    return "n/a" if v != v else f"{v:.0f} ms" if v >= 10 else f"{v:.1f} ms"


def describe_outcome(o: Outcome, slo: Slo, ladder: list[float]) -> str:
    if o.best is not None:
        shown = ", ".join(f"{k} {_fmt_ms(v)}" for k, v in o.best.values_ms(slo).items())
        return (f"goodput {o.best.goodput(slo):.2f} req/s meeting the SLO at {o.best.rate:.3g} req/s offered "
                f"({shown})")
    if not o.runs:
        return "not measured (budget)"
    r = min(o.runs, key=lambda x: x.rung)
    vals = slo.run_values(r.recs)
    missed = [f"{b.key} {_fmt_ms(1000 * vals[b.key])} > {format_duration(b.limit_s)}" for b in slo.bounds
              if vals[b.key] == vals[b.key] and vals[b.key] > b.limit_s]
    failed = sum(1 for x in r.recs if x.error and not x.error.startswith("aborted"))
    if missed or failed:
        why = ", ".join(missed) or f"{failed} request(s) failed"
        return f"misses the SLO at {r.rate:.3g} req/s ({why}{'; run stopped early' if r.aborted else ''})"
    return f"misses the SLO at {r.rate:.3g} req/s (run stopped once too many requests were certainly over a bound)"


def knob_reasons(chosen: Outcome, outcomes: list[Outcome], slo: Slo, ladder: list[float]) -> dict[str, str]:
    """For each setting of the chosen configuration, the measurement behind it: the best measured configuration
    that differs in that setting, and what it got."""
    reasons = {}
    c = chosen.config
    settings: dict[str, Any] = {"mode": c.group.mode, "workers": c.group.workers, "threads": c.group.threads,
                                **dict(c.knobs)}

    def value(o: Outcome, key: str) -> Any:
        g = o.config.group
        return {"mode": g.mode, "workers": g.workers, "threads": g.threads}.get(key, dict(o.config.knobs).get(key))

    ranked = sorted(outcomes, key=lambda o: (o.rung, o.score), reverse=True)
    for key, v in settings.items():
        others = [o for o in ranked if value(o, key) != v and o.runs]
        if not others:
            reasons[key] = "no other value measured"
            continue
        o = others[0]
        other = value(o, key)
        reasons[key] = (f"best with {key}={other if other is not None else '(' + o.config.group.mode + ')'}: "
                        f"{describe_outcome(o, slo, ladder)}")
    return reasons


def annotated_properties(model_dir: Path, chosen: Outcome, reasons: dict[str, str], header: list[str]) -> str:
    from serving.bench.launch import read_properties

    props = read_properties(model_dir)
    new = chosen.config.properties()
    tuned_keys = {"option.rolling_batch": "mode", "minWorkers": "workers", "maxWorkers": "workers",
                  "option.num_threads": "threads", **{k.prop: k.name for k in KNOBS}}
    # the other mode's knobs do nothing in the chosen mode: drop them
    other = {k.prop for m in ("rolling", "dynamic") if m != chosen.config.group.mode for k in knobs_of(m)}
    lines = [f"# {h}" for h in header]
    written = set()
    for key, value in props.items():
        if key in other:
            lines.append(f"# {key}={value}  (removed by serving tune: not used with "
                         f"{chosen.config.group.mode} batching)")
            continue
        if key in new:
            lines.append(f"# {tuned_keys[key]}: {reasons.get(tuned_keys[key], '')}")
            lines.append(f"{key}={new[key]}")
            written.add(key)
        else:
            lines.append(f"{key}={value}")
    for key, v in new.items():
        if key not in written and v is not None:
            lines.append(f"# {tuned_keys[key]}: {reasons.get(tuned_keys[key], '')}")
            lines.append(f"{key}={v}")
    return "\n".join(lines) + "\n"


def report_doc(plan: Plan, tuner: Tuner, ladder: list[float], calibration: dict[str, Any] | None,
               wall_s: float, times: dict[str, float] | None = None) -> dict[str, Any]:
    slo = plan.slo
    ev = tuner.ev
    base = tuner.baseline_outcome()
    chosen = tuner.incumbent or base
    runs = [r.row(slo) for r in ev.order]

    def summary(o: Outcome) -> dict[str, Any]:
        return {"config_id": o.config.id, "label": o.config.id, "properties": o.config.properties(),
                "meets_slo": o.best is not None, "goodput_req_s": round(o.best.goodput(slo), 4) if o.best else 0.0,
                "rate_req_s": round(o.best.rate, 4) if o.best else None,
                "slo_values_ms": {k: round(v, 2) for k, v in o.best.values_ms(slo).items()} if o.best else None,
                "result": describe_outcome(o, slo, ladder)}

    configs = sorted(tuner.outcomes.values(), key=lambda o: (o.rung, o.score), reverse=True)
    b, c = summary(base), summary(chosen)
    improvement = (c["goodput_req_s"] / b["goodput_req_s"]) if b["goodput_req_s"] > 0 else None
    v = tuner.verification
    if v is not None and v.get("done"):  # the head-to-head's ratio of means (1: the folder's kept)
        improvement = 1.0 if v["kept"] == "baseline" else v["ratio"]
    return {"model": plan.model_dir.resolve().name, "model_dir": str(plan.model_dir.resolve()),
            "slo": {"spec": str(slo), "bounds": [{"key": x.key, "limit_ms": x.limit_s * 1000} for x in slo.bounds]},
            "scenario": plan.scenario.describe(), "ladder_req_s": [round(x, 4) for x in ladder],
            "calibration": calibration, "budget_s": plan.budget_s, "wall_s": round(wall_s, 1),
            "stopped": tuner.stop_reason or "search complete",
            "time_s": {k: round(v, 1) for k, v in (times or {}).items()},
            "server_starts": [{"group": g, "seconds": round(s, 1)} for g, s in ev.restarts],
            "server_stops_s": [round(s, 1) for s in ev.stops],
            "live_knob_changes": ev.knob_changes,
            "dropped_groups": [g.label for g in tuner.dropped],
            "skipped_for_budget": tuner.skipped,
            "runs_cut_at_deadline": [{"config_id": r.config.id, "rung": r.rung, "seconds": round(r.seconds, 1)}
                                     for r in ev.cut],
            # the improvement as the printed line rounds it
            "baseline": b, "chosen": c, "improvement": None if improvement is None else round(improvement, 2),
            "head_to_head": v,
            "configurations": [summary(o) | {"runs": len(o.runs)} for o in configs],
            "step_cost_lines": {g.label: step_line_summary(cost) for g, cost in ev.step_costs.items()},
            "history": tuner.history, "runs": runs}


def clipped_knobs(config: Config) -> dict[str, int]:
    """``config``'s live knobs, each clipped to its range (a folder's value may lie outside)."""
    return {k.name: min(max(int(config.knob(k.name)), k.lo), k.hi) for k in knobs_of(config.group.mode)}


def step_line_summary(cost: StepCost) -> dict[str, Any]:
    """A group's step-cost line as the report shows it (``fixed_ms``/``per_token_ms`` None: no line)."""
    line = cost.fit()
    return {"steps": cost.steps, "max_tokens": cost.max_tokens,
            "fixed_ms": None if line is None else round(1000 * line[0], 3),
            "per_token_ms": None if line is None else round(1000 * line[1], 4)}


def cmd_tune(args: argparse.Namespace) -> int:
    try:
        plan = _plan(args)
    except (ScenarioError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        print(plan.text())
        return 0
    return tune(plan, args.out or Path(f"tune-{plan.model_dir.resolve().name}"), started=process_started())


def _plan(args: argparse.Namespace) -> Plan:
    from serving.errors import ConfigError

    if not args.model_dir.is_dir():
        raise ValueError(f"{args.model_dir}: model folder not found")
    slo = parse_slo(args.slo)
    scenario = load_scenario(args.scenario)
    if args.num_requests is not None:
        if args.num_requests < 1:
            raise ValueError("--num-requests must be >= 1")
        scenario = replace(scenario, num_requests=args.num_requests)
    if not any(p.sweep_index is not None for p in scenario.passes):
        raise ScenarioError(f"{scenario.source}: serving tune needs a load ladder: an arrival pass "
                            f"{{process: sweep, rates: ...}}")
    if args.max_trials < 1 or args.patience < 1:
        raise ValueError("--max-trials and --patience must be >= 1")
    modes = tuple(m.strip() for m in args.modes.split(",")) if args.modes else None
    try:
        space = build_space(args.model_dir, modes, args.workers, args.threads)
    except ConfigError as exc:
        raise ValueError(str(exc)) from None
    return Plan(args.model_dir, slo, scenario, space, parse_budget(args.budget), args.max_trials, args.patience,
                args.seed)


def improvement_text(base: Outcome, chosen: Outcome, slo: Slo, verification: dict[str, Any] | None = None) -> str:
    """The line comparing the chosen configuration with the folder's: the head-to-head's (``Tuner.verify``)
    when it ran, else the search's runs."""
    if chosen.best is None:
        return "no configuration met the SLO at any rung of the ladder: loosen the SLO or lower the scenario's rates"
    v = verification or {}
    if v.get("done"):
        c, b = v["chosen_goodput_req_s"], v["baseline_goodput_req_s"]
        mc, mb = sum(c) / len(c), sum(b) / len(b)
        how = (f"measured again head to head, {v['runs_each']} runs each at {v['rate_req_s']:.3g} req/s, "
               f"alternating: mean {mc:.2f} req/s for the search's pick (met the SLO in {v['chosen_met']}), "
               f"{mb:.2f} for the folder's (met in {v['baseline_met']})")
        if v["kept"] == "baseline":
            return f"improvement: none, so the folder's configuration is kept ({how})"
        ratio = (f"{v['ratio']:.2f}x the baseline's goodput" if v["ratio"] is not None
                 else "no ratio (the baseline's goodput was 0)")
        return f"improvement: {ratio} ({how})"
    note = f" (not measured again: {v['why']})" if v else ""
    return _search_improvement(base, chosen, slo) + note


def _search_improvement(base: Outcome, chosen: Outcome, slo: Slo) -> str:
    assert chosen.best is not None
    got = chosen.best.goodput(slo)
    if base.best is not None:
        return (f"improvement: {got / base.best.goodput(slo):.2f}x the baseline's goodput "
                f"({got:.2f} vs {base.best.goodput(slo):.2f} req/s)")
    if not base.runs:
        return ("improvement: not known: the baseline was not measured (the budget ran out before it); the "
                f"chosen configuration's goodput is {got:.2f} req/s")
    low = min(r.rung for r in base.runs)
    if low == 0:
        return "improvement: the baseline meets the SLO at no rung of the ladder; the chosen configuration does"
    rate = min(base.runs, key=lambda r: r.rung).rate
    return (f"improvement: the baseline misses the SLO at {rate:.3g} req/s (raced: not tried lower), which the "
            f"chosen configuration meets ({got:.2f} req/s goodput at {chosen.best.rate:.3g} req/s offered)")


def tune(plan: Plan, out: Path, started: float | None = None) -> int:
    """Run the tune; ``started``: ``time.monotonic()`` from which ``--budget`` counts (default: now)."""
    import yaml

    from serving.bench.plots import tune_figure
    from serving.bench.runner import workload_of
    from serving.bench.workload import load_tokenizer

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    t0 = time.monotonic() if started is None else started
    setup_at = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    print(plan.text(), file=sys.stderr, flush=True)
    w = workload_of(plan.scenario, load_tokenizer(plan.model_dir))
    sweep = [p for p in plan.scenario.passes if p.sweep_index is not None]
    ev = Evaluator(plan.model_dir, out / "servers", w, [], plan.scenario.api, [plan.slo], log)
    ev.baseline = plan.space.baseline
    tuner = Tuner(plan, ev, log, t0 + plan.budget_s)
    calibration = None
    search_at = time.monotonic()
    try:
        if any(p.rate is not None and p.rate.relative for p in sweep):
            m = ev.burst(plan.space.baseline)
            if not m.get("request_s"):
                raise RuntimeError(f"the calibration burst pass failed: {m.get('errors')}")
            calibration = {"burst_req_s": round(m["request_s"], 4), "burst_output_tok_s": round(m["output_tok_s"], 2)}
            log(f"  calibration: the baseline's burst pass served {m['request_s']:.3f} req/s "
                f"({m['output_tok_s']:.1f} tok/s)")
        burst_req_s = calibration["burst_req_s"] if calibration else None
        ladder = [p.rate.resolve(burst_req_s, plan.scenario.source) for p in sweep if p.rate is not None]
        ev.ladder = ladder
        log("  ladder (req/s): " + ", ".join(f"{x:.3g}" for x in ladder))
        tuner.run()
        tuner.verify()
    except (RuntimeError, ScenarioError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        stop_at, stops_before = time.monotonic(), sum(ev.stops)
        ev.close()
    finish_at = time.monotonic()
    runs_s = sum(r.seconds for r in ev.order) + sum(r.seconds for r in ev.cut)
    starts_s = sum(s for _, s in ev.restarts)
    times = {"before_tune": setup_at - t0, "setup": search_at - setup_at, "server_starts": starts_s,
             "runs": runs_s, "server_stops": sum(ev.stops),
             "other_search": (stop_at - search_at) - starts_s - runs_s - stops_before,
             "deadline_left": tuner.end - finish_at}
    wall = time.monotonic() - t0
    doc = report_doc(plan, tuner, ladder, calibration, wall, times)
    base = tuner.baseline_outcome()
    chosen = tuner.incumbent or base
    header = [f"serving tune {time.strftime('%Y-%m-%d %H:%M')}: SLO {plan.slo}; scenario {plan.scenario.name} "
              f"({plan.scenario.num_requests} requests a run, Poisson ladder {ladder[0]:.3g}-{ladder[-1]:.3g} req/s)",
              f"{len(ev.order)} runs of {len(tuner.outcomes)} configurations in {wall / 60:.1f} min "
              f"({doc['stopped']})",
              f"chosen: {describe_outcome(chosen, plan.slo, ladder)}",
              f"the folder's configuration: {describe_outcome(base, plan.slo, ladder)}",
              improvement_text(base, chosen, plan.slo, tuner.verification)]
    reasons = knob_reasons(chosen, list(tuner.outcomes.values()), plan.slo, ladder)
    (out / "serving.properties").write_text(annotated_properties(plan.model_dir, chosen, reasons, header))
    tune_figure(doc, out / "tune-report.png")
    wall = time.monotonic() - t0
    doc["wall_s"] = round(wall, 1)
    (out / "tune-report.yaml").write_text(yaml.safe_dump(doc, sort_keys=False, width=120))
    print(f"baseline (the folder's configuration): {base.config.id}\n  {describe_outcome(base, plan.slo, ladder)}")
    print(f"chosen: {chosen.config.id}\n  {describe_outcome(chosen, plan.slo, ladder)}")
    print(improvement_text(base, chosen, plan.slo, tuner.verification))
    skipped = f", {len(tuner.skipped)} skipped for budget" if tuner.skipped else ""
    print(f"{len(ev.order)} runs of {len(tuner.outcomes)} configurations, {len(ev.restarts)} server start(s), "
          f"{ev.knob_changes} live knob change(s){skipped}, {wall:.0f} s of a {plan.budget_s:.0f} s budget "
          f"({doc['stopped']})")
    print(f"wrote {out / 'serving.properties'}, {out / 'tune-report.yaml'}, {out / 'tune-report.png'}")
    return 0 if chosen.best is not None else 1
