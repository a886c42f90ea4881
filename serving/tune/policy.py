"""The search (``Tuner``): a seed per group in order of promise, then successive halving over the groups left,
within each group a compass search from its best and then what a TPE sampler (optuna) proposes; every server
start and run predicted first (``serving.tune.costs``) and skipped when it would end after the budget."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from serving.bench.run_metrics import Slo
from serving.tune import costs, verify
from serving.tune.moves import LineMove, compass, evidence, fitted_move
from serving.tune.plan import Plan, promise_order
from serving.tune.protocols import Evaluator
from serving.tune.racing import Outcome, better, race
from serving.tune.space import Config, Group, clipped_knobs, knobs_of, make_config


@dataclass(frozen=True)
class Trial:
    """One configuration raced: the search's history, in order."""

    phase: str
    config_id: str
    runs: int
    rung: int
    score: float
    improved: bool


@dataclass(frozen=True)
class Skip:
    """A run (with a server start when ``server_start_s``) left out because it would end after the budget."""

    config_id: str
    rung: int
    rate_req_s: float
    server_start_s: float
    run_s: float
    left_s: float


@dataclass
class Tuner:
    """The search. ``end``: ``clock()`` by which the whole tune (its report written) should be done."""

    plan: Plan
    ev: Evaluator
    log: Callable[[str], None]
    end: float
    clock: Callable[[], float] = time.monotonic
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    incumbent: Outcome | None = None
    history: list[Trial] = field(default_factory=list)
    skipped: list[Skip] = field(default_factory=list)
    dropped: list[Group] = field(default_factory=list)
    stop_reason: str = ""
    lines_told: set[tuple[Group, int]] = field(default_factory=set)  # step-cost moves already logged
    verifying: bool = False  # the head-to-head runs now: the search's reserve for it is free
    verification: verify.Verification | None = None  # what ``verify`` found (None: nothing to verify)

    @property
    def slo(self) -> Slo:
        return self.plan.slo

    # --- the budget ---
    def finish_estimate(self) -> float:
        """The tune's end after the search: the last server's stop and the report."""
        return costs.stop_estimate(self.ev) + costs.REPORT_S

    def deadline(self) -> float:
        """When the search must be over (the head-to-head's reserve kept: ``verify_reserve``)."""
        return self.end - self.finish_estimate() - (0.0 if self.verifying else self.verify_reserve())

    def out_of_time(self, rung: int, config: Config, record: bool = True) -> bool:
        """Would a run of ``config`` at ``rung`` (with a server start when its group is not the running one)
        end after the deadline? Records what it skips."""
        start, run = costs.switch_cost(self.ev, config, rung)
        left = self.deadline() - self.clock()
        if start + run <= left:
            return False
        if record and not any(x.config_id == config.id and x.rung == rung for x in self.skipped):
            self.skipped.append(Skip(config.id, rung, round(self.ev.ladder[rung], 4), round(start, 1),
                                     round(run, 1), round(max(left, 0.0), 1)))
            self.log(f"  skipped for budget: {config.id} at {self.ev.ladder[rung]:.3g}/s"
                     f"{f' (with a server start, {start:.0f} s)' if start else ''}: predicted {start + run:.0f} s, "
                     f"{max(left, 0.0):.0f} s left")
        return True

    def budget_left(self) -> bool:
        """Room for another trial in the running server's group."""
        if self.trials() >= self.plan.max_trials:
            self.stop_reason = f"{self.plan.max_trials} configurations tried (--max-trials)"
            return False
        if costs.run_estimate(self.ev, self.next_rung()) > self.deadline() - self.clock():
            self.stop_reason = "budget spent"
            return False
        return True

    def affordable(self, g: Group) -> bool:
        """Can a run in ``g`` (with its server's start, unless it is the running one) end before the deadline?"""
        if self.ev.current is not None and self.ev.current.group == g:
            return True
        return not self.out_of_time(self.next_rung(), self.plan.space.seeds[g])

    def next_rung(self) -> int:
        inc = self.incumbent.rung if self.incumbent is not None else -1
        return min(inc + 1, len(self.ev.ladder) - 1)

    # --- trials ---
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
        self.history.append(Trial(phase, config.id, len(o.runs), o.rung, round(o.score, 4), improved))
        return o

    def trials(self) -> int:
        return len(self.outcomes)

    def pruned(self, g: Group) -> bool:
        """No configuration of ``g`` met the SLO at any rung tried, and one missed it at the lowest rung."""
        os_ = [o for o in self.outcomes.values() if o.config.group == g]
        return bool(os_) and all(o.best is None for o in os_) and any(r.rung == 0 for o in os_ for r in o.runs)

    def group_best(self, g: Group) -> tuple[int, float]:
        os_ = [o for o in self.outcomes.values() if o.config.group == g]
        return max(((o.rung, o.score) for o in os_), default=(-2, 0.0))

    def order(self, groups: list[Group]) -> list[Group]:
        """``promise_order``; before the first start the folder's group counts as the running one: the baseline
        is measured first (the improvement is against it, and a calibration runs it)."""
        current = self.ev.current.group if self.ev.current is not None else None
        if current is None and not self.ev.started:
            current = self.plan.space.baseline.group
        return promise_order(groups, current=current, dropped=set(self.dropped),
                             best_mode=self.incumbent.config.group.mode if self.incumbent is not None else None,
                             baseline_group=self.plan.space.baseline.group,
                             start_estimate=lambda g: costs.start_estimate(self.ev, g))

    # --- where to go next in a group ---
    def line_move(self, g: Group, params: dict[str, int]) -> LineMove | None:
        """The step-cost line's budget from ``params`` (``fitted_move``), logged once per group and budget."""
        if g.mode != "rolling":
            return None
        move = fitted_move(self.ev.step_costs.get(g), self.slo, params)
        if move is not None and (g, move.tokens) not in self.lines_told:
            self.lines_told.add((g, move.tokens))
            self.log(f"  step-cost line of {g.label}: {move.note}")
        return move

    def moves(self, g: Group) -> list[dict[str, int]]:
        """The neighbours of ``g``'s best measured configuration (``compass``); empty when nothing was measured
        in ``g``."""
        ev = evidence(self.outcomes.values(), g, self.slo, self.ev.stream)
        return [] if ev is None else compass(g, ev, self.line_move(g, ev.knobs))

    def step(self, g: Group) -> dict[str, int] | None:
        """The first of ``moves(g)`` not measured yet (None: the best's neighbourhood is explored)."""
        return next((m for m in self.moves(g) if make_config(g, m).id not in self.outcomes), None)

    def line_step(self, g: Group) -> dict[str, int] | None:
        """The step-cost line's move from ``g``'s best when it is not measured yet; else None."""
        ev = evidence(self.outcomes.values(), g, self.slo, self.ev.stream)
        move = None if ev is None else self.line_move(g, ev.knobs)
        if move is None:
            return None
        config = make_config(g, move.knobs)
        return None if config.id in self.outcomes else dict(config.knobs)

    def probe_line(self, g: Group, seed: Config) -> Config | None:
        """With nothing meeting the SLO yet: ``seed``'s run at the top rung (the shortest; the seed's race
        reuses it), and when it missed the SLO, the configuration the group's step-cost line (read from the
        server just started) allows; None otherwise. Any missed bound will do: at the top rung requests queue,
        so TTFT is what a run misses first, while the line already says whether the seed's longest steps break
        a decode bound at any rate. Raced before the rest of the seed's bisection, whose runs down the ladder
        (the long ones) would otherwise take a tight budget's time."""
        top = len(self.ev.ladder) - 1
        if g.mode != "rolling" or self.trials() >= self.plan.max_trials or self.out_of_time(top, seed):
            return None
        self.ev.deadline = self.deadline()
        probe = self.ev.measure(seed, top)
        if probe.cut or probe.met(self.slo):
            return None
        move = self.line_move(g, clipped_knobs(seed))
        config = None if move is None else make_config(g, move.knobs)
        return None if config is None or config == seed or config.id in self.outcomes else config

    # --- the search ---
    def run(self) -> None:
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        space = self.plan.space
        studies = {g: optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(
            seed=self.plan.seed + i, n_startup_trials=3, multivariate=True)) for i, g in enumerate(space.groups)}
        dists: dict[Group, dict[str, Any]] = {
            g: {k.name: optuna.distributions.IntDistribution(k.lo, k.hi, log=k.log) for k in knobs_of(g.mode)}
            for g in space.groups}

        def tell(g: Group, o: Outcome) -> None:
            params = dict(o.config.knobs)
            if all(k.lo <= params[k.name] <= k.hi for k in knobs_of(g.mode)):  # a folder value outside: not told
                studies[g].add_trial(optuna.trial.create_trial(params=params, distributions=dists[g], value=o.score))

        if not self.seed_groups(tell):
            return
        self.halving(studies, dists)

    def seed_groups(self, tell: Callable[[Group, Outcome], None]) -> bool:
        """A seed per group, in order of promise (the baseline is its group's seed, measured in that server).
        False: the search is over."""
        space = self.plan.space
        pending = list(space.groups)
        while pending:
            g = self.order(pending)[0]
            pending.remove(g)
            if self.trials() >= self.plan.max_trials:
                self.stop_reason = f"{self.plan.max_trials} configurations tried (--max-trials)"
                return False
            seed = space.seeds[g]
            phase = "baseline" if seed == space.baseline else f"seed {g.label}"
            line = self.probe_line(g, seed) if self.incumbent is None else None
            if line is not None:
                lo = self.evaluate(line, f"step-cost line {g.label}", first=len(self.ev.ladder) - 1, allow_below=True)
                if lo.runs:
                    tell(g, lo)
            if self.incumbent is None:  # nothing to race against: bisection on the ladder from its top rung,
                # the shortest run: passing there ends it at once
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
        if not any(g not in self.dropped and self.group_best(g)[0] > -2 for g in space.groups):
            self.stop_reason = self.stop_reason or ("every group dropped" if self.dropped else "budget spent")
            return False
        return True

    def halving(self, studies: dict[Group, Any], dists: dict[Group, dict[str, Any]]) -> None:
        """Successive halving over the measured groups left: each round keeps the better half and doubles the
        trials per group; the last group goes on until the budget, ``--max-trials`` or ``--patience``."""
        import optuna

        alive = [g for g in self.plan.space.groups if g not in self.dropped and self.group_best(g)[0] > -2]
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
                    # the compass search first, recentred whenever a neighbour is better; then the sampler's
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

    def verify_reserve(self) -> float:
        """The time the search leaves for the head-to-head of the best so far: its predicted cost while that
        is at most ``VERIFY_SHARE`` of the budget, else nothing (it then runs only if time is left)."""
        pair = self.verify_pair()
        if pair is None:
            return 0.0
        cost = verify.cost(self.ev, *pair)
        return cost if cost <= verify.VERIFY_SHARE * self.plan.budget_s else 0.0

    def verify(self) -> None:
        """The head-to-head (``serving.tune.verify``); when the folder's configuration is kept, it becomes the
        incumbent with what it measured."""
        pair = self.verify_pair()
        if pair is None:
            return
        chosen, base, rung = pair
        self.verifying = True
        self.ev.deadline = self.deadline()
        old = self.outcomes.get(base.id)
        v, base_runs = verify.head_to_head(self.ev, self.slo, chosen, base, rung, self.deadline() - self.clock(),
                                           old is not None and old.best is not None, self.log)
        self.verification = v
        if v.kept != "baseline":
            return
        passed = [r for r in base_runs if r.met(self.slo)]
        if passed:  # it met the SLO at the pick's rung: that is its best now
            best = max(passed, key=lambda r: r.goodput(self.slo))
            o = Outcome(base, best, (old.runs if old else []) + base_runs, best.goodput(self.slo))
        else:  # what the search measured of it stands
            assert old is not None and old.best is not None
            o = Outcome(base, old.best, old.runs + base_runs, old.score)
        self.outcomes[base.id] = o
        self.incumbent = o

    def baseline_outcome(self) -> Outcome:
        """The folder's configuration's outcome (not measured when the budget never reached its group)."""
        b = self.plan.space.baseline
        return self.outcomes.get(b.id) or Outcome(b, None, [], 0.0)
