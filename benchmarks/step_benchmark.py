"""Measure decode step times of ``LLMEngine`` (B sequences, one new token each), one torch thread.

    python -m benchmarks.step_benchmark MODEL_DIR [--batch 1 8 32] [--context 256] [--steps 10]
        [--prefill 2048] [--option prepack_weights=hybrid|true|false]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from handlers.engine.engine import LLMEngine
from rollcore.types import SamplingParams


def decode_step_ms(model_dir: Path, batch: int, context: int, steps: int,
                   options: dict[str, str]) -> tuple[float, float]:
    """Median (wall ms, CPU ms) of a decode-only step with ``batch`` sequences at about ``context`` tokens.
    CPU time (this thread's; torch runs one thread here) is what to compare on a busy machine."""
    engine = LLMEngine.from_options(model_dir, {"max_rolling_batch_size": str(batch), **options})
    params = SamplingParams(max_new_tokens=steps + 8, ignore_eos=True)
    for i in range(batch):
        engine.add(f"r{i}", [5 + (i * 7 + j) % 400 for j in range(context)], params)
    sched = engine.scheduler
    while sched.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in sched.running):
        engine.step()
    times, cpu = [], []
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.thread_time()
        deltas = engine.step()
        times.append((time.perf_counter() - t0) * 1e3)
        cpu.append((time.thread_time() - c0) * 1e3)
        assert len(deltas) == batch
    return statistics.median(times), statistics.median(cpu)


def prefill_step_ms(model_dir: Path, num_tokens: int, options: dict[str, str], repeats: int = 3) -> float:
    """Best wall time of one step that prefills ``num_tokens`` prompt tokens (16 prompts of equal length)."""
    engine = LLMEngine.from_options(model_dir, {"max_rolling_batch_prefill_tokens": str(num_tokens), **options})
    length = max(1, num_tokens // 16)
    times = []
    for rep in range(repeats):
        for i in range(16):
            prompt = [5 + (i * 31 + j * 7 + rep) % 4000 for j in range(length)]
            engine.add(f"p{rep}-{i}", prompt, SamplingParams(max_new_tokens=1, ignore_eos=True))
        t0 = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - t0) * 1e3)
        while engine.has_work():
            engine.step()
    return min(times)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--option", action="append", default=[], help="KEY=VALUE engine option")
    ap.add_argument("--prefill", type=int, default=0, help="also time one step prefilling this many tokens")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    options = dict(o.split("=", 1) for o in args.option)
    options.setdefault("kv_cache_memory_mb", "1200")
    result = {b: decode_step_ms(args.model_dir, b, args.context, args.steps, options) for b in args.batch}
    report: dict[str, object] = {"options": options, "context": args.context,
                                 "median_step_ms": {b: round(w, 1) for b, (w, _) in result.items()},
                                 "median_step_cpu_ms": {b: round(c, 1) for b, (_, c) in result.items()}}
    if args.prefill:
        report[f"prefill_{args.prefill}_tokens_ms"] = round(prefill_step_ms(args.model_dir, args.prefill, options))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
