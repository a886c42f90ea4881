"""Measuring configurations on real servers: ``LiveEvaluator`` restarts the server when the group changes and
changes live knobs with ``PUT /models/{name}`` otherwise, warms each server up, and measures runs, stopping one
early once the SLO is certainly missed."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rollcore.step_cost import StepCost
from serving.bench.clients import Target, run_requests
from serving.bench.launch import LocalServer
from serving.bench.run_metrics import Rec, RunResult, Slo, metrics
from serving.bench.workload import BenchRequest, Workload
from serving.tune.runs import Run, certainly_violated
from serving.tune.space import Config, Group, cores_available

WARM_BURST_TOKENS = 8  # new tokens a request of the warm-up burst asks for (after a server start)


class StartCut(Exception):
    """A server start still loading at the evaluator's deadline was stopped."""


class LiveEvaluator:
    """The ``Evaluator`` of real servers: owns the server (restarts it when the group changes, PUTs live knobs
    otherwise) and measures runs.

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
        self.started: list[tuple[Group, float]] = []  # (group, seconds of its start and warm-up)
        self.stops: list[float] = []  # seconds each server stop took
        self.knob_changes = 0
        self.deadline: float | None = None  # time.monotonic(): a run still going then is cut (``Run.cut``)
        self.cut: list[Run] = []
        self.warm_e2e: list[float] = []  # the warm-up requests' E2E (the run estimate before any full run)
        self.variants = 0  # prompt variants drawn so far (``fresh``)
        # each group's rolling engines' step cost (``rollcore.step_cost``), read from its server after the
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
        self.started.append((config.group, took))

    def _check_effective(self, config: Config, answer: dict[str, Any]) -> None:
        """The PUT's answer lists every knob's effective value (``{"knobs": {name: {"value": ...}}}``)."""
        effective = answer.get("knobs", {})
        for k, v in config.knobs:
            got = effective.get(k, {}).get("value")
            if got != v:
                raise RuntimeError(f"PUT {k}={v}: the server reports {k}={got}")

    @property
    def n_requests(self) -> int:
        return len(self.w.requests)

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
        # batches grow its heap to what the biggest step needs; the first timed run after a start is then not
        # the slow one (benchmarks/HISTORY.md, tune quality).
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
