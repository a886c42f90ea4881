"""The rolling engine's decode step with the lean decoder and with transformers' forward, alternating.

Admits ``--batch`` requests of the benchmark workload into ``LLMEngine`` (bench.py's configuration c options),
prefills them, then times blocks of 5 decode steps, switching the runner between ``LeanDecoder`` and
transformers' forward after each block (``--rounds`` blocks each); prints the median of the blocks' median
step times and their range. Both paths give bitwise the same logits (the runner checks at load).

    taskset -c 0 .venv/bin/python benchmarks/lean_step.py --model default --batch 32 --rounds 10
"""

from __future__ import annotations

import argparse
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
    ap.add_argument("--model", default="default", choices=["default", "110m"])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args(argv)

    import torch

    from handlers.engine.engine import LLMEngine
    from rollcore.types import SamplingParams

    torch.set_num_threads(args.threads)
    engine = LLMEngine.from_options(model_dir(args.model), engine_options(args.threads))
    lean = engine.runner.lean
    if lean is None:
        raise SystemExit("the lean decoder does not apply to this model")
    w = build_workload(engine.tokenizer, max(64, 2 * args.batch), seed=0)
    params = SamplingParams(max_new_tokens=4096, ignore_eos=True)
    for i, r in enumerate(list(w.requests)[:args.batch]):
        engine.add(f"r{i}", list(r.prompt_token_ids), params)
    sched = engine.scheduler
    while sched.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in sched.running):
        engine.step()
    blocks: dict[str, list[float]] = {"transformers": [], "lean": []}
    for _ in range(args.rounds):
        for name in blocks:
            engine.runner.lean = lean if name == "lean" else None
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - t0)
            blocks[name].append(1000 * statistics.median(times))
    print(f"model {args.model}, {len(sched.running)} sequences decoding, {torch.get_num_threads()} thread(s)")
    for name, v in blocks.items():
        print(f"{name:>12}: step ms median {statistics.median(v):.2f} (blocks {min(v):.2f}-{max(v):.2f})")
    ratio = statistics.median(blocks["transformers"]) / statistics.median(blocks["lean"])
    print(f"transformers / lean: {ratio:.3f}x")


if __name__ == "__main__":
    main()
