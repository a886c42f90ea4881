"""Replay a workload through the engine's real scheduler and prefill bound on a step-cost model, without a
model: which first-token times and inter-token gaps a scheduling policy gives, in seconds, not hours.

The scheduler (``handlers.engine.core.scheduler``) and the time bound (``step_budget.PrefillBudget``) are the
engine's own classes, driven as ``LLMEngine.step`` drives them: plan, "run" the step for
``fixed + per_row x decode rows + per_token x prompt tokens`` seconds (the fit the engine reports in its stats,
``prefill_budget``), commit, append a token to each sampled sequence, finish those at their output length. The
step fit is fed those times, as the engine feeds it measured ones. Policies:

* ``tokens (vLLM)``: no time bound (the token budget alone): vLLM's V1 scheduler (decodes first, then prompt
  chunks up to ``max_num_batched_tokens``), on the same cost model;
* ``ratio R``: the time bound ``max_mixed_step_ratio`` R, with and without ``burst_prefill_first``;
* ``itl T``: the inter-token latency target ``max_itl_ms`` T (``handlers.engine.core.itl_target``).

Workload: the chat workload's prompts (``chat_workload.py``, tokenized by the real model's template) and each
request's output length from a ``compare.py`` result (``--lengths RESULT.json``: the first run of
``--lengths-server``), arriving at once (burst) or at ``--rate`` requests/s (the seeded Poisson arrivals
``compare.py`` sends).

    .venv/bin/python benchmarks/schedule_sim.py --lengths /tmp/r.json --fixed 0.05 --per-row 0.004 \\
        --per-token 0.004 [--rate 0.4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from handlers.engine.core.itl_target import ItlTarget  # noqa: E402
from handlers.engine.core.scheduler import Scheduler, SchedulerConfig  # noqa: E402
from handlers.engine.core.sequence import Sequence, SequenceStatus  # noqa: E402
from handlers.engine.core.step_budget import PrefillBudget, StepFit  # noqa: E402
from rollcore.types import SamplingParams  # noqa: E402


def simulate(prompts: list[int], outputs: list[int], arrivals: list[float], cost: tuple[float, float, float],
             ratio: float = 0.0, burst_first: bool = False, max_seqs: int = 32, budget: int = 2048,
             block_size: int = 16, num_blocks: int = 8192, itl_ms: int = 0) -> dict[str, list]:
    """First-token times and inter-token gaps (seconds) of every request, and each step's (decode rows, prompt
    tokens, seconds). ``ratio`` 0: the token budget alone; ``itl_ms``: an inter-token latency target (0: none)."""
    fixed, per_row, per_token = cost
    sched = Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, block_size=block_size,
                                      num_blocks=num_blocks, max_model_len=8192, enable_prefix_caching=False,
                                      max_prefill_tokens_while_decoding=0, burst_prefill_first=burst_first))
    fit = StepFit()
    for rows, tokens in ((1, 0), (4, 0), (8, 0), (16, 0), (2, 64), (4, 128), (1, 256), (8, 32)):
        fit.record(rows, tokens, fixed + per_row * rows + per_token * tokens)  # the server's warm-up steps
    if ratio:
        sched.prefill_limit = PrefillBudget(ratio, floor=block_size, fit=fit).limit
    if itl_ms:
        sched.itl_budget = ItlTarget(fit, floor=block_size, target_ms=itl_ms).prefill_tokens
    order = sorted(range(len(prompts)), key=lambda i: arrivals[i])
    times: dict[str, list[float]] = {}
    now, nxt, steps = 0.0, 0, []
    while nxt < len(order) or sched.has_work():
        while nxt < len(order) and arrivals[order[nxt]] <= now:
            i = order[nxt]
            seq = Sequence(str(i), list(range(1, prompts[i] + 1)), SamplingParams(max_new_tokens=outputs[i]))
            times[seq.request_id] = [arrivals[i]]
            sched.add(seq)
            nxt += 1
        if not sched.has_work():
            now = arrivals[order[nxt]]
            continue
        plan = sched.schedule()
        prompt_tokens = sum(c.num_tokens for c in plan.chunks if c.start < c.seq.num_prompt_tokens)
        rows = plan.num_batched_tokens - prompt_tokens
        seconds = fixed + per_row * rows + per_token * prompt_tokens
        now += seconds
        fit.record(rows, prompt_tokens, seconds)
        steps.append((rows, prompt_tokens, seconds))
        sched.commit(plan)
        for c in plan.chunks:
            if not c.samples or c.seq.status is not SequenceStatus.RUNNING:
                continue
            c.seq.append_token(0)
            times[c.seq.request_id].append(now)
            if c.seq.num_output_tokens >= c.seq.params.max_new_tokens:
                sched.finish(c.seq)
    ttft = [t[1] - t[0] for t in times.values()]
    gaps = [b - a for t in times.values() for a, b in zip(t[1:], t[2:], strict=False)]
    return {"ttft": ttft, "itl": gaps, "end": [now], "steps": steps}


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def summary(name: str, r: dict[str, list], tokens: int) -> str:
    mixed = [s for s in r["steps"] if s[0] and s[1]]
    return (f"{name:22s} tok/s {tokens / r['end'][0]:6.1f}  TTFT p50 {statistics.median(r['ttft']):6.2f} s  ITL p50 "
            f"{pct(r['itl'], 50) * 1e3:6.0f} p99 {pct(r['itl'], 99) * 1e3:6.0f} max {max(r['itl']) * 1e3:6.0f} ms  "
            f"steps {len(r['steps'])} mixed {len(mixed)} (stalled gaps {sum(s[0] for s in mixed)} of "
            f"{len(r['itl'])})")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=Path, required=True, help="compare.py result JSON (its output lengths)")
    ap.add_argument("--lengths-server", default="vllm")
    ap.add_argument("--fixed", type=float, required=True, help="seconds a step costs beyond its rows")
    ap.add_argument("--per-row", type=float, required=True, help="seconds a decode row costs")
    ap.add_argument("--per-token", type=float, required=True, help="seconds a prompt token costs")
    ap.add_argument("--ratio", type=float, action="append", help="time bounds to replay (default 8)")
    ap.add_argument("--itl-ms", type=int, action="append", help="inter-token latency targets to replay")
    ap.add_argument("--rate", type=float, default=0.0, help="Poisson arrivals, requests/s (0: burst)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    from benchmarks.chat_workload import build_chat_workload
    from tests.real_model import smollm2_folder
    res = json.loads(args.lengths.read_text())
    run = next(r for c in res["comparisons"] for r in c["runs"] if r["server"] == args.lengths_server)
    outputs = run["output_lengths"]
    w = build_chat_workload(AutoTokenizer.from_pretrained(smollm2_folder()), len(outputs), args.seed)
    prompts = [r.prompt_len for r in w.requests]
    arrivals = w.arrivals(args.rate or None)
    cost = (args.fixed, args.per_row, args.per_token)
    print(f"{len(prompts)} requests, {sum(prompts)} prompt tokens, {sum(outputs)} output tokens, "
          f"{'burst' if not args.rate else f'Poisson {args.rate} req/s'}; step = {cost[0]} + {cost[1]} x rows + "
          f"{cost[2]} x prompt tokens s")
    print(summary("tokens (vLLM)", simulate(prompts, outputs, arrivals, cost), sum(outputs)))
    for ratio in args.ratio or [8.0]:
        for first in (False, True):
            r = simulate(prompts, outputs, arrivals, cost, ratio=ratio, burst_first=first)
            print(summary(f"ratio {ratio:g}{' burst-first' if first else ''}", r, sum(outputs)))
    for itl_ms in args.itl_ms or []:
        r = simulate(prompts, outputs, arrivals, cost, ratio=8.0, burst_first=True, itl_ms=itl_ms)
        print(summary(f"itl {itl_ms} ms", r, sum(outputs)))


if __name__ == "__main__":
    main()
