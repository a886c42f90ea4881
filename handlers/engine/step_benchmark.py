"""Measure decode step times of ``LLMEngine`` (B sequences, one new token each), one torch thread.

    python -m handlers.engine.step_benchmark MODEL_DIR [--batch 1 8 32] [--context 256] [--steps 10]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from handlers.engine.engine import LLMEngine
from serving.types import SamplingParams


def decode_step_ms(model_dir: Path, batch: int, context: int, steps: int, options: dict[str, str]) -> float:
    """Median wall time of a decode-only step with ``batch`` sequences at about ``context`` tokens."""
    engine = LLMEngine.from_options(model_dir, {"max_rolling_batch_size": str(batch), **options})
    params = SamplingParams(max_new_tokens=steps + 8, ignore_eos=True)
    for i in range(batch):
        engine.add(f"r{i}", [5 + (i * 7 + j) % 400 for j in range(context)], params)
    sched = engine.scheduler
    while sched.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in sched.running):
        engine.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        deltas = engine.step()
        times.append((time.perf_counter() - t0) * 1e3)
        assert len(deltas) == batch
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--option", action="append", default=[], help="KEY=VALUE engine option")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    options = dict(o.split("=", 1) for o in args.option)
    options.setdefault("kv_cache_memory_mb", "1200")
    result = {b: round(decode_step_ms(args.model_dir, b, args.context, args.steps, options), 1) for b in args.batch}
    print(json.dumps({"options": options, "context": args.context, "median_step_ms": result}))


if __name__ == "__main__":
    main()
