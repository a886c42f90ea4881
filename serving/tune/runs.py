"""One run of a configuration (a pass of the workload at one rung of the load ladder) and what it says
about an SLO: met, goodput, slack, the bounds it missed, and whether a run still going can no longer meet it
(the early stop that makes a failing run cheap)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from serving.bench.run_metrics import Bound, Rec, RunResult, Slo, metrics
from serving.tune.space import Config


@dataclass
class Run:
    """One rung of one configuration: a pass of the workload at ``rate``."""

    config: Config
    rung: int
    rate: float
    recs: list[Rec]
    expected: list[int]
    seconds: float  # wall time of the run, including its drain and the settling after an abort
    aborted: bool
    wall_s: float  # first send -> last answer (or the abort): goodput's denominator
    violated_at: dict[str, float] = field(default_factory=dict)  # SLO spec -> seconds into the run
    cut: bool = False  # stopped at the evaluator's deadline (the budget): no measurement, never cached

    def met(self, slo: Slo) -> bool:
        return not self.aborted and slo.run_meets(self.recs)

    def goodput(self, slo: Slo) -> float:
        good = sum(1 for r in self.recs if slo.request_meets(r))
        return good / self.wall_s if self.wall_s > 0 else 0.0

    def values_ms(self, slo: Slo) -> dict[str, float]:
        return {k: 1000 * v for k, v in slo.run_values(self.recs).items()}

    def slack(self, slo: Slo) -> float:
        """min over bounds of min(1, bound / value): 1 when every bound holds."""
        vals = slo.run_values(self.recs)
        worst = 1.0
        for b in slo.bounds:
            v = vals[b.key]
            if v == v and v > 0:
                worst = min(worst, b.limit_s / v)
        failed = sum(1 for r in self.recs if r.error is not None and not r.error.startswith("aborted"))
        return worst * (1 - failed / len(self.recs))

    def seconds_for(self, slo: Slo) -> float:
        """What this run would have cost a search for ``slo`` alone (it stops at that SLO's violation)."""
        t = self.violated_at.get(str(slo))
        return self.seconds if t is None else min(self.seconds, t + 1.0)

    def row(self, slo: Slo) -> dict[str, Any]:
        m = metrics(RunResult(self.recs), self.expected)
        return {"config_id": self.config.id, "group": self.config.group.label, "knobs": dict(self.config.knobs),
                "rung": self.rung, "rate_req_s": round(self.rate, 4), "slo_met": self.met(slo),
                "goodput_req_s": round(self.goodput(slo), 4), "aborted": self.aborted,
                "slo_values_ms": {k: round(v, 2) for k, v in self.values_ms(slo).items()},
                "output_tok_s": round(m.get("output_tok_s", 0.0), 2), "completed": m.get("completed", 0),
                "failed": sum(1 for r in self.recs if r.error and not r.error.startswith("aborted")),
                "seconds": round(self.seconds, 2)}


def certainly_violated(slo: Slo, recs: list[Rec], expected: list[int], stream: bool, now: float) -> bool:
    """True when the run cannot meet ``slo`` whatever its open requests do: a request failed, or a bound's
    percentile is already over its limit counting only values known to exceed it (mean bounds: never)."""
    if any(r.error is not None for r in recs):
        return True
    started = _started(recs, expected, now)
    return any(_certainly_over(b, recs, expected, started, stream, now) for b in slo.bounds)


def _started(recs: list[Rec], expected: list[int], now: float) -> list[tuple[Rec, int]]:
    """The requests sent by ``now``, with their expected output lengths."""
    return [(r, n) for r, n in zip(recs, expected, strict=True) if r.send <= now]


def _certainly_over(b: Bound, recs: list[Rec], expected: list[int], started: list[tuple[Rec, int]], stream: bool,
                    now: float) -> bool:
    """``b``'s percentile is over its limit counting only values known (by ``now``) to exceed it."""
    if b.stat == "mean":
        return False
    over, total = _over_and_total(b, recs, expected, started, stream, now)
    return bool(total) and over >= total - math.floor((total - 1) * float(b.stat[1:]) / 100)


def missed_bounds(run: Run, slo: Slo, stream: bool) -> set[str]:
    """The metrics (ttft, tpot, itl, e2e) whose bound ``run`` missed: over the limit on the requests it finished,
    or, for a run stopped early, certainly over counting its open requests at the stop."""
    vals = slo.run_values(run.recs)
    missed = {b.metric for b in slo.bounds if vals[b.key] == vals[b.key] and vals[b.key] > b.limit_s}
    if run.aborted and run.recs:
        now = min(r.send for r in run.recs) + run.wall_s
        started = _started(run.recs, run.expected, now)
        missed |= {b.metric for b in slo.bounds
                   if _certainly_over(b, run.recs, run.expected, started, stream, now)}
    return missed


def _over_and_total(b: Bound, recs: list[Rec], expected: list[int], started: list[tuple[Rec, int]],
                    stream: bool, now: float) -> tuple[int, int]:
    lim = b.limit_s
    if b.metric in ("ttft", "e2e"):
        over = 0
        for r, _ in started:
            if b.metric == "ttft":
                over += (r.token_times[0] - r.send if r.token_times else now - r.send) > lim
            else:
                over += ((r.done if r.end is not None else now) - r.send) > lim
        return over, len(recs)
    if b.metric == "tpot":
        done = [t for r, _ in started if r.end is not None and r.ok and (t := r.tpot()) is not None]
        return sum(1 for t in done if t > lim), sum(1 for n in expected if n > 1)
    if not stream:
        return 0, 0
    over = 0
    for r, _ in started:
        over += sum(1 for g in r.itl() if g > lim)
        if r.token_times and r.end is None and now - r.token_times[-1] > lim:
            over += 1
    return over, sum(max(0, n - 1) for n in expected)
