"""Greedy engine output equals transformers' generate(), token for token, under batching, chunked
prefill, prefix caching and preemption."""

from __future__ import annotations

from pathlib import Path

import pytest

from handlers.engine.engine import LLMEngine
from rollcore.types import FinishReason, SamplingParams, TokenDelta
from tests.engine.conftest import make_prompts, reference_greedy

MAX_NEW = 12


def run_staggered(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams,
                  per_step: int = 3) -> dict[str, list[TokenDelta]]:
    """Add ``per_step`` prompts before each step until all are in, then run to completion."""
    deltas: dict[str, list[TokenDelta]] = {f"r{i}": [] for i in range(len(prompts))}
    pending = list(enumerate(prompts))
    steps = 0
    while pending or engine.has_work():
        for i, p in pending[:per_step]:
            engine.add(f"r{i}", p, params)
        pending = pending[per_step:]
        for d in engine.step():
            deltas[d.request_id].append(d)
        steps += 1
        assert steps < 2000
    return deltas


def check_against_generate(model_dir: Path, prompts: list[list[int]], deltas: dict[str, list[TokenDelta]],
                           max_new: list[int] | None = None) -> None:
    for i, p in enumerate(prompts):
        got = [t.id for d in deltas[f"r{i}"] for t in d.tokens]
        n = max_new[i] if max_new else MAX_NEW
        assert got == reference_greedy(model_dir, p, n), f"prompt {i} (len {len(p)})"
        ds = deltas[f"r{i}"]
        assert ds[0].prompt_tokens == len(p)
        assert [d.finish_reason is not None for d in ds] == [False] * (len(ds) - 1) + [True]


VARIANTS = {
    "default": {},
    "chunked-no-prefix": {"max_rolling_batch_prefill_tokens": "32", "enable_prefix_caching": "false"},
    "chunked-prefix": {"max_rolling_batch_prefill_tokens": "32", "block_size": "4"},
    "no-prepack": {"prepack_weights": "false", "block_size": "8"},
    "packed-only+fused": {"prepack_weights": "true", "fuse_projections": "true"},
    "torch-attention": {"attention_kernel": "torch", "block_size": "4"},
}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_batched_greedy_equals_generate(model_dirs: dict[str, Path], arch: str, variant: str) -> None:
    options = {"num_kv_blocks": "256", **VARIANTS[variant]}
    engine = LLMEngine.from_options(model_dirs[arch], options)
    prompts = make_prompts(16, seed=1, shared_prefix=20)
    deltas = run_staggered(engine, prompts, SamplingParams(max_new_tokens=MAX_NEW))
    check_against_generate(model_dirs[arch], prompts, deltas)
    stats = engine.stats()
    assert stats["kv_blocks_used"] == 0 and stats["num_running"] == 0
    if options.get("enable_prefix_caching") != "false":
        assert stats["prefix_cache_hits_total"] > 0


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_each_prompt_alone_equals_generate(model_dirs: dict[str, Path], arch: str) -> None:
    engine = LLMEngine.from_options(model_dirs[arch], {"num_kv_blocks": "64", "block_size": "4"})
    prompts = make_prompts(4, seed=2)
    for i, p in enumerate(prompts):
        engine.add(f"r{i}", p, SamplingParams(max_new_tokens=MAX_NEW))
        got: list[int] = []
        while engine.has_work():
            got += [t.id for d in engine.step() for t in d.tokens]
        assert got == reference_greedy(model_dirs[arch], p, MAX_NEW)


def test_preemption_with_tiny_pool_still_equals_generate(model_dirs: dict[str, Path]) -> None:
    engine = LLMEngine.from_options(model_dirs["llama"], {"num_kv_blocks": "20", "block_size": "4",
                                                          "max_rolling_batch_prefill_tokens": "64"})
    prompts = [p[:20] for p in make_prompts(8, seed=3, shared_prefix=8)]
    deltas = run_staggered(engine, prompts, SamplingParams(max_new_tokens=MAX_NEW), per_step=8)
    check_against_generate(model_dirs["llama"], prompts, deltas)
    stats = engine.stats()
    assert stats["num_preemptions_total"] > 0
    assert stats["kv_blocks_used"] == 0


def test_abort_frees_blocks_and_length_finish(model_dirs: dict[str, Path]) -> None:
    engine = LLMEngine.from_options(model_dirs["llama"], {"num_kv_blocks": "64", "block_size": "4",
                                                          "enable_prefix_caching": "false"})
    for i, p in enumerate(make_prompts(3, seed=4)):
        engine.add(f"r{i}", p, SamplingParams(max_new_tokens=5, ignore_eos=True))
    engine.step()
    engine.step()
    held = engine.stats()["blocks_held"]
    assert held["r1"] > 0
    engine.abort("r1")
    stats = engine.stats()
    assert "r1" not in stats["blocks_held"]
    assert stats["kv_blocks_used"] == sum(stats["blocks_held"].values())
    finishes = {}
    while engine.has_work():
        for d in engine.step():
            assert d.request_id != "r1"
            if d.finish_reason:
                finishes[d.request_id] = d.finish_reason
    assert finishes == {"r0": FinishReason.LENGTH, "r2": FinishReason.LENGTH}
    assert engine.stats()["kv_blocks_used"] == 0


def test_step_cost_sums_every_step_and_every_token_it_computed(model_dirs: dict[str, Path]) -> None:
    """``stats()["step_cost"]`` (what ``serving tune`` fits a step's cost from): one entry per step, each with the
    tokens the model was fed: every prompt token once and every generated token but the last (no prefix
    cache, no preemption here), never more than the step's token budget."""
    engine = LLMEngine.from_options(model_dirs["llama"], {"num_kv_blocks": "256", "enable_prefix_caching": "false",
                                                          "max_rolling_batch_prefill_tokens": "32"})
    prompts = make_prompts(6, seed=5)
    deltas = run_staggered(engine, prompts, SamplingParams(max_new_tokens=MAX_NEW), per_step=2)
    generated = [sum(len(d.tokens) for d in deltas[f"r{i}"]) for i in range(len(prompts))]
    cost = engine.stats()["step_cost"]
    assert cost["steps"] == engine.stats()["num_steps_total"] > 0
    assert cost["tokens"] == sum(len(p) + n - 1 for p, n in zip(prompts, generated, strict=True))
    assert cost["max_tokens"] == 32  # the prompts are longer than the budget: the first step is full
    assert cost["seconds"] > 0 and cost["tokens_seconds"] > 0
    assert cost["tokens_sq"] > cost["tokens"]


def test_time_bounded_prefill_keeps_greedy_output_and_reports_its_fit(model_dirs: dict[str, Path]) -> None:
    """With the time bound on (the default) and no token cap, prompts arriving while others decode are chunked by
    the fitted step costs; the answers stay generate's and the engine reports the fit it used."""
    engine = LLMEngine.from_options(model_dirs["llama"], {"num_kv_blocks": "256",
                                                          "max_prefill_tokens_while_decoding": "0"})
    assert engine.scheduler.prefill_limit == engine.prefill_budget.limit
    prompts = make_prompts(10, seed=11)
    deltas = run_staggered(engine, prompts, SamplingParams(max_new_tokens=MAX_NEW), per_step=1)
    check_against_generate(model_dirs["llama"], prompts, deltas)
    fit = engine.stats()["prefill_budget"]
    assert fit["ratio"] == 8.0  # the default
    assert fit["fixed_s"] is not None and fit["per_decode_row_s"] > 0 and fit["per_prompt_token_s"] > 0
    off = LLMEngine.from_options(model_dirs["llama"], {"num_kv_blocks": "64", "max_mixed_step_ratio": "0"})
    assert off.prefill_budget is None and off.scheduler.prefill_limit is None
    assert off.stats()["prefill_budget"] is None


@pytest.mark.parametrize("burst_first", ["true", "false"])
def test_a_burst_beside_running_streams_keeps_greedy_output(model_dirs: dict[str, Path], burst_first: str) -> None:
    """Two long answers decode, then eight prompts arrive at once: with ``burst_prefill_first`` (the default) and
    no inter-token latency target the eight are prefilled while the two wait (counted), without it beside them;
    the answers are generate's either way."""
    engine = LLMEngine.from_options(model_dirs["llama"], {"num_kv_blocks": "256", "burst_prefill_first": burst_first,
                                                          "max_rolling_batch_prefill_tokens": "32",
                                                          "max_itl_ms": "0"})
    prompts = make_prompts(10, seed=12)
    # streams that wrote 100 tokens: as many are likely to come, so the pause pays
    max_new = [230, 230] + [MAX_NEW] * 8
    deltas: dict[str, list[TokenDelta]] = {f"r{i}": [] for i in range(len(prompts))}
    for i in (0, 1):
        engine.add(f"r{i}", prompts[i], SamplingParams(max_new_tokens=max_new[i]))
    while len(deltas["r0"]) < 100 or len(deltas["r1"]) < 100:
        for d in engine.step():
            deltas[d.request_id].append(d)
    for i in range(2, len(prompts)):
        engine.add(f"r{i}", prompts[i], SamplingParams(max_new_tokens=MAX_NEW))
    while engine.has_work():
        for d in engine.step():
            deltas[d.request_id].append(d)
    check_against_generate(model_dirs["llama"], prompts, deltas, max_new)
    paused = engine.stats()["num_burst_paused_steps_total"]
    assert paused > 0 if burst_first == "true" else paused == 0
