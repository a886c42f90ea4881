"""The scheduler's policy over a whole burst, replayed on a step-cost model (``benchmarks/schedule_sim.py``, the
engine's own scheduler and time bound, no model): with ``burst_prefill_first`` each stream the burst finds running
pauses once, so the 99th percentile of the gaps is a decode step; without it, every step that carries a piece of
the burst stalls them all. The burst arrives while four long answers stream: a pause pays only for streams likely to
write many more tokens, a guess made of what they wrote so far (never of their ``max_tokens``)."""

from __future__ import annotations

import random

from benchmarks.schedule_sim import pct, simulate

COST = (0.037, 0.004, 0.00274)  # seconds: a step, a decode row, a prompt token (one core, SmolLM2-135M)


def _burst(seed: int = 0, streaming: int = 4) -> tuple[list[int], list[int], list[float]]:
    """32 requests: ``streaming`` long answers from 0 s, the rest at once 10 s later (their answers ~190 tokens in)."""
    rng = random.Random(seed)
    prompts = [rng.randint(80, 400) for _ in range(32)]
    outputs = [1000] * streaming + [rng.randint(20, 256) for _ in range(32 - streaming)]
    return prompts, outputs, [0.0] * streaming + [10.0] * (32 - streaming)


def test_burst_first_pauses_each_stream_once() -> None:
    prompts, outputs, arrivals = _burst()
    first = simulate(prompts, outputs, arrivals, COST, ratio=8.0, burst_first=True)
    smooth = simulate(prompts, outputs, arrivals, COST, ratio=8.0, burst_first=False)
    full_batch_step = COST[0] + COST[1] * 32
    stalled = sum(rows for rows, tokens, _ in smooth["steps"] if rows and tokens)
    assert stalled > len(first["itl"]) // 100  # the smooth policy stalls more than 1% of the gaps
    assert sum(g > full_batch_step for g in first["itl"]) < stalled // 4  # a pause is one long gap, not many
    assert pct(first["itl"], 99) <= full_batch_step
    assert pct(smooth["itl"], 99) > full_batch_step
    # the same tokens, and the burst's first tokens no later at the median
    assert len(first["itl"]) == len(smooth["itl"]) == sum(outputs) - len(outputs)
    assert sorted(first["ttft"])[16] <= sorted(smooth["ttft"])[16]


def test_steady_arrivals_are_no_burst() -> None:
    """Requests a few seconds apart: one waits beside several decoding, so the two policies plan the same steps."""
    prompts, outputs, _ = _burst(1, streaming=0)
    arrivals = [3.0 * i for i in range(len(prompts))]
    first = simulate(prompts, outputs, arrivals, COST, ratio=8.0, burst_first=True)
    smooth = simulate(prompts, outputs, arrivals, COST, ratio=8.0, burst_first=False)
    assert first["steps"] == smooth["steps"] and first["itl"] == smooth["itl"]
