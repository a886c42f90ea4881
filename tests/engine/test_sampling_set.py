"""The sampling set against vLLM's definitions, on fixed logits: each parameter computed here the plain way (a
reference written from the definitions) and by the engine's sampler (``handlers.engine.execution.decoding.sampling``),
then end to end in the rolling engine and the dynamic handler on the real model."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from handlers.base import Context, Input
from handlers.engine.engine import LLMEngine
from handlers.engine.execution.decoding.sampling import RequestSampler
from handlers.huggingface import HuggingFaceHandler
from rollcore.types import SamplingParams
from tests.real_model import smollm2_folder

V = 12
LOGITS = torch.tensor([2.0, 1.5, 1.4, 0.3, -0.2, 3.1, 0.0, -1.0, 2.9, 0.8, 0.1, -3.0])
PROMPT = [5, 5, 8, 1]  # the prompt's tokens: penalties never count them
OUTPUT = [8, 8, 2, 8, 0]  # generated so far: token 8 three times, 2 and 0 once


def reference(params: SamplingParams, prompt: list[int], output: list[int], stop_ids: set[int]) -> list[float]:
    """The processed logits, element by element, as vLLM defines each parameter."""
    out = LOGITS.tolist()
    for t, b in params.logit_bias:
        out[t] += b
    if len(output) < params.min_tokens:
        for t in stop_ids:
            out[t] = -math.inf
    for t in range(V):
        n = output.count(t)
        out[t] -= params.frequency_penalty * n + (params.presence_penalty if n else 0.0)
    return out


def processed(params: SamplingParams, stop_ids: frozenset[int] = frozenset()) -> list[float]:
    sampler = RequestSampler(params, random.Random(0), len(PROMPT), stop_ids)
    ids = torch.tensor([PROMPT + OUTPUT])
    return sampler.processors(ids, LOGITS.clone().unsqueeze(0))[0].tolist()


@pytest.mark.parametrize("params", [
    SamplingParams(presence_penalty=1.5), SamplingParams(frequency_penalty=0.7),
    SamplingParams(presence_penalty=-0.5, frequency_penalty=-1.2),
    SamplingParams(logit_bias=((3, 4.0), (5, -100.0))), SamplingParams(min_tokens=6),
    SamplingParams(min_tokens=5), SamplingParams(min_tokens=9, frequency_penalty=0.4, logit_bias=((11, 7.0),)),
], ids=["presence", "frequency", "negative", "logit_bias", "min_tokens-held", "min_tokens-reached", "together"])
def test_processors_equal_the_definitions(params: SamplingParams) -> None:
    stop = {5, 2}
    want = reference(params, PROMPT, OUTPUT, stop)
    got = processed(params, frozenset(stop))
    assert got == pytest.approx(want, rel=1e-6, abs=1e-6)  # float32 against Python floats
    sampler = RequestSampler(params, random.Random(0), len(PROMPT), frozenset(stop))
    assert sampler.choose(LOGITS.clone(), PROMPT + OUTPUT) == max(range(V), key=lambda t: want[t])  # greedy


def test_bad_words_ban_a_words_last_token_after_the_rest_of_it() -> None:
    """vLLM's bad_words on fixed logits: a one-token word is banned everywhere; a longer word's last token only
    when the generated tokens end with the word's other tokens (the prompt never counts)."""
    words = [[3], [8, 2, 9], [0, 4]]  # OUTPUT ends with 0: [0, 4] is armed, [8, 2, 9] is not (it ends 8, 0)
    sampler = RequestSampler(SamplingParams(), random.Random(0), len(PROMPT), bad_words=words)
    got = sampler.processors(torch.tensor([PROMPT + OUTPUT]), LOGITS.clone().unsqueeze(0))[0]
    want = LOGITS.clone()
    want[3] = want[4] = -math.inf
    assert got.tolist() == want.tolist()
    armed = RequestSampler(SamplingParams(), random.Random(0), len(PROMPT), bad_words=[[8, 2, 9], [1, 5]])
    got = armed.processors(torch.tensor([PROMPT + [8, 2]]), LOGITS.clone().unsqueeze(0))[0]
    want = LOGITS.clone()
    want[9] = -math.inf  # [1, 5]: the prompt's 1 does not arm it
    assert got.tolist() == want.tolist()


def test_min_p_keeps_the_tokens_within_min_p_of_the_likeliest() -> None:
    for min_p, temperature in ((0.2, 1.0), (0.5, 0.7), (0.05, 1.3)):
        sampler = RequestSampler(SamplingParams(do_sample=True, min_p=min_p, temperature=temperature),
                                 random.Random(0))
        warped = sampler.warpers(None, LOGITS.clone().unsqueeze(0))[0]
        probs = torch.softmax(LOGITS / temperature, -1)
        kept = {t for t in range(V) if probs[t] >= min_p * probs.max()}
        assert {t for t in range(V) if math.isfinite(warped[t])} == kept
        draws = {sampler.choose(LOGITS.clone(), PROMPT) for _ in range(300)}
        assert draws <= kept and len(draws) == len(kept)  # only kept tokens, each of them drawn


def test_typical_p_keeps_the_typical_set() -> None:
    mass = 0.6
    sampler = RequestSampler(SamplingParams(do_sample=True, typical_p=mass), random.Random(0))
    warped = sampler.warpers(None, LOGITS.clone().unsqueeze(0))[0]
    logp = torch.log_softmax(LOGITS, -1)
    entropy = -(logp.exp() * logp).sum()
    order = sorted(range(V), key=lambda t: abs(-logp[t] - entropy).item())  # most typical first
    kept, total = set(), 0.0
    for t in order:  # the smallest typical set whose mass reaches typical_p (transformers' definition)
        kept.add(t)
        total += logp[t].exp().item()
        if total >= mass:
            break
    assert {t for t in range(V) if math.isfinite(warped[t])} == kept


@pytest.fixture(scope="module")
def folder() -> Path:
    return smollm2_folder()


def test_the_engine_and_the_dynamic_handler_apply_them(folder: Path) -> None:
    engine = LLMEngine.from_options(folder, {"max_model_len": "512"})
    handler = HuggingFaceHandler()
    handler.initialize(Context("m", folder, {}))
    prompt = "Write the word hello five times:"
    ids = list(engine.tokenizer(prompt)["input_ids"])

    def rolling(params: SamplingParams, prompt_ids: list[int] = ids) -> list[int]:
        engine.add("r", prompt_ids, params)
        got: list[int] = []
        while engine.has_work():
            got += [t.id for d in engine.step() for t in d.tokens]
        return got

    def dynamic(params: SamplingParams, text: str = prompt) -> list[int]:
        return [t.id for t in handler.handle([Input("d", text, params)])[0].tokens]

    plain = rolling(SamplingParams(max_new_tokens=12, ignore_eos=True))
    assert len(set(plain)) < len(plain)  # the model repeats itself: penalties have something to act on
    for params in (SamplingParams(max_new_tokens=12, ignore_eos=True, frequency_penalty=1.5),
                   SamplingParams(max_new_tokens=12, ignore_eos=True, presence_penalty=2.0),
                   SamplingParams(max_new_tokens=12, ignore_eos=True, logit_bias=((plain[1], -100.0),))):
        got = rolling(params)
        assert got != plain and got == dynamic(params), params
        if params.logit_bias:
            assert plain[1] not in got
    # min_tokens holds EOS back: the answer to a short question goes on past its natural end
    eos = sorted(engine.eos_token_ids)[0]
    question = handler.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    question_ids = list(engine.tokenizer(question)["input_ids"])
    short = rolling(SamplingParams(max_new_tokens=40), question_ids)
    assert short[-1] == eos and len(short) < 30
    longer = rolling(SamplingParams(max_new_tokens=40, min_tokens=30), question_ids)
    assert len(longer) >= 30 and eos not in longer[:30]
    assert dynamic(SamplingParams(max_new_tokens=40, min_tokens=30), question)[:30] == longer[:30]


@dataclass
class Capital:
    """The real model in the rolling engine and the dynamic handler, and one chat question to both."""

    engine: LLMEngine
    handler: HuggingFaceHandler
    question: str
    ids: list[int]

    def rolling(self, params: SamplingParams) -> str:
        self.engine.add("r", self.ids, params)
        text = ""
        while self.engine.has_work():
            text += "".join(d.text for d in self.engine.step())
        return text

    def dynamic(self, params: SamplingParams) -> Any:
        return self.handler.handle([Input("d", self.question, params)])[0]


@pytest.fixture(scope="module")
def capital(folder: Path) -> Capital:
    engine = LLMEngine.from_options(folder, {"max_model_len": "512"})
    handler = HuggingFaceHandler()
    handler.initialize(Context("m", folder, {}))
    question = handler.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    return Capital(engine, handler, question, list(engine.tokenizer(question)["input_ids"]))


def test_stop_strings_kept_on_request_and_special_tokens_shown(capital: Capital) -> None:
    """include_stop_str_in_output keeps the stop string; skip_special_tokens=false keeps chat markers' text: in the
    rolling engine and in the dynamic handler alike."""

    def both(params: SamplingParams) -> str:
        text = capital.rolling(params)
        assert capital.dynamic(params).text == text, params
        return text

    assert both(SamplingParams(max_new_tokens=20, stop=("Paris", "France"))) == "The capital of "
    assert both(SamplingParams(max_new_tokens=20, stop=("Paris", "France"), include_stop_str_in_output=True)) == (
        "The capital of France")
    plain = both(SamplingParams(max_new_tokens=14, ignore_eos=True))
    shown = both(SamplingParams(max_new_tokens=14, ignore_eos=True, skip_special_tokens=False))
    assert "<|im_end|>" in shown and "<|im_end|>" not in plain
    assert shown.replace("<|im_end|>", "").replace("<|im_start|>", "") == plain


def test_bad_words_and_beam_search(capital: Capital, folder: Path) -> None:
    """bad_words keeps a word out of the answer in the rolling engine and the dynamic handler alike; beam search
    (dynamic batching) answers what transformers' own beam search does."""
    from transformers import AutoModelForCausalLM

    engine, ids = capital.engine, capital.ids
    plain = capital.rolling(SamplingParams(max_new_tokens=12))
    assert "Paris" in plain
    banned = SamplingParams(max_new_tokens=12, bad_words=("Paris",))
    without = capital.rolling(banned)
    assert "Paris" not in without and without == capital.dynamic(banned).text
    beams = SamplingParams(max_new_tokens=12, num_beams=3, length_penalty=0.5, early_stopping=True, details=True)
    got = capital.dynamic(beams)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        want = model.generate(torch.tensor([ids]), max_new_tokens=12, num_beams=3, length_penalty=0.5,
                              early_stopping=True, do_sample=False)[0, len(ids):].tolist()
    n = len(got.tokens)
    assert [t.id for t in got.tokens] == want[:n] and (n == len(want) or want[n - 1] in engine.eos_token_ids)
    # each token's log-probability is the model's own given the answer so far
    with torch.no_grad():
        full = torch.log_softmax(model(torch.tensor([ids + [t.id for t in got.tokens]])).logits[0].float(), -1)
    for k, t in enumerate(got.tokens):
        assert t.logprob == pytest.approx(float(full[len(ids) - 1 + k, t.id]), abs=1e-4)
