"""The tune's clock: what a server start, a run and the end of the tune should take, predicted from what the
evaluator measured so far, and the ``--budget`` it is held to."""

from __future__ import annotations

import math
import os
import re
import time
from pathlib import Path

from serving.tune.protocols import Evaluator
from serving.tune.space import Config, Group

STOP_S = 2.0  # a server's stop, before one was measured
REPORT_S = 2.0  # writing the report and its figure (matplotlib's import included)
# A worker's load (interpreter, torch, the weights) is mostly one thread's work, so workers load side by side,
# one a core, each beyond the first slowing the round by this share (benchmarks/HISTORY.md, tune quality).
LOAD_CONTENTION = 0.3

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


def load_rounds(workers: int, cores: int) -> float:
    """A server start's cost in units of one worker's load: rounds of ``cores`` workers loading side by side,
    each round slower by ``LOAD_CONTENTION`` per worker beyond the first (they share memory bandwidth and the
    frontend's core)."""
    cores = max(1, cores)
    return math.ceil(workers / cores) * (1.0 + LOAD_CONTENTION * (min(workers, cores) - 1))


def start_estimate(ev: Evaluator, group: Group) -> float | None:
    """What starting ``group``'s server (and its warm-up) should take: the slowest measured start of that
    group, else a measured start scaled by ``load_rounds``, else None (nothing measured yet)."""
    own = [s for g, s in ev.started if g == group]
    if own:
        return max(own)
    if not ev.started:
        return None
    per_round = max(s / load_rounds(g.workers, ev.cores) for g, s in ev.started)
    return per_round * load_rounds(group.workers, ev.cores)


def run_estimate(ev: Evaluator, rung: int) -> float:
    """What a run at ``rung`` should take: the requests' arrival span plus the slowest drain of a full run
    so far; before any full run, the longest request seen (a stopped run's, the warm-up's) stands for the
    drain, and with none either, the span again."""
    span = ev.n_requests / ev.ladder[rung]
    drains = [r.seconds - len(r.recs) / r.rate for r in ev.order if not r.aborted]
    if drains:
        return span + max(drains)
    e2e = [x.e2e() for r in ev.order for x in r.recs if x.ok and x.end is not None] + ev.warm_e2e
    return span + (max(e2e) if e2e else span)


def stop_estimate(ev: Evaluator) -> float:
    return max(ev.stops) if ev.stops else STOP_S


def needs_start(ev: Evaluator, config: Config) -> bool:
    return ev.current is None or ev.current.group != config.group


def switch_cost(ev: Evaluator, config: Config, rung: int) -> tuple[float, float]:
    """(a server start, with the running server's stop, when ``config``'s group is not the running one; a run
    at ``rung``): predicted seconds. The first start costs nothing here: nothing to predict it from."""
    start = 0.0
    if needs_start(ev, config):
        stop = stop_estimate(ev) if ev.current is not None else 0.0
        start = (start_estimate(ev, config.group) or 0.0) + stop
    return start, run_estimate(ev, rung)
