"""``serving tune MODEL_DIR --slo SPEC``: the serving.properties with the highest goodput meeting an SLO.

    serving tune examples/models/tiny-llama --slo "ttft_p99=2s,itl_p99=200ms" [--scenario FILE] [--budget 20m]
    serving tune examples/models/tiny-llama --slo "ttft_p99=2s,itl_p99=200ms" --dry-run        # the plan only

It starts the model and searches on the live server (``serving.tune``: knobs changed with
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
import sys
import time
from dataclasses import replace
from pathlib import Path

from serving.bench.run_metrics import parse_slo
from serving.bench.scenario import ScenarioError, load_scenario
from serving.tune.costs import parse_budget, process_started
from serving.tune.evaluator import LiveEvaluator
from serving.tune.plan import Plan
from serving.tune.policy import Tuner
from serving.tune.report import annotated_properties, describe_outcome, improvement_text, knob_reasons, report_doc
from serving.tune.space import build_space


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
    from rollcore.errors import ConfigError

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


def tune(plan: Plan, out: Path, started: float | None = None) -> int:
    """Run the tune; ``started``: ``time.monotonic()`` from which ``--budget`` counts (default: now)."""
    import yaml

    from serving.bench.passes import workload_of
    from serving.bench.plots import tune_figure
    from serving.bench.workload import load_tokenizer

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    t0 = time.monotonic() if started is None else started
    setup_at = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    print(plan.text(), file=sys.stderr, flush=True)
    w = workload_of(plan.scenario, load_tokenizer(plan.model_dir))
    sweep = [p for p in plan.scenario.passes if p.sweep_index is not None]
    ev = LiveEvaluator(plan.model_dir, out / "servers", w, [], plan.scenario.api, [plan.slo], log)
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
    starts_s = sum(s for _, s in ev.started)
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
    print(f"{len(ev.order)} runs of {len(tuner.outcomes)} configurations, {len(ev.started)} server start(s), "
          f"{ev.knob_changes} live knob change(s){skipped}, {wall:.0f} s of a {plan.budget_s:.0f} s budget "
          f"({doc['stopped']})")
    print(f"wrote {out / 'serving.properties'}, {out / 'tune-report.yaml'}, {out / 'tune-report.png'}")
    return 0 if chosen.best is not None else 1
