"""The knob space, and measuring a configuration's goodput on a live server (``serving tune``, the grid).

**Space.** A *group* is what needs a restart: batching mode (rolling or dynamic), worker count, threads
per worker. Inside a group the *live knobs* change on the running model through ``PUT /models/{name}``:
``max_rolling_batch_size`` and ``max_rolling_batch_prefill_tokens`` (rolling), ``batch_size`` and
``max_batch_delay`` (dynamic).

**Goodput of a configuration** = the goodput (requests meeting the SLO per second) of the highest rung of
the scenario's load ladder (Poisson passes at increasing rates) at which its run meets the SLO. A
configuration is *raced* against the best one so far (the incumbent): its first run is at the rung above
the incumbent's; failing it, the configuration cannot be better and costs one run; passing it, it climbs
(1, 2, 4 rungs up, then bisection) to its own highest passing rung and becomes the incumbent. A run stops
early, its open requests cancelled, once the SLO is certainly missed (e.g. more TTFTs over the bound than
the percentile allows), so a failing run costs little.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from serving.bench.clients import Target, run_requests
from serving.bench.launch import LocalServer
from serving.bench.metrics import Bound, Rec, RunResult, Slo, metrics
from serving.bench.workload import BenchRequest, Workload
from serving.step_cost import StepCost


# ------------------------------------------------------------------------------------------------- space
@dataclass(frozen=True)
class Knob:
    """A live knob: its ``PUT`` query name, its serving.properties key, its range."""

    name: str
    prop: str
    lo: int
    hi: int
    log: bool
    mode: str  # rolling | dynamic
    unit: str = ""


KNOBS = (
    Knob("max_rolling_batch_size", "option.max_rolling_batch_size", 1, 64, True, "rolling", " sequences"),
    Knob("max_rolling_batch_prefill_tokens", "option.max_rolling_batch_prefill_tokens", 64, 4096, True,
         "rolling", " tokens"),
    Knob("batch_size", "batch_size", 1, 32, True, "dynamic", " requests"),
    Knob("max_batch_delay", "max_batch_delay", 0, 200, False, "dynamic", " ms"),
)
# where a mode's search starts when the folder does not set a knob (the folder's own values otherwise)
SEED = {"max_rolling_batch_size": 32, "max_rolling_batch_prefill_tokens": 2048, "batch_size": 8,
        "max_batch_delay": 50}


def knobs_of(mode: str) -> tuple[Knob, ...]:
    return tuple(k for k in KNOBS if k.mode == mode)


@dataclass(frozen=True, order=True)
class Group:
    mode: str
    workers: int
    threads: int

    @property
    def label(self) -> str:
        return f"{self.mode} {self.workers}w x {self.threads}t"

    def properties(self) -> dict[str, str | None]:
        return {"option.rolling_batch": "auto" if self.mode == "rolling" else "disable",
                "minWorkers": str(self.workers), "maxWorkers": str(self.workers),
                "option.num_threads": str(self.threads)}


@dataclass(frozen=True)
class Config:
    group: Group
    knobs: tuple[tuple[str, int], ...]

    @property
    def id(self) -> str:
        return f"{self.group.label}: " + ", ".join(f"{k}={v}" for k, v in self.knobs)

    def knob(self, name: str) -> int:
        return dict(self.knobs)[name]

    def properties(self) -> dict[str, str | None]:
        props = self.group.properties()
        by_name = {k.name: k for k in KNOBS}
        props.update({by_name[k].prop: str(v) for k, v in self.knobs})
        return props


def make_config(group: Group, values: dict[str, int]) -> Config:
    """A configuration of ``group`` with ``values`` clipped into range (a prefill budget of at least one
    token per sequence, which a decode step needs)."""
    out = {}
    for k in knobs_of(group.mode):
        out[k.name] = max(k.lo, min(k.hi, int(values[k.name])))
    if group.mode == "rolling":
        out["max_rolling_batch_prefill_tokens"] = max(out["max_rolling_batch_prefill_tokens"],
                                                      out["max_rolling_batch_size"])
    return Config(group, tuple(out.items()))


@dataclass(frozen=True)
class Space:
    """The groups a tune explores (the baseline's first) and the folder's configuration (the baseline)."""

    groups: tuple[Group, ...]
    baseline: Config
    seeds: dict[Group, Config]


def cores_available() -> int:
    return len(os.sched_getaffinity(0))


WARM_BURST_TOKENS = 8  # new tokens a request of the warm-up burst asks for (after a server start)

# A worker's load (interpreter, torch, the weights) is mostly one thread's work, so workers load side by side,
# one a core; measured on 2 cores (the tune-quality grid's server logs): 2 workers ready in 1.20-1.32x the
# time of one.
LOAD_CONTENTION = 0.3


def load_rounds(workers: int, cores: int) -> float:
    """A server start's cost in units of one worker's load: rounds of ``cores`` workers loading side by side,
    each round slower by ``LOAD_CONTENTION`` per worker beyond the first (they share memory bandwidth and the
    frontend's core)."""
    cores = max(1, cores)
    return math.ceil(workers / cores) * (1.0 + LOAD_CONTENTION * (min(workers, cores) - 1))


def build_space(model_dir: Path, modes: tuple[str, ...] | None = None, workers: tuple[int, ...] | None = None,
                threads: tuple[int, ...] | None = None, cores: int | None = None) -> Space:
    """The space of a model folder: its configuration (``serving.config``) is the baseline; the groups are
    every mode the model can run (rolling needs an architecture the engine serves) x worker counts x threads
    with workers x threads = the cores (the CPUs of this process's affinity mask), unless given.
    Raises ``ConfigError`` or ``ValueError``."""
    from serving.config import load_model_config

    cfg = load_model_config(model_dir, env=os.environ)
    if cfg.entry_point not in ("huggingface", "rolling", "djl_python.huggingface"):
        raise ValueError(f"{model_dir}: entry point {cfg.entry_point!r} is a custom handler; serving tune "
                         f"searches the built-in handlers' knobs (huggingface / rolling)")
    cores = cores or cores_available()
    can_roll = load_model_config(model_dir, env=os.environ,
                                 overrides={"option.rolling_batch": "auto"}).batching.rolling
    all_modes = ("rolling", "dynamic") if can_roll else ("dynamic",)
    modes = modes or all_modes
    bad = [m for m in modes if m not in all_modes]
    if bad:
        raise ValueError(f"mode {bad[0]!r} is not available for this model (available: {', '.join(all_modes)})")
    b = cfg.batching
    base_mode = "rolling" if b.rolling else "dynamic"
    t = cfg.options.get("num_threads", "auto")
    base_threads = max(1, cores // cfg.max_workers) if t == "auto" else int(t)
    base_group = Group(base_mode, cfg.max_workers, base_threads)
    folder = {"max_rolling_batch_size": b.max_rolling_batch_size,
              "max_rolling_batch_prefill_tokens": b.max_rolling_batch_prefill_tokens,
              "batch_size": b.batch_size, "max_batch_delay": b.max_batch_delay_ms}
    sources = {"max_rolling_batch_size": "option.max_rolling_batch_size",
               "max_rolling_batch_prefill_tokens": "option.max_rolling_batch_prefill_tokens",
               "batch_size": "batch_size", "max_batch_delay": "max_batch_delay"}
    seed_values = {k: (v if cfg.sources.get(sources[k], "default") != "default" else SEED[k])
                   for k, v in folder.items()}
    pairs = sorted({(w, cores // w) for w in range(1, cores + 1) if cores // w >= 1 and w * (cores // w) == cores})
    if workers:
        pairs = [(w, tt) for w, tt in pairs if w in workers] or [(w, max(1, cores // w)) for w in workers]
    if threads:
        pairs = [(w, tt) for w, tt in ({(w, x) for w, _ in pairs for x in threads})]
    groups = [Group(m, w, tt) for m in modes for w, tt in sorted(pairs)]
    groups = [base_group] + [g for g in groups if g != base_group]
    baseline = Config(base_group, tuple((k.name, folder[k.name]) for k in knobs_of(base_mode)))
    seeds = {g: baseline if g == base_group else make_config(g, seed_values) for g in groups}
    return Space(tuple(groups), baseline, seeds)


# --------------------------------------------------------------------------------------------- measuring
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


class StartCut(Exception):
    """A server start still loading at the evaluator's deadline was stopped."""


class Evaluator:
    """Owns the server (restarts it when the group changes, PUTs live knobs otherwise) and measures runs.

    ``abort_slos``: a run stops early once every one of these SLOs is certainly missed."""

    def __init__(self, model_dir: Path, workdir: Path, requests: Workload, ladder: list[float], api: str,
                 abort_slos: list[Slo], log: Callable[[str], None] | None = None,
                 server_timeout_s: float = 600.0) -> None:
        self.model_dir = model_dir
        self.workdir = workdir
        self.w = requests
        self.ladder = ladder
        self.api = api
        self.abort_slos = abort_slos
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.server_timeout_s = server_timeout_s
        self.server: LocalServer | None = None
        self.current: Config | None = None
        self.baseline: Config | None = None  # started from the folder's file unchanged
        self.stream = True
        self.runs: dict[tuple[str, int], Run] = {}
        self.order: list[Run] = []
        self.restarts: list[tuple[str, float]] = []  # (group label, seconds)
        self.started: list[tuple[Group, float]] = []  # the same, by group
        self.stops: list[float] = []  # seconds each server stop took
        self.knob_changes = 0
        self.deadline: float | None = None  # time.monotonic(): a run still going then is cut (``Run.cut``)
        self.cut: list[Run] = []
        self.warm_e2e: list[float] = []  # the warm-up requests' E2E (estimated_seconds before any full run)
        self.variants = 0  # prompt variants drawn so far (``fresh``)
        # each group's rolling engines' step cost (``serving.step_cost``), read from its server after the
        # warm-up and after every run: the sums since that server started, its workers added together
        self.step_costs: dict[Group, StepCost] = {}
        self._n_servers = 0
        self.cores = cores_available()

    # --- server ---
    def apply(self, config: Config) -> None:
        """Make ``config`` the live configuration: a restart for another group (or the first start; the
        baseline starts from the folder's file as it is), a ``PUT`` of the changed knobs otherwise."""
        if self.server is not None and self.current is not None and self.current.group == config.group:
            changed = {k: v for k, v in config.knobs if self.current.knob(k) != v}
            if changed:
                answer = self.server.put(changed)
                self._check_effective(config, answer)
                self.knob_changes += 1
            self.current = config
            return
        self.close()
        t0 = time.perf_counter()
        self._n_servers += 1
        props = {} if config == self.baseline else config.properties()
        self.log(f"  starting {config.group.label} (server {self._n_servers})")
        # A start predicted to fit the budget may take longer (the tune predicts it from measured ones): one
        # still loading at the deadline is stopped there, so the budget holds.
        deadline = self.deadline
        left = None if deadline is None else deadline - time.monotonic()
        by_deadline = left is not None and left < self.server_timeout_s
        timeout = max(0.0, left) if left is not None and by_deadline else self.server_timeout_s
        try:
            self.server = LocalServer.start(self.model_dir, self.workdir / f"server-{self._n_servers}",
                                            name=self.model_dir.resolve().name, properties=props,
                                            server_config={"enable_model_api": "true"}, timeout_s=timeout)
        except RuntimeError:
            if by_deadline and deadline is not None and time.monotonic() >= deadline:
                self.log(f"  the start of {config.group.label} was stopped at the budget's deadline")
                raise StartCut(config.group.label) from None
            raise
        self.current = config
        self._warm()
        self.read_step_cost()
        took = time.perf_counter() - t0
        self.restarts.append((config.group.label, took))
        self.started.append((config.group, took))

    def _check_effective(self, config: Config, answer: dict[str, Any]) -> None:
        """The PUT's answer lists every knob's effective value (``{"knobs": {name: {"value": ...}}}``)."""
        effective = answer.get("knobs", {})
        for k, v in config.knobs:
            got = effective.get(k, {}).get("value")
            if got != v:
                raise RuntimeError(f"PUT {k}={v}: the server reports {k}={got}")

    @property
    def target(self) -> Target:
        assert self.server is not None
        return Target(self.server.url, self.server.name, self.server.grpc_target,
                      self.server.tokens.get("inference"))

    def _warm(self) -> None:
        warm = [BenchRequest(r.index, r.prompt, r.prompt_token_ids, min(r.max_new_tokens, 4))
                for r in sorted(self.w.requests, key=lambda r: r.prompt_len)[:2]]
        probe = run_requests(self.api, self.target, warm[:1], [0.0], True)[0]
        self.stream = probe.error is None
        if not self.stream and "rolling_batch" not in (probe.error or "") and "stream" not in (probe.error or ""):
            raise RuntimeError(f"the warm-up request failed: {probe.error}")
        recs = run_requests(self.api, self.target, warm, [0.0] * len(warm), self.stream)
        if any(r.error for r in recs):
            raise RuntimeError(f"the warm-up requests failed: {[r.error for r in recs if r.error][0]}")
        self.warm_e2e += [r.e2e() for r in recs if r.ok]
        # Then every request of the workload at once (new prompts, a few tokens each): the worker's first large
        # batches grow its heap to what the biggest step needs (it keeps it). The first timed run after a start
        # was measured far slower than the next ones (110m model: ITL p99 666, then 103 and 140 ms), but most of
        # that turned out to be the prefix cache: every run sent the same prompts (with prefix caching off all
        # three measured alike), which is why each run now sends prompts of its own (``fresh``).
        burst = [BenchRequest(r.index, r.prompt, r.prompt_token_ids, min(r.max_new_tokens, WARM_BURST_TOKENS))
                 for r in self.fresh().requests]
        recs = run_requests(self.api, self.target, burst, [0.0] * len(burst), self.stream)
        if any(r.error for r in recs):
            raise RuntimeError(f"the warm-up burst failed: {[r.error for r in recs if r.error][0]}")

    def read_step_cost(self) -> None:
        """The running server's engines' step cost (``GET /models/{name}``), kept for its group; nothing for
        a dynamic-batching model (no engine) or when the server does not answer."""
        if self.server is None or self.current is None:
            return
        try:
            engines = self.server.describe().get("batcher", {}).get("engines", {})
        except Exception as exc:  # noqa: BLE001 - a missed reading only leaves the tuner without a fitted line
            self.log(f"  (step cost not read: {exc})")
            return
        if not isinstance(engines, dict) or not engines:
            return
        total = StepCost()
        for stats in engines.values():
            total = total + StepCost.from_dict(stats.get("step_cost") if isinstance(stats, dict) else None)
        if total.steps:
            self.step_costs[self.current.group] = total

    def fresh(self) -> Workload:
        """The workload with prompts no earlier run sent (``Workload.fresh``): a run must not be answered from
        the prefix cache an earlier one filled."""
        self.variants += 1
        return self.w.fresh(self.variants)

    def settle(self) -> None:
        """After an aborted run: one 1-token request, answered once the server has finished what it was doing."""
        r = self.w.requests[0]
        run_requests(self.api, self.target, [BenchRequest(r.index, r.prompt, r.prompt_token_ids, 1)], [0.0],
                     self.stream, timeout_s=600)

    def close(self) -> None:
        if self.server is not None:
            t0 = time.perf_counter()
            self.server.stop()
            self.stops.append(time.perf_counter() - t0)
            self.server = None
            self.current = None

    def start_estimate(self, group: Group) -> float | None:
        """What starting ``group``'s server (and its warm-up) should take: the slowest measured start of that
        group, else a measured start scaled by ``load_rounds`` (the workers load side by side, one a core),
        else None (nothing measured yet)."""
        own = [s for g, s in self.started if g == group]
        if own:
            return max(own)
        if not self.started:
            return None
        per_round = max(s / load_rounds(g.workers, self.cores) for g, s in self.started)
        return per_round * load_rounds(group.workers, self.cores)

    def needs_start(self, config: Config) -> bool:
        return self.server is None or self.current is None or self.current.group != config.group

    # --- runs ---
    def burst(self, config: Config) -> dict[str, Any]:
        """A burst pass (every request at t=0) of ``config``: its metrics (the calibration of relative rates)."""
        self.apply(config)
        w = self.fresh()
        recs = run_requests(self.api, self.target, w.requests, [0.0] * len(w.requests), self.stream)
        return metrics(RunResult(recs), [r.max_new_tokens for r in w.requests])

    def measure(self, config: Config, rung: int, again: bool = False) -> Run:
        """``config`` at ladder rung ``rung`` (cached: a configuration is measured once per rung; ``again``: a
        new run all the same, which leaves the cached one in place)."""
        key = (config.id, rung)
        if key in self.runs and not again:
            return self.runs[key]
        rate = self.ladder[rung]
        try:
            self.apply(config)
        except StartCut:  # the budget ran out while its server started: no measurement
            run = Run(config, rung, rate, [], [r.max_new_tokens for r in self.w.requests], 0.0, True, 0.0, cut=True)
            self.cut.append(run)
            return run
        requests = self.fresh().requests  # drawn (tokenized) before the run's clock starts
        expected = [r.max_new_tokens for r in requests]
        violated_at: dict[str, float] = {}
        t0 = time.perf_counter()
        stream = self.stream

        def should_abort(recs: list[Rec], now: float) -> bool:
            for slo in self.abort_slos:
                if str(slo) not in violated_at and certainly_violated(slo, recs, expected, stream, now):
                    violated_at[str(slo)] = now - t0
            return bool(self.abort_slos) and len(violated_at) == len(self.abort_slos)

        aborted_at: list[float] = []
        cut: list[bool] = []
        deadline = self.deadline

        def abort(recs: list[Rec], now: float) -> bool:
            if deadline is not None and time.monotonic() >= deadline:
                cut.append(True)
                aborted_at.append(now)
                return True
            if should_abort(recs, now):
                aborted_at.append(now)
                return True
            return False

        recs = run_requests(self.api, self.target, requests, self.w.arrivals(rate), stream, should_abort=abort)
        first_send = min(r.send for r in recs)
        if cut:  # the budget is spent: no settling (the server is stopped next), no measurement
            run = Run(config, rung, rate, recs, expected, time.perf_counter() - t0, True,
                      aborted_at[0] - first_send, violated_at, cut=True)
            self.cut.append(run)
            return run
        if aborted_at:
            wall = aborted_at[0] - first_send
            self.settle()
        else:
            done = [r.done for r in recs if r.ok]
            wall = (max(done) - first_send) if done else time.perf_counter() - first_send
        run = Run(config, rung, rate, recs, expected, time.perf_counter() - t0, bool(aborted_at), wall,
                  violated_at)
        self.read_step_cost()
        self.runs.setdefault(key, run)
        self.order.append(run)
        return run

    def estimated_seconds(self, rung: int) -> float:
        """What a run at ``rung`` should take: the requests' arrival span plus the slowest drain of a full run
        so far; before any full run, the longest request seen (a stopped run's, the warm-up's) stands for the
        drain, and with none either, the span again."""
        span = len(self.w.requests) / self.ladder[rung]
        drains = [r.seconds - len(r.recs) / r.rate for r in self.order if not r.aborted]
        if drains:
            return span + max(drains)
        e2e = [x.e2e() for r in self.order for x in r.recs if x.ok and x.end is not None] + self.warm_e2e
        return span + (max(e2e) if e2e else span)


# ----------------------------------------------------------------------------------------------- racing
@dataclass
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
    best = ev.runs[(config.id, lo)]
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
