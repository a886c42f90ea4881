"""``serving bench``: run a scenario's passes against a server, write JSON and PNG figures.

    serving bench MODEL_DIR [--scenario PRESET|FILE] [--slo SPEC] [--out DIR]     # starts the folder itself
    serving bench --url http://HOST:PORT --model NAME --tokenizer DIR [...]       # a running server

A pass sends every request of the workload open-loop at its arrival time (burst: all at t=0; Poisson at a
rate); the metrics are vLLM's (``serving.bench.run_metrics``). Results: ``bench.json`` (scenario, conditions,
per pass the metrics and every request's timings) and ``latency_throughput.png``, ``ttft_distribution.png``,
``itl_distribution.png``.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from serving.bench.clients import Target, run_requests
from serving.bench.run_metrics import Rec, RunResult, Slo, metrics
from serving.bench.scenario import Pass, Scenario
from serving.bench.workload import BenchRequest, Workload, build_workload


def workload_of(scenario: Scenario, tokenizer: Any, num_requests: int | None = None) -> Workload:
    return build_workload(tokenizer, num_requests or scenario.num_requests, scenario.seed, scenario.prompt_len,
                          scenario.output_len)


def warm_requests(w: Workload, n: int) -> list[BenchRequest]:
    """``n`` of the shortest prompts with at most 4 output tokens: warms caches before timing."""
    return [BenchRequest(r.index, r.prompt, r.prompt_token_ids, min(r.max_new_tokens, 4))
            for r in sorted(w.requests, key=lambda r: r.prompt_len)[:n]]


def choose_stream(scenario: Scenario, api: str, target: Target, probe: BenchRequest) -> bool:
    """``stream: auto``: stream unless the model refuses it (a dynamic-batching model answers a stream with a
    400 naming ``option.rolling_batch``; gRPC answers INVALID_ARGUMENT)."""
    if scenario.stream != "auto":
        return scenario.stream == "true"
    rec = run_requests(api, target, [probe], [0.0], True)[0]
    if rec.error is None:
        return True
    if "rolling_batch" in rec.error or "stream" in rec.error.lower():
        return False
    raise RuntimeError(f"the probe request failed: {rec.error}")


@dataclass
class PassRun:
    spec: Pass
    rate_req_s: float | None
    recs: list[Rec]
    metrics: dict[str, Any]
    started: float  # time.time() at the start
    seconds: float  # wall time of the pass, including its drain

    @property
    def label(self) -> str:
        return "burst" if self.rate_req_s is None else f"poisson {self.rate_req_s:.3g}/s"

    def to_json(self, w: Workload, slo: Slo | None) -> dict[str, Any]:
        return {"label": self.label, "process": self.spec.process,
                "rate": str(self.spec.rate) if self.spec.rate else None, "rate_req_s": self.rate_req_s,
                "burstiness": self.spec.burstiness, "seconds": self.seconds, "metrics": self.metrics,
                "requests": request_rows(self.recs, w, slo)}


def request_rows(recs: list[Rec], w: Workload, slo: Slo | None) -> list[dict[str, Any]]:
    t0 = min(r.send for r in recs)
    rows = []
    for req, r in zip(w.requests, recs, strict=True):
        row: dict[str, Any] = {"index": req.index, "prompt_tokens": req.prompt_len,
                               "max_new_tokens": req.max_new_tokens, "send_s": r.send - t0, "error": r.error}
        if r.ok:
            tpot = r.tpot()
            row.update({"output_tokens": r.num_tokens, "ttft_ms": 1000 * r.ttft(), "e2e_ms": 1000 * r.e2e(),
                        "tpot_ms": None if tpot is None else 1000 * tpot,
                        "itl_ms": [round(1000 * g, 3) for g in r.itl()]})
        if slo is not None:
            row["slo_met"] = slo.request_meets(r)
        rows.append(row)
    return rows


def run_pass(api: str, target: Target, w: Workload, spec: Pass, rate: float | None, stream: bool,
             slo: Slo | None, progress: bool) -> PassRun:
    """One pass of ``w`` at ``rate`` (None: burst), with a progress bar on stderr when ``progress``."""
    from tqdm import tqdm

    arrivals = w.arrivals(rate, spec.burstiness)
    label = "burst" if rate is None else f"poisson {rate:.3g}/s"
    bar = tqdm(total=len(w.requests), desc=f"  {label}", unit="req", file=sys.stderr, disable=not progress,
               leave=True, dynamic_ncols=True)
    failed = 0

    def done(rec: Rec) -> None:
        nonlocal failed
        failed += rec.error is not None
        bar.update(1)
        if failed:
            bar.set_postfix(failed=failed)

    started, t0 = time.time(), time.perf_counter()
    try:
        recs = run_requests(api, target, w.requests, arrivals, stream, done)
    finally:
        bar.close()
    seconds = time.perf_counter() - t0
    m = metrics(RunResult(recs), [r.max_new_tokens for r in w.requests], slo)
    return PassRun(spec, rate, recs, m, started, seconds)


def conditions() -> dict[str, Any]:
    """Machine and load facts recorded with every result."""
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        load = list(os.getloadavg())
    except OSError:
        load = []
    return {"cpu": cpu, "cpus": os.cpu_count(), "cpus_allowed": len(os.sched_getaffinity(0)),
            "python": platform.python_version(), "load_avg_at_start": load,
            "time": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def run_scenario(scenario: Scenario, api: str, target: Target, w: Workload, slo: Slo | None,
                 progress: bool = True, log: Any = None) -> dict[str, Any]:
    """Every pass of ``scenario`` on ``w``; returns the result document (``bench.json``)."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    warm = warm_requests(w, max(1, scenario.warmup))
    stream = choose_stream(scenario, api, target, warm[0])
    if scenario.warmup:
        recs = run_requests(api, target, warm, [0.0] * len(warm), stream)
        bad = [r.error for r in recs if r.error]
        if bad:
            raise RuntimeError(f"warm-up requests failed: {bad[0]}")
    log(f"scenario {scenario.name} ({scenario.source}): {len(w.requests)} requests a pass, api {api}, "
        f"{'streamed' if stream else 'whole answers'}; workload {json.dumps(w.summary())}")
    burst_req_s: float | None = None
    passes = []
    for i, spec in enumerate(scenario.passes):
        rate = None if spec.rate is None else spec.rate.resolve(burst_req_s, f"{scenario.source}: arrival")
        # New prompt text each pass (same lengths and arrivals): a pass must not hit the prefix cache an
        # earlier one filled (serving.bench.workload); the warm-up sent variant 0.
        wp = w.fresh(i + 1)
        run = run_pass(api, target, wp, spec, rate, stream, slo, progress)
        if spec.process == "burst" and run.metrics.get("request_s"):
            burst_req_s = run.metrics["request_s"]
        log(f"  [{run.label}] {summary_line(run.metrics)}")
        passes.append(run.to_json(wp, slo))
    return {"model": target.model, "scenario": scenario.describe(), "api": api, "stream": stream,
            "slo": str(slo) if slo else None, "workload": w.summary(), "conditions": conditions(),
            "passes": passes}


def summary_line(m: dict[str, Any]) -> str:
    if not m.get("completed"):
        return f"no request completed: {m.get('errors')}"
    s = (f"{m['output_tok_s']:.1f} tok/s  {m['request_s']:.2f} req/s  TTFT p50/p99 {m['ttft_ms']['p50']:.0f}/"
         f"{m['ttft_ms']['p99']:.0f} ms  ITL p50/p99 {m['itl_ms']['p50']:.1f}/{m['itl_ms']['p99']:.1f} ms  "
         f"TPOT p50 {m['tpot_ms']['p50']:.1f} ms  E2E p50/p99 {m['e2e_ms']['p50']:.0f}/{m['e2e_ms']['p99']:.0f} ms")
    if "goodput_req_s" in m:
        s += f"  goodput {m['goodput_req_s']:.2f} req/s (SLO {'met' if m['slo']['met'] else 'MISSED'})"
    if m.get("failed") or m.get("wrong_lengths"):
        s += f"  failed {m['failed']} wrong-lengths {m.get('wrong_lengths')} {m.get('errors')}"
    return s


def table(result: dict[str, Any]) -> str:
    """The passes as a markdown table (printed at the end of a run)."""
    head = ("| pass | req/s | out tok/s | TTFT p50 / p90 / p99 ms | ITL p50 / p90 / p99 ms | TPOT p50 / p99 ms | "
            "E2E p50 / p99 ms | goodput req/s | failed |")
    lines = [head, "|" + "---|" * 9]
    for p in result["passes"]:
        m = p["metrics"]
        if not m.get("completed"):
            lines.append(f"| {p['label']} | failed: {m.get('errors')} | | | | | | | {m.get('failed')} |")
            continue
        good = f"{m['goodput_req_s']:.2f}" + ("" if m["slo"]["met"] else " (SLO missed)") \
            if "goodput_req_s" in m else "-"
        lines.append(f"| {p['label']} | {m['request_s']:.2f} | {m['output_tok_s']:.1f} | "
                     f"{m['ttft_ms']['p50']:.0f} / {m['ttft_ms']['p90']:.0f} / {m['ttft_ms']['p99']:.0f} | "
                     f"{m['itl_ms']['p50']:.1f} / {m['itl_ms']['p90']:.1f} / {m['itl_ms']['p99']:.1f} | "
                     f"{m['tpot_ms']['p50']:.1f} / {m['tpot_ms']['p99']:.1f} | "
                     f"{m['e2e_ms']['p50']:.0f} / {m['e2e_ms']['p99']:.0f} | {good} | {m['failed']} |")
    return "\n".join(lines)
