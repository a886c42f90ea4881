"""Where the time goes in a rolling-engine step: torch.profiler operator table + cProfile Python summary.

Admits the first ``--batch`` requests of the benchmark workload into ``LLMEngine`` (same options as
``bench.py``'s configuration c), runs until every prompt is prefilled (and, with ``--phase mixed``, keeps
admitting new prompts so steps mix prefill chunks and decodes), then profiles ``--steps`` steps.

    python benchmarks/profile_step.py --model 110m --batch 32 --steps 10
    python benchmarks/profile_step.py --model 110m --batch 24 --phase mixed --steps 10   # batch < 32 leaves
                                                                                          # room for new prompts
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:
    sys.path.insert(0, str(HERE.parent))

from benchmarks.bench import engine_options  # noqa: E402
from benchmarks.build_models import model_dir  # noqa: E402
from benchmarks.workload import build_workload  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="110m", choices=["default", "110m"])
    ap.add_argument("--batch", type=int, default=32, help="running sequences (decode phase)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--phase", default="decode", choices=["decode", "mixed"])
    ap.add_argument("--rows", type=int, default=25, help="rows of each table")
    ap.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                    help="an engine option over bench.py's (e.g. fuse_projections=true); repeatable")
    args = ap.parse_args(argv)

    import torch
    from torch.profiler import ProfilerActivity, profile

    from handlers.engine.engine import LLMEngine
    from rollcore.types import SamplingParams

    torch.set_num_threads(args.threads)
    path = model_dir(args.model)
    options = engine_options(args.threads)
    for item in args.option:
        key, sep, value = item.partition("=")
        if not sep:
            ap.error(f"--option {item!r}: expected KEY=VALUE")
        options[key.removeprefix("option.")] = value
    engine = LLMEngine.from_options(path, options)
    w = build_workload(engine.tokenizer, max(64, args.batch * 2), seed=0)
    reqs = list(w.requests)
    params = SamplingParams(max_new_tokens=1024, ignore_eos=True)  # long enough to stay running
    n = 0
    for r in reqs[:args.batch]:
        engine.add(f"r{n}", list(r.prompt_token_ids), params)
        n += 1
    sched = engine.scheduler
    while sched.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in sched.running):
        engine.step()
    for _ in range(3):  # warm
        engine.step()
    if args.phase == "mixed":
        for r in reqs[args.batch:args.batch + args.steps]:
            engine.add(f"r{n}", list(r.prompt_token_ids), params)
            n += 1

    times = []
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
    print(f"model {args.model} ({path}), phase {args.phase}, running {len(sched.running)}, options "
          f"{args.option}, threads {torch.get_num_threads()}, step ms: median {1000 * statistics.median(times):.1f} "
          f"(min {1000 * min(times):.1f}, max {1000 * max(times):.1f}) under torch.profiler")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))

    if args.phase == "mixed":
        for r in reqs[args.batch + args.steps:args.batch + 2 * args.steps]:
            engine.add(f"r{n}", list(r.prompt_token_ids), params)
            n += 1
    pr = cProfile.Profile()
    times = []
    pr.enable()
    for _ in range(args.steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(args.rows)
    print(f"cProfile (Python view), step ms median {1000 * statistics.median(times):.1f} under cProfile")
    print(s.getvalue())


if __name__ == "__main__":
    main()
