"""The family matrix: every model family the engine claims equals transformers' ``generate`` token for token,
and every family it cannot serve exactly is refused at load with a message naming the feature.

Tiny random-weight models of each family are built from their configs (``handlers.synthetic_model.FAMILIES``)
with a sliding window of 16 and small soft-caps, so that prompts (3-45 tokens), 48 generated tokens,
chunked prefill (a 24-token budget, 4-token blocks) and prefix-cache hits all cross the window boundary.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from handlers.engine.engine import LLMEngine
from handlers.engine.execution.forward.runner import kv_geometry
from handlers.engine.planning.families import SUPPORTED, TENSOR_PARALLEL, UnsupportedModel
from handlers.synthetic_model import FAMILIES, TEST_SLIDING_WINDOW, build_model
from rollcore.types import SamplingParams

MAX_NEW = 48


def _tiny() -> dict[str, int]:
    from handlers.synthetic_model import SIZES

    return SIZES["tiny"]


REFUSED = {"bloom": "ALiBi", "mpt": "ALiBi", "falcon-alibi": "ALiBi"}
EXACT = sorted(set(FAMILIES) - set(REFUSED))
ENGINE_OPTIONS = {"num_kv_blocks": "160", "block_size": "4", "max_rolling_batch_prefill_tokens": "24"}


def family_prompts(seed: int = 0) -> list[list[int]]:
    """Five prompts of different lengths (three longer than the window); the last two share 20 tokens."""
    rng = random.Random(seed)
    prompts = [[rng.randint(5, 500) for _ in range(n)] for n in (3, 11, 17, 30)]
    prompts.append(prompts[3][:20] + [rng.randint(5, 500) for _ in range(25)])
    return prompts


@pytest.fixture(scope="module")
def family_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("families")


def family_dir(root: Path, family: str) -> Path:
    d = root / family
    if not (d / "config.json").exists():
        build_model(d, family, "tiny")
    return d


_REFERENCES: dict[tuple[Any, ...], list[list[int]]] = {}


def generate_reference(model_dir: Path, prompts: list[list[int]], max_new_tokens: int = MAX_NEW) -> list[list[int]]:
    """Greedy ``generate`` of each prompt alone, EOS ignored (the engine runs with ignore_eos); computed once per
    model folder (as its files are), prompts and length: several tests compare against the same references."""
    files = tuple((f.name, f.stat().st_mtime_ns, f.stat().st_size) for f in sorted(Path(model_dir).iterdir())
                  if f.suffix in (".json", ".safetensors"))
    key = (str(Path(model_dir).resolve()), files, tuple(map(tuple, prompts)), max_new_tokens)
    if key not in _REFERENCES:
        _REFERENCES[key] = _generate(model_dir, prompts, max_new_tokens)
    return [list(r) for r in _REFERENCES[key]]


def _generate(model_dir: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    refs = []
    with torch.no_grad():
        for p in prompts:
            out = model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=max_new_tokens,
                                 attention_mask=torch.ones(1, len(p), dtype=torch.long))
            refs.append(out[0, len(p):].tolist())
    return refs


def run_together(engine: LLMEngine, prompts: list[list[int]], tag: str, max_new_tokens: int = MAX_NEW,
                 peak_blocks: list[int] | None = None) -> list[list[int]]:
    """Admit all prompts at once and step until done; returns each one's generated token ids.
    ``peak_blocks`` (if given) receives the most KV blocks any one request held after a step."""
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add(f"{tag}{i}", p, params)
    got: dict[str, list[int]] = {f"{tag}{i}": [] for i in range(len(prompts))}
    while engine.has_work():
        for d in engine.step():
            got[d.request_id].extend(t.id for t in d.tokens)
        if peak_blocks is not None:
            peak_blocks.append(max(engine.stats()["blocks_held"].values(), default=0))
    return [got[f"{tag}{i}"] for i in range(len(prompts))]


def test_matrix_covers_the_issue_families() -> None:
    required = {"llama", "qwen2", "qwen3", "gemma", "gpt2", "gpt_neox", "mixtral", "qwen2_moe", "olmo2", "mistral",
                "phi3", "starcoder2", "gemma2", "gemma3", "gpt_oss", "falcon-7b", "falcon-40b", "bloom"}
    assert required <= set(FAMILIES)
    assert len(EXACT) >= 16


@pytest.mark.parametrize("family", EXACT)
def test_family_equals_generate(family_root: Path, family: str) -> None:
    model_dir = family_dir(family_root, family)
    prompts = family_prompts()
    assert max(len(p) for p in prompts) + MAX_NEW > 3 * TEST_SLIDING_WINDOW
    refs = generate_reference(model_dir, prompts)
    engine = LLMEngine.from_options(model_dir, ENGINE_OPTIONS)
    first = run_together(engine, prompts, "a")
    second = run_together(engine, prompts, "b")  # the same prompts again: served from the prefix cache
    for i, p in enumerate(prompts):
        assert first[i] == refs[i], f"{family}: prompt {i} ({len(p)} tokens) differs from generate"
        assert second[i] == refs[i], f"{family}: prompt {i} ({len(p)} tokens) differs on prefix-cache hits"
    stats = engine.stats()
    assert stats["prefix_cache_hits_total"] > 0
    assert stats["kv_blocks_used"] == 0


def test_sliding_window_frees_blocks_out_of_the_window(family_root: Path) -> None:
    """Mistral attends within the window on every layer: a request holds about window / block_size blocks
    however long it grows, and its output still equals generate."""
    model_dir = family_dir(family_root, "mistral")
    prompts = family_prompts(seed=2)
    refs = generate_reference(model_dir, prompts, 96)
    engine = LLMEngine.from_options(model_dir, {**ENGINE_OPTIONS, "enable_prefix_caching": "false"})
    assert engine.scheduler.config.sliding_window == TEST_SLIDING_WINDOW
    peaks: list[int] = []
    got = run_together(engine, prompts, "w", 96, peaks)
    assert got == refs
    # Window (16 tokens) plus one prefill chunk (24), in 4-token blocks, plus the partly filled edge blocks.
    bound = -(-(TEST_SLIDING_WINDOW + 24) // 4) + 2
    longest = -(-(max(len(p) for p in prompts) + 96) // 4)
    assert max(peaks) <= bound < longest
    assert engine.stats()["kv_blocks_used"] == 0


def test_mixed_full_and_sliding_layers_keep_every_block(family_root: Path) -> None:
    """Gemma-2 alternates sliding and full layers: the full layers need every block, none is freed."""
    engine = LLMEngine.from_options(family_dir(family_root, "gemma2"), ENGINE_OPTIONS)
    assert engine.scheduler.config.sliding_window == 0
    peaks: list[int] = []
    run_together(engine, family_prompts(seed=2)[3:4], "g", 40, peaks)
    # At its last live step the request has fed 30 + 38 tokens (the 40th is sampled, never fed back).
    assert max(peaks) == -(-(30 + 40 - 2) // 4)


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_family_refused_by_name(family_root: Path, family: str) -> None:
    model_dir = family_dir(family_root, family)
    with pytest.raises(UnsupportedModel, match=REFUSED[family]) as info:
        LLMEngine.from_options(model_dir, ENGINE_OPTIONS)
    arch = {"bloom": "Bloom", "mpt": "Mpt", "falcon-alibi": "Falcon"}[family]
    assert arch in str(info.value)


TP_FAMILIES = sorted(f for f in EXACT if FAMILIES[f](_tiny(), 64)[0] in TENSOR_PARALLEL)


@pytest.mark.parametrize("family", TP_FAMILIES)
def test_tensor_parallel_equals_generate(family_root: Path, family: str) -> None:
    """TP=2 (rank 1 a child process over gloo) equals generate; Falcon-7B's single KV head is replicated."""
    model_dir = family_dir(family_root, family)
    prompts = family_prompts(seed=1)
    refs = generate_reference(model_dir, prompts, 24)
    engine = LLMEngine.from_options(model_dir, {**ENGINE_OPTIONS, "tensor_parallel_degree": "2"})
    try:
        config_kv_heads = kv_geometry(engine.model.config)[1]
        assert engine.runner.pool.keys[0].shape[0] == max(1, config_kv_heads // 2)
        got = run_together(engine, prompts, "t", 24)
    finally:
        engine.close()
    assert got == refs


@pytest.mark.parametrize("family", sorted(set(EXACT) - set(TP_FAMILIES)))
def test_tensor_parallel_refused_before_ranks_start(family_root: Path, family: str) -> None:
    with pytest.raises(UnsupportedModel, match="tensor parallelism supports"):
        LLMEngine.from_options(family_dir(family_root, family), {**ENGINE_OPTIONS, "tensor_parallel_degree": "2"})


def test_unknown_attention_argument_refuses_the_model(family_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A model whose attention passes an argument the engine does not implement is refused at load."""
    from transformers.models.llama import modeling_llama

    model_dir = family_dir(family_root, "llama")
    real = modeling_llama.LlamaAttention.forward

    # type: ignore[no-untyped-def]
    def forward_with_new_feature(self, hidden_states, position_embeddings, attention_mask=None, **kwargs):
        return real(self, hidden_states, position_embeddings, attention_mask, attention_chunk_size=8, **kwargs)

    monkeypatch.setattr(modeling_llama.LlamaAttention, "forward", forward_with_new_feature)
    with pytest.raises(UnsupportedModel, match="attention_chunk_size") as info:
        LLMEngine.from_options(model_dir, ENGINE_OPTIONS)
    assert "LlamaForCausalLM" in str(info.value)


def test_supported_list_matches_the_matrix() -> None:
    """Every model_type the engine claims is exercised above (no claim without a test)."""
    tested = {FAMILIES[f](_tiny(), 64)[0] for f in EXACT}
    assert tested == set(SUPPORTED), (sorted(SUPPORTED - tested), sorted(tested - SUPPORTED))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_dynamic_batching_equals_generate(family_root: Path, family: str) -> None:
    """Dynamic batching (HF generate on a left-padded batch) serves every family, refused ones included:
    three prompts of different lengths in one batch each equal their own unpadded generate."""
    from handlers.base import Context, Input
    from handlers.huggingface import HuggingFaceHandler

    model_dir = family_dir(family_root, family)
    handler = HuggingFaceHandler()
    handler.initialize(Context(model_name=family, model_dir=model_dir, properties={"num_threads": "1"}))
    prompts = family_prompts(seed=4)[1:4]
    refs = generate_reference(model_dir, prompts, 16)
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    outs = handler.handle([Input(request_id=f"d{i}", prompt="", params=params, prompt_token_ids=tuple(p))
                           for i, p in enumerate(prompts)])
    for i, out in enumerate(outs):
        assert out.error is None, out.error
        assert [t.id for t in out.tokens] == refs[i], f"{family}: prompt {i} ({len(prompts[i])} tokens)"


@pytest.mark.parametrize("family", EXACT)
def test_bf16_against_generate_bf16(family_root: Path, family: str, record_property: Any) -> None:
    """bf16: oneDNN's and transformers' bf16 kernels round differently, so greedy paths may part at a near-tie;
    the first divergence is recorded (docs/configuration.md's matrix shows it). What must hold: teacher-forced on
    the same tokens, the engine's next-token choice agrees with transformers' bf16 model at >= 90% of positions (a
    broken path agrees at ~1/vocab)."""
    from transformers import AutoModelForCausalLM

    from handlers.engine.execution.forward.runner import StepInputs

    model_dir = family_dir(family_root, family)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    model.generation_config.eos_token_id = None
    prompts = family_prompts(seed=5)
    engine = LLMEngine.from_options(model_dir, {**ENGINE_OPTIONS, "dtype": "bf16"})
    assert next(engine.model.parameters()).dtype == torch.bfloat16
    got = run_together(engine, prompts, "h", 32)
    divergences = []
    with torch.no_grad():
        for p, tokens in zip(prompts, got, strict=True):
            ref = model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=32,
                                 attention_mask=torch.ones(1, len(p), dtype=torch.long))[0, len(p):].tolist()
            divergences.append(next((i for i, (a, b) in enumerate(zip(tokens, ref, strict=True)) if a != b), None))
        seq = prompts[3] + got[3]
        n, bs = len(seq), 4
        table = list(range(-(-n // bs)))
        logits = engine.runner.forward(StepInputs(seq, list(range(n)), [table[i // bs] * bs + i % bs for i in range(n)],
                                                  [(0, 0, n, table)], list(range(n))))
        ref_logits = model(torch.tensor([seq])).logits[0]
    agree = float((logits.argmax(-1) == ref_logits.argmax(-1)).float().mean())
    first = min((d for d in divergences if d is not None), default=None)
    record_property("bf16_first_divergence", "none" if first is None else str(first))
    assert agree >= 0.9, (family, agree, divergences)


@pytest.mark.parametrize("family", EXACT)
def test_family_with_speculative_decoding_equals_generate(family_root: Path, family: str) -> None:
    """Prompt-lookup speculation changes how many tokens a step emits, never which: every family's greedy
    output stays generate's, with guesses confirmed and rejected across the sliding window."""
    model_dir = family_dir(family_root, family)
    prompts = family_prompts()
    refs = generate_reference(model_dir, prompts)
    engine = LLMEngine.from_options(model_dir, {**ENGINE_OPTIONS, "speculative_draft": "ngram",
                                                "num_speculative_tokens": "5", "speculative_max_batch_size": "0"})
    got = run_together(engine, prompts, "s")
    for i, p in enumerate(prompts):
        assert got[i] == refs[i], f"{family}: prompt {i} ({len(p)} tokens) differs from generate with speculation"
    stats = engine.stats()
    assert stats["spec_draft_tokens_total"] > 0
    assert stats["spec_accepted_tokens_total"] > 0, f"{family}: no guess was confirmed (the test needs some)"
    assert stats["kv_blocks_used"] == 0
