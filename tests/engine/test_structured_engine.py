"""Constrained decoding in the rolling engine and the dynamic handler, on the real SmolLM2-135M-Instruct (random
weights would satisfy a grammar by accident or never finish one): constrained and free rows share steps, every
constrained answer validates, the free answers are the ones they are without constrained neighbours, a grammar is
compiled once, a grammar the tokenizer cannot serve fails its request alone, preemption keeps the state right."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from handlers.base import Context, Input
from handlers.engine.engine import LLMEngine
from handlers.huggingface import HuggingFaceHandler
from rollcore.types import FinishReason, SamplingParams, TokenDelta
from serving.requests import structured
from tests.real_model import smollm2_folder

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "languages": {"type": "array", "items": {"enum": ["English", "French", "German"]}, "minItems": 1, "maxItems": 2},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"], "additionalProperties": False},
    "height_m": {"type": "number", "minimum": 0.5, "maximum": 2.5}},
    "required": ["name", "age", "languages", "address", "height_m"], "additionalProperties": False}
TASKS = ["Describe a French teacher as JSON.", "Invent a person living in Berlin. Answer in JSON.",
         "Write a JSON profile of a retired pilot.", "Give a JSON record for a student from London."]
FREE = ["What is the capital of France?", "Name three colors.", "Why is the sky blue?", "Say hello in German."]


@pytest.fixture(scope="module")
def folder() -> Path:
    return smollm2_folder()


@pytest.fixture(scope="module")
def engine(folder: Path) -> LLMEngine:
    # no latency target: this counts the steps of one shared batch, which the target would spread over more
    return LLMEngine.from_options(folder, {"max_model_len": "1024", "max_rolling_batch_size": "16", "max_itl_ms": "0"})


def chat_ids(engine: LLMEngine, question: str) -> list[int]:
    text = engine.tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                                add_generation_prompt=True)
    return list(engine.tokenizer(text)["input_ids"])


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list[TokenDelta]]:
    for rid, (ids, params) in requests.items():
        engine.add(rid, ids, params)
    out: dict[str, list[TokenDelta]] = {rid: [] for rid in requests}
    while engine.has_work():
        for d in engine.step():
            out[d.request_id].append(d)
    return out


def text_of(deltas: list[TokenDelta]) -> str:
    return "".join(d.text for d in deltas)


def test_constrained_and_free_rows_share_steps_and_each_gets_its_answer(engine: LLMEngine) -> None:
    free = {f"free{i}": (chat_ids(engine, q), SamplingParams(max_new_tokens=24)) for i, q in enumerate(FREE)}
    alone = run(engine, free)
    grammar = structured.json_schema(PERSON, "schema")
    constrained = {f"json{i}": (chat_ids(engine, q), SamplingParams(max_new_tokens=200, grammar=grammar))
                   for i, q in enumerate(TASKS)}
    steps_before = engine.stats()["num_steps_total"]
    mixed = run(engine, {**constrained, **free})
    for rid in constrained:
        answer = text_of(mixed[rid])
        jsonschema.validate(json.loads(answer), PERSON)
        assert mixed[rid][-1].finish_reason is FinishReason.STOP, answer  # the grammar completed
    for rid in free:  # greedy free rows: the same tokens as without the constrained neighbours
        assert [t.id for d in mixed[rid] for t in d.tokens] == [t.id for d in alone[rid] for t in d.tokens], rid
    longest = max(len(v) for v in mixed.values())
    assert engine.stats()["num_steps_total"] - steps_before <= longest + 2  # one batch: no separate path
    compiler = engine._compiling.compiler
    assert compiler is not None and len(compiler._built) == 1  # compiled once, used four times


def test_regex_choice_and_sampling_hold(engine: LLMEngine) -> None:
    date = structured.regex(r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]", "r")
    colours = ["red", "green", "blue", "light yellow"]
    requests = {f"date{i}": (chat_ids(engine, "When did the war end? Give a date."),
                             SamplingParams(max_new_tokens=20, grammar=date, do_sample=True, temperature=1.0, seed=i))
                for i in range(3)}
    requests |= {f"pick{i}": (chat_ids(engine, "Pick a colour."), SamplingParams(
        max_new_tokens=10, grammar=structured.choice(colours, "c"), do_sample=True, temperature=1.5, seed=i))
                 for i in range(3)}
    out = run(engine, requests)
    for rid, deltas in out.items():
        answer = text_of(deltas)
        if rid.startswith("date"):
            assert re.fullmatch(r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]", answer), answer
        else:
            assert answer in colours, answer
        assert deltas[-1].finish_reason is FinishReason.STOP


def test_max_tokens_ends_with_length_not_a_claimed_whole(engine: LLMEngine) -> None:
    out = run(engine, {"cut": (chat_ids(engine, TASKS[0]), SamplingParams(
        max_new_tokens=6, grammar=structured.json_schema(PERSON, "s")))})["cut"]
    assert out[-1].finish_reason is FinishReason.LENGTH
    with pytest.raises(json.JSONDecodeError):
        json.loads(text_of(out))


def test_a_grammar_the_tokenizer_cannot_serve_fails_alone(engine: LLMEngine) -> None:
    bad = structured.grammar("start: <[999999]>", "g")  # a token id past the vocabulary: only the model can tell
    out = run(engine, {"bad": (chat_ids(engine, FREE[0]), SamplingParams(max_new_tokens=8, grammar=bad)),
                       "good": (chat_ids(engine, FREE[0]), SamplingParams(max_new_tokens=8))})
    assert [d.finish_reason for d in out["bad"]] == [FinishReason.ERROR]
    assert out["bad"][0].error is not None and "cannot be compiled for this model" in out["bad"][0].error
    assert "Paris" in text_of(out["good"]) and out["good"][-1].finish_reason is FinishReason.EOS


def test_abort_while_compiling_and_preemption_keep_the_engine_right(folder: Path) -> None:
    small = LLMEngine.from_options(folder, {"max_model_len": "512", "num_kv_blocks": "24", "block_size": "16",
                                            "max_rolling_batch_size": "8"})
    grammar = structured.json_schema(PERSON, "s")
    small.add("gone", chat_ids(small, TASKS[0]), SamplingParams(max_new_tokens=100, grammar=grammar))
    small.abort("gone")
    assert not small.has_work()
    requests = {f"p{i}": (chat_ids(small, TASKS[i % 4]), SamplingParams(max_new_tokens=150, grammar=grammar))
                for i in range(6)}
    out = run(small, requests)
    assert small.stats()["num_preemptions_total"] > 0  # 24 blocks of 16 tokens cannot hold six answers at once
    for deltas in out.values():
        jsonschema.validate(json.loads(text_of(deltas)), PERSON)
    assert small.stats()["kv_blocks_used"] == 0


def test_the_dynamic_handler_applies_the_same_constraint(folder: Path) -> None:
    handler = HuggingFaceHandler()
    handler.initialize(Context("smollm2", folder, {}))
    prompts = [handler.apply_chat_template([{"role": "user", "content": q}]) for q in TASKS[:2]]
    grammar = structured.json_schema(PERSON, "s")
    inputs: list[Any] = [Input(f"j{i}", p, SamplingParams(max_new_tokens=200, grammar=grammar))
                         for i, p in enumerate(prompts)]
    inputs.append(Input("free", prompts[0], SamplingParams(max_new_tokens=12)))
    inputs.append(Input("bad", prompts[0], SamplingParams(max_new_tokens=4, grammar=structured.grammar(
        "start: <[999999]>", "g"))))
    outputs = {o.request_id: o for o in handler.handle(inputs)}
    for rid in ("j0", "j1"):
        jsonschema.validate(json.loads(outputs[rid].text), PERSON)
    alone = handler.handle([Input("free", prompts[0], SamplingParams(max_new_tokens=12))])[0]
    assert outputs["free"].text == alone.text
    assert outputs["bad"].error is not None and "cannot be compiled for this model" in outputs["bad"].error
