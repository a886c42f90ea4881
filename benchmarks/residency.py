"""First-request latency of a model loaded on demand (cold) against one already loaded (warm), under a memory budget.

A store of COPIES copies of the real SmolLM2-135M-Instruct (the fp32 folder of ``tests/real_model.py``; each copy its
own folder, its weights linked) with ``load_on_demand=true`` and a budget (``model_memory_budget``) that holds two of
them by their predicted memory (the engine's memory plan with the KV cache populated at load, so the prediction is
what a worker takes). The models are asked in turn, ROUNDS times: each turn sends one greedy request to a model that
is not loaded (cold: it waits for the load, which unloads the least recently used model) and then the same request
again (warm). Prints every request, the medians, the loads and unloads the server counted, and the largest sum of
the loaded models' memory sampled from ``GET /models`` against the budget.

    python benchmarks/residency.py [--copies 5] [--rounds 2] [--max-new-tokens 16]

``--scenario burst``: how much a load slows another model's burst. Two copies of the GGUF SmolLM2 (what the server
serves from the file, ``tests/real_model.py``), both loaded on demand under a budget that holds both; B unloads after
a second idle (``idle_ttl``). Each round streams a burst on A (``--streams`` greedy streams of ``--burst-tokens``
tokens), alone and, alternating which goes first, while B loads (asked once every stream of A has its first token).
Compared over the same span of each burst (from every stream's first token for as long as B's load took): A's
tokens per second, the CPU-seconds A's worker spent per token, the CPU the server's processes got, and the loader's
share of it (B's worker's CPU-seconds over the whole server's, from /proc: on a shared machine the server's session
gets a fair part of the cores, not all of them). A burst not slowed beyond the loader's share has a tok/s ratio of
about 1 - share or more, at the same CPU per token.

    python benchmarks/residency.py --scenario burst [--rounds 3] [--streams 2] [--burst-tokens 600]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.residency_burst import run_burst  # noqa: E402
from handlers.preflight import planned_memory  # noqa: E402
from serving.config.model_config import load_model_config  # noqa: E402
from serving.models.residency import WORKER_OVERHEAD  # noqa: E402
from tests.integration.harness import ServerProcess, write_model  # noqa: E402
from tests.real_model import smollm2_folder  # noqa: E402

PROPS = {"option.rolling_batch": "auto", "option.max_rolling_batch_size": "4", "option.max_model_len": "2048",
         "minWorkers": "1", "maxWorkers": "1", "load_on_demand": "true"}
PROMPT = "Write one sentence about the sea."


def predicted(folder: Path) -> int:
    cfg = load_model_config(folder)
    plan = planned_memory(cfg.model_dir, cfg.model_id, cfg.handler_properties())
    assert plan is not None
    return plan.weight_bytes + plan.prepack_bytes + plan.activation_bytes + plan.kv_cache_bytes + WORKER_OVERHEAD


def ask(server: ServerProcess, name: str, max_new_tokens: int) -> float:
    t0 = time.monotonic()
    r = httpx.post(f"{server.url}/predictions/{name}", json={"inputs": PROMPT, "parameters": {
        "max_new_tokens": max_new_tokens, "do_sample": False}}, timeout=600)
    elapsed = time.monotonic() - t0
    if r.status_code != 200:
        raise SystemExit(f"{name}: {r.status_code} {r.text}")
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--copies", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--scenario", choices=("turns", "burst"), default="turns")
    ap.add_argument("--streams", type=int, default=2, help="burst: A's streams")
    ap.add_argument("--burst-tokens", type=int, default=600, help="burst: tokens of each stream")
    args = ap.parse_args()
    if args.scenario == "burst":
        run_burst(args.rounds, args.streams, args.burst_tokens)
        return
    source = smollm2_folder()
    names = [f"m{i}" for i in range(args.copies)]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for name in names:
            write_model(root / "model_store", name, PROPS, source)
        one = predicted(root / "model_store" / names[0])
        budget = int(2.5 * one)
        print(f"{args.copies} copies, predicted {one / 2**20:.0f} MiB each, budget {budget / 2**20:.0f} MiB")
        server = ServerProcess.start(root, config={"model_memory_budget": str(budget), "model_load_wait": "600"},
                                     timeout_s=600)
        peak = [0]
        done = threading.Event()

        def sample() -> None:
            with httpx.Client(headers=server.mgmt_headers, timeout=10) as client:
                while not done.wait(0.2):
                    listed = client.get(server.mgmt + "/models").json()["models"]
                    peak[0] = max(peak[0], sum(m["residency"]["memory_bytes"] for m in listed))

        watcher = threading.Thread(target=sample, daemon=True)
        watcher.start()
        cold: list[float] = []
        warm: list[float] = []
        first = 0.0
        try:
            for rnd in range(args.rounds):
                for name in names:
                    c = ask(server, name, args.max_new_tokens)
                    w = ask(server, name, args.max_new_tokens)
                    print(f"round {rnd + 1} {name}: cold {c:6.2f} s  warm {w:6.2f} s")
                    if (rnd, name) == (0, names[0]):
                        first = c  # the first load also starts the fork server (torch imported once)
                    else:
                        cold.append(c)
                    warm.append(w)
            done.set()
            watcher.join()
            text = httpx.get(server.mgmt + "/metrics", headers=server.mgmt_headers).text
            samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
            loads = sum(s.value for s in samples if s.name == "rollserve_model_loads_total")
            unloads = sum(s.value for s in samples if s.name == "rollserve_model_unloads_total")
        finally:
            done.set()
            server.stop()
    print(f"the server's first load: {first:.2f} s")
    print(f"cold first request: median {statistics.median(cold):.2f} s (n={len(cold)}, min {min(cold):.2f}, "
          f"max {max(cold):.2f}); warm: median {statistics.median(warm):.3f} s (n={len(warm)})")
    print(f"loads {loads:.0f}, unloads {unloads:.0f}; loaded models' memory at most {peak[0] / 2**20:.0f} MiB "
          f"of the {budget / 2**20:.0f} MiB budget")


if __name__ == "__main__":
    main()
