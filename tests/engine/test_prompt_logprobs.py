"""Prompt log-probabilities (vLLM's ``prompt_logprobs``) equal transformers' own forward over the prompt, under
batching, chunked prefill, prefix-cache hits of other requests and speculative decoding."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from handlers.engine.engine import LLMEngine
from rollcore.types import SamplingParams, TokenDelta
from tests.engine.conftest import _reference_model, make_prompts, reference_greedy

MAX_NEW = 6


def reference_scores(model_dir: Path, prompt: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits over the whole prompt: row p scores token p + 1."""
    with torch.no_grad():
        logits = _reference_model(model_dir)(torch.tensor([prompt])).logits[0]
    return torch.log_softmax(logits.float(), -1)


def run(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]) -> dict[str, list[TokenDelta]]:
    deltas: dict[str, list[TokenDelta]] = {}
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add(f"r{i}", p, sp)
        deltas[f"r{i}"] = []
    while engine.has_work():
        for d in engine.step():
            deltas[d.request_id].append(d)
    return deltas


VARIANTS = {
    "whole-prompt": {},
    "chunked": {"max_rolling_batch_prefill_tokens": "16", "block_size": "4"},
    "speculative": {"speculative_draft": "ngram", "block_size": "4"},
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_prompt_logprobs_equal_transformers(model_dirs: dict[str, Path], variant: str) -> None:
    model_dir = model_dirs["llama"]
    engine = LLMEngine.from_options(model_dir, {"num_kv_blocks": "256", **VARIANTS[variant]})
    prompts = make_prompts(6, seed=3, shared_prefix=24)
    # the first request fills the prefix cache; the others share its first blocks but must still score them
    run(engine, prompts[:1], [SamplingParams(max_new_tokens=MAX_NEW)])
    asks = [SamplingParams(max_new_tokens=MAX_NEW, prompt_logprobs=k) for k in (0, 3, 0, 5, None)]
    deltas = run(engine, prompts[1:], asks)
    assert engine.stats()["prefix_cache_hits_total"] > 0  # the request without prompt_logprobs reused blocks
    for i, (prompt, params) in enumerate(zip(prompts[1:], asks, strict=True)):
        ds = deltas[f"r{i}"]
        assert [t.id for d in ds for t in d.tokens] == reference_greedy(model_dir, prompt, MAX_NEW)
        assert all(d.prompt_logprobs is None for d in ds[1:])
        scored = ds[0].prompt_logprobs
        if params.prompt_logprobs is None:
            assert scored is None
            continue
        assert scored is not None and [t.id for t in scored] == prompt
        assert scored[0].logprob is None and scored[0].top_logprobs == ()
        want = reference_scores(model_dir, prompt)
        got = torch.tensor([t.logprob for t in scored[1:]])
        expected = want[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
        for p, t in enumerate(scored[1:]):
            assert len(t.top_logprobs) == params.prompt_logprobs
            if t.top_logprobs:
                values, ids = want[p].topk(params.prompt_logprobs)
                assert [a for a, _ in t.top_logprobs] == ids.tolist()
                torch.testing.assert_close(torch.tensor([b for _, b in t.top_logprobs]), values, atol=1e-4, rtol=0)


def test_prompt_logprobs_survive_preemption(model_dirs: dict[str, Path]) -> None:
    """A sequence preempted and recomputed scores its prompt once, with the same values."""
    model_dir = model_dirs["llama"]
    engine = LLMEngine.from_options(model_dir, {"num_kv_blocks": "20", "block_size": "4",
                                                "max_rolling_batch_prefill_tokens": "64"})
    prompts = [p[:20] for p in make_prompts(8, seed=3)]
    deltas = run(engine, prompts, [SamplingParams(max_new_tokens=12, ignore_eos=True, prompt_logprobs=0)] * 8)
    assert engine.stats()["num_preemptions_total"] > 0
    for i, prompt in enumerate(prompts):
        scored = deltas[f"r{i}"][0].prompt_logprobs
        assert scored is not None and [t.id for t in scored] == prompt
        want = reference_scores(model_dir, prompt)
        expected = want[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
        torch.testing.assert_close(torch.tensor([t.logprob for t in scored[1:]]), expected, atol=1e-4, rtol=0)


def test_a_one_token_prompt_has_nothing_to_score(model_dirs: dict[str, Path]) -> None:
    """The first prompt token has no log-probability; a prompt of one token is that token alone, in the rolling
    engine and in the dynamic handler."""
    from handlers.base import Context, Input
    from handlers.huggingface import HuggingFaceHandler

    params = SamplingParams(max_new_tokens=2, prompt_logprobs=2)
    engine = LLMEngine.from_options(model_dirs["llama"], {"num_kv_blocks": "16"})
    deltas = run(engine, [[7]], [params])
    assert [(t.id, t.logprob, t.top_logprobs) for t in deltas["r0"][0].prompt_logprobs or ()] == [(7, None, ())]
    handler = HuggingFaceHandler()
    handler.initialize(Context("m", model_dirs["llama"], {}))
    [out] = handler.handle([Input("d", "", params, prompt_token_ids=(7,))])
    assert out.error is None and [(t.id, t.logprob) for t in out.prompt_logprobs or ()] == [(7, None)]
