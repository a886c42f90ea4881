"""What a tune will do, as data (``Plan.steps``) and as the text ``--dry-run`` prints."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from serving.bench.run_metrics import Slo
from serving.bench.scenario import Scenario
from serving.tune.costs import REPORT_S
from serving.tune.space import Group, Space, knobs_of
from serving.tune.verify import VERIFY_RUNS, VERIFY_SHARE


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


@dataclass(frozen=True)
class PlanStep:
    kind: str  # calibrate | seeds | halving | head_to_head | write
    summary: str
    items: tuple[str, ...] = ()  # what the step goes through (the seeds in order, the knobs and their ranges)


@dataclass(frozen=True)
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

    def steps(self) -> tuple[PlanStep, ...]:
        b = self.space.baseline
        order = promise_order(self.space.groups, current=b.group, baseline_group=b.group)
        out = []
        if self.calibrates:
            out.append(PlanStep("calibrate", "a burst pass of the baseline (the first server) makes the relative "
                                             "rates req/s"))
        out.append(PlanStep(
            "seeds", "one server start per group, in order of promise (the running server's group first, then the "
                     "cheapest to start; a layout that failed in a dropped group last); its seed is raced against "
                     f"the best so far (with no best yet, bisection from the top rung, {len(self.ladder_spec()) - 1}); "
                     "a group whose seed misses the SLO at the lowest rung is dropped",
            tuple(self.space.seeds[g].id + ("  (the baseline)" if self.space.seeds[g] == b else "") for g in order)))
        out.append(PlanStep(
            "halving", "successive halving over the groups left (keep the better half, double the trials per group "
                       "each round): a compass search from each group's best, the way the missed bound points "
                       "first, then TPE (optuna) proposals; knobs changed with PUT /models/{name}, no restart; the "
                       f"last group until the budget, {self.max_trials} configurations, or {self.patience} trials "
                       "in a row without a better one. Every start and run is predicted first and skipped if it "
                       f"would end after the budget ({REPORT_S:.0f} s and a server stop kept for the end); a run "
                       "still going at the deadline is cut, a start still loading then is stopped",
            tuple(f"{mode} {k.name} in [{k.lo}, {k.hi}]{' (log scale)' if k.log else ''}"
                  for mode in sorted({g.mode for g in self.space.groups}) for k in knobs_of(mode))))
        out.append(PlanStep(
            "head_to_head", f"head to head: the chosen configuration and the baseline measured again, {VERIFY_RUNS} "
                            "runs each, alternating, at the chosen one's rung (time kept for it when it costs at "
                            f"most {VERIFY_SHARE:.0%} of the budget); the baseline is kept unless the pick holds up"))
        out.append(PlanStep("write", "write serving.properties (annotated), tune-report.yaml, tune-report.png; print "
                                     "the improvement over the baseline"))
        return tuple(out)

    def text(self) -> str:
        lines = [f"serving tune {self.model_dir}: SLO {self.slo}, budget {self.budget_s / 60:.1f} min, at most "
                 f"{self.max_trials} configurations",
                 f"scenario {self.scenario.name} ({self.scenario.source}): {self.scenario.num_requests} requests a "
                 f"run, api {self.scenario.api}; load ladder (Poisson rates): {', '.join(self.ladder_spec())}"
                 + ("  (x = times the baseline's burst throughput, measured first)" if self.calibrates else ""),
                 f"baseline (the folder's configuration, measured in its group's server): {self.space.baseline.id}",
                 ""]
        for n, step in enumerate(self.steps(), 1):
            lines.append(f"{n}. {step.summary}")
            lines += [f"     {item}" for item in step.items]
        return "\n".join(lines)
