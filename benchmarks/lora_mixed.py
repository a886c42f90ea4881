"""A burst of requests spread over LoRA adapters and the base model vs the same burst on the base model alone.

    taskset -c 1 python -m benchmarks.lora_mixed [--requests 24] [--max-new-tokens 64] [--runs 3]

In process, on the real SmolLM2-135M-Instruct with the two peft-built adapters of the tests (ranks 8 and 16,
``tests/lora_adapters.py``). Three engines: ``base`` (option.enable_lora off), ``lora-base`` (adapters on, every
request on the base model: the cost of the wrappers alone) and ``mixed`` (requests cycled over the base model and
both adapters, all in the same steps). Each run submits the whole burst at once and steps until it is done;
configurations alternate, prefix caching is off (runs repeat prompts). Prints tokens/s and CPU-seconds per run,
medians, spread, and the ratio to ``base``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

from handlers.engine.engine import LLMEngine
from rollcore.types import SamplingParams
from tests.lora_adapters import model_with_adapters

PROMPTS = ["Summarise the water cycle in two sentences.", "Write a short poem about autumn leaves.",
           "Explain what a database index is.", "List four uses of a paperclip.", "Describe a busy train station.",
           "Give three tips for learning to cook.", "What makes a good team leader?", "Tell a story about a lost key."]
CONFIGS = {"base": ({"enable_lora": "false"}, (None,)), "lora-base": ({"enable_lora": "true"}, (None,)),
           "mixed": ({"enable_lora": "true"}, (None, "terse", "verbose"))}


def burst(engine: LLMEngine, requests: int, max_new: int, adapters: tuple[str | None, ...]) -> tuple[float, float, int]:
    """Submit ``requests`` at once, step to the end: (wall seconds, CPU seconds, tokens generated)."""
    for i in range(requests):
        ids = engine.tokenizer(PROMPTS[i % len(PROMPTS)]).input_ids
        engine.add(f"r{time.monotonic_ns()}-{i}", ids, SamplingParams(max_new_tokens=max_new, ignore_eos=True,
                                                                       adapter=adapters[i % len(adapters)]))
    wall, cpu = time.perf_counter(), time.process_time()
    tokens = 0
    while engine.has_work():
        tokens += sum(len(d.tokens) for d in engine.step())
    return time.perf_counter() - wall, time.process_time() - cpu, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    folder = model_with_adapters(Path(tempfile.gettempdir()) / "rollserve-bench-lora")
    common = {"max_rolling_batch_size": str(args.requests), "enable_prefix_caching": "false", "max_model_len": "512",
              "max_loras": "2"}
    engines = {name: LLMEngine.from_options(folder, {**common, **opts}) for name, (opts, _) in CONFIGS.items()}
    print(f"cpu: {platform.processor() or platform.machine()}, cores {sorted(os.sched_getaffinity(0))}, "
          f"load {os.getloadavg()[0]:.2f}; {args.requests} requests x {args.max_new_tokens} tokens, "
          f"dtype {engines['base'].config.dtype}")
    for engine in engines.values():  # warm-up: kernels built, caches touched
        burst(engine, 3, 4, (None,))
    rates: dict[str, list[float]] = {name: [] for name in CONFIGS}
    for run in range(args.runs):
        for name, (_, adapters) in CONFIGS.items():
            wall, cpu, tokens = burst(engines[name], args.requests, args.max_new_tokens, adapters)
            rates[name].append(tokens / wall)
            print(f"run {run + 1} {name:9s} {tokens / wall:7.1f} tok/s  {wall:6.2f} s wall  {cpu:6.2f} CPU-s  "
                  f"load {os.getloadavg()[0]:.2f}")
    base = statistics.median(rates["base"])
    for name, values in rates.items():
        med = statistics.median(values)
        print(f"{name:9s} median {med:7.1f} tok/s (spread {min(values):.1f}-{max(values):.1f})  "
              f"{med / base:.2f}x base")


if __name__ == "__main__":
    main()
