"""How long a killed worker takes to serve again, forked from the fork server or exec'd: a server with one
rolling model, its worker SIGKILLed N times; each time, the seconds from the kill until the server lists a new
READY worker (polling ``GET /models/{name}`` every 20 ms). Both settings alternate on fresh servers.

    python benchmarks/restart_latency.py [--kills 3] [--rounds 2] [--model-dir DIR]

Prints one line per kill and the medians per setting.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.integration.harness import DEFAULT_MODEL, ServerProcess  # noqa: E402


def ready_worker(server: ServerProcess, other_than: int | None) -> int | None:
    for w in server.describe("m")["workers"]:
        if w["status"] == "READY" and w["pid"] != other_than:
            return int(w["pid"])
    return None


def measure(fork: bool, kills: int, model_dir: Path) -> list[float]:
    with tempfile.TemporaryDirectory() as tmp:
        server = ServerProcess.start(Path(tmp), models={"m": {"option.rolling_batch": "auto"}},
                                     sources={"m": model_dir}, config={"worker_fork_server": str(fork).lower()})
        try:
            times = []
            pid = None
            while pid is None:
                pid = ready_worker(server, None)
            for _ in range(kills):
                t0 = time.monotonic()
                os.kill(pid, signal.SIGKILL)
                new = None
                while new is None:
                    time.sleep(0.02)
                    new = ready_worker(server, pid)
                times.append(time.monotonic() - t0)
                pid = new
            return times
        finally:
            server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL)
    args = ap.parse_args()
    results: dict[str, list[float]] = {"fork server": [], "exec": []}
    for r in range(args.rounds):
        for name, fork in (("fork server", True), ("exec", False)):
            times = measure(fork, args.kills, args.model_dir)
            results[name] += times
            print(f"round {r + 1} {name}: " + ", ".join(f"{t:.2f} s" for t in times), flush=True)
    for name, times in results.items():
        print(f"{name}: median {statistics.median(times):.2f} s (min {min(times):.2f}, max {max(times):.2f}, "
              f"{len(times)} restarts)")


if __name__ == "__main__":
    main()
