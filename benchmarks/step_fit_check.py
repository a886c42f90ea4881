"""How well the time bound's step fit (``handlers.engine.core.step_budget.StepFit``) predicts the steps it bounds:
an in-process burst of prompts on a model, each step's wall time against the fit's prediction made just before it,
for decode-only and for mixed (decode + prompt chunk) steps.

    taskset -c 0 .venv/bin/python benchmarks/step_fit_check.py MODEL_DIR
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from handlers.engine.engine import LLMEngine
from rollcore.types import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("--threads", default="1")
    ap.add_argument("--waves", type=int, default=2, help="bursts of 24 prompts (90-320 random tokens), in turn")
    args = ap.parse_args()
    engine = LLMEngine.from_options(args.model, {"num_threads": args.threads, "kv_cache_memory_mb": "2000"})
    steps: list[tuple[int, int, float, float | None]] = []  # decode rows, prompt tokens, seconds, predicted
    record = engine.step_fit.record

    def recorded(decode_rows: int, prompt_tokens: int, seconds: float) -> None:
        m = engine.step_fit.model
        steps.append((decode_rows, prompt_tokens, seconds,
                      None if m is None else m.fixed + m.per_row * decode_rows + m.per_token * prompt_tokens))
        record(decode_rows, prompt_tokens, seconds)

    engine.step_fit.record = recorded  # type: ignore[method-assign]
    gen = torch.Generator().manual_seed(0)
    for wave in range(args.waves):
        for i in range(24):
            n = int(torch.randint(90, 320, (1,), generator=gen))
            engine.add(f"w{wave}r{i}", torch.randint(100, 40000, (n,), generator=gen).tolist(),
                       SamplingParams(max_new_tokens=48 + 4 * i))
        while engine.has_work():
            engine.step()
    for name, keep in (("decode-only", lambda p: p == 0), ("mixed", lambda p: p > 0)):
        ratios = sorted(s / pred for d, p, s, pred in steps if pred and d > 0 and keep(p))
        if ratios:
            print(f"{name} steps: {len(ratios)}, actual / predicted median {statistics.median(ratios):.2f} "
                  f"(p10 {ratios[len(ratios) // 10]:.2f}, p90 {ratios[9 * len(ratios) // 10]:.2f})")
    print("fit:", engine.step_fit.model)


if __name__ == "__main__":
    main()
