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
import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import bench_configs  # noqa: E402
from benchmarks.bench_configs import CONFIGS, DYNAMIC_BATCH, engine_options, kv_tokens_for  # noqa: E402
from benchmarks.bench_report import KV_UTIL_DEF, code_state, conditions, markdown, ratios, result_line  # noqa: E402
from benchmarks.bench_runners import EngineRunner, HFContinuousBatchingRunner, HFHandlerRunner  # noqa: E402
from benchmarks.bench_servers import run_http, start_rollserve, start_vllm  # noqa: E402
from benchmarks.build_models import model_dir  # noqa: E402
from benchmarks.workload import BenchRequest, Workload, build_workload  # noqa: E402
from serving.bench.run_metrics import RunResult, metrics  # noqa: E402

RESULTS = HERE / "results"
RUN_ORDER = "cdefba"  # c first: its burst wall time sets the Poisson rate when --rate auto


def _warm_workload(w: Workload, n: int = 2) -> Workload:
    """A couple of short requests to warm caches, allocators and prepacked weights before timing."""
    reqs = tuple(BenchRequest(r.index, r.prompt, r.prompt_token_ids, min(r.max_new_tokens, 4))
                 for r in sorted(w.requests, key=lambda r: r.prompt_len)[:n])
    return Workload(reqs, w.seed)


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
        print(f"  [{key}] {result_line(m)}  load {m['load_avg_1m_after']:.1f}", flush=True)

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
    bench_configs.PREFIX_CACHING = args.prefix_caching
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
