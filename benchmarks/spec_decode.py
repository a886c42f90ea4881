"""Prompt-lookup speculative decoding in the engine, by batch size: plain decoding vs ``speculative_draft=ngram``.

For each ``--batch`` B, the first B prompts of the benchmark workload each generate ``--tokens`` tokens (greedy,
EOS ignored) in an ``LLMEngine`` with bench.py's engine options, plain and with n-gram guesses under each
``--max-batch`` (``option.speculative_max_batch_size``: auto = the cost gate, 0 = guesses at every batch size, N),
alternating ``--rounds`` times. One engine per variant serves every round and batch size, as a server would (the
gate's step fit and confirmed shares carry over). Prints per B: the median output tok/s of each (min-max), each
variant's ratio to plain, the share of guesses the model confirmed and tokens per step. Every variant's outputs are
compared with plain decoding's token for token (they must be equal).

``--model smollm2``: the real SmolLM2-135M-Instruct on the chat workload of real English text
(``chat_workload.py``: paragraphs, then summarise / list / explain / rewrite / quote), each request generating
until its EOS or ``--tokens``: the text a trained model writes from its prompt, where prompt lookup can pay. The
tok/s are the tokens generated over the time taken.

    taskset -c 0 .venv/bin/python benchmarks/spec_decode.py --model default --batch 1 --batch 4 --batch 32
    taskset -c 0 .venv/bin/python benchmarks/spec_decode.py --model smollm2 --batch 1 --batch 2 --batch 4 --batch 8
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:
    sys.path.insert(0, str(HERE.parent))

from benchmarks.bench import engine_options  # noqa: E402
from benchmarks.build_models import model_dir  # noqa: E402
from benchmarks.workload import build_workload  # noqa: E402


def run(engine: Any, prompts: list[list[int]], tokens: int, ignore_eos: bool = True,
        ) -> tuple[float, dict[str, list[int]], int]:
    from rollcore.types import SamplingParams

    params = SamplingParams(max_new_tokens=tokens, ignore_eos=ignore_eos)
    for i, p in enumerate(prompts):
        engine.add(f"r{i}", p, params)
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    steps = 0
    t0 = time.perf_counter()
    while engine.has_work():
        for d in engine.step():
            out[d.request_id].extend(t.id for t in d.tokens)
        steps += 1
    return time.perf_counter() - t0, out, steps


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", choices=["default", "110m", "smollm2"])
    ap.add_argument("--batch", type=int, action="append")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--requests", type=int, default=8, help="smollm2: the chat requests run at every batch size")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-batch", action="append", help="option.speculative_max_batch_size of an ngram variant, "
                    "repeatable (default: auto, the cost gate, and 0, guesses at every batch size)")
    ap.add_argument("--guesses", type=int, action="append", help="option.num_speculative_tokens of the ngram "
                    "variants, repeatable (default: the option's default)")
    args = ap.parse_args(argv)
    variants: dict[str, dict[str, str]] = {"plain": {}}
    for m in args.max_batch or ["auto", "0"]:
        variants[f"ngram-{m}"] = {"speculative_draft": "ngram", "speculative_max_batch_size": m}
        if args.guesses:
            opts = variants.pop(f"ngram-{m}")
            variants |= {f"ngram-{m}-k{k}": opts | {"num_speculative_tokens": str(k)} for k in args.guesses}
    spec = [name for name in variants if name != "plain"]

    import torch

    from handlers.engine.engine import LLMEngine

    torch.set_num_threads(args.threads)
    real = args.model == "smollm2"
    if real:
        from tests.real_model import smollm2_folder

        path = smollm2_folder()
    else:
        path = model_dir(args.model)
    engines = {name: LLMEngine.from_options(path, engine_options(args.threads) | opts)
               for name, opts in variants.items()}
    if real:
        from benchmarks.chat_workload import build_chat_workload

        w = build_chat_workload(engines["plain"].tokenizer, 32, seed=0)
    else:
        w = build_workload(engines["plain"].tokenizer, 64, seed=0)
    prompts = [list(r.prompt_token_ids) for r in w.requests]
    print(f"model {args.model}, {args.tokens} tokens per request, {torch.get_num_threads()} thread(s), "
          f"{args.rounds} alternating rounds; cells: median (min-max)")
    print("| batch | " + " | ".join(f"{n} tok/s" for n in variants) + " | "
          + " | ".join(f"{n} / plain" for n in spec) + " | " + " | ".join(f"{n} guesses confirmed" for n in spec)
          + " | tokens per step (" + ", ".join(variants) + ") |")
    print("|---" * (2 + 3 * len(spec) + 1) + "|")
    for batch in args.batch or [1, 4, 32]:
        rates: dict[str, list[float]] = {name: [] for name in variants}
        outs: dict[str, dict[str, list[int]]] = {}
        steps: dict[str, int] = {}
        before = {n: dict(engines[n].stats()) for n in spec}
        for _ in range(args.rounds):
            for name, engine in engines.items():
                if real:  # the same --requests prompts at every batch size, B at a time
                    seconds, outs[name], steps[name] = 0.0, {}, 0
                    for g in range(0, args.requests, batch):
                        t, out, n = run(engine, prompts[g:g + batch], args.tokens, ignore_eos=False)
                        seconds, steps[name] = seconds + t, steps[name] + n
                        outs[name].update({f"g{g}{k}": v for k, v in out.items()})
                else:
                    seconds, outs[name], steps[name] = run(engine, prompts[:batch], args.tokens)
                rates[name].append(sum(map(len, outs[name].values())) / seconds)
        for n in spec:
            if outs["plain"] != outs[n]:
                differ = [k for k in outs["plain"] if outs["plain"][k] != outs[n][k]]
                print(f"batch {batch}: {n}'s outputs differ for {differ} (a near-tie resolved differently by another "
                      "matmul shape)")
        p = statistics.median(rates["plain"])
        cells = [f"{statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f})" for v in rates.values()]
        ratios = [f"{statistics.median(rates[n]) / p:.2f}x" for n in spec]
        shares = []
        for n in spec:
            after = engines[n].stats()
            drafted = after["spec_draft_tokens_total"] - before[n]["spec_draft_tokens_total"]
            confirmed = after["spec_accepted_tokens_total"] - before[n]["spec_accepted_tokens_total"]
            shares.append(f"{confirmed}/{drafted} ({confirmed / drafted:.0%})" if drafted else "no guesses")
        per_step = ", ".join(f"{sum(map(len, out.values())) / steps[name]:.2f}" for name, out in outs.items())
        print(f"| {batch} | " + " | ".join(cells + ratios + shares) + f" | {per_step} |", flush=True)
    for n in spec:  # what the cost gate ended with (its step fit, the confirmed shares, its choices)
        st = engines[n].stats()
        if st["draft_gate"] is not None:
            fit = engines[n].step_fit.model
            print(f"{n}: gate {st['draft_gate']}; step fit {fit}")


if __name__ == "__main__":
    main()
