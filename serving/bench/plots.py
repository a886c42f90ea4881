"""PNG figures of ``serving bench`` and ``serving tune`` results (matplotlib, Agg backend: no display)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def ecdf(ax: Any, values_ms: list[float], label: str) -> None:
    xs = sorted(values_ms)
    n = len(xs)
    if not n:
        return
    ax.step(xs, [(i + 1) / n for i in range(n)], where="post", label=f"{label} (n={n})")


def bench_figures(result: dict[str, Any], out_dir: Path) -> list[Path]:
    """``latency_throughput.png``, ``ttft_distribution.png``, ``itl_distribution.png`` of a bench result."""
    plt = pyplot()
    passes = [p for p in result["passes"] if p["metrics"].get("completed")]
    title = f"{result['model']} - scenario {result['scenario']['name']} ({result['scenario']['api']})"
    paths = []

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for ax, key, name in ((axes[0], "ttft_ms", "TTFT"), (axes[1], "itl_ms", "ITL")):
        for stat, style in (("p50", "o-"), ("p90", "s--"), ("p99", "^:")):
            xs = [p["metrics"]["output_tok_s"] for p in passes]
            ys = [p["metrics"][key][stat] for p in passes]
            ax.plot(xs, ys, style, label=f"{name} {stat}")
        for p in passes:
            ax.annotate(p["label"], (p["metrics"]["output_tok_s"], p["metrics"][key]["p99"]), fontsize=7,
                        textcoords="offset points", xytext=(4, 4))
        ax.set_xlabel("output tokens/s (measured)")
        ax.set_ylabel(f"{name} (ms)")
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    slo = result.get("slo")
    fig.suptitle(f"Latency vs throughput, one point per pass - {title}" + (f"\nSLO {slo}" if slo else ""),
                 fontsize=10)
    fig.tight_layout()
    paths.append(out_dir / "latency_throughput.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    for key, name, fname in (("ttft", "TTFT", "ttft_distribution.png"), ("itl", "ITL", "itl_distribution.png")):
        fig, ax = plt.subplots(figsize=(7.5, 4.8))
        for p in passes:
            if key == "ttft":
                values = [r["ttft_ms"] for r in p["requests"] if r.get("ttft_ms") is not None]
            else:
                values = [g for r in p["requests"] for g in r.get("itl_ms", [])]
            ecdf(ax, values, p["label"])
        ax.set_xscale("log")
        ax.set_xlabel(f"{name} (ms, log scale)")
        ax.set_ylabel("cumulative share" + (" of requests" if key == "ttft" else " of inter-token gaps"))
        ax.axhline(0.99, color="grey", lw=0.8, ls=":")
        ax.axhline(0.5, color="grey", lw=0.8, ls=":")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        ax.set_title(f"{name} distribution (CDF) per pass - {title}", fontsize=10)
        fig.tight_layout()
        paths.append(out_dir / fname)
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


def tune_figure(report: dict[str, Any], path: Path) -> Path:
    """Every measured run of a tune (goodput vs the SLO's run statistics), the Pareto front, the baseline and
    the chosen configuration."""
    plt = pyplot()
    runs = report["runs"]
    bounds = report["slo"]["bounds"]
    fig, axes = plt.subplots(1, len(bounds), figsize=(6.2 * len(bounds), 5), squeeze=False)
    groups = sorted({r["group"] for r in runs})
    colors = {g: plt.get_cmap("tab10")(i % 10) for i, g in enumerate(groups)}
    chosen = report["chosen"]["config_id"]
    baseline = report["baseline"]["config_id"]
    for ax, b in zip(axes[0], bounds, strict=True):
        key, limit = b["key"], b["limit_ms"]
        for g in groups:
            for met in (True, False):
                pts = [r for r in runs if r["group"] == g and r["slo_met"] == met]
                ax.scatter([r["goodput_req_s"] for r in pts], [r["slo_values_ms"][key] for r in pts],
                           color=colors[g], marker="o" if met else "x", s=28,
                           label=f"{g} ({'meets SLO' if met else 'misses SLO'})" if pts else None)
        front = pareto_front([(r["goodput_req_s"], r["slo_values_ms"][key]) for r in runs])
        if front:
            ax.plot([x for x, _ in front], [y for _, y in front], "k--", lw=1, label="Pareto front")
        for cid, mark, label in ((baseline, "s", "baseline (folder)"), (chosen, "*", "chosen")):
            pts = [r for r in runs if r["config_id"] == cid and r["slo_met"]]
            if pts:
                best = max(pts, key=lambda r: r["goodput_req_s"])
                ax.scatter([best["goodput_req_s"]], [best["slo_values_ms"][key]], marker=mark, s=220,
                           facecolors="none", edgecolors="red" if cid == chosen else "black", linewidths=2,
                           label=label, zorder=5)
        ax.axhline(limit, color="red", lw=1, ls=":", label=f"SLO {key} = {limit:g} ms")
        ax.set_xlabel("goodput (requests/s meeting the SLO)")
        ax.set_ylabel(f"{key} of the run (ms)")
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    base_note = "" if report["baseline"]["meets_slo"] else " (the baseline met the SLO at no rung: not marked)"
    fig.suptitle(f"serving tune {report['model']} - SLO {report['slo']['spec']}: {len(runs)} runs of "
                 f"{len({r['config_id'] for r in runs})} configurations{base_note}\nchosen: "
                 f"{report['chosen']['label']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def pareto_front(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points no other point beats on both counts (higher x, lower y), by increasing x."""
    front: list[tuple[float, float]] = []
    for x, y in sorted(points, key=lambda p: (-p[0], p[1])):
        if y != y:  # NaN
            continue
        if not front or y < front[-1][1]:
            front.append((x, y))
    return sorted(front)
