"""``serving tune``: the ``--dry-run`` plan, and a short real tune of the default model (its knobs changed on
the live server) that writes an annotated serving.properties and the report."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import yaml

from serving.config.model_config import load_model_config
from serving.tune.space import Group
from serving.tune.tune_command import _plan, add_arguments
from tests.integration.harness import DEFAULT_MODEL

SLO = "ttft_p99=30s,itl_p99=10s"  # bounds the default model meets at every rung here: the search climbs
SCENARIO = """
api: lmi
num_requests: 6
seed: 1
warmup: 1
prompt_len: {dist: uniform, min: 8, max: 40}
output_len: {dist: uniform, min: 4, max: 12}
arrival:
  - {process: burst}
  - {process: sweep, rates: {start: 0.5x, factor: 2, count: 3}}
"""


def tune(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "serving", "tune", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300)


def test_dry_run_prints_the_plan(tmp_path: Path) -> None:
    """The printed plan is the plan built from the same arguments (``Plan.text`` of ``Plan.steps``), and the
    plan's data says what the tune will do: calibrate (a relative ladder), the seeds in order of promise with
    the folder's group first, the knobs and their ranges, the head-to-head, the report."""
    argv = [str(DEFAULT_MODEL), "--slo", "ttft_p99=2s,itl_p99=200ms", "--budget", "5m", "--workers", "1",
            "--threads", "1", "--dry-run"]
    proc = tune(argv, tmp_path)
    assert proc.returncode == 0, proc.stderr
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    plan = _plan(ap.parse_args(argv))
    assert proc.stdout == plan.text() + "\n"
    assert (plan.budget_s, plan.max_trials, str(plan.slo)) == (300.0, 60, "ttft_p99=2s,itl_p99=200ms")
    steps = plan.steps()
    assert [s.kind for s in steps] == ["calibrate", "seeds", "halving", "head_to_head", "write"]
    base = plan.space.baseline
    cores = len(os.sched_getaffinity(0))
    workers = load_model_config(DEFAULT_MODEL).max_workers  # the folder's (auto: from the cores)
    assert base.group == Group("rolling", workers, max(1, cores // workers))
    others = [Group("rolling", 1, 1), Group("dynamic", 1, 1)]
    seeds = [base.id + "  (the baseline)"] + [plan.space.seeds[g].id for g in others if g != base.group]
    assert list(steps[1].items) == seeds
    assert "rolling max_rolling_batch_size in [1, 64] (log scale)" in steps[2].items
    assert "dynamic max_batch_delay in [0, 200]" in steps[2].items
    assert not list(tmp_path.iterdir())  # nothing started, nothing written


def test_dry_run_refuses_bad_input(tmp_path: Path) -> None:
    proc = tune([str(DEFAULT_MODEL), "--slo", "ttft_p99=2s", "--scenario", "sweep", "--budget", "soon",
                 "--dry-run"], tmp_path)
    assert (proc.returncode, proc.stderr) == (2, "error: --budget 'soon': expected a duration such as 20m, 90s "
                                                 "or 1h\n")
    (tmp_path / "s.yaml").write_text("arrival: {process: burst}\n")
    proc = tune([str(DEFAULT_MODEL), "--slo", "ttft_p99=2s", "--scenario", str(tmp_path / "s.yaml"), "--dry-run"],
                tmp_path)
    assert proc.returncode == 2
    assert proc.stderr == (f"error: {tmp_path / 's.yaml'}: serving tune needs a load ladder: an arrival pass "
                           "{process: sweep, rates: ...}\n")
    proc = tune([str(DEFAULT_MODEL), "--slo", "ttft_p99=2s", "--modes", "speculative", "--dry-run"], tmp_path)
    assert proc.stderr.startswith("error: mode 'speculative' is not available for this model (available: "
                                  "rolling, dynamic)")


def test_short_tune_writes_properties_and_report(tmp_path: Path) -> None:
    (tmp_path / "s.yaml").write_text(SCENARIO)
    out = tmp_path / "out"
    cores = len(os.sched_getaffinity(0))
    workers = load_model_config(DEFAULT_MODEL).max_workers  # the folder's (auto: from the cores)
    threads = max(1, cores // workers)
    # one group (the folder's: rolling, its workers sharing the cores): one server start, the trials change
    # knobs live
    proc = tune([str(DEFAULT_MODEL), "--slo", SLO, "--scenario", str(tmp_path / "s.yaml"), "--budget", "4m",
                 "--modes", "rolling", "--workers", str(workers), "--threads", str(threads), "--max-trials", "3",
                 "--out", str(out)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = yaml.safe_load((out / "tune-report.yaml").read_text())
    assert report["baseline"]["config_id"] == (f"rolling {workers}w x {threads}t: max_rolling_batch_size=32, "
                                               f"max_rolling_batch_prefill_tokens=2048")
    assert report["stopped"] == "3 configurations tried (--max-trials)"
    assert len(report["configurations"]) == 3
    burst = report["calibration"]["burst_req_s"]
    assert report["ladder_req_s"] == [round(burst * f, 4) for f in (0.5, 1.0, 2.0)]
    runs = report["runs"]
    assert runs[0]["config_id"] == report["baseline"]["config_id"]  # the baseline is measured first
    assert all(r["completed"] == 6 and r["failed"] == 0 and r["slo_met"] for r in runs)
    # the loose SLO holds at every rung: every configuration climbs to the top rung, and the chosen one is there
    assert report["chosen"]["meets_slo"] is True
    top = report["ladder_req_s"][-1]
    assert report["chosen"]["rate_req_s"] == top
    # the search's pick (the best of its 3 configurations) measured again against the baseline when they
    # differ: 2 runs each at the top rung, alternating, the pick first (the running server has its knobs)
    best = max((h for h in report["history"] if h["improved"]), key=lambda h: report["history"].index(h))
    h2h = report["head_to_head"]
    search_runs = runs
    if best["config_id"] == report["baseline"]["config_id"]:
        assert h2h is None
    else:
        pick, base = best["config_id"], report["baseline"]["config_id"]
        assert {k: h2h[k] for k in ("search_pick", "rate_req_s", "runs_each", "done")} == {
            "search_pick": pick, "rate_req_s": top, "runs_each": 2, "done": True}
        assert [(r["config_id"], r["rate_req_s"]) for r in runs[-4:]] == [(pick, top), (base, top), (base, top),
                                                                           (pick, top)]
        assert (h2h["chosen_met"], h2h["baseline_met"]) == (2, 2)  # the loose SLO: every run meets it
        kept = base if h2h["kept"] == "baseline" else pick
        assert report["chosen"]["config_id"] == kept
        search_runs = runs[:-4]
    # a restart only for another group; otherwise the knobs changed live (PUT /models/{name})
    starts = 1 + sum(1 for a, b in zip(runs, runs[1:], strict=False) if a["group"] != b["group"])
    puts = sum(1 for a, b in zip(runs, runs[1:], strict=False) if a["group"] == b["group"] and a["knobs"] != b["knobs"])
    search_puts = sum(1 for a, b in zip(search_runs, search_runs[1:], strict=False) if a["knobs"] != b["knobs"])
    assert len(report["server_starts"]) == starts == 1
    assert search_puts == 2, runs  # two trials after the baseline, each a PUT
    # the head-to-head's PUTs: pick -> baseline -> pick, and one before it unless the search ended on the pick
    h2h_puts = 2 + (search_runs[-1]["knobs"] != runs[-4]["knobs"]) if h2h else 0
    assert report["live_knob_changes"] == puts == search_puts + h2h_puts, runs
    # the step-cost sums of both workers' engines, read from GET /models/{name} (rollcore.step_cost)
    line = report["step_cost_lines"][f"rolling {workers}w x {threads}t"]
    assert line["steps"] > 0 and 0 < line["max_tokens"] <= 4096
    # the written file: the folder's keys, the chosen values, each with its measured reason above it
    text = (out / "serving.properties").read_text()
    lines = text.splitlines()
    chosen = report["chosen"]["properties"]
    for key, value in chosen.items():
        i = lines.index(f"{key}={value}")
        assert lines[i - 1].startswith("# "), lines[i - 1]
    assert "option.dtype=fp32" in lines and "option.enable_prefix_caching=true" in lines
    assert lines[0].startswith("# serving tune ") and f"SLO {SLO}" in lines[0]
    cfg = load_model_config(_folder_with(tmp_path, text))  # the file is valid serving.properties
    assert cfg.batching.max_rolling_batch_size == int(chosen["option.max_rolling_batch_size"])
    assert (out / "tune-report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if h2h is None:
        assert f"improvement: {report['improvement']:.2f}x the baseline's goodput" in proc.stdout
    elif h2h["kept"] == "baseline":
        assert "improvement: none, so the folder's configuration is kept (measured again head to head" in proc.stdout
    else:
        assert f"improvement: {report['improvement']:.2f}x the baseline's goodput (measured again" in proc.stdout
    assert report["model"] == "tiny-llama"


def _folder_with(tmp_path: Path, properties: str) -> Path:
    d = tmp_path / "check" / "tiny-llama"
    d.mkdir(parents=True)
    for f in DEFAULT_MODEL.iterdir():
        if f.name != "serving.properties":
            os.symlink(f, d / f.name)
    (d / "serving.properties").write_text(properties)
    return d
