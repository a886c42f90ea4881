"""compare.py's summary and report: median and range per server, the ratios of medians unless a run failed,
escaped its cores or ran on a busy machine, whether the servers' greedy outputs agree, and the markdown table."""

from __future__ import annotations

import statistics
from typing import Any

SERVERS = ("rollserve", "vllm", "rollserve-ngram", "rollserve-ngram-r4", "rollserve-ngram-smooth", "rollserve-tokencap",
           "rollserve-r2", "rollserve-r4", "rollserve-auto", "rollserve-auto-smooth", "rollserve-2w",
           "rollserve-packed", "rollserve-hybrid", "rollserve-dynamic", "rollserve-no-itl", "rollserve-itl200",
           "rollserve-itl150")
RATIOS = (("rollserve", "vllm"), ("rollserve-ngram", "vllm"), ("rollserve-ngram", "rollserve"),
          ("rollserve-ngram-r4", "vllm"), ("rollserve-ngram-r4", "rollserve-ngram"),
          ("rollserve-ngram-smooth", "vllm"), ("rollserve-ngram", "rollserve-ngram-smooth"),
          ("rollserve-tokencap", "vllm"), ("rollserve", "rollserve-tokencap"), ("rollserve-r2", "vllm"),
          ("rollserve-r4", "vllm"), ("rollserve-auto", "vllm"), ("rollserve-auto", "rollserve-2w"),
          ("rollserve-packed", "vllm"),
          ("rollserve-auto", "rollserve-packed"), ("rollserve-hybrid", "vllm"), ("rollserve-auto", "rollserve-hybrid"),
          ("rollserve-auto", "rollserve-dynamic"), ("rollserve-auto-smooth", "vllm"),
          ("rollserve-auto", "rollserve-auto-smooth"), ("rollserve", "rollserve-no-itl"),
          ("rollserve-itl200", "vllm"), ("rollserve-itl200", "rollserve"), ("rollserve-itl150", "vllm"))
KEYS = ("output_tok_s", "cpu_s", "tok_per_cpu_s", "ttft_p50", "ttft_p99", "itl_p50", "itl_p99")


def parity(runs: list[dict[str, Any]], extra: list[dict[str, Any]]) -> dict[str, Any]:
    """Output tokens of every run that completed all its requests, per server (``extra``: vLLM's capacity run);
    ``same``: one total for all, and how many requests' lengths differ between those runs (greedy on the same
    weights: none)."""
    ok = [r for r in extra + runs if r["metrics"].get("completed") and not r["metrics"]["failed"]]
    totals: dict[str, list[int]] = {}
    for r in ok:
        totals.setdefault(r["server"] + (" capacity" if r in extra else ""), []).append(r["metrics"]["output_tokens"])
    differ = sum(1 for lengths in zip(*(r["output_lengths"] for r in ok), strict=True) if len(set(lengths)) > 1)
    return {"output_tokens": totals, "same": len({t for v in totals.values() for t in v}) <= 1,
            "requests_differing": differ}


def parity_line(p: dict[str, Any]) -> str:
    runs = "; ".join(f"{s} {', '.join(map(str, v))}" for s, v in p["output_tokens"].items())
    verdict = "no complete run" if not runs else "same totals" if p["same"] else "DIFFERENT totals"
    return f"output tokens per run: {runs} -> {verdict}, {p['requests_differing']} request(s) differ in length"


def summarize(runs: list[dict[str, Any]], extra: list[dict[str, Any]], allow_busy: bool) -> dict[str, Any]:
    """Median/min/max per server; the ratio of medians unless a run failed, escaped its cores, or was busy
    (``extra``: the vLLM capacity run, whose busy flag counts too)."""
    out: dict[str, Any] = {}
    for s in SERVERS:
        rs = [r for r in runs if r["server"] == s and "output_tok_s" in r]
        if not any(r["server"] == s for r in runs):
            continue
        out[s] = {k: {"median": statistics.median(v), "min": min(v), "max": max(v)} if (
            v := [r[k] for r in rs]) else None for k in KEYS} | {"runs": len(rs)}
    bad = [r for r in runs if "output_tok_s" not in r or r["metrics"]["failed"] or r["metrics"]["wrong_lengths"]]
    escaped = [r for r in runs if not all(r.get(k, {"ok": 1})["ok"] for k in ("pins_after_start", "pins_after_pass"))]
    busy = [r for r in runs + extra if r["busy"]]
    loads = ", ".join(f"{r['load_check']['load1']:.1f}" for r in runs + extra if "load_check" in r)
    pairs = [(a, b) for a, b in RATIOS if a in out and b in out]
    if not pairs:
        out["withheld"] = "one server only (--servers): no ratio"
    elif bad or escaped:
        out["withheld"] = f"ratio withheld: {len(bad)} run(s) failed or wrong lengths, {len(escaped)} escaped pinning"
    elif busy and not allow_busy:
        out["withheld"] = f"ratio withheld: machine busy (load {loads})"
    else:
        out["ratios"] = {f"{a} / {b}": {k: out[a][k]["median"] / out[b][k]["median"] for k in KEYS} for a, b in pairs}
        if "rollserve / vllm" in out["ratios"]:
            out["ratio"] = out["ratios"]["rollserve / vllm"]
        out["flag"] = f"measured under load (load {loads})" if busy else ""
    out["parity"] = parity(runs, extra)
    return out


def cell(v: dict[str, float] | None) -> str:
    """median (min-max); the median alone for one run."""
    n = {k: f"{x:.0f}" if x >= 1000 else f"{x:.1f}" for k, x in (v or {}).items()}
    return "-" if not v else n["median"] + (f" ({n['min']}-{n['max']})" if v["min"] != v["max"] else "")


def markdown(res: dict[str, Any]) -> str:
    e, wl = res["env"], res["workload"]
    out = (f"chat, greedy to EOS or {wl['max_tokens']} tokens" if wl.get("kind") == "chat"
           else f"{wl['output_tokens_total']} output tokens")
    lines = [f"`{res['argv']}`: model {res['model']} ({wl['num_requests']} requests, {out}), {res['dtype']}, "
             f"{res['pass']}, a fresh server per run (+ warm-up), {res['repeats']} alternating repeats; {e['cpu']} "
             f"({e['cpus']} CPUs; {' '.join(e['flags'])}), torch {e['torch']}, "
             f"vLLM {e['vllm']}, rollserve {e['code_state']}. Cells: median (min-max).", ""]
    head = ("| cores (load gen.) | server | runs | out tok/s | CPU-s | tok/CPU-s | TTFT p50 ms | TTFT p99 ms | "
            "ITL p50 ms | ITL p99 ms | load1 before (own) | others' cores during |")
    lines += [head, "|---" * (head.count("|") - 1) + "|"]
    for c in res["comparisons"]:
        sm, cores = c["summary"], f"{c['cores']} ({c['loadgen_cores']})"
        rate = f", Poisson {c['rate']:.2f} req/s" if c.get("rate") else ""
        if c.get("capacity_run"):
            rate += f" ({res['rate_from_vllm']} x vLLM's {c['capacity_run']['metrics']['request_s']:.2f})"
        if res.get("arrivals_from"):
            rate += f", only the arrivals from {res['arrivals_from']:g} s"
        for s in SERVERS:
            if s not in sm:
                continue
            rs = [r for r in c["runs"] if r["server"] == s and "load_check" in r]
            cells = [cell(sm[s][k]) for k in KEYS]
            load = ", ".join(f"{r['load_check']['load1']:.2f} ({r['load_check']['own_load']:.2f})" for r in rs)
            during = ", ".join(f"{r['others_cores_during']:.2f}" for r in rs)
            lines.append(f"| {cores}{rate} | {s} | {sm[s]['runs']} | {' | '.join(cells)} | {load} | {during} |")
        if "ratios" in sm:
            for name, ratio in sm["ratios"].items():
                ratios = " | ".join(f"{ratio[k]:.2f}x" for k in KEYS)
                lines.append(f"| {cores} | **{name.replace('vllm', 'vLLM')}** {sm['flag']} | | {ratios} | | |")
        else:
            lines.append(f"| {cores} | **{sm['withheld']}** |" + " |" * 10)
    lines += [""] + [f"cores {c['cores']}: {parity_line(c['summary']['parity'])}" for c in res["comparisons"]]
    return "\n".join(lines) + "\n"
