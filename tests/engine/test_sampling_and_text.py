"""Seeded sampling, logprobs, incremental detokenization and stop sequences."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from handlers.base import Context, Input
from handlers.engine.core.detokenizer import IncrementalDetokenizer
from handlers.engine.engine import LLMEngine
from handlers.rolling_handler import HuggingFaceRollingHandler
from rollcore.errors import InvalidRequest
from rollcore.types import FinishReason, SamplingParams
from tests.engine.conftest import make_prompts, reference_greedy


def run_one(engine: LLMEngine, prompt: list[int], params: SamplingParams, others: int = 0
            ) -> tuple[list[int], str, FinishReason]:
    engine.add("main", prompt, params)
    for i, p in enumerate(make_prompts(others, seed=9)):
        engine.add(f"other{i}", p, SamplingParams(max_new_tokens=8, do_sample=True, temperature=1.5))
    ids: list[int] = []
    text = ""
    reason = None
    while engine.has_work():
        for d in engine.step():
            if d.request_id == "main":
                ids += [t.id for t in d.tokens]
                text += d.text
                reason = d.finish_reason or reason
    assert reason is not None
    return ids, text, reason


def test_seeded_sampling_is_reproducible_across_batches(model_dirs: dict[str, Path]) -> None:
    engine = LLMEngine.from_options(model_dirs["llama"], {"num_kv_blocks": "128"})
    prompt = make_prompts(1, seed=5)[0]
    params = SamplingParams(max_new_tokens=10, do_sample=True, temperature=1.3, top_k=50, top_p=0.95,
                            repetition_penalty=1.2, seed=42, ignore_eos=True)
    a, _, _ = run_one(engine, prompt, params)
    b, _, _ = run_one(engine, prompt, params, others=5)
    c, _, _ = run_one(engine, prompt, replace(params, seed=43))
    assert a == b and len(a) == 10
    assert a != c


def test_top_k_1_sampling_equals_greedy_and_logprobs(model_dirs: dict[str, Path]) -> None:
    engine = LLMEngine.from_options(model_dirs["qwen2"], {"num_kv_blocks": "128"})
    prompt = make_prompts(1, seed=6)[0]
    engine.add("x", prompt, SamplingParams(max_new_tokens=6, do_sample=True, top_k=1, logprobs=3, seed=1))
    tokens = []
    while engine.has_work():
        tokens += [t for d in engine.step() for t in d.tokens]
    assert [t.id for t in tokens] == reference_greedy(model_dirs["qwen2"], prompt, 6)
    for t in tokens:
        assert t.logprob is not None and t.logprob <= 0 and len(t.top_logprobs) == 3
        assert t.top_logprobs[0][0] == t.id


def test_stop_token_ids_and_stop_strings(model_dirs: dict[str, Path]) -> None:
    engine = LLMEngine.from_options(model_dirs["llama"], {"num_kv_blocks": "128"})
    prompt = make_prompts(3, seed=1)[1]
    ids, text, reason = run_one(engine, prompt, SamplingParams(max_new_tokens=12, ignore_eos=True))
    assert reason is FinishReason.LENGTH and len(ids) == 12
    params = SamplingParams(max_new_tokens=12, stop_token_ids=(ids[4],), ignore_eos=True)
    ids2, _, reason2 = run_one(engine, prompt, params)
    assert reason2 is FinishReason.STOP and ids2 == ids[:ids.index(ids[4]) + 1]
    # As vLLM: the stop token ends the text without adding its own.
    _, text2, _ = run_one(engine, prompt, params)
    assert text2 == Tokenizer.from_file(str(model_dirs["llama"] / "tokenizer.json")).decode(ids2[:-1])
    stop = text[len(text) // 2:len(text) // 2 + 3]
    _, text3, reason3 = run_one(engine, prompt, SamplingParams(max_new_tokens=12, stop=(stop,), ignore_eos=True))
    assert reason3 is FinishReason.STOP and text3 == text[:text.find(stop)]


@pytest.fixture(scope="module")
def tokenizer(model_dirs: dict[str, Path]) -> Tokenizer:
    return Tokenizer.from_file(str(model_dirs["llama"] / "tokenizer.json"))


def test_decode_stream_multibyte_equals_full_decode(tokenizer: Tokenizer) -> None:
    text = "Hello 東京 数据 😀 🚀 café über — “quoted” 模型 ✓ naïve"
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    detok = IncrementalDetokenizer(tokenizer, [1])
    pieces = [detok.push(i) for i in ids]
    assert "".join(p.released for p in pieces) == tokenizer.decode(ids) == text
    assert all("\ufffd" not in p.piece for p in pieces)


def test_stop_string_hold_back(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("one two three four five", add_special_tokens=False).ids
    detok = IncrementalDetokenizer(tokenizer, [1], stop=("three four", "xyz"))
    released = ""
    stopped = False
    for i in ids:
        step = detok.push(i)
        released += step.released
        assert "thr" not in released  # held back until it is clear whether "three four" follows
        if step.stopped:
            stopped = True
            break
    assert stopped and released == "one two "
    # Text that only looked like a stop start is released when disambiguated or at the end.
    detok = IncrementalDetokenizer(tokenizer, [1], stop=("two three x",))
    released = "".join(detok.push(i).released for i in ids)
    assert released + detok.flush()[0] == "one two three four five"


def test_an_unfinished_character_at_the_end_is_the_last_tokens_text(tokenizer: Tokenizer) -> None:
    """A request cut inside a character (max_tokens): the U+FFFD that decoding gives is released by flush and
    belongs to the last token's piece, so the pieces add up to the text (tgi_compat's generated_text)."""
    ids = tokenizer.encode("ok 東京 𝄞 ğ", add_special_tokens=False).ids
    cut = next(k for k in range(1, len(ids)) if tokenizer.decode(ids[:k]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(tokenizer, [1])
    pieces = [detok.push(i) for i in ids[:cut]]
    released, unpieced = detok.flush()
    text = "".join(p.released for p in pieces) + released
    assert text == tokenizer.decode(ids[:cut]) and text.endswith("\ufffd")
    assert "".join(p.piece for p in pieces) + unpieced == text and unpieced.endswith("\ufffd")


def test_rolling_handler(model_dirs: dict[str, Path]) -> None:
    handler = HuggingFaceRollingHandler()
    handler.initialize(Context("m", model_dirs["llama"], {"num_kv_blocks": "64", "max_model_len": "128"}))
    info = handler.describe()
    assert info["max_model_len"] == 128 and info["eos_token_id"] == 2 and isinstance(info["chat_template"], str)
    assert info["num_blocks"] == 64 and info["block_size"] == 16 and info["vocab_size"] >= 512
    with pytest.raises(InvalidRequest, match="empty"):
        handler.add(Input("e", ""))
    with pytest.raises(InvalidRequest, match="120"):
        handler.add(Input("long", "x", SamplingParams(max_new_tokens=120), prompt_token_ids=tuple(range(5, 15))))
    handler.add(Input("a", "hello world model", SamplingParams(max_new_tokens=4, ignore_eos=True)))
    handler.add(Input("b", "", SamplingParams(max_new_tokens=3, ignore_eos=True), prompt_token_ids=(1, 40, 41)))
    got: dict[str, int] = {}
    while handler.has_work():
        for d in handler.step():
            got[d.request_id] = got.get(d.request_id, 0) + len(d.tokens)
    assert got == {"a": 4, "b": 3}
    assert handler.stats()["kv_blocks_used"] == 0
