"""Phase timings of the rolling engine in-process: [wall ms, CPU ms] medians of a decode step (B
sequences x context) and of one prefill step (1 x 256 and 16 x 128 tokens); CPU is the whole process's
(every torch thread), so with ``--threads 2`` it shows what the second thread costs.

    python benchmarks/phases.py benchmarks/models/llama-110m
    python benchmarks/phases.py benchmarks/models/llama-110m --threads 2 --option prepack_weights=true
    python benchmarks/phases.py benchmarks/models/llama-110m --threads 2 --prefill 1x128 --prefill 4x512
    PYTHONPATH=/path/to/an/older/checkout python benchmarks/phases.py MODEL_DIR   # the same on other code

CPU time is what to compare on a shared machine: other jobs stretch wall time far more than CPU time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from handlers.engine.engine import LLMEngine
from rollcore.types import SamplingParams

OPTIONS = {"kv_cache_memory_mb": "3000", "num_threads": "1"}


def _timed(step: Callable[[], object]) -> tuple[float, float]:
    t0, c0 = time.perf_counter(), time.process_time()
    step()
    return time.perf_counter() - t0, time.process_time() - c0


def _medians(samples: list[tuple[float, float]]) -> list[float]:
    return [round(statistics.median(s[i] for s in samples) * 1e3, 1) for i in (0, 1)]


def decode(model: Path, batch: int, context: int, steps: int = 8) -> list[float]:
    # no prefill cap while decodes run, and room for every prefill step: all ``batch`` sequences must still be
    # running when the decode steps are timed (with the cap, the first ones finished while the last prefilled)
    engine = LLMEngine.from_options(model, {**OPTIONS, "max_rolling_batch_size": str(batch),
                                            "max_prefill_tokens_while_decoding": "0"})
    params = SamplingParams(max_new_tokens=steps + 8 + -(-batch * context // 2048), ignore_eos=True)
    for i in range(batch):
        engine.add(f"r{i}", [5 + (i * 7 + j) % 400 for j in range(context)], params)
    sched = engine.scheduler
    while sched.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in sched.running):
        engine.step()
    samples = [_timed(engine.step) for _ in range(steps)]
    if len(sched.running) != batch:
        raise SystemExit(f"decode B={batch} ctx={context}: {len(sched.running)} sequences running, not {batch} "
                         "(KV too small for this case?)")
    return _medians(samples)


def prefill(model: Path, num_prompts: int, length: int, repeats: int = 3) -> list[float]:
    engine = LLMEngine.from_options(model, {**OPTIONS, "max_rolling_batch_prefill_tokens": str(num_prompts * length)})
    samples = []
    for rep in range(repeats + 1):  # the first one warms up
        for i in range(num_prompts):
            prompt = [5 + (i * 31 + j * 7 + rep) % 4000 for j in range(length)]
            engine.add(f"p{rep}-{i}", prompt, SamplingParams(max_new_tokens=1, ignore_eos=True))
        sample = _timed(engine.step)
        if rep:
            samples.append(sample)
        while engine.has_work():
            engine.step()
    return _medians(samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--option", action="append", default=[], metavar="K=V", help="engine option (repeatable)")
    ap.add_argument("--decode", action="append", default=[], metavar="BxC",
                    help="only these decode cases (B sequences x C tokens of context; repeatable)")
    ap.add_argument("--prefill", action="append", default=[], metavar="NxL",
                    help="only these prefill cases (one step of N prompts of L tokens; repeatable)")
    args = ap.parse_args()
    OPTIONS.update(kv.split("=", 1) for kv in args.option)
    OPTIONS["num_threads"] = str(args.threads)
    torch.set_num_threads(args.threads)
    model = Path(args.model)
    out: dict[str, list[float]] = {}
    chosen = bool(args.decode or args.prefill)
    cases = [tuple(int(x) for x in c.split("x")) for c in args.decode] or \
        ([] if chosen else [(b, c) for b in (1, 8, 32) for c in (128, 1024)])
    prefills = [tuple(int(x) for x in c.split("x")) for c in args.prefill] or ([] if chosen else [(1, 256), (16, 128)])
    for batch, context in cases:
        out[f"decode B={batch} ctx={context}"] = decode(model, batch, context)
    for num_prompts, length in prefills:
        out[f"prefill {num_prompts}x{length}"] = prefill(model, num_prompts, length)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
