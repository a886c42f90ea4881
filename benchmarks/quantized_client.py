"""quantized_speed.py's load and measurement: streamed OpenAI chat completions one after another (batch-1) or all
at once (burst), and a pass's metrics with the server tree's CPU-seconds and the load around it."""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from benchmarks.cpu_accounting import OwnLoad, others_cores, snap, tree, wait_quiet
from benchmarks.quantized_servers import MODEL
from serving.bench.run_metrics import Rec, percentile


@dataclass
class ChatRec(Rec):
    """One streamed chat answer: ``token_times`` are the chunks with content; ``n_out`` the usage's count."""

    chunks: int = 0
    prompt_tokens: int | None = None
    finish: str | None = None
    text: str = ""


async def chat(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int, rec: ChatRec) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                rec.error = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
                return
            async for line in resp.aiter_lines():
                t = time.perf_counter()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    rec.error = str(obj["error"])[:300]
                for choice in obj.get("choices") or []:
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        rec.token_times.append(t)
                        rec.chunks += 1
                        rec.text += content
                    rec.finish = choice.get("finish_reason") or rec.finish
                if obj.get("usage"):
                    rec.n_out = int(obj["usage"]["completion_tokens"])
                    rec.prompt_tokens = int(obj["usage"]["prompt_tokens"])
            rec.end = time.perf_counter()
    except Exception as exc:  # noqa: BLE001 - a benchmark reports failures
        rec.error = f"{type(exc).__name__}: {exc}"


def _client(n: int, timeout_s: float) -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=httpx.Timeout(timeout_s),
                             limits=httpx.Limits(max_connections=n + 4, max_keepalive_connections=n + 4))


def run_batch1(url: str, prompts: list[str], max_tokens: int, timeout_s: float) -> list[ChatRec]:
    """The prompts one after another (each sent when the previous one finished)."""
    async def main() -> list[ChatRec]:
        recs = []
        async with _client(1, timeout_s) as client:
            for p in prompts:
                recs.append(ChatRec(time.perf_counter()))
                await chat(client, url, p, max_tokens, recs[-1])
        return recs

    return asyncio.run(main())


def run_burst(url: str, prompts: list[str], max_tokens: int, timeout_s: float) -> list[ChatRec]:
    """All of ``prompts`` sent at once (every request's send time is the common start)."""
    async def main() -> list[ChatRec]:
        async with _client(len(prompts), timeout_s) as client:
            t0 = time.perf_counter()
            recs = [ChatRec(t0) for _ in prompts]
            await asyncio.gather(*(chat(client, url, p, max_tokens, r) for p, r in zip(prompts, recs, strict=True)))
        return recs

    return asyncio.run(main())


# ------------------------------------------------------------------------------------------ metrics
def _ms(xs: list[float], p: float) -> float:
    return 1000 * percentile(xs, p)


def pass_metrics(recs: list[ChatRec], burst: bool) -> dict[str, Any]:
    ok = [r for r in recs if r.ok]
    itl = [g for r in ok for g in r.itl()]
    ttft = [r.ttft() for r in ok]
    m: dict[str, Any] = {"requests": len(recs), "failed": len(recs) - len(ok),
                         "errors": sorted({r.error for r in recs if r.error})[:3],
                         "tokens": sum(r.num_tokens for r in ok), "chunks": sum(r.chunks for r in ok),
                         "usage_counted": sum(r.n_out is not None for r in ok),
                         "finish": {f: sum(r.finish == f for r in ok) for f in {r.finish for r in ok}},
                         "ttft_p50": _ms(ttft, 50), "itl_p50": _ms(itl, 50), "itl_p99": _ms(itl, 99)}
    if burst:
        wall = max((r.done for r in ok), default=float("nan")) - min((r.send for r in recs), default=0.0)
        m.update({"wall_s": wall, "tok_s": m["tokens"] / wall if ok else float("nan")})
    else:
        rates = [(r.num_tokens - 1) / (r.token_times[-1] - r.token_times[0]) for r in ok
                 if r.num_tokens > 1 and len(r.token_times) > 1 and r.token_times[-1] > r.token_times[0]]
        m.update({"decode_tok_s": statistics.median(rates) if rates else float("nan"),
                  "decode_tok_s_each": rates, "tokens_mean": m["tokens"] / len(ok) if ok else float("nan")})
    return m


def measured_pass(name: str, root: int, own: OwnLoad, args: argparse.Namespace,
                  fn: Callable[[], list[ChatRec]]) -> tuple[dict[str, Any], list[ChatRec]]:
    """Load check, then ``fn()`` with the server tree's CPU-s and others' cores around it."""
    check = wait_quiet(own, tree(root), args.busy_threshold, args.settle_s)
    pids = tree(root)
    a = snap(pids)
    recs = fn()
    b = snap(sorted(set(pids) | set(tree(root))))
    m = pass_metrics(recs, burst=name == "burst")
    tree_s, others = sum(b[0].values()) - sum(a[0].values()), others_cores(a, b)
    busy = []
    if not check["quiet"]:
        busy.append(f"{name} before: load {check['load1']} (own {check['own_load']}), others {check['others_cores']}")
    if others > args.busy_threshold:
        busy.append(f"{name} during: others {others:.2f} cores")
    m.update({"cpu_s": tree_s, "tok_per_cpu_s": m["tokens"] / max(tree_s, 1e-9), "load_check": check,
              "others_cores_during": others, "loadgen_cpu_s": b[3] - a[3], "busy": busy})
    return m, recs


def answers(recs: list[ChatRec]) -> list[dict[str, Any]]:
    return [{"prompt_tokens": r.prompt_tokens, "tokens": r.num_tokens, "chunks": r.chunks, "finish": r.finish,
             "error": r.error, "text": r.text} for r in recs]

