"""Tensor parallelism: with tensor_parallel_degree=2 (rank 0 in this process, rank 1 a child process over
gloo) the engine's greedy outputs equal the model's own ``generate``, for a batch admitted at once."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from handlers.engine.engine import LLMEngine
from handlers.engine.execution.forward.runner import StepInputs
from handlers.engine.execution.parallel.ranks import pack_step, unpack_step
from handlers.engine.execution.parallel.sharding import shard_model
from rollcore.types import SamplingParams
from tests.engine.conftest import make_prompts, reference_greedy


def run_all(engine: LLMEngine, prompts: list[list[int]], max_new_tokens: int) -> dict[str, list[int]]:
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add(f"r{i}", p, params)
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_work():
        for d in engine.step():
            out[d.request_id].extend(t.id for t in d.tokens)
    return out


def test_tp2_greedy_equals_generate(model_dirs: dict[str, Path]) -> None:
    model_dir = model_dirs["llama"]
    prompts = make_prompts(6, seed=7)
    engine = LLMEngine.from_options(model_dir, {"tensor_parallel_degree": "2", "num_kv_blocks": "64",
                                                "max_rolling_batch_prefill_tokens": "64"})
    try:
        assert engine.runner.pool.keys[0].shape[0] == 1  # 2 KV heads split over 2 ranks
        assert engine.runner.lean is not None  # the lean forward sums the shards' partial outputs as the hooks do
        got = run_all(engine, prompts, 12)
    finally:
        engine.close()
    for i, p in enumerate(prompts):
        assert got[f"r{i}"] == reference_greedy(model_dir, p, 12), f"prompt {i}"


def test_tp2_with_speculative_decoding_equals_generate(model_dirs: dict[str, Path]) -> None:
    """Verification chunks (the last token and its guesses, logits at every row) reach rank 1 like any step."""
    model_dir = model_dirs["llama"]
    prompts = make_prompts(6, seed=11)
    engine = LLMEngine.from_options(model_dir, {"tensor_parallel_degree": "2", "num_kv_blocks": "128",
                                                "speculative_draft": "ngram", "speculative_max_batch_size": "0"})
    try:
        got = run_all(engine, prompts, 40)
        accepted = engine.stats()["spec_accepted_tokens_total"]
    finally:
        engine.close()
    for i, p in enumerate(prompts):
        assert got[f"r{i}"] == reference_greedy(model_dir, p, 40), f"prompt {i}"
    assert accepted > 0


def test_step_packing_round_trips() -> None:
    step = StepInputs([5, 6, 7], [0, 1, 9], [16, 17, 40], [(0, 0, 2, [1]), (2, 9, 1, [2, 3])], [1, 2])
    assert unpack_step(pack_step(step)) == step
    step = StepInputs([5, 6, 7], [0, 1, 9], [16, 17, 40], [(0, 0, 2, [1]), (2, 9, 1, [2, 3])], [1, 2], [0, -1],
                      fills=[(0, "left", ""), (1, "right", "/adapters/ré")])
    assert unpack_step(pack_step(step)) == step


def test_shard_rejects_heads_that_do_not_divide(model_dirs: dict[str, Path]) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dirs["llama"], dtype=torch.float32)
    with pytest.raises(ValueError, match="does not divide"):
        shard_model(model, 0, 3)


def test_later_groups_fork_their_ranks_from_the_zygote_the_first_started(model_dirs: dict[str, Path]) -> None:
    """Rank 1 is not a fresh interpreter that imports torch again: each group's rank is forked from one process
    that imported it once, started by (and dying with) this one, and is named for ``ps``."""
    parents, names = [], []
    for _ in range(2):
        engine = LLMEngine.from_options(model_dirs["llama"], {"tensor_parallel_degree": "2", "num_kv_blocks": "64"})
        try:
            (rank,) = engine.runner.group.children
            stat = Path(f"/proc/{rank.pid}/stat").read_text()
            parents.append(int(stat.rpartition(")")[2].split()[1]))
            names.append(Path(f"/proc/{rank.pid}/comm").read_text().strip())
        finally:
            engine.close()
    assert parents[0] == parents[1] != os.getpid()
    assert Path(f"/proc/{parents[0]}/stat").read_text().rpartition(")")[2].split()[1] == str(os.getpid())
    assert names == ["tp-rank1", "tp-rank1"]
