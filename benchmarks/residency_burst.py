"""``benchmarks/residency.py --scenario burst``: a burst on model A alone and while model B loads, alternating (the
scenario is described in that script's docstring)."""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tests.integration.harness import ServerProcess, write_model
from tests.integration.proc_tree import cpu_seconds, spent, tree_cpu
from tests.real_model import smollm2_gguf_folder

PROPS = {"option.rolling_batch": "auto", "option.max_rolling_batch_size": "4", "option.max_model_len": "1024",
         "load_on_demand": "true"}
PROMPT = "Write a long story about the sea."
WAIT_S = 600


@dataclass
class Burst:
    kind: str  # alone | load
    span_s: float  # from every stream's first token, for as long as B's load took
    tokens: int  # A's tokens in the span
    a_cpu_s: float  # A's worker's CPU-seconds in the span
    loader_cpu_s: float  # B's worker's CPU-seconds by its ready (0 alone)
    server_cpu_s: float  # the whole server's (frontend, fork server, workers) in the span
    cores: int
    outlasted: bool  # A still streamed after the span

    @property
    def tok_s(self) -> float:
        return self.tokens / self.span_s

    @property
    def cpu_per_token_ms(self) -> float:
        return 1000 * self.a_cpu_s / max(1, self.tokens)

    @property
    def loader_share(self) -> float:
        """Of the CPU the server got in the span (a shared machine gives its session a fair part, not its cores)."""
        return self.loader_cpu_s / self.server_cpu_s

    @property
    def server_cores(self) -> float:
        return self.server_cpu_s / self.span_s


def _entry(server: ServerProcess, name: str) -> dict[str, Any]:
    r = httpx.get(f"{server.mgmt}/models/{name}", headers=server.mgmt_headers, timeout=30)
    r.raise_for_status()
    return dict(r.json()[0]["models"][0])


def _ask(server: ServerProcess, name: str) -> None:
    r = httpx.post(f"{server.url}/predictions/{name}", json={"inputs": PROMPT, "parameters": {
        "max_new_tokens": 4, "do_sample": False}}, timeout=WAIT_S)
    if r.status_code != 200:
        raise SystemExit(f"{name}: {r.status_code} {r.text}")


def _until(server: ServerProcess, name: str, state: str) -> float:
    while (now := _entry(server, name)["residency"]["state"]) != state:
        if now == "failed":
            raise SystemExit(f"{name} failed:\n{server.log()[-4000:]}")
        time.sleep(0.02)
    return time.monotonic()


def _burst(server: ServerProcess, kind: str, streams: int, tokens: int, span_s: float, cores: int) -> Burst:
    arrivals: list[float] = []
    first = threading.Barrier(streams + 1)

    def stream() -> None:
        body = {"inputs": PROMPT, "parameters": {"max_new_tokens": tokens, "do_sample": False, "ignore_eos": True},
                "stream": True}
        n = 0
        with httpx.stream("POST", f"{server.url}/predictions/a", json=body, timeout=WAIT_S) as r:
            for line in r.iter_lines():
                if line.strip() and json.loads(line).get("token") is not None:
                    arrivals.append(time.monotonic())
                    n += 1
                    if n == 1:
                        first.wait()

    a_worker = _entry(server, "a")["workers"][0]["pid"]
    threads = [threading.Thread(target=stream) for _ in range(streams)]
    for t in threads:
        t.start()
    first.wait()
    t0, cpu0, tree0 = time.monotonic(), cpu_seconds(a_worker), tree_cpu(server.proc.pid)
    loader_cpu = 0.0
    if kind == "load":
        asking = threading.Thread(target=_ask, args=(server, "b"))
        asking.start()
        t1 = _until(server, "b", "ready")
        loader_cpu = cpu_seconds(_entry(server, "b")["workers"][0]["pid"])
        cpu1, tree1 = cpu_seconds(a_worker), tree_cpu(server.proc.pid)
        asking.join()
    else:
        time.sleep(span_s)  # the span a load took, alone
        t1, cpu1, tree1 = time.monotonic(), cpu_seconds(a_worker), tree_cpu(server.proc.pid)
    for t in threads:
        t.join()
    if kind == "load":
        _until(server, "b", "unloaded")  # after its idle_ttl: the next round loads it again
    return Burst(kind, t1 - t0, sum(1 for a in arrivals if t0 <= a <= t1), cpu1 - cpu0, loader_cpu,
                 spent(tree0, tree1), cores, max(arrivals) > t1)


def run_burst(rounds: int, streams: int, tokens: int) -> None:
    source = smollm2_gguf_folder()
    print(f"load average before: {os.getloadavg()}")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_model(root / "model_store", "a", PROPS, source)
        write_model(root / "model_store", "b", {**PROPS, "idle_ttl": "1"}, source)
        server = ServerProcess.start(root, config={"model_load_wait": str(WAIT_S)}, timeout_s=WAIT_S)
        try:
            cores = len(os.sched_getaffinity(server.proc.pid))
            _ask(server, "a")
            t0 = time.monotonic()
            _ask(server, "b")  # a load of B alone: the first alone span
            span = time.monotonic() - t0
            print(f"B's load alone: {span:.2f} s")
            _until(server, "b", "unloaded")
            runs: list[Burst] = []
            for rnd in range(rounds):
                for kind in ("alone", "load") if rnd % 2 == 0 else ("load", "alone"):
                    run = _burst(server, kind, streams, tokens, span, cores)
                    span = run.span_s if kind == "load" else span
                    runs.append(run)
                    print(f"round {rnd + 1} {kind:5s}: {run.tokens:4d} tokens in {run.span_s:5.2f} s = "
                          f"{run.tok_s:6.1f} tok/s, A {run.cpu_per_token_ms:6.1f} CPU-ms/token, the server "
                          f"{run.server_cores:.2f} cores, the loader {run.loader_share:.2f} of them"
                          f"{'' if run.outlasted else ' (the burst ended first: more tokens)'}")
        finally:
            server.stop()
    print(f"load average after: {os.getloadavg()}")
    alone = [r for r in runs if r.kind == "alone"]
    load = [r for r in runs if r.kind == "load"]
    ratio = statistics.median(r.tok_s for r in load) / statistics.median(r.tok_s for r in alone)
    share = statistics.median(r.loader_share for r in load)
    cpu = statistics.median(r.cpu_per_token_ms for r in load) / statistics.median(r.cpu_per_token_ms for r in alone)
    got = statistics.median(r.server_cores for r in load) / statistics.median(r.server_cores for r in alone)
    print(f"{len(load)} bursts while B loaded, {len(alone)} alone ({streams} streams, {cores} cores; medians): A's "
          f"tok/s {ratio:.2f}x alone; the loader's share of the server's CPU {share:.2f} (1 - share = "
          f"{1 - share:.2f}); the server's CPU {got:.2f}x alone; A's CPU per token {cpu:.2f}x alone")
