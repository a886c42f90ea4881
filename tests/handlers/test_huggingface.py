"""HuggingFaceHandler against a synthetic local Llama: batching exactness, stop, seed, EOS, details,
per-item failure isolation."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from handlers.base import Context, Input, Output
from handlers.huggingface import HuggingFaceHandler
from rollcore.errors import ErrorKind
from rollcore.types import FinishReason, SamplingParams

PROMPTS = [
    "Hello world",
    "The model server is fast and",
    "a",
    "Deep learning language generate answer question hello world data time fast slow small large",
    "東京 数据 模型 😀",
    "one two three four",
    "stop start ready, the request queue",
    "Batch rolling dynamic cache block sequence prefill decode worker stream",
]


@pytest.fixture(scope="module")
def handler(llama_dir: Path) -> HuggingFaceHandler:
    h = HuggingFaceHandler()
    h.initialize(Context(model_name="llama", model_dir=llama_dir, properties={"num_threads": "1"}))
    return h


def generate_alone(h: HuggingFaceHandler, prompt: str, max_new_tokens: int) -> list[int]:
    """Reference: plain transformers greedy generate of one unpadded prompt, cut after EOS."""
    enc = h.tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        seq = h.model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=2)
    ids = seq[0, enc["input_ids"].shape[1]:].tolist()
    return ids[:ids.index(2) + 1] if 2 in ids else ids


def ask(h: HuggingFaceHandler, prompt: str, **params: Any) -> Output:
    [out] = h.handle([Input(request_id="r", prompt=prompt, params=SamplingParams(**params))])
    assert out.error is None, out.error
    return out


def ids(out: Output) -> list[int]:
    return [t.id for t in out.tokens]


def test_describe(handler: HuggingFaceHandler) -> None:
    info = handler.describe()
    assert info["max_model_len"] == 2048
    assert info["eos_token_id"] == 2
    assert info["vocab_size"] == 1024
    assert "<|im_start|>" in info["chat_template"]


def test_greedy_alone_equals_model_generate(handler: HuggingFaceHandler) -> None:
    out = ask(handler, PROMPTS[1], max_new_tokens=24)
    assert ids(out) == generate_alone(handler, PROMPTS[1], 24)
    assert out.prompt_tokens == len(handler.tokenizer(PROMPTS[1])["input_ids"])
    assert out.text == handler.tokenizer.decode(ids(out), skip_special_tokens=True)
    assert "".join(t.text for t in out.tokens) == out.text
    assert out.finish_reason is FinishReason.LENGTH


def test_greedy_in_batch_of_8_equals_alone(handler: HuggingFaceHandler) -> None:
    lengths = {len(handler.tokenizer(p)["input_ids"]) for p in PROMPTS}
    assert len(lengths) >= 6  # really different lengths, so left padding is exercised
    outs = handler.handle([Input(str(i), p, SamplingParams(max_new_tokens=24)) for i, p in enumerate(PROMPTS)])
    assert [o.request_id for o in outs] == [str(i) for i in range(len(PROMPTS))]
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert ids(out) == generate_alone(handler, prompt, 24), prompt


def test_different_max_new_tokens_share_a_batch(handler: HuggingFaceHandler) -> None:
    outs = handler.handle([Input("a", PROMPTS[0], SamplingParams(max_new_tokens=5)),
                           Input("b", PROMPTS[0], SamplingParams(max_new_tokens=12))])
    assert len(outs[0].tokens) == 5 and len(outs[1].tokens) == 12
    assert ids(outs[0]) == ids(outs[1])[:5]
    assert outs[0].finish_reason is outs[1].finish_reason is FinishReason.LENGTH


def test_stop_sequence_truncates_text_and_tokens(handler: HuggingFaceHandler) -> None:
    full = ask(handler, PROMPTS[5], max_new_tokens=24)
    # A stop string that first appears mid-answer: the text of a token past the beginning.
    k, stop = next((k, t.text) for k, t in enumerate(full.tokens)
                   if k >= 3 and len(t.text.strip()) >= 2 and t.text not in "".join(x.text for x in full.tokens[:k]))
    out = ask(handler, PROMPTS[5], max_new_tokens=24, stop=(stop, "never-appears-xyz"))
    assert out.finish_reason is FinishReason.STOP
    assert out.text == full.text[:full.text.index(stop)]
    assert ids(out) == ids(full)[:k + 1]


def test_stop_sequence_across_token_boundary(handler: HuggingFaceHandler) -> None:
    full = ask(handler, PROMPTS[7], max_new_tokens=24)
    pieces = [t.text for t in full.tokens]
    k = next(k for k in range(3, len(pieces) - 1) if pieces[k] and pieces[k + 1])
    stop = pieces[k][-1] + pieces[k + 1][0]  # completed only by token k + 1
    start = full.text.index(stop)
    out = ask(handler, PROMPTS[7], max_new_tokens=24, stop=(stop,))
    assert out.finish_reason is FinishReason.STOP
    assert out.text == full.text[:start]
    covered = len("".join(pieces[:len(out.tokens)]))
    assert covered >= start + len(stop) > len("".join(pieces[:len(out.tokens) - 1]))


def test_stop_token_ids(handler: HuggingFaceHandler) -> None:
    full = ask(handler, PROMPTS[5], max_new_tokens=16)
    stop_id = ids(full)[4]
    k = ids(full).index(stop_id)  # its first occurrence
    out = ask(handler, PROMPTS[5], max_new_tokens=16, stop_token_ids=(stop_id,))
    assert out.finish_reason is FinishReason.STOP
    assert ids(out) == ids(full)[:k + 1]
    # The stop token's own text is not part of the answer (as vLLM and the rolling engine).
    assert out.text == handler.tokenizer.decode(ids(full)[:k], skip_special_tokens=True,
                                                clean_up_tokenization_spaces=False)


def test_seed_reproducible(handler: HuggingFaceHandler) -> None:
    def sample(seed: int) -> list[int]:
        return ids(ask(handler, PROMPTS[0], max_new_tokens=16, do_sample=True, temperature=1.0, seed=seed))

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_eos_ends_generation_unless_ignored(handler: HuggingFaceHandler) -> None:
    # The random model almost never emits its real EOS, so make its usual first token the EOS of a copy.
    first = generate_alone(handler, PROMPTS[2], 1)[0]
    h = copy.copy(handler)
    h.eos_token_ids = frozenset({first})
    stopped = ask(h, PROMPTS[2], max_new_tokens=10)
    assert stopped.finish_reason is FinishReason.EOS
    assert ids(stopped) == [first]
    ignored = ask(h, PROMPTS[2], max_new_tokens=10, ignore_eos=True)
    assert ignored.finish_reason is FinishReason.LENGTH
    assert len(ignored.tokens) == 10
    # As vLLM (and the rolling engine): EOS may be generated and does not end the row.
    assert ids(ignored)[0] == first


def test_details_and_logprobs(handler: HuggingFaceHandler) -> None:
    plain = ask(handler, PROMPTS[3], max_new_tokens=8)
    assert all(t.logprob is None and t.top_logprobs == () for t in plain.tokens)
    out = ask(handler, PROMPTS[3], max_new_tokens=8, details=True, logprobs=3)
    assert ids(out) == ids(plain)
    for t in out.tokens:
        assert t.logprob is not None and t.logprob <= 0
        assert len(t.top_logprobs) == 3
        assert [lp for _, lp in t.top_logprobs] == sorted((lp for _, lp in t.top_logprobs), reverse=True)
        assert t.top_logprobs[0] == (t.id, pytest.approx(t.logprob))  # greedy picks the most likely token


def test_return_full_text_and_token_ids_prompt(handler: HuggingFaceHandler) -> None:
    out = ask(handler, PROMPTS[0], max_new_tokens=6, return_full_text=True)
    alone = ask(handler, PROMPTS[0], max_new_tokens=6)
    assert out.text == PROMPTS[0] + alone.text
    prompt_ids = tuple(handler.tokenizer(PROMPTS[0])["input_ids"])
    [by_ids] = handler.handle([Input("t", "", SamplingParams(max_new_tokens=6), prompt_token_ids=prompt_ids)])
    assert ids(by_ids) == ids(alone)


def test_bad_items_fail_alone(handler: HuggingFaceHandler) -> None:
    outs = handler.handle([
        Input("ok1", PROMPTS[0], SamplingParams(max_new_tokens=6)),
        Input("empty", "", SamplingParams(max_new_tokens=6)),
        Input("long", PROMPTS[1], SamplingParams(max_new_tokens=2045)),
        Input("ok2", PROMPTS[1], SamplingParams(max_new_tokens=6)),
    ])
    assert [o.request_id for o in outs] == ["ok1", "empty", "long", "ok2"]
    assert outs[1].error_kind is ErrorKind.INVALID and "inputs" in (outs[1].error or "")
    num_prompt = len(handler.tokenizer(PROMPTS[1])["input_ids"])
    assert outs[2].error_kind is ErrorKind.INVALID
    assert f"{num_prompt} tokens" in (outs[2].error or "") and "2045" in (outs[2].error or "")
    assert outs[1].finish_reason is outs[2].finish_reason is FinishReason.ERROR
    assert ids(outs[0]) == generate_alone(handler, PROMPTS[0], 6)
    assert ids(outs[3]) == generate_alone(handler, PROMPTS[1], 6)


def test_failing_group_does_not_fail_other_groups(handler: HuggingFaceHandler,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    real_generate = handler.model.generate

    def generate(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("do_sample"):
            raise RuntimeError("sampler exploded")
        return real_generate(*args, **kwargs)

    monkeypatch.setattr(handler.model, "generate", generate)
    outs = handler.handle([Input("greedy", PROMPTS[0], SamplingParams(max_new_tokens=4)),
                           Input("sampled", PROMPTS[0], SamplingParams(max_new_tokens=4, do_sample=True))])
    assert outs[0].error is None and len(outs[0].tokens) == 4
    assert outs[1].error_kind is ErrorKind.HANDLER and "sampler exploded" in (outs[1].error or "")


def test_chat_template(handler: HuggingFaceHandler) -> None:
    prompt = handler.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_mixed_sampling_parameters_in_one_batch_each_equal_their_solo_result(handler: HuggingFaceHandler) -> None:
    """Greedy, seeded sampling (two requests sharing every sampling parameter, seed included), stop strings and
    different temperatures in one dynamic batch: each item's answer is the one it gets alone."""
    stop_probe = ask(handler, PROMPTS[3], max_new_tokens=16)
    stop = stop_probe.text[len(stop_probe.tokens[0].text) + 1:][:3]  # text the greedy answer reaches later
    assert stop.strip(), stop_probe.text

    def sampled(temperature: float, seed: int, **kw: Any) -> SamplingParams:
        return SamplingParams(max_new_tokens=12, do_sample=True, temperature=temperature, seed=seed, **kw)

    mixed = [
        (PROMPTS[1], SamplingParams(max_new_tokens=12)),
        (PROMPTS[0], sampled(1.8, 7, top_k=50)),
        (PROMPTS[5], sampled(1.8, 7, top_k=50)),
        (PROMPTS[3], SamplingParams(max_new_tokens=16, stop=(stop,))),
        (PROMPTS[6], sampled(2.0, 3, top_p=0.9)),  # the top of the range: the most varied draws
        (PROMPTS[7], sampled(2.0, 11, repetition_penalty=1.2)),
        (PROMPTS[2], SamplingParams(max_new_tokens=10)),
    ]
    batch = handler.handle([Input(f"m{i}", p, params) for i, (p, params) in enumerate(mixed)])
    assert [o.request_id for o in batch] == [f"m{i}" for i in range(len(mixed))]
    for (prompt, params), out in zip(mixed, batch, strict=True):
        [alone] = handler.handle([Input("solo", prompt, params)])
        assert out.error is None and alone.error is None, (out.error, alone.error)
        assert (ids(out), out.text, out.finish_reason) == (ids(alone), alone.text, alone.finish_reason), \
            (prompt, params)
    assert batch[3].finish_reason is FinishReason.STOP and stop not in batch[3].text
    for k in (1, 2, 4, 5):  # the sampled items really sampled: not their greedy answer
        prompt, params = mixed[k]
        assert ids(batch[k]) != ids(ask(handler, prompt, max_new_tokens=12)), prompt
