"""A tune's results for people: each outcome described, the measurement behind each chosen setting, the
annotated serving.properties, the report document (tune-report.yaml) and the improvement line."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from rollcore.step_cost import StepCost
from serving.bench.run_metrics import Slo, format_duration
from serving.tune.plan import Plan
from serving.tune.policy import Tuner
from serving.tune.racing import Outcome
from serving.tune.space import KNOBS, knobs_of
from serving.tune.verify import Verification


def _fmt_ms(v: float) -> str:
    return "n/a" if v != v else f"{v:.0f} ms" if v >= 10 else f"{v:.1f} ms"


def describe_outcome(o: Outcome, slo: Slo, ladder: list[float]) -> str:
    if o.best is not None:
        shown = ", ".join(f"{k} {_fmt_ms(v)}" for k, v in o.best.values_ms(slo).items())
        return (f"goodput {o.best.goodput(slo):.2f} req/s meeting the SLO at {o.best.rate:.3g} req/s offered "
                f"({shown})")
    if not o.runs:
        return "not measured (budget)"
    r = min(o.runs, key=lambda x: x.rung)
    vals = slo.run_values(r.recs)
    missed = [f"{b.key} {_fmt_ms(1000 * vals[b.key])} > {format_duration(b.limit_s)}" for b in slo.bounds
              if vals[b.key] == vals[b.key] and vals[b.key] > b.limit_s]
    failed = sum(1 for x in r.recs if x.error and not x.error.startswith("aborted"))
    if missed or failed:
        why = ", ".join(missed) or f"{failed} request(s) failed"
        return f"misses the SLO at {r.rate:.3g} req/s ({why}{'; run stopped early' if r.aborted else ''})"
    return f"misses the SLO at {r.rate:.3g} req/s (run stopped once too many requests were certainly over a bound)"


def knob_reasons(chosen: Outcome, outcomes: list[Outcome], slo: Slo, ladder: list[float]) -> dict[str, str]:
    """For each setting of the chosen configuration, the measurement behind it: the best measured configuration
    that differs in that setting, and what it got."""
    reasons = {}
    c = chosen.config
    settings: dict[str, Any] = {"mode": c.group.mode, "workers": c.group.workers, "threads": c.group.threads,
                                **dict(c.knobs)}

    def value(o: Outcome, key: str) -> Any:
        g = o.config.group
        return {"mode": g.mode, "workers": g.workers, "threads": g.threads}.get(key, dict(o.config.knobs).get(key))

    ranked = sorted(outcomes, key=lambda o: (o.rung, o.score), reverse=True)
    for key, v in settings.items():
        others = [o for o in ranked if value(o, key) != v and o.runs]
        if not others:
            reasons[key] = "no other value measured"
            continue
        o = others[0]
        other = value(o, key)
        reasons[key] = (f"best with {key}={other if other is not None else '(' + o.config.group.mode + ')'}: "
                        f"{describe_outcome(o, slo, ladder)}")
    return reasons


def annotated_properties(model_dir: Path, chosen: Outcome, reasons: dict[str, str], header: list[str]) -> str:
    from serving.bench.launch import read_properties

    props = read_properties(model_dir)
    new = chosen.config.properties()
    tuned_keys = {"option.rolling_batch": "mode", "minWorkers": "workers", "maxWorkers": "workers",
                  "option.num_threads": "threads", **{k.prop: k.name for k in KNOBS}}
    # the other mode's knobs do nothing in the chosen mode: drop them
    other = {k.prop for m in ("rolling", "dynamic") if m != chosen.config.group.mode for k in knobs_of(m)}
    lines = [f"# {h}" for h in header]
    written = set()
    for key, value in props.items():
        if key in other:
            lines.append(f"# {key}={value}  (removed by serving tune: not used with "
                         f"{chosen.config.group.mode} batching)")
            continue
        if key in new:
            lines.append(f"# {tuned_keys[key]}: {reasons.get(tuned_keys[key], '')}")
            lines.append(f"{key}={new[key]}")
            written.add(key)
        else:
            lines.append(f"{key}={value}")
    for key, v in new.items():
        if key not in written and v is not None:
            lines.append(f"# {tuned_keys[key]}: {reasons.get(tuned_keys[key], '')}")
            lines.append(f"{key}={v}")
    return "\n".join(lines) + "\n"


def report_doc(plan: Plan, tuner: Tuner, ladder: list[float], calibration: dict[str, Any] | None,
               wall_s: float, times: dict[str, float] | None = None) -> dict[str, Any]:
    slo = plan.slo
    ev = tuner.ev
    base = tuner.baseline_outcome()
    chosen = tuner.incumbent or base
    runs = [r.row(slo) for r in ev.order]

    def summary(o: Outcome) -> dict[str, Any]:
        return {"config_id": o.config.id, "label": o.config.id, "properties": o.config.properties(),
                "meets_slo": o.best is not None, "goodput_req_s": round(o.best.goodput(slo), 4) if o.best else 0.0,
                "rate_req_s": round(o.best.rate, 4) if o.best else None,
                "slo_values_ms": {k: round(v, 2) for k, v in o.best.values_ms(slo).items()} if o.best else None,
                "result": describe_outcome(o, slo, ladder)}

    configs = sorted(tuner.outcomes.values(), key=lambda o: (o.rung, o.score), reverse=True)
    b, c = summary(base), summary(chosen)
    improvement = (c["goodput_req_s"] / b["goodput_req_s"]) if b["goodput_req_s"] > 0 else None
    v = tuner.verification
    if v is not None and v.done:  # the head-to-head's ratio of means (1: the folder's kept)
        improvement = 1.0 if v.kept == "baseline" else v.ratio
    return {"model": plan.model_dir.resolve().name, "model_dir": str(plan.model_dir.resolve()),
            "slo": {"spec": str(slo), "bounds": [{"key": x.key, "limit_ms": x.limit_s * 1000} for x in slo.bounds]},
            "scenario": plan.scenario.describe(), "ladder_req_s": [round(x, 4) for x in ladder],
            "calibration": calibration, "budget_s": plan.budget_s, "wall_s": round(wall_s, 1),
            "stopped": tuner.stop_reason or "search complete",
            "time_s": {k: round(v, 1) for k, v in (times or {}).items()},
            "server_starts": [{"group": g.label, "seconds": round(s, 1)} for g, s in ev.started],
            "server_stops_s": [round(s, 1) for s in ev.stops],
            "live_knob_changes": ev.knob_changes,
            "dropped_groups": [g.label for g in tuner.dropped],
            "skipped_for_budget": [asdict(s) for s in tuner.skipped],
            "runs_cut_at_deadline": [{"config_id": r.config.id, "rung": r.rung, "seconds": round(r.seconds, 1)}
                                     for r in ev.cut],
            # the improvement as the printed line rounds it
            "baseline": b, "chosen": c, "improvement": None if improvement is None else round(improvement, 2),
            "head_to_head": None if v is None else asdict(v),
            "configurations": [summary(o) | {"runs": len(o.runs)} for o in configs],
            "step_cost_lines": {g.label: step_line_summary(cost) for g, cost in ev.step_costs.items()},
            "history": [asdict(t) for t in tuner.history], "runs": runs}


def step_line_summary(cost: StepCost) -> dict[str, Any]:
    """A group's step-cost line as the report shows it (``fixed_ms``/``per_token_ms`` None: no line)."""
    line = cost.fit()
    return {"steps": cost.steps, "max_tokens": cost.max_tokens,
            "fixed_ms": None if line is None else round(1000 * line[0], 3),
            "per_token_ms": None if line is None else round(1000 * line[1], 4)}



def improvement_text(base: Outcome, chosen: Outcome, slo: Slo, verification: Verification | None = None) -> str:
    """The line comparing the chosen configuration with the folder's: the head-to-head's (``Tuner.verify``)
    when it ran, else the search's runs."""
    if chosen.best is None:
        return "no configuration met the SLO at any rung of the ladder: loosen the SLO or lower the scenario's rates"
    v = verification
    if v is not None and v.done:
        c, b = v.chosen_goodput_req_s, v.baseline_goodput_req_s
        mc, mb = sum(c) / len(c), sum(b) / len(b)
        how = (f"measured again head to head, {v.runs_each} runs each at {v.rate_req_s:.3g} req/s, "
               f"alternating: mean {mc:.2f} req/s for the search's pick (met the SLO in {v.chosen_met}), "
               f"{mb:.2f} for the folder's (met in {v.baseline_met})")
        if v.kept == "baseline":
            return f"improvement: none, so the folder's configuration is kept ({how})"
        ratio = (f"{v.ratio:.2f}x the baseline's goodput" if v.ratio is not None
                 else "no ratio (the baseline's goodput was 0)")
        return f"improvement: {ratio} ({how})"
    note = f" (not measured again: {v.why})" if v is not None else ""
    return _search_improvement(base, chosen, slo) + note


def _search_improvement(base: Outcome, chosen: Outcome, slo: Slo) -> str:
    assert chosen.best is not None
    got = chosen.best.goodput(slo)
    if base.best is not None:
        return (f"improvement: {got / base.best.goodput(slo):.2f}x the baseline's goodput "
                f"({got:.2f} vs {base.best.goodput(slo):.2f} req/s)")
    if not base.runs:
        return ("improvement: not known: the baseline was not measured (the budget ran out before it); the "
                f"chosen configuration's goodput is {got:.2f} req/s")
    low = min(r.rung for r in base.runs)
    if low == 0:
        return "improvement: the baseline meets the SLO at no rung of the ladder; the chosen configuration does"
    rate = min(base.runs, key=lambda r: r.rung).rate
    return (f"improvement: the baseline misses the SLO at {rate:.3g} req/s (raced: not tried lower), which the "
            f"chosen configuration meets ({got:.2f} req/s goodput at {chosen.best.rate:.3g} req/s offered)")
