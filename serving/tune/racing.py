"""Racing a configuration against the best so far on the load ladder.

A configuration's goodput is that of the highest rung at which its run meets the SLO (requests meeting the SLO
per second, vLLM's definition). Its first run is at the rung above the incumbent's; failing it, it cannot be
better and costs one run; passing, it climbs (1, 2, 4 rungs up, then bisection) to its own highest passing rung.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from serving.bench.run_metrics import Slo
from serving.tune.protocols import Evaluator
from serving.tune.runs import Run
from serving.tune.space import Config


@dataclass(frozen=True)
class Outcome:
    """What racing found about one configuration under one SLO."""

    config: Config
    best: Run | None  # its highest passing run (None: it never passed a rung it was tried at)
    runs: list[Run]
    score: float  # the optimiser's value: the best run's goodput, else a fraction of the failing run's

    @property
    def rung(self) -> int:
        return -1 if self.best is None else self.best.rung


def race(ev: Evaluator, config: Config, slo: Slo, incumbent: int, first: int | None = None,
         allow_below: bool = False, out_of_time: Callable[[int], bool] | None = None) -> Outcome:
    """Race ``config`` against the incumbent's rung (-1: none): first run at ``first`` (default incumbent + 1,
    the top rung at most); failing, it stops there (or bisects below with ``allow_below``); passing, it climbs
    by 1, 2, 4 rungs, then bisects, to its highest passing rung. ``out_of_time(rung)`` stops it early."""
    top = len(ev.ladder) - 1
    start = min(incumbent + 1, top) if first is None else first
    runs: list[Run] = []

    def run(k: int) -> Run | None:
        if out_of_time is not None and out_of_time(k):
            return None
        r = ev.measure(config, k)
        if r.cut:  # stopped at the deadline: no result
            return None
        runs.append(r)
        return r

    r0 = run(start)
    if r0 is None:
        return Outcome(config, None, runs, 0.0)
    lo, hi = (start, top + 1) if r0.met(slo) else (-1, start)
    if lo == -1 and not allow_below:
        return Outcome(config, None, runs, r0.goodput(slo) * r0.slack(slo))
    out = False  # out of time (or a run cut at the deadline): what is known so far is the outcome
    if lo >= 0:  # gallop up
        step = 1
        while lo + step < hi:
            k = lo + step
            r = run(k)
            if r is None:
                out = True
                break
            if r.met(slo):
                lo, step = k, step * 2
            else:
                hi = k
                break
    while hi - lo > 1 and not out:  # bisect between a passing and a failing rung
        k = (lo + hi) // 2
        r = run(k)
        if r is None:
            break
        lo, hi = (k, hi) if r.met(slo) else (lo, k)
    if lo < 0:
        worst = min(runs, key=lambda x: x.rung)
        return Outcome(config, None, runs, worst.goodput(slo) * worst.slack(slo))
    best = next(r for r in runs if r.rung == lo)
    return Outcome(config, best, runs, best.goodput(slo))


def better(a: Outcome, b: Outcome | None, slo: Slo) -> bool:
    """``a`` beats ``b``: a higher passing rung, then more goodput, then more slack to the bounds."""
    if b is None:
        return True
    if a.rung != b.rung:
        return a.rung > b.rung
    if a.best is None or b.best is None:
        return a.score > b.score
    ga, gb = a.best.goodput(slo), b.best.goodput(slo)
    if abs(ga - gb) > 1e-9:
        return ga > gb
    return a.best.slack(slo) > b.best.slack(slo)
