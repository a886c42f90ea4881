"""quantized_speed.py's summary and table: median and range per server, the ratios of medians, what went wrong,
and how far each server's greedy answers agree with rollserve-none's."""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.compare_report import cell

KEYS = {  # summary key -> table header
    "b1_decode_tok_s": "b1 decode tok/s", "b1_ttft_p50": "b1 TTFT p50 ms", "b1_itl_p50": "b1 ITL p50 ms",
    "b1_itl_p99": "b1 ITL p99 ms", "b1_tokens_mean": "b1 tokens/req", "b1_cpu_s": "b1 CPU-s",
    "b1_tok_per_cpu_s": "b1 tok/CPU-s", "burst_tok_s": "burst tok/s", "burst_ttft_p50": "burst TTFT p50 ms",
    "burst_itl_p99": "burst ITL p99 ms", "burst_tokens": "burst tokens", "burst_cpu_s": "burst CPU-s",
    "burst_tok_per_cpu_s": "burst tok/CPU-s", "start_s": "start s", "pss_mb": "PSS MB (server tree)",
}
RATIOS = (("rollserve-int8", "rollserve-none"), ("rollserve-int4", "rollserve-none"),
          ("rollserve-int4", "llama.cpp"), ("rollserve-int8", "llama.cpp"), ("rollserve-gguf", "llama.cpp"),
          ("rollserve-gguf-int8", "llama.cpp"))
RATIO_KEYS = ("b1_decode_tok_s", "burst_tok_s", "b1_tok_per_cpu_s", "burst_tok_per_cpu_s", "pss_mb")


def summarize(runs: list[dict[str, Any]], servers: list[str]) -> dict[str, Any]:
    """Median / min / max per server over its good runs; ratios of medians; flags for what went wrong."""
    out: dict[str, Any] = {"servers": {}, "ratios": {}, "flags": []}
    for s in servers:
        good = [r["summary"] for r in runs if r["server"] == s and "summary" in r]
        out["servers"][s] = {k: {"median": statistics.median(v), "min": min(v), "max": max(v)}
                             if (v := [g[k] for g in good]) else None for k in KEYS} | {"runs": len(good)}
    for a, b in RATIOS:
        sa, sb = out["servers"].get(a), out["servers"].get(b)
        if sa and sb and sa["runs"] and sb["runs"]:
            out["ratios"][f"{a} / {b}"] = {k: sa[k]["median"] / sb[k]["median"] for k in RATIO_KEYS}
    failed = [r["server"] for r in runs if "summary" not in r]
    escaped = [r["server"] for r in runs if not all(r.get(k, {"ok": True})["ok"]
                                                    for k in ("pins_after_start", "pins_after_passes"))]
    busy = [f"{r['server']}: {'; '.join(r['busy'])}" for r in runs if r["busy"]]
    if failed:
        out["flags"].append(f"failed runs (left out): {', '.join(failed)}")
    if escaped:
        out["flags"].append(f"escaped pinning: {', '.join(escaped)}")
    if busy:
        out["flags"].append("measured under load: " + " | ".join(busy))
    return out


def _common(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def same_answers(runs: list[dict[str, Any]], servers: list[str]) -> dict[str, str]:
    """Per server (its first run with answers): the batch-1 prompts' token counts (usage; "-" without a usage
    chunk), answer tokens and finish reasons, and how far each greedy answer agrees with rollserve-none's."""
    first = {s: next((r["answers"] for r in runs if r["server"] == s and "answers" in r), None) for s in servers}
    ref = first.get("rollserve-none")
    out = {}
    for s, ans in first.items():
        if ans is None:
            continue
        prompt = " ".join("-" if a["prompt_tokens"] is None else str(a["prompt_tokens"]) for a in ans)
        line = (f"batch-1 prompt tokens [{prompt}], answer tokens {[a['tokens'] for a in ans]}, finish "
                f"{[a['finish'] for a in ans]}")
        if ref is not None and s != "rollserve-none":
            same = sum(a["text"] == b["text"] for a, b in zip(ans, ref, strict=False))
            common = [f"{_common(a['text'], b['text'])}/{len(b['text'])}" for a, b in zip(ans, ref, strict=False)]
            line += (f"; answers equal to rollserve-none's {same}/{len(ans)}, common prefix (characters of "
                     f"rollserve-none's answer) {' '.join(common)}")
        out[s] = line
    return out


def table(comp: dict[str, Any]) -> str:
    sm = comp["summary"]
    head = "| server | runs | " + " | ".join(KEYS.values()) + " |"
    lines = [f"cores {comp['cores']} (load generator on {comp['loadgen_cores']}); cells: median (min-max)", "",
             head, "|---" * (head.count("|") - 1) + "|"]
    for s, v in sm["servers"].items():
        lines.append(f"| {s} | {v['runs']} | " + " | ".join(cell(v[k]) for k in KEYS) + " |")
    if sm["ratios"]:
        lines += ["", "| ratio of medians | " + " | ".join(KEYS[k] for k in RATIO_KEYS) + " |",
                  "|---" * (len(RATIO_KEYS) + 1) + "|"]
        lines += [f"| {name} | " + " | ".join(f"{r[k]:.2f}x" for k in RATIO_KEYS) + " |"
                  for name, r in sm["ratios"].items()]
    lines += [""] + [f"{s}: {line}" for s, line in comp["answers"].items()]
    lines += [f"FLAG {f}" for f in sm["flags"]]
    return "\n".join(lines) + "\n"
