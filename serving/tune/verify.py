"""The head-to-head at the end of a tune: the chosen configuration and the folder's, measured again,
alternating, at the chosen one's rung. A configuration is chosen for its best run among many noisy ones, so
that run flatters it (benchmarks/HISTORY.md, "Tune quality", Run 9: a pick printed as much better than the
folder's was level with it when both were measured again); the pick must hold up here or the folder's
configuration is kept."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from serving.bench.run_metrics import Slo
from serving.tune import costs
from serving.tune.protocols import Evaluator
from serving.tune.runs import Run
from serving.tune.space import Config

VERIFY_RUNS = 2  # runs of each configuration
# The search keeps the head-to-head's time when it costs at most this share of the budget; otherwise it runs
# only if time is left.
VERIFY_SHARE = 0.25


@dataclass(frozen=True)
class Verification:
    search_pick: str  # the chosen configuration's id
    rung: int
    rate_req_s: float
    runs_each: int
    done: bool
    why: str = ""  # why not done
    chosen_goodput_req_s: tuple[float, ...] = ()
    baseline_goodput_req_s: tuple[float, ...] = ()
    chosen_met: int = 0  # runs meeting the SLO
    baseline_met: int = 0
    ratio: float | None = None  # mean goodputs, chosen / folder's (None: the folder's was 0)
    kept: str = ""  # "chosen" or "baseline"


def sequence(ev: Evaluator, chosen: Config, base: Config) -> list[Config]:
    """``VERIFY_RUNS`` runs each, alternating (ABBA...), starting with the one the running server has."""
    a, b = ((base, chosen) if costs.needs_start(ev, chosen) and not costs.needs_start(ev, base)
            else (chosen, base))
    return [x for i in range(VERIFY_RUNS) for x in ((a, b) if i % 2 == 0 else (b, a))]


def cost(ev: Evaluator, chosen: Config, base: Config, rung: int) -> float:
    """Predicted seconds of the head-to-head: its runs, and a server start (with the stop before it) at every
    switch between groups."""
    stop = costs.stop_estimate(ev)
    running = ev.current.group if ev.current is not None else None
    total = 0.0
    for c in sequence(ev, chosen, base):
        if c.group != running:
            total += (costs.start_estimate(ev, c.group) or 0.0) + (stop if running is not None else 0.0)
            running = c.group
        total += costs.run_estimate(ev, rung)
    return total


def head_to_head(ev: Evaluator, slo: Slo, chosen: Config, base: Config, rung: int, left_s: float,
                 base_met_in_search: bool, log: Callable[[str], None]) -> tuple[Verification, list[Run]]:
    """Measure the two again (``left_s``: the seconds the search has left). The pick holds up when it meets the
    SLO in one of its runs at least, with a mean goodput at least the folder's or more runs meeting the SLO;
    otherwise the folder's configuration is kept when it met the SLO somewhere (in these runs, or in the
    search's). Returns the verification and the folder's new runs."""
    rate = ev.ladder[rung]
    info = Verification(chosen.id, rung, round(rate, 4), VERIFY_RUNS, done=False)
    predicted = cost(ev, chosen, base, rung)
    if predicted > left_s:
        why = f"predicted {predicted:.0f} s, {max(left_s, 0.0):.0f} s left"
        log(f"  head-to-head with the folder's configuration skipped for budget ({why})")
        return replace(info, why=why), []
    runs: dict[str, list[Run]] = {chosen.id: [], base.id: []}
    for c in sequence(ev, chosen, base):
        r = ev.measure(c, rung, again=True)
        if r.cut:
            log("  head-to-head with the folder's configuration cut at the deadline")
            return replace(info, why="a run was cut at the deadline"), []
        runs[c.id].append(r)
    good = {cid: [r.goodput(slo) for r in rs] for cid, rs in runs.items()}
    met = {cid: sum(r.met(slo) for r in rs) for cid, rs in runs.items()}
    mean_c = sum(good[chosen.id]) / len(good[chosen.id])
    mean_b = sum(good[base.id]) / len(good[base.id])
    holds = met[chosen.id] >= 1 and (mean_c >= mean_b or met[chosen.id] > met[base.id])
    keep_base = not holds and (met[base.id] >= 1 or base_met_in_search)
    v = replace(info, done=True, chosen_goodput_req_s=tuple(round(g, 4) for g in good[chosen.id]),
              baseline_goodput_req_s=tuple(round(g, 4) for g in good[base.id]), chosen_met=met[chosen.id],
              baseline_met=met[base.id], ratio=round(mean_c / mean_b, 4) if mean_b > 0 else None,
              kept="baseline" if keep_base else "chosen")
    log(f"  head-to-head at {rate:.3g}/s, {VERIFY_RUNS} runs each: chosen "
        f"{', '.join(f'{g:.2f}' for g in good[chosen.id])} req/s (met {met[chosen.id]}), folder's "
        f"{', '.join(f'{g:.2f}' for g in good[base.id])} (met {met[base.id]})"
        + ("  -> the folder's configuration is kept" if keep_base else ""))
    return v, runs[base.id]


