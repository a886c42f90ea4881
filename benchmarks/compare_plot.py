"""The distributions behind a ``compare.py`` result: TTFT and inter-token latency of every request of every run,
pooled per server and core list, as empirical CDFs (log time axis), one PNG.

    .venv/bin/python benchmarks/compare_plot.py benchmarks/results/compare-STAMP.json --out docs/itl-smollm2-1core.png

A result given as ``PATH:TAG`` adds TAG to its curves' labels (two runs of one server at two commits).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from serving.bench.plots import ecdf, pyplot  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", help="compare.py JSON results (runs with samples_ms), each PATH[:TAG]")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    pooled: dict[str, dict[str, list[float]]] = {}
    titles = []
    for given in args.results:
        path, _, tag = given.partition(":")
        res = json.loads(Path(path).read_text())
        titles.append(f"{res['model']}, {res['pass']}")
        for comp in res["comparisons"]:
            for run in comp["runs"]:
                if "samples_ms" not in run:
                    continue
                label = f"{run['server']}, cores {comp['cores']}" + (f", {res['pass']}" if len(args.results) > 1
                                                                     else "") + (f", {tag}" if tag else "")
                into = pooled.setdefault(label, {"ttft": [], "itl": []})
                for key in into:
                    into[key] += run["samples_ms"][key]
    if not pooled:
        raise SystemExit("no run with samples_ms in the results (compare.py records them since the chat workload)")
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for ax, key, name in ((axes[0], "ttft", "time to first token"), (axes[1], "itl", "inter-token latency")):
        for label, samples in sorted(pooled.items()):
            ecdf(ax, samples[key], label)
        ax.set_xscale("log")
        ax.set_xlabel(f"{name} (ms, log scale)")
        ax.set_ylabel("share of samples at or below")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    fig.suptitle("; ".join(sorted(set(titles))) + " (every request of every run, pooled)")
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=100)
    print(args.out)


if __name__ == "__main__":
    main()
