"""Multi-turn chat over two rolling workers: prefix-aware routing against least-loaded routing.

CONVERSATIONS conversations of TURNS turns each share one system prompt; every conversation is its own client,
all of them at once, each sending its next turn (the whole conversation so far: system prompt, the earlier user
turns and the model's answers) a seeded random think time (uniform in 0..THINK_MS) after the previous answer
ended, so that the conversations do not move in lockstep (in lockstep, least-loaded routing happens to send each
conversation to the same worker every turn, which real traffic does not do). Requests are streamed greedy chat
completions (``/v1/chat/completions`` with ``stream_options.include_usage``); per request: TTFT (the first chunk
with content) and the usage's ``prompt_tokens`` and ``prompt_tokens_details.cached_tokens``.

One server per run (empty prefix caches), two workers of the model (``minWorkers=maxWorkers=2``, one thread each),
``option.routing`` prefix or least_loaded, the runs alternating (prefix, least_loaded, prefix, ...) RUNS times
each, the server pinned with ``taskset -c CORES``. Reported per policy (medians over runs): the prefix-cache hit
rate (cached prompt tokens / prompt tokens, all turns; and turns 2+), TTFT p50 and p90, wall time, and the
server's own routing counters; the 1-minute load average before each run.

    python benchmarks/multiturn.py [--model tiny|smollm2] [--runs 3] [--cores 0-1] [--conversations 20]
        [--turns 4] [--max-tokens 32] [--think-ms 500] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.integration.harness import DEFAULT_MODEL, ServerProcess  # noqa: E402

MODEL = "chat"
POLICIES = ("prefix", "least_loaded")
SYSTEM = ("You are the support assistant of a small bicycle shop. You answer questions about repairs, spare parts, "
          "opening hours and orders. Be brief and friendly, name the part or the service the customer needs, and "
          "say when a repair needs the bicycle in the shop. Opening hours: Monday to Friday nine to six, Saturday "
          "ten to four, closed on Sunday. Repairs take two working days; a flat tyre is fixed while you wait. ")
QUESTIONS = ("My front brake squeaks, what should I do?", "How much is a new chain?", "Can you fix a flat tyre today?",
             "Do you sell child seats?", "My gears skip on the hill.", "When are you open on Saturday?",
             "Can I order a dynamo light?", "Is a service before winter useful?", "The saddle is too low.",
             "Which tyres are good for gravel?", "My bell is broken.", "Do you repair electric bicycles?")


def properties(policy: str) -> dict[str, str]:
    return {"option.entryPoint": "huggingface", "option.rolling_batch": "scheduler",
            "option.enable_prefix_caching": "true", "option.max_rolling_batch_size": "16", "option.num_threads": "1",
            "minWorkers": "2", "maxWorkers": "2", "option.routing": policy}


def source(model: str) -> Path:
    if model == "tiny":
        return DEFAULT_MODEL
    from tests.real_model import smollm2_folder
    return smollm2_folder()


async def turn(client: httpx.AsyncClient, url: str, messages: list[dict[str, str]], max_tokens: int
               ) -> dict[str, Any]:
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft: float | None = None
    text: list[str] = []
    usage: dict[str, Any] = {}
    async with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            raise SystemExit(f"{r.status_code}: {(await r.aread()).decode()}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or ():
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    text.append(piece)
            if chunk.get("usage"):
                usage = chunk["usage"]
    return {"ttft_s": ttft if ttft is not None else time.perf_counter() - t0, "text": "".join(text),
            "prompt_tokens": usage["prompt_tokens"], "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]}


async def conversation(client: httpx.AsyncClient, url: str, index: int, turns: int, max_tokens: int,
                       think_s: float) -> list[dict[str, Any]]:
    rng = random.Random(index)
    messages = [{"role": "system", "content": SYSTEM}]
    out = []
    for k in range(turns):
        await asyncio.sleep(rng.uniform(0, think_s))  # the user reads and types (seeded: the same in every run)
        messages.append({"role": "user", "content": f"(customer {index}) {rng.choice(QUESTIONS)}"})
        rec = await turn(client, url, messages, max_tokens)
        messages.append({"role": "assistant", "content": rec.pop("text")})
        out.append({**rec, "turn": k})
    return out


async def workload(server: ServerProcess, args: argparse.Namespace) -> list[dict[str, Any]]:
    url = f"{server.url}/v1/chat/completions"
    async with httpx.AsyncClient(headers=server.inference_headers, timeout=600) as client:
        runs = await asyncio.gather(*(conversation(client, url, i, args.turns, args.max_tokens, args.think_ms / 1000)
                                      for i in range(args.conversations)))
    return [r for conv in runs for r in conv]


def summary(records: list[dict[str, Any]]) -> dict[str, float]:
    def hit(rs: list[dict[str, Any]]) -> float:
        return sum(r["cached_tokens"] for r in rs) / max(1, sum(r["prompt_tokens"] for r in rs))
    ttfts = sorted(r["ttft_s"] for r in records)
    return {"hit_rate": hit(records), "hit_rate_later_turns": hit([r for r in records if r["turn"] > 0]),
            "ttft_p50_ms": 1000 * statistics.median(ttfts),
            "ttft_p90_ms": 1000 * ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))]}


def one_run(policy: str, model: Path, cores: str, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        server = ServerProcess.start(Path(tmp), models={MODEL: properties(policy)}, sources={MODEL: model},
                                     prefix=["taskset", "-c", cores], timeout_s=600)
        try:
            load = os.getloadavg()[0]
            t0 = time.perf_counter()
            records = asyncio.run(workload(server, args))
            wall = time.perf_counter() - t0
            routing = server.describe(MODEL)["batcher"]["routing"]
        finally:
            server.stop()
    return {"policy": policy, "load1_before": load, "wall_s": wall, **summary(records),
            "routed_by_prefix": routing["routed_by_prefix_total"], "routed": routing["routed_total"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--cores", default="0-1")
    ap.add_argument("--conversations", type=int, default=20)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--think-ms", type=float, default=500.0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    model = source(args.model)
    runs = []
    for i in range(args.runs):
        for policy in POLICIES:
            r = one_run(policy, model, args.cores, args)
            runs.append(r)
            print(f"run {i + 1} {policy:>12}: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                                             for k, v in r.items() if k != "policy"), flush=True)
    keys = ("hit_rate", "hit_rate_later_turns", "ttft_p50_ms", "ttft_p90_ms", "wall_s")
    medians = {p: {k: statistics.median(r[k] for r in runs if r["policy"] == p) for k in keys} for p in POLICIES}
    for p, m in medians.items():
        print(f"median {p:>12}: " + ", ".join(f"{k} {v:.3f}" for k, v in m.items()))
    ratio = medians["prefix"]["ttft_p50_ms"] / medians["least_loaded"]["ttft_p50_ms"]
    print(f"TTFT p50 prefix / least_loaded: {ratio:.2f}x")
    if args.json is not None:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "runs": runs,
                                         "medians": medians}, indent=2))


if __name__ == "__main__":
    main()
