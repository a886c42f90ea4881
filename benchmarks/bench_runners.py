"""bench.py's in-process configurations, timed token by token: rollserve's HuggingFaceHandler one request at a
time (a) and in dynamic batches (b), the rolling engine's step loop (c), transformers' continuous batching (e)."""

from __future__ import annotations

import contextlib
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.bench_configs import MAX_BATCH_DELAY_S, MAX_BATCH_TOKENS, MAX_SEQS
from benchmarks.workload import BenchRequest, Workload
from serving.bench.run_metrics import Rec, RunResult


def _wait_until(t: float) -> None:
    d = t - time.perf_counter()
    if d > 0:
        time.sleep(d)


# ---------------------------------------------------------------------------------- a, b: HF handler
class _StepClock:
    """A transformers streamer that timestamps every generation step (first ``put`` is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: Any) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


class HFHandlerRunner:
    """rollserve's dynamic-batching HuggingFaceHandler, in-process, with a step clock on ``generate``."""

    def __init__(self, path: Path, threads: int) -> None:
        from handlers.base import Context
        from handlers.huggingface import HuggingFaceHandler

        self.handler = HuggingFaceHandler()
        self.handler.initialize(Context("bench", path, {"num_threads": str(threads), "dtype": "fp32"}))
        model = self.handler.model
        self._generate = model.generate
        self.clock: _StepClock | None = None

        def timed_generate(*args: Any, **kwargs: Any) -> Any:
            self.clock = _StepClock()
            return self._generate(*args, streamer=self.clock, **kwargs)

        model.generate = timed_generate

    def run_batch(self, batch: list[tuple[BenchRequest, Rec]]) -> list[int]:
        """Run one batch through ``handle``; fills the records; returns padded-KV stats per step."""
        from handlers.base import Input
        from rollcore.types import SamplingParams

        inputs = [Input(f"r{r.index}", r.prompt, SamplingParams(max_new_tokens=r.max_new_tokens, ignore_eos=True),
                        prompt_token_ids=r.prompt_token_ids) for r, _ in batch]
        outs = self.handler.handle(inputs)
        done = time.perf_counter()
        steps = self.clock.times if self.clock else []
        for (_, rec), out in zip(batch, outs, strict=False):
            if out.error:
                rec.error = out.error
                continue
            n = len(out.tokens)
            rec.token_times = steps[:n]
            rec.end = done
        return steps

    def run(self, w: Workload, arrivals: list[float], batch_size: int) -> RunResult:
        t0 = time.perf_counter()
        recs = [Rec(t0 + a) for a in arrivals]
        pending = list(zip(w.requests, recs, strict=True))
        useful = alloc = 0.0
        util_steps: list[float] = []
        while pending:
            _wait_until(pending[0][1].send)
            if batch_size > 1 and any(a > 0 for a in arrivals):
                # dynamic batcher: wait up to max_batch_delay for the batch to fill
                deadline = pending[0][1].send + MAX_BATCH_DELAY_S
                while time.perf_counter() < deadline and sum(
                        1 for _, r in pending[:batch_size] if r.send <= time.perf_counter()) < batch_size:
                    time.sleep(0.002)
            now = time.perf_counter()
            batch = [p for p in pending[:batch_size] if p[1].send <= now] or pending[:1]
            pending = pending[len(batch):]
            self.run_batch(batch)
            if len(batch) > 1:
                width = max(r.prompt_len for r, _ in batch)
                steps = max(r.max_new_tokens for r, _ in batch)
                for t in range(steps):
                    u = sum(r.prompt_len + min(t, r.max_new_tokens) for r, _ in batch if t < r.max_new_tokens)
                    a = len(batch) * (width + t)
                    useful += u
                    alloc += a
                    util_steps.append(u / a)
        extra = {}
        if util_steps:
            extra["kv_util_mean"] = statistics.fmean(util_steps)
            extra["kv_util_min"] = min(util_steps)
        return RunResult(recs, extra)


# ---------------------------------------------------------------------------------- c: rolling engine
class EngineRunner:
    def __init__(self, path: Path, options: dict[str, str]) -> None:
        from handlers.engine.engine import LLMEngine

        self.engine = LLMEngine.from_options(path, options)

    def kv_sample(self) -> tuple[float, float] | None:
        sched = self.engine.scheduler
        alloc = sched.allocator
        used = alloc.num_used_blocks
        if used == 0:
            return None
        stored = sum(s.num_computed_tokens for s in sched.running)
        return stored / (used * self.engine.config.block_size), used / alloc.num_blocks

    def run(self, w: Workload, arrivals: list[float]) -> RunResult:
        from rollcore.types import SamplingParams

        eng = self.engine
        t0 = time.perf_counter()
        recs = [Rec(t0 + a) for a in arrivals]
        order = sorted(range(len(recs)), key=lambda i: recs[i].send)
        by_id = {f"r{i}": recs[i] for i in range(len(recs))}
        k = 0
        util: list[float] = []
        usage: list[float] = []
        steps = 0
        step_times: list[float] = []
        while k < len(order) or eng.has_work():
            now = time.perf_counter()
            while k < len(order) and recs[order[k]].send <= now:
                r = w.requests[order[k]]
                eng.add(f"r{order[k]}", list(r.prompt_token_ids),
                        SamplingParams(max_new_tokens=r.max_new_tokens, ignore_eos=True))
                k += 1
            if not eng.has_work():
                _wait_until(recs[order[k]].send)
                continue
            s0 = time.perf_counter()
            deltas = eng.step()
            t = time.perf_counter()
            step_times.append(t - s0)
            steps += 1
            for d in deltas:
                rec = by_id[d.request_id]
                rec.token_times.extend([t] * len(d.tokens))
                if d.finish_reason is not None:
                    rec.end = t
            sample = self.kv_sample()
            if sample is not None:
                util.append(sample[0])
                usage.append(sample[1])
        st = eng.stats()
        extra = {"kv_util_mean": statistics.fmean(util) if util else float("nan"),
                 "kv_util_min": min(util) if util else float("nan"),
                 "kv_usage_peak": max(usage) if usage else float("nan"),
                 "kv_usage_mean": statistics.fmean(usage) if usage else float("nan"),
                 "engine_steps": steps, "step_ms_mean": 1000 * statistics.fmean(step_times) if step_times else 0,
                 "kv_blocks_total": st["kv_blocks_total"], "preemptions": st["num_preemptions_total"],
                 "prefix_cache_hits": st["prefix_cache_hits_total"]}
        return RunResult(recs, extra)


# --------------------------------------------------------------------------------- e: transformers CB
class HFContinuousBatchingRunner:
    def __init__(self, path: Path, threads: int, kv_tokens: int) -> None:
        import torch
        from transformers import AutoModelForCausalLM, GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        torch.set_num_threads(threads)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        self.model.eval()
        self.page_size = 16
        self.num_blocks = max(1, kv_tokens // self.page_size)
        self.gen_config = GenerationConfig(do_sample=False, max_new_tokens=256, eos_token_id=-1, pad_token_id=0)
        self.cb_config = ContinuousBatchingConfig(
            page_size=self.page_size, num_blocks=self.num_blocks, max_batch_tokens=MAX_BATCH_TOKENS,
            max_requests_per_batch=MAX_SEQS, auto_switch_to_flash=False, use_cuda_graph=False,
            allow_block_sharing=False)
        self.manager = self.model.init_continuous_batching(generation_config=self.gen_config,
                                                           continuous_batching_config=self.cb_config)
        self.manager.start()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.manager.stop(block=True, timeout=10)

    def run(self, w: Workload, arrivals: list[float], tag: str) -> RunResult:
        t0 = time.perf_counter()
        recs = [Rec(t0 + a) for a in arrivals]
        order = sorted(range(len(recs)), key=lambda i: recs[i].send)
        ids = {}
        k = 0
        done = 0
        while done < len(recs):
            now = time.perf_counter()
            while k < len(order) and recs[order[k]].send <= now:
                r = w.requests[order[k]]
                rid = f"{tag}-{r.index}"
                ids[rid] = order[k]
                self.manager.add_request(list(r.prompt_token_ids), request_id=rid, max_new_tokens=r.max_new_tokens,
                                         record_timestamps=True, eos_token_id=-1)
                k += 1
            timeout = 0.5 if k >= len(order) else max(0.0005, min(0.05, recs[order[k]].send - time.perf_counter()))
            out = self.manager.get_result(timeout=timeout)
            if out is None:
                if not self.manager.is_running():
                    raise RuntimeError("transformers continuous batching thread died")
                continue
            if not out.is_finished() or out.request_id not in ids:
                continue
            rec = recs[ids[out.request_id]]
            if out.error:
                rec.error = str(out.error)
            else:
                rec.token_times = list(out.timestamps or [])
                rec.n_out = len(out.generated_tokens)
                rec.end = time.perf_counter()
            done += 1
        return RunResult(recs, {"kv_blocks_total": self.num_blocks, "page_size": self.page_size})
