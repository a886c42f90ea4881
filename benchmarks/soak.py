"""Soak: steady load on both batchers for a long time; reports failures and per-process RSS drift.

    python benchmarks/soak.py                      # 30 minutes (the issue-11 soak), default model
    python benchmarks/soak.py --duration-s 240 --warmup-s 60    # a shortened run

Starts ``python -m serving`` on 127.0.0.1 ephemeral ports with two copies of the default model: ``stream``
(rolling batching) and ``dyn`` (dynamic batching). Two Poisson arrival processes (seeded) run for the whole
duration: OpenAI streaming completions on ``stream`` (``--stream-rate`` per second; a fraction
``--disconnect-fraction`` of them drop the connection after a few chunks, as impatient clients do) and LMI
whole-answer requests on ``dyn`` (``--dynamic-rate`` per second). Every ``--sample-s`` seconds the RSS of
the frontend and of each worker (by model; a restarted worker is a new series) is read from ``/proc``. At the
end it prints (and writes to ``--out`` as JSON): requests sent and answered by kind, every failure with its
status and message, latency percentiles, and for each process its RSS at the end of the warm-up, at the end,
and the drift after warm-up in %/h from a least-squares line through the post-warm-up samples. A rolling
worker's KV pool is mapped lazily (``option.kv_cache_populate=lazy``): its pages are paid for when a block is
first handed out, so its RSS grows with use up to the planned KV size; for such a worker the drift is taken
net of the KV blocks touched so far (engine stats ``kv_blocks_touched`` x ``kv_block_bytes``, sampled with
the RSS), and the raw drift and the KV MiB touched are reported next to it. Targets
(the robustness targets): no failure, drift < 5 %/h. Exit code 0 when both targets are met, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = REPO / "examples" / "models" / "tiny-llama"
WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches in the "
         "old city near the river under a pale moon").split()


@dataclass
class Outcome:
    """What happened to the requests of one kind."""

    sent: int = 0
    ok: int = 0
    disconnected: int = 0  # dropped on purpose by the client (not a failure)
    failures: list[str] = field(default_factory=list)
    latencies_s: list[float] = field(default_factory=list)


def start_server(workdir: Path) -> tuple[subprocess.Popen[bytes], dict[str, int], dict[str, str]]:
    """The server, its ports and its tokens (read from the key file it writes)."""
    store = workdir / "model_store"
    for name, props in (("stream", {"option.rolling_batch": "auto", "option.max_rolling_batch_size": "16"}),
                        ("dyn", {"option.entryPoint": "huggingface", "batch_size": "4", "max_batch_delay": "20"})):
        d = store / name
        d.mkdir(parents=True)
        for f in DEFAULT_MODEL.iterdir():
            if f.is_file() and f.name != "serving.properties":
                os.symlink(f, d / f.name)
        (d / "serving.properties").write_text("".join(f"{k}={v}\n" for k, v in props.items()))
    cfg = {"inference_address": "http://127.0.0.1:0", "management_address": "http://127.0.0.1:0",
           "grpc_address": "off", "model_store": str(store), "drain_timeout": "10"}
    (workdir / "config.properties").write_text("".join(f"{k}={v}\n" for k, v in cfg.items()))
    ports_file = workdir / "ports.json"
    proc = subprocess.Popen([sys.executable, "-m", "serving", "--config", str(workdir / "config.properties"),
                             "--ports-file", str(ports_file)], cwd=workdir, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"},
                            stdout=open(workdir / "server.log", "wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while True:
        if ports_file.exists():
            ports = json.loads(ports_file.read_text())
            try:
                if httpx.get(f"http://127.0.0.1:{ports['inference']}/ping", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"server did not start; see {workdir / 'server.log'}")
        time.sleep(0.2)
    key_file = workdir / "key_file.json"
    keys = json.loads(key_file.read_text()) if key_file.exists() else {}  # none: authorization disabled
    return proc, ports, {scope: keys[scope]["key"] for scope in ("management", "inference") if scope in keys}


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 64)))


async def one_stream(client: httpx.AsyncClient, url: str, rng: random.Random, disconnect: bool, out: Outcome) -> None:
    body = {"model": "stream", "prompt": prompt(rng), "max_tokens": rng.randint(8, 48), "stream": True,
            "ignore_eos": True}
    t0 = time.monotonic()
    out.sent += 1
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                out.failures.append(f"stream {r.status_code}: {(await r.aread())[:300]!r}")
                return
            chunks = 0
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if '"error"' in line:
                    out.failures.append(f"stream error event: {line[:300]}")
                    return
                if line == "data: [DONE]":
                    out.ok += 1
                    out.latencies_s.append(time.monotonic() - t0)
                    return
                chunks += 1
                if disconnect and chunks >= 3:
                    out.disconnected += 1
                    return  # leaving the context manager drops the connection mid-stream
            out.failures.append("stream ended without [DONE]")
    except httpx.HTTPError as exc:
        out.failures.append(f"stream {type(exc).__name__}: {exc}")


async def one_whole(client: httpx.AsyncClient, url: str, rng: random.Random, out: Outcome) -> None:
    body = {"inputs": prompt(rng), "parameters": {"max_new_tokens": rng.randint(8, 32), "ignore_eos": True}}
    t0 = time.monotonic()
    out.sent += 1
    try:
        r = await client.post(f"{url}/predictions/dyn", json=body)
    except httpx.HTTPError as exc:
        out.failures.append(f"dynamic {type(exc).__name__}: {exc}")
        return
    if r.status_code == 200 and "generated_text" in r.json():
        out.ok += 1
        out.latencies_s.append(time.monotonic() - t0)
    else:
        out.failures.append(f"dynamic {r.status_code}: {r.text[:300]}")


async def arrivals(rate: float, until: float, rng: random.Random, launch: Any) -> list[asyncio.Task[None]]:
    tasks: list[asyncio.Task[None]] = []
    while time.monotonic() < until:
        await asyncio.sleep(rng.expovariate(rate))
        tasks.append(asyncio.ensure_future(launch()))
    return tasks


async def sample_rss(mgmt: str, headers: dict[str, str], frontend: int, until: float, every_s: float,
                     samples: dict[str, list[tuple[float, float]]], kv: dict[str, list[tuple[float, float]]]) -> None:
    """RSS of every process (MiB) into ``samples``; for rolling workers whose KV pool is lazily mapped, the MiB
    of KV blocks handed out at least once (the pool's pages paid for so far) into ``kv``."""
    t_start = time.monotonic()
    async with httpx.AsyncClient(timeout=10, headers=headers) as client:
        while time.monotonic() < until:
            now = time.monotonic() - t_start
            pids = {"frontend": frontend}
            for model in ("stream", "dyn"):
                d = (await client.get(f"{mgmt}/models/{model}")).json()[0]["models"][0]
                engines = (d.get("batcher") or {}).get("engines") or {}
                for w in d.get("workers", []):
                    name = f"worker {model} pid {w['pid']}"
                    pids[name] = int(w["pid"])
                    e = engines.get(str(w["id"]))
                    if e and e.get("kv_cache_populate") == "lazy":
                        kv.setdefault(name, []).append((now, e["kv_blocks_touched"] * e["kv_block_bytes"] / 2**20))
            for name, pid in pids.items():
                value = rss_mib(pid)
                if value is not None:
                    samples.setdefault(name, []).append((now, value))
            await asyncio.sleep(every_s)


def drift_per_hour(points: list[tuple[float, float]], warmup_s: float) -> tuple[float, float, float] | None:
    """(RSS at the end of warm-up, RSS at the end, least-squares drift after warm-up in % of the former per hour)."""
    after = [(t, v) for t, v in points if t >= warmup_s]
    if len(after) < 3:
        return None
    n = len(after)
    mt, mv = sum(t for t, _ in after) / n, sum(v for _, v in after) / n
    slope = sum((t - mt) * (v - mv) for t, v in after) / max(sum((t - mt) ** 2 for t, _ in after), 1e-9)
    base = after[0][1]
    return base, after[-1][1], slope * 3600 / base * 100


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def soak(args: argparse.Namespace, url: str, mgmt: str, tokens: dict[str, str], frontend: int) -> dict[str, Any]:
    rng = random.Random(args.seed)
    until = time.monotonic() + args.duration_s
    streams, wholes = Outcome(), Outcome()
    samples: dict[str, list[tuple[float, float]]] = {}
    kv: dict[str, list[tuple[float, float]]] = {}
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=50)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        auth = {"Authorization": f"Bearer {tokens['management']}"} if "management" in tokens else {}
        sampler = asyncio.ensure_future(sample_rss(mgmt, auth, frontend, until, args.sample_s, samples, kv))
        s_rng, d_rng = random.Random(rng.random()), random.Random(rng.random())
        stream_tasks, whole_tasks = await asyncio.gather(
            arrivals(args.stream_rate, until, s_rng, lambda: one_stream(
                client, url, s_rng, s_rng.random() < args.disconnect_fraction, streams)),
            arrivals(args.dynamic_rate, until, d_rng, lambda: one_whole(client, url, d_rng, wholes)))
        await asyncio.gather(*stream_tasks, *whole_tasks)
        await sampler
    report: dict[str, Any] = {"config": vars(args), "streams": asdict(streams), "dynamic": asdict(wholes), "rss": {}}
    for kind in ("streams", "dynamic"):
        lat = report[kind].pop("latencies_s")
        report[kind]["latency_p50_s"], report[kind]["latency_p99_s"] = percentile(lat, 0.5), percentile(lat, 0.99)
    for name, points in samples.items():
        d = drift_per_hour(points, args.warmup_s)
        if d is None:
            continue
        entry = report["rss"][name] = {"after_warmup_mib": round(d[0], 2), "end_mib": round(d[1], 2),
                                       "drift_pct_per_hour": round(d[2], 2),
                                       "samples_mib": [[round(t), round(v, 2)] for t, v in points]}
        net = net_of_kv(points, kv.get(name, []))
        d_net = drift_per_hour(net, args.warmup_s) if net else None
        if d_net is not None:  # a lazily mapped KV pool: its first use is planned memory, not a leak
            entry["kv_touched_mib"] = [round(kv[name][0][1], 2), round(kv[name][-1][1], 2)]
            entry["raw_drift_pct_per_hour"] = entry["drift_pct_per_hour"]
            entry["drift_pct_per_hour"] = round(d_net[2], 2)
    return report


def net_of_kv(rss: list[tuple[float, float]], kv: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """RSS samples minus the KV MiB paid for by the same time (the latest KV sample at or before each RSS
    sample; none when there are no KV samples)."""
    out = []
    i = -1
    for t, v in rss:
        while i + 1 < len(kv) and kv[i + 1][0] <= t + 1e-6:
            i += 1
        if i >= 0:
            out.append((t, v - kv[i][1]))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration-s", type=float, default=1800.0)
    ap.add_argument("--warmup-s", type=float, default=240.0)
    ap.add_argument("--stream-rate", type=float, default=2.0)
    ap.add_argument("--dynamic-rate", type=float, default=2.0)
    ap.add_argument("--disconnect-fraction", type=float, default=0.1)
    ap.add_argument("--sample-s", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help="write the report here as JSON")
    args = ap.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="rollserve-soak-"))
    proc, ports, tokens = start_server(workdir)
    try:
        report = asyncio.run(soak(args, f"http://127.0.0.1:{ports['inference']}",
                                  f"http://127.0.0.1:{ports['management']}", tokens, proc.pid))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    report["server_log"] = str(workdir / "server.log")
    failures = len(report["streams"]["failures"]) + len(report["dynamic"]["failures"])
    worst = max((r["drift_pct_per_hour"] for r in report["rss"].values()), default=0.0)
    report["targets_met"] = failures == 0 and worst < 5.0
    text = json.dumps(report, indent=2, default=str)
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    return 0 if report["targets_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
