"""Weight-only quantization vs llama.cpp, pinned: rollserve with ``option.quantize`` = none / int8 / int4 against
llama.cpp's server (llama-cpp-python) on the same real model, SmolLM2-135M-Instruct: llama.cpp serves the Q4_1 GGUF
file itself (``tests.real_model.smollm2_gguf``), rollserve the same weights dequantized to fp32
(``tests.real_model.smollm2_folder``), which int8 / int4 quantize again at load.

* Servers: each run starts a fresh one under ``taskset -c LIST`` (its whole tree inherits it; every thread's
  ``Cpus_allowed_list`` is checked after start and after the passes, ``compare.pins``). rollserve:
  ``serving --model-store DIR`` over a temporary store whose model folder has ``option.model_id`` = the converted
  folder, ``option.rolling_batch=auto``, ``option.max_rolling_batch_size=32``, ``option.max_model_len=2048``,
  ``option.num_threads`` = ``OMP_NUM_THREADS`` = len(LIST); ready when ``/ping`` answers 200. llama.cpp:
  ``python -m llama_cpp.server`` from its own virtualenv (``--llama-python``; not a dependency of rollserve) with
  ``--n_threads`` = ``--n_threads_batch`` = ``OMP_NUM_THREADS`` = len(LIST), ``--n_ctx 2048``, ``--n_batch 512``,
  ``--interrupt_requests False`` (its default lets a new request cut off the one streaming); ready when
  ``/v1/models`` answers 200. The load generator (this process) runs on the other allowed cores where there are any.
* Workload: OpenAI chat completions, ``stream: true`` with ``stream_options.include_usage``, greedy, ``max_tokens``
  128, stopping at EOS as usual (no ``ignore_eos``), over a fixed set of English questions. A token's time is the
  arrival of a chunk with content; its count is the usage chunk's ``completion_tokens`` (chunks with content when a
  server sends no usage: llama-cpp-python ignores ``stream_options`` and streams one chunk per token). batch-1: one
  warm-up request (not measured), then the prompts one after another; decode tok/s = (tokens - 1) / (last - first
  content chunk) per request, median over requests; TTFT p50, ITL p50 / p99 pooled. burst: ``--burst`` requests (the
  prompts cycled) sent at once; output tok/s = all tokens / (last completion - send); TTFT p50, ITL p99. Answer
  lengths differ between servers (greedy answers of differently quantized weights), so burst tok/s is tokens actually
  produced per second.
* CPU-s: utime+stime of the server's process tree (/proc) over each pass. Load check before each pass
  (``compare.wait_quiet``: others' cores and load1 minus our share <= ``--busy-threshold``, re-probed up to
  ``--settle-s``); a busy pass, a failed request or an escaped thread flags the run (the table still prints).
* Alternation: for each core list, ``--repeats`` rounds of rollserve-none, rollserve-int8, rollserve-int4, llama.cpp
  (``--servers``), each a fresh server running batch-1 then burst. Table: median (min-max) per server; ratios of
  medians int8/none, int4/none, int4/llama.cpp, int8/llama.cpp for batch-1 decode tok/s and burst tok/s (and for
  tokens per CPU-second of the server's tree, which other jobs on the same cores disturb less).

    python3 -m venv ../llama-venv && ../llama-venv/bin/pip install 'llama-cpp-python[server]==0.3.36'  # once
    .venv/bin/python benchmarks/quantized_speed.py                                  # 3 rounds on core 1
    .venv/bin/python benchmarks/quantized_speed.py --cores 1 --cores 0,1 --repeats 3 --out /tmp/qs.json
    .venv/bin/python benchmarks/quantized_speed.py --servers rollserve-int4,llama.cpp --repeats 5
    .venv/bin/python benchmarks/quantized_speed.py --repeats 1 --num-prompts 2 --burst 4 --settle-s 5  # smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import httpx  # noqa: E402

from benchmarks import bench, compare  # noqa: E402
from benchmarks.compare import OwnLoad, cpulist, others_cores, parse_cpulist, pins, snap, tree, wait_quiet  # noqa: E402
from serving.bench.launch import LocalServer, read_tokens, wait_http  # noqa: E402
from serving.bench.metrics import Rec, percentile  # noqa: E402

SERVERS = ("rollserve-none", "rollserve-int8", "rollserve-int4", "llama.cpp")
SERVING = REPO / ".venv" / "bin" / "serving"
LLAMA_PYTHON = REPO.parent / "llama-venv" / "bin" / "python"  # beside the checkout, as the docstring builds it
MODEL = "smollm2"  # the model's name on both servers (rollserve: its folder; llama.cpp: --model_alias)
MAX_SEQS = 32
MAX_MODEL_LEN = 2048
N_BATCH = 512  # llama.cpp's prompt batch: more than any prompt here, so a prompt is one forward pass
PROMPTS = (
    "Explain how a bicycle works.",
    "Why is the sky blue?",
    "Give three tips for writing a clear email.",
    "What is the difference between weather and climate?",
    "Describe how to make a cup of tea.",
    "What are the main causes of the French Revolution?",
    "How does a refrigerator keep food cold?",
    "Write a short story about a lost dog finding its way home.",
)
WARMUP_PROMPT = "Say hello and introduce yourself."
KEYS = {  # summary key -> table header
    "b1_decode_tok_s": "b1 decode tok/s", "b1_ttft_p50": "b1 TTFT p50 ms", "b1_itl_p50": "b1 ITL p50 ms",
    "b1_itl_p99": "b1 ITL p99 ms", "b1_tokens_mean": "b1 tokens/req", "b1_cpu_s": "b1 CPU-s",
    "b1_tok_per_cpu_s": "b1 tok/CPU-s", "burst_tok_s": "burst tok/s", "burst_ttft_p50": "burst TTFT p50 ms",
    "burst_itl_p99": "burst ITL p99 ms", "burst_tokens": "burst tokens", "burst_cpu_s": "burst CPU-s",
    "burst_tok_per_cpu_s": "burst tok/CPU-s",
}
RATIOS = (("rollserve-int8", "rollserve-none"), ("rollserve-int4", "rollserve-none"),
          ("rollserve-int4", "llama.cpp"), ("rollserve-int8", "llama.cpp"))
RATIO_KEYS = ("b1_decode_tok_s", "burst_tok_s", "b1_tok_per_cpu_s", "burst_tok_per_cpu_s")
EXTRA_FLAGS = ("fma", "f16c", "avx_vnni")


# ------------------------------------------------------------------------------------------ servers
def start_rollserve(quantize: str, args: argparse.Namespace, cores: list[int], workdir: Path,
                    rec: dict[str, Any]) -> tuple[bench.Subprocess, str]:
    """``serving --model-store`` over a one-model store on 127.0.0.1 ephemeral ports, pinned; waits for /ping."""
    n = len(cores)
    store = workdir / "model_store"
    (store / MODEL).mkdir(parents=True, exist_ok=True)
    props = {"option.model_id": str(args.model_dir), "option.rolling_batch": "auto",
             "option.max_rolling_batch_size": str(MAX_SEQS), "option.max_model_len": str(MAX_MODEL_LEN),
             "option.num_threads": str(n), "option.quantize": quantize, "minWorkers": "1", "maxWorkers": "1"}
    rec["serving_properties"] = "".join(f"{k}={v}\n" for k, v in props.items())
    (store / MODEL / "serving.properties").write_text(rec["serving_properties"])
    cfg = {"inference_address": "http://127.0.0.1:0", "management_address": "http://127.0.0.1:0",
           "grpc_address": "127.0.0.1:0", "key_file": str(workdir / "key_file.json")}
    (workdir / "config.properties").write_text("".join(f"{k}={v}\n" for k, v in cfg.items()))
    ports_file = workdir / "ports.json"
    cmd = ["taskset", "-c", cpulist(cores), str(SERVING), "--model-store", str(store),
           "--config", str(workdir / "config.properties"), "--ports-file", str(ports_file)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(n)}
    rec["command"] = shlex.join(cmd)
    proc = bench.Subprocess(cmd, env, workdir / "server.log", workdir)
    try:
        deadline = time.monotonic() + args.start_timeout
        while not ports_file.exists():
            if proc.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"rollserve did not start:\n{proc.tail()}")
            time.sleep(0.1)
        server = LocalServer(proc, workdir, MODEL, json.loads(ports_file.read_text()),
                             read_tokens(workdir / "key_file.json"))
        server.wait_ready(deadline)
    except BaseException:
        proc.stop()
        raise
    return proc, server.url


def start_llama(args: argparse.Namespace, cores: list[int], workdir: Path,
                rec: dict[str, Any]) -> tuple[bench.Subprocess, str]:
    """llama-cpp-python's OpenAI server on the GGUF file, pinned; waits until ``/v1/models`` answers."""
    if not args.llama_python.exists():
        raise RuntimeError(f"{args.llama_python} not found: make llama.cpp's virtualenv first (module docstring)")
    n, port = len(cores), bench._free_port()
    cmd = ["taskset", "-c", cpulist(cores), str(args.llama_python), "-m", "llama_cpp.server",
           "--model", str(args.gguf), "--model_alias", MODEL, "--n_threads", str(n), "--n_threads_batch", str(n),
           "--n_ctx", str(MAX_MODEL_LEN), "--n_batch", str(N_BATCH), "--interrupt_requests", "False",
           "--host", "127.0.0.1", "--port", str(port)]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(n)})
    rec["command"] = shlex.join(cmd)
    proc = bench.Subprocess(cmd, env, workdir / "server.log", workdir)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/v1/models", proc, args.start_timeout)
    except BaseException:
        proc.stop()
        raise
    return proc, url


def start(server: str, args: argparse.Namespace, cores: list[int], workdir: Path,
          rec: dict[str, Any]) -> tuple[bench.Subprocess, str]:
    workdir.mkdir(parents=True, exist_ok=True)
    if server == "llama.cpp":
        return start_llama(args, cores, workdir, rec)
    return start_rollserve(server.removeprefix("rollserve-"), args, cores, workdir, rec)


# ------------------------------------------------------------------------------------------- client
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


def _answers(recs: list[ChatRec]) -> list[dict[str, Any]]:
    return [{"prompt_tokens": r.prompt_tokens, "tokens": r.num_tokens, "chunks": r.chunks, "finish": r.finish,
             "error": r.error, "text": r.text} for r in recs]


def run_one(server: str, cores: list[int], args: argparse.Namespace, own: OwnLoad, workdir: Path) -> dict[str, Any]:
    """Fresh pinned server, warm-up, batch-1 pass, burst pass, server stopped."""
    rec: dict[str, Any] = {"server": server, "cores": cpulist(cores), "busy": []}
    t0 = time.monotonic()
    try:
        proc, url = start(server, args, cores, workdir, rec)
    except Exception as exc:  # noqa: BLE001 - a server that cannot start is a failed run
        return rec | {"error": f"{type(exc).__name__}: {exc}"[-2000:]}
    root = proc.proc.pid
    own.roots.append(root)
    try:
        rec["startup_s"] = round(time.monotonic() - t0, 1)
        rec["pins_after_start"] = pins(root, cores)
        warm = run_batch1(url, [WARMUP_PROMPT], args.max_tokens, args.timeout)
        rec["warmup"] = _answers(warm)
        prompts = list(PROMPTS[:args.num_prompts])
        burst = [prompts[i % len(prompts)] for i in range(args.burst)]
        rec["batch1"], b1 = measured_pass("batch1", root, own, args,
                                          lambda: run_batch1(url, prompts, args.max_tokens, args.timeout))
        rec["burst"], _ = measured_pass("burst", root, own, args,
                                        lambda: run_burst(url, burst, args.max_tokens, args.timeout))
        rec["answers"] = _answers(b1)
        rec["pins_after_passes"] = pins(root, cores)
    except Exception as exc:  # noqa: BLE001
        rec["error"] = f"{type(exc).__name__}: {exc}"[-2000:]
    finally:
        own.roots.remove(root)
        proc.stop()
    for p in ("batch1", "burst"):
        rec["busy"] += rec.get(p, {}).get("busy", [])
    if "burst" in rec and not rec["batch1"]["failed"] and not rec["burst"]["failed"]:
        b1, bu = rec["batch1"], rec["burst"]
        rec["summary"] = {"b1_decode_tok_s": b1["decode_tok_s"], "b1_ttft_p50": b1["ttft_p50"],
                          "b1_itl_p50": b1["itl_p50"], "b1_itl_p99": b1["itl_p99"],
                          "b1_tokens_mean": b1["tokens_mean"], "b1_cpu_s": b1["cpu_s"],
                          "b1_tok_per_cpu_s": b1["tok_per_cpu_s"], "burst_tok_s": bu["tok_s"],
                          "burst_ttft_p50": bu["ttft_p50"], "burst_itl_p99": bu["itl_p99"],
                          "burst_tokens": bu["tokens"], "burst_cpu_s": bu["cpu_s"],
                          "burst_tok_per_cpu_s": bu["tok_per_cpu_s"]}
    return rec


def run_line(r: dict[str, Any]) -> str:
    if "summary" not in r:
        errs = r.get("error") or [r.get(p, {}).get("errors") for p in ("batch1", "burst")]
        return f"  {r['server']:14s} FAILED {errs}"
    s, b1, bu = r["summary"], r["batch1"], r["burst"]
    pin_ok = all(r[k]["ok"] for k in ("pins_after_start", "pins_after_passes"))
    return (f"  {r['server']:14s} start {r['startup_s']:.0f}s | batch-1: decode {s['b1_decode_tok_s']:.1f} tok/s, "
            f"TTFT p50 {s['b1_ttft_p50']:.0f} ms, ITL p50/p99 {s['b1_itl_p50']:.1f}/{s['b1_itl_p99']:.1f} ms, "
            f"{b1['tokens']} tokens ({b1['chunks']} chunks), CPU {b1['cpu_s']:.1f} s | burst {bu['requests']}: "
            f"{s['burst_tok_s']:.1f} tok/s, TTFT p50 {s['burst_ttft_p50']:.0f} ms, ITL p99 {s['burst_itl_p99']:.0f} "
            f"ms, {bu['tokens']} tokens in {bu['wall_s']:.1f} s, CPU {bu['cpu_s']:.1f} s | load1 before "
            f"{b1['load_check']['load1']}/{bu['load_check']['load1']}, others' cores during "
            f"{b1['others_cores_during']:.2f}/{bu['others_cores_during']:.2f}{'  BUSY' if r['busy'] else ''}"
            f"{'' if pin_ok else '  ESCAPED PINNING'}")


# ------------------------------------------------------------------------------------------ summary
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
        lines.append(f"| {s} | {v['runs']} | " + " | ".join(compare._cell(v[k]) for k in KEYS) + " |")
    if sm["ratios"]:
        lines += ["", "| ratio of medians | " + " | ".join(KEYS[k] for k in RATIO_KEYS) + " |",
                  "|---" * (len(RATIO_KEYS) + 1) + "|"]
        lines += [f"| {name} | " + " | ".join(f"{r[k]:.2f}x" for k in RATIO_KEYS) + " |"
                  for name, r in sm["ratios"].items()]
    lines += [""] + [f"{s}: {line}" for s, line in comp["answers"].items()]
    lines += [f"FLAG {f}" for f in sm["flags"]]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------ setting
def environment(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    info = dict(ln.split(":", 1) for ln in subprocess.run(["lscpu"], capture_output=True, text=True).stdout
                .splitlines() if ":" in ln)
    flags = info.get("Flags", "").split()
    llama = "?"
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        llama = subprocess.run([str(args.llama_python), "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                               capture_output=True, text=True, timeout=60).stdout.strip() or "?"
    h = hashlib.sha256()
    for f in sorted((REPO / "handlers").rglob("*.py")) + sorted((REPO / "serving").rglob("*.py")):
        h.update(f.read_bytes())
    return {"cpu": info.get("Model name", "?").strip(), "cpus": os.cpu_count(),
            "flags": [f for f in compare.FLAGS + EXTRA_FLAGS if f in flags], "torch": torch.__version__,
            "llama_cpp_python": llama, "rollserve_src": h.hexdigest()[:10], "model_dir": str(args.model_dir),
            "gguf": str(args.gguf), "loadavg": os.getloadavg()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cores", action="append", type=parse_cpulist, help="server core list, repeatable (default 1)")
    ap.add_argument("--repeats", type=int, default=3, help="rounds over the servers (default 3)")
    ap.add_argument("--servers", type=lambda v: [x for x in v.split(",") if x], default=list(SERVERS),
                    help=f"comma list, run in this order each round (default {','.join(SERVERS)})")
    ap.add_argument("--num-prompts", type=int, default=len(PROMPTS), help=f"batch-1 prompts (1-{len(PROMPTS)})")
    ap.add_argument("--burst", type=int, default=32, help="requests sent at once in the burst pass (default 32)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--busy-threshold", type=float, default=0.5, help="cores of other jobs that make a pass busy")
    ap.add_argument("--settle-s", type=float, default=60.0, help="how long to wait for a quiet machine per pass")
    ap.add_argument("--start-timeout", type=float, default=300.0, help="seconds for a server to become ready")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds for one request")
    ap.add_argument("--model-dir", type=Path, default=None, help="rollserve's model (default: the converted GGUF)")
    ap.add_argument("--gguf", type=Path, default=None, help="llama.cpp's model (default: SmolLM2-135M Q4_1)")
    ap.add_argument("--llama-python", type=Path, default=LLAMA_PYTHON, help=f"default {LLAMA_PYTHON}")
    ap.add_argument("--out", type=Path, default=None, help="results JSON (default /tmp/quantized_speed-STAMP.json)")
    args = ap.parse_args(argv)
    if not args.servers or set(args.servers) - set(SERVERS):
        ap.error(f"--servers takes a comma list of {', '.join(SERVERS)}")
    if not 1 <= args.num_prompts <= len(PROMPTS) or args.burst < 1 or args.repeats < 1:
        ap.error(f"--num-prompts 1-{len(PROMPTS)}, --burst and --repeats at least 1")
    allowed = sorted(os.sched_getaffinity(0))
    cores_lists = args.cores or [[1]]
    for cs in cores_lists:
        if not set(cs) <= set(allowed):
            ap.error(f"--cores {cpulist(cs)} not within this process's CPUs {allowed}")
    from tests.real_model import smollm2_folder, smollm2_gguf

    args.gguf = (args.gguf or smollm2_gguf()).resolve()
    args.model_dir = (args.model_dir or smollm2_folder()).resolve()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out_path = args.out or Path(f"/tmp/quantized_speed-{stamp}.json")
    work = out_path.with_name(out_path.stem + "-work")
    res: dict[str, Any] = {"stamp": stamp, "argv": shlex.join(["python", *sys.argv]), "env": environment(args),
                           "prompts": list(PROMPTS[:args.num_prompts]), "burst": args.burst,
                           "max_tokens": args.max_tokens, "comparisons": []}
    e = res["env"]
    print(f"{e['cpu']}, {e['cpus']} CPUs, flags {' '.join(e['flags'])}; torch {e['torch']}, llama-cpp-python "
          f"{e['llama_cpp_python']}, rollserve src {e['rollserve_src']}; load {' '.join(map(str, e['loadavg']))}\n"
          f"rollserve: {e['model_dir']}\nllama.cpp: {e['gguf']}\nwork folders (server logs): {work}", flush=True)
    own = OwnLoad()
    own.start()
    try:
        for cores in cores_lists:
            gen = sorted(set(allowed) - set(cores)) or cores
            os.sched_setaffinity(0, gen)  # the load generator off the servers' cores where it can be
            comp: dict[str, Any] = {"cores": cpulist(cores), "loadgen_cores": cpulist(gen), "runs": []}
            res["comparisons"].append(comp)
            print(f"\n== cores {comp['cores']}: load generator on {comp['loadgen_cores']}"
                  f"{' (shared with the servers)' if gen == cores else ''}", flush=True)
            for i in range(args.repeats):
                for s in args.servers:
                    r = run_one(s, cores, args, own, work / comp["cores"] / f"{s}-{i}")
                    comp["runs"].append(r)
                    print(run_line(r), flush=True)
                    out_path.write_text(json.dumps(res, indent=1, default=str))
            comp["summary"] = summarize(comp["runs"], args.servers)
            comp["answers"] = same_answers(comp["runs"], args.servers)
    finally:
        os.sched_setaffinity(0, allowed)
        out_path.write_text(json.dumps(res, indent=1, default=str))
    print("\n" + "\n".join(table(c) for c in res["comparisons"]) + f"\nresults: {out_path}", flush=True)


if __name__ == "__main__":
    main()
