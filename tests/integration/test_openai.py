"""The OpenAI routes through the real ``openai`` SDK (sync and async), answers validated against the
SDK's own pydantic types."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from openai.types import Completion, CompletionUsage
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from tokenizers import Tokenizer

from tests.byte_level import byte_ids
from tests.integration.harness import DEFAULT_MODEL, ServerProcess

MSGS = [{"role": "user", "content": "Tell me a story"}]


@pytest.fixture(scope="module")
def client(api_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=api_server.url + "/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def aclient(api_server: ServerProcess) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=api_server.url + "/v1", api_key="none", max_retries=0, timeout=60)


def test_models_lists_every_model(client: openai.OpenAI) -> None:
    ids = {m.id for m in client.models.list().data}
    assert {"tiny", "tiny-rb", "echo"} <= ids


@pytest.mark.parametrize("model", ["tiny", "tiny-rb"])
def test_completion_whole(client: openai.OpenAI, model: str) -> None:
    raw = client.completions.with_raw_response.create(model=model, prompt="Hello world", max_tokens=5,
                                                      temperature=0)
    c = raw.parse()
    Completion.model_validate(c.model_dump())
    assert c.object == "text_completion" and c.model == model
    assert c.choices[0].finish_reason in ("stop", "length")
    assert c.usage is not None and c.usage.completion_tokens <= 5
    assert c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
    h = raw.headers
    assert h["x-request-id"] and int(h["x-generated-tokens"]) == c.usage.completion_tokens
    assert float(h["x-ttft-ms"]) <= float(h["x-e2e-ms"])


def test_completion_stream_equals_whole_for_greedy(client: openai.OpenAI) -> None:
    kw = dict(model="tiny-rb", prompt="The quick brown fox", max_tokens=8, temperature=0,
              extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw)  # type: ignore[call-overload]
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True},
                                            **kw))  # type: ignore[call-overload]
    for ch in chunks:  # the SDK types a chunk as Completion, whose finish_reason may not be null
        if not ch.choices or ch.choices[0].finish_reason:
            Completion.model_validate(ch.model_dump())
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 8
    finals = [ch for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "length"
    timings = finals[0].model_extra["timings"]  # type: ignore[index]
    assert timings["ttft_ms"] <= timings["e2e_ms"] and timings["generated_tokens"] == 8


def test_chat_whole_and_stream_agree(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model="tiny-rb", messages=MSGS, max_completion_tokens=6,  # type: ignore
                                           temperature=0, seed=1)
    ChatCompletion.model_validate(whole.model_dump())
    assert whole.choices[0].message.role == "assistant"
    CompletionUsage.model_validate(whole.usage.model_dump())  # type: ignore[union-attr]
    stream = client.chat.completions.create(model="tiny-rb", messages=MSGS, max_tokens=6,  # type: ignore
                                            temperature=0, stream=True)
    chunks = list(stream)
    for ch in chunks:
        ChatCompletionChunk.model_validate(ch.model_dump())
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_chat_on_dynamic_model_and_through_invocations(api_server: ServerProcess, client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=4, temperature=0)  # type: ignore
    ChatCompletion.model_validate(whole.model_dump())
    r = httpx.post(f"{api_server.url}/invocations?model_name=tiny",
                   json={"messages": MSGS, "max_tokens": 4, "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    assert ChatCompletion.model_validate(r.json()).choices[0].message.content == whole.choices[0].message.content


def test_n_logprobs_stop_and_token_prompts(client: openai.OpenAI) -> None:
    c = client.completions.create(model="tiny-rb", prompt=[[1, 572, 532], [1, 572, 532]], max_tokens=3, n=2,
                                  temperature=0, logprobs=2)
    assert sorted(ch.index for ch in c.choices) == [0, 1, 2, 3]
    # token ids [1, 572, 532] are "Hello world" with BOS: the same greedy answer
    text = client.completions.create(model="tiny-rb", prompt="Hello world", max_tokens=3, temperature=0)
    assert {ch.text for ch in c.choices} == {text.choices[0].text}
    lp = c.choices[0].logprobs
    assert lp is not None and lp.token_logprobs and len(lp.top_logprobs or []) == len(lp.tokens or [])
    chat = client.chat.completions.create(model="tiny-rb", messages=MSGS, max_tokens=3, temperature=0,  # type: ignore
                                          logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content and all(len(t.top_logprobs) == 2 for t in content)


@pytest.mark.parametrize(("words", "completed"), [("The quick brown fox", False), ("Tell me a story about", True)])
def test_token_id_prompt_ending_inside_a_character_leaks_no_prompt_text(client: openai.OpenAI, words: str,
                                                                         completed: bool) -> None:
    """A token-id prompt ending with the first two bytes of '東' (E6 9D): the rolling engine's completion holds
    only the generated tokens' text, streamed or whole (it used to start with the prompt's last words). The
    dynamic-batching model (HF generate) decodes the generated ids alone; so do we, except that when the greedy
    first token is a byte completing the prompt's character (E6 9D AB, U+676B, after the second prompt), we
    release that character where decoding the generated ids alone gives U+FFFD."""
    tokenizer = Tokenizer.from_file(str(DEFAULT_MODEL / "tokenizer.json"))
    prompt = [1, *tokenizer.encode(words, add_special_tokens=False).ids, *byte_ids(tokenizer, "東")[:2]]
    assert tokenizer.decode(prompt) == words + "\ufffd"
    kw = dict(prompt=prompt, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(model="tiny-rb", **kw)  # type: ignore[call-overload]
    chunks = client.completions.create(model="tiny-rb", stream=True, **kw)  # type: ignore[call-overload]
    streamed = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    dynamic = client.completions.create(model="tiny", **kw).choices[0].text  # type: ignore[call-overload]
    assert whole.usage is not None and whole.usage.completion_tokens == 8
    assert len(dynamic) >= 4 and words.split()[-1] not in dynamic
    if completed:
        assert dynamic[0] == "\ufffd" and whole.choices[0].text == streamed == "\u676b" + dynamic[1:]
    else:
        assert "\ufffd" not in dynamic and whole.choices[0].text == streamed == dynamic


def test_sdk_errors(client: openai.OpenAI) -> None:
    # rollserve's error body is {"error": message, "error_type", "request_id"}: the SDK puts the message in .body
    with pytest.raises(openai.NotFoundError) as e1:
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    assert "nope" in str(e1.value.body)
    with pytest.raises(openai.BadRequestError) as e2:
        list(client.completions.create(model="tiny", prompt="x", max_tokens=2, stream=True))
    assert "option.rolling_batch" in str(e2.value.body)
    with pytest.raises(openai.BadRequestError) as e3:
        client.chat.completions.create(model="echo", messages=MSGS)  # type: ignore[arg-type]
    assert "chat template" in str(e3.value.body)
    with pytest.raises(openai.BadRequestError) as e4:
        client.completions.create(model="tiny", prompt="x", extra_body={"min_p": 1.5})
    assert "'min_p' must be >= 0 and <= 1, got 1.5" in str(e4.value.body)
    # the vLLM extensions are accepted at their neutral values
    c = client.completions.create(model="tiny", prompt="x", max_tokens=2, temperature=0,
                                  extra_body={"min_p": 0, "top_k": -1, "repetition_penalty": 1.0,
                                              "stop_token_ids": [], "ignore_eos": True})
    assert c.usage is not None and c.usage.completion_tokens == 2


def test_async_client_concurrent_streams(aclient: openai.AsyncOpenAI) -> None:
    async def one(i: int) -> tuple[str, str]:
        whole = await aclient.completions.create(model="tiny-rb", prompt=f"Number {i}", max_tokens=5,
                                                 temperature=0, extra_body={"ignore_eos": True})
        parts = []
        async for ch in await aclient.completions.create(model="tiny-rb", prompt=f"Number {i}", max_tokens=5,
                                                         temperature=0, stream=True,
                                                         extra_body={"ignore_eos": True}):
            parts.extend(c.text for c in ch.choices)
        return whole.choices[0].text, "".join(parts)

    async def run() -> list[tuple[str, str]]:
        return await asyncio.gather(*(one(i) for i in range(3)))

    for whole, streamed in asyncio.run(run()):
        assert whole == streamed
