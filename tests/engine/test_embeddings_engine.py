"""Embedding requests in the rolling engine (``handlers.engine.execution.forward.pooling``), on the tiny Llama: the
pooled vector is transformers' ``AutoModel`` final hidden state pooled the same way, whether the prompt runs alone, in
chunks, from a cached prefix or beside generation; and generation beside embeddings is token for token what it is
alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from handlers.engine.engine import LLMEngine
from handlers.engine.planning.engine_config import EngineConfig
from rollcore.errors import InvalidRequest
from rollcore.types import SamplingParams, TokenDelta
from tests.engine.conftest import make_prompts

# The lean forward and the C kernels run the same operations as transformers in another order (prompt attention
# over paged blocks, fused norms): fp32 rounding of a 64-wide hidden state stays far under this.
ATOL = 1e-5


def reference(model_dir: Path, prompt: list[int], pooling: str) -> torch.Tensor:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = model(torch.tensor([prompt])).last_hidden_state[0]
    row = {"last": hidden[-1], "cls": hidden[0], "mean": hidden.mean(0)}[pooling]
    return torch.nn.functional.normalize(row, dim=0)


def engine(model_dir: Path, **kw: object) -> LLMEngine:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    # type: ignore[arg-type]
    config = EngineConfig(**{"num_kv_blocks": 64, "block_size": 4, "max_model_len": 256, **kw})
    return LLMEngine(model, AutoTokenizer.from_pretrained(model_dir), config)


def collect(deltas: list[TokenDelta], out: dict[str, Any]) -> None:
    """Each embedding's vector, each generation's token ids."""
    for d in deltas:
        if d.embedding is not None:
            assert d.finish_reason is not None and d.prompt_tokens is not None and not d.tokens
            out[d.request_id] = torch.tensor(d.embedding)
        else:
            out.setdefault(d.request_id, []).extend(t.id for t in d.tokens)


def run(eng: LLMEngine, out: dict[str, Any] | None = None) -> dict[str, Any]:
    """Step until idle."""
    out = {} if out is None else out
    while eng.has_work():
        collect(eng.step(), out)
    return out


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_pooled_vector_is_automodels_alone_and_chunked(model_dirs: dict[str, Path], pooling: str) -> None:
    prompts = make_prompts(3, seed=3)
    # a step budget of 8 tokens: every prompt longer than that is prefilled in chunks
    eng = engine(model_dirs["llama"], max_num_batched_tokens=8, max_prefill_tokens_while_decoding=8)
    for i, p in enumerate(prompts):
        eng.add_embedding(f"e{i}", p, pooling)
    got = run(eng)
    for i, p in enumerate(prompts):
        torch.testing.assert_close(got[f"e{i}"], reference(model_dirs["llama"], p, pooling), atol=ATOL, rtol=0)
    assert eng.stats()["kv_blocks_used"] == 0  # finished embeddings hold no blocks


def test_generation_beside_embeddings_is_unchanged(model_dirs: dict[str, Path]) -> None:
    prompts = make_prompts(4, seed=5, shared_prefix=8)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    solo = engine(model_dirs["llama"])
    for i, p in enumerate(prompts[:2]):
        solo.add(f"g{i}", p, params)
    alone = run(solo)
    mixed = engine(model_dirs["llama"])
    for i, p in enumerate(prompts[:2]):
        mixed.add(f"g{i}", p, params)
    mixed.add_embedding("e0", prompts[2], "last")
    got: dict[str, Any] = {}
    collect(mixed.step(), got)
    collect(mixed.step(), got)
    assert got["g0"] and got["g1"]  # these embeddings join while the generations decode
    mixed.add_embedding("e1", prompts[3], "mean")
    mixed.add_embedding("e2", prompts[0], "last")  # its prefix is cached by now: the last row is computed anyway
    run(mixed, got)
    assert (got["g0"], got["g1"]) == (alone["g0"], alone["g1"])
    assert len(got["g0"]) == 12
    torch.testing.assert_close(got["e0"], reference(model_dirs["llama"], prompts[2], "last"), atol=ATOL, rtol=0)
    torch.testing.assert_close(got["e1"], reference(model_dirs["llama"], prompts[3], "mean"), atol=ATOL, rtol=0)
    torch.testing.assert_close(got["e2"], reference(model_dirs["llama"], prompts[0], "last"), atol=ATOL, rtol=0)


def test_a_bad_embedding_request_is_refused_alone(model_dirs: dict[str, Path]) -> None:
    eng = engine(model_dirs["llama"])
    with pytest.raises(InvalidRequest, match="pooling 'max'"):
        eng.add_embedding("e0", [5, 6, 7], "max")
    with pytest.raises(InvalidRequest, match="exceeds the model's maximum length"):
        eng.add_embedding("e1", [5] * 300, "last")
    eng.add_embedding("e2", [5, 6, 7], "last")
    eng.abort("e2")
    assert not eng.has_work()
