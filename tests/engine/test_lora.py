"""LoRA adapters on the rolling engine, on the real SmolLM2-135M-Instruct with two adapters built by peft (random
A and B, ranks 8 and 16): requests of the base model and of both adapters in one batch equal peft's merged
models token for token; with one slot for two adapters they wait and swap and still do; the prefix cache never
serves one adapter's KV to another; bad adapters are refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from handlers.engine.engine import LLMEngine
from handlers.engine.execution.forward.lora import AdapterError
from rollcore.errors import InvalidRequest, ModelNotFound
from rollcore.types import SamplingParams
from tests.engine.test_structured_engine import run as run_deltas
from tests.lora_adapters import merged_greedy, model_with_adapters

PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "List three colours:",
           "Explain what a compiler does in one sentence."]
MAX_NEW = 16


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return model_with_adapters(tmp_path_factory.mktemp("lora"))


@pytest.fixture(scope="module")
def engine(folder: Path) -> LLMEngine:
    """Two slots for two adapters, 4-token blocks (shared by the tests that leave it empty)."""
    return engine_for(folder, max_loras="2", block_size="4")


def engine_for(folder: Path, **options: str) -> LLMEngine:
    return LLMEngine.from_options(folder, {"enable_lora": "true", "max_model_len": "512", "num_kv_blocks": "128",
                                           **options})


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list[int]]:
    """Each request's token ids, all added before the first step."""
    return {rid: [t.id for d in deltas for t in d.tokens] for rid, deltas in run_deltas(engine, requests).items()}


def mixed_requests(engine: LLMEngine) -> tuple[dict[str, tuple[list[int], SamplingParams]], dict[str, str | None]]:
    requests, adapters = {}, {}
    for i, prompt in enumerate(PROMPTS):
        ids = engine.tokenizer(prompt).input_ids
        for adapter in (None, "terse", "verbose"):
            rid = f"{adapter or 'base'}-{i}"
            requests[rid] = (ids, SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True, adapter=adapter))
            adapters[rid] = adapter
    return requests, adapters


def test_mixed_adapters_in_one_batch_equal_peft(folder: Path, engine: LLMEngine) -> None:
    requests, adapters = mixed_requests(engine)
    steps_before = engine.stats()["num_steps_total"]
    got = run(engine, requests)
    assert engine.stats()["num_steps_total"] - steps_before <= MAX_NEW + 1  # all 12 in the same steps
    for rid, (ids, _) in requests.items():
        assert got[rid] == merged_greedy(folder, adapters[rid], ids, MAX_NEW), rid
    assert len({tuple(got[f"{a}-0"]) for a in ("base", "terse", "verbose")}) == 3  # the adapters change answers


def test_one_slot_two_adapters_swap_and_stay_exact(folder: Path) -> None:
    engine = engine_for(folder, max_loras="1")
    requests, adapters = mixed_requests(engine)
    got = run(engine, requests)
    for rid, (ids, _) in requests.items():
        assert got[rid] == merged_greedy(folder, adapters[rid], ids, MAX_NEW), rid
    assert engine.lora is not None and len(engine.lora.slots.resident) == 1  # one slot, filled twice at least
    assert engine.stats()["kv_blocks_used"] == 0


def test_the_prefix_cache_keys_include_the_adapter(folder: Path, engine: LLMEngine) -> None:
    ids = engine.tokenizer("Describe the smell of rain in one short sentence, please.").input_ids  # no other test's
    first = run(engine, {"a": (ids, SamplingParams(max_new_tokens=8, ignore_eos=True, adapter="terse"))})["a"]
    hits = engine.stats()["prefix_cache_hits_total"]
    second = run(engine, {"b": (ids, SamplingParams(max_new_tokens=8, ignore_eos=True, adapter="verbose"))})["b"]
    assert engine.stats()["prefix_cache_hits_total"] == hits  # terse's blocks are not verbose's
    third = run(engine, {"c": (ids, SamplingParams(max_new_tokens=8, ignore_eos=True, adapter="terse"))})["c"]
    assert engine.stats()["prefix_cache_hits_total"] > hits and third == first
    assert second == merged_greedy(folder, "verbose", ids, 8)


def test_unknown_adapters_and_lora_off_are_refused(folder: Path, engine: LLMEngine, tmp_path: Path) -> None:
    with pytest.raises(ModelNotFound, match="LoRA adapter 'nope' is not registered for this model "
                                            r"\(registered: terse, verbose\)"):
        engine.add("x", [1, 2, 3], SamplingParams(adapter="nope"))
    plain = LLMEngine.from_options(folder, {"max_model_len": "512", "num_kv_blocks": "64"})
    with pytest.raises(InvalidRequest, match="option.enable_lora is off"):
        plain.add("x", [1, 2, 3], SamplingParams(adapter="terse"))
    config = folder / "adapters" / "terse" / "adapter_config.json"
    wide = json.loads(config.read_text())
    assert engine.lora is not None
    with pytest.raises(AdapterError, match="rank 8 exceeds option.max_lora_rank=4"):
        engine_for(folder, max_lora_rank="4")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text(json.dumps({**wide, "target_modules": ["embed_tokens"]}))
    with pytest.raises(AdapterError, match="adapter_model.safetensors is missing"):
        engine.lora.register("broken", broken)
