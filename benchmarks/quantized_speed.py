"""Weight-only quantization vs llama.cpp, pinned: rollserve with ``option.quantize`` = none / int8 / int4 against
llama.cpp's server (llama-cpp-python) on the same real model, SmolLM2-135M-Instruct: llama.cpp serves the Q4_1 GGUF
file itself (``tests.real_model.smollm2_gguf``), rollserve the same weights dequantized to fp32
(``tests.real_model.smollm2_folder``), which int8 / int4 quantize again at load; rollserve-gguf serves llama.cpp's
file itself (``option.model_id`` = the file, ``option.quantize=auto``: its blocks as they are).

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
import contextlib
import hashlib
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.compare import FLAGS  # noqa: E402
from benchmarks.cpu_accounting import OwnLoad, cpulist, parse_cpulist, pins, pss_mb, tree  # noqa: E402
from benchmarks.quantized_client import answers, measured_pass, run_batch1, run_burst  # noqa: E402
from benchmarks.quantized_report import same_answers, summarize, table  # noqa: E402
from benchmarks.quantized_servers import LLAMA_PYTHON, start  # noqa: E402

SERVERS = ("rollserve-none", "rollserve-int8", "rollserve-int4", "rollserve-gguf", "rollserve-gguf-int8", "llama.cpp")
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
EXTRA_FLAGS = ("fma", "f16c", "avx_vnni")


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
        rec["pss_mb_after_start"] = pss_mb(tree(root))
        rec["pins_after_start"] = pins(root, cores)
        warm = run_batch1(url, [WARMUP_PROMPT], args.max_tokens, args.timeout)
        rec["warmup"] = answers(warm)
        prompts = list(PROMPTS[:args.num_prompts])
        burst = [prompts[i % len(prompts)] for i in range(args.burst)]
        rec["batch1"], b1 = measured_pass("batch1", root, own, args,
                                          lambda: run_batch1(url, prompts, args.max_tokens, args.timeout))
        rec["burst"], _ = measured_pass("burst", root, own, args,
                                        lambda: run_burst(url, burst, args.max_tokens, args.timeout))
        rec["answers"] = answers(b1)
        rec["pss_mb_after_passes"] = pss_mb(tree(root))
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
                          "burst_tok_per_cpu_s": bu["tok_per_cpu_s"], "start_s": rec["startup_s"],
                          "pss_mb": rec["pss_mb_after_passes"]}
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
            f" | PSS {r['pss_mb_after_start']:.0f} MB after start, {r['pss_mb_after_passes']:.0f} MB after the passes"
            f"{'' if pin_ok else '  ESCAPED PINNING'}")



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
            "flags": [f for f in FLAGS + EXTRA_FLAGS if f in flags], "torch": torch.__version__,
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
    ap.add_argument("--rollserve-option", action="append", metavar="KEY=VALUE",
                    help="a serving.properties line for every rollserve server, e.g. option.kv_cache_populate=lazy")
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
