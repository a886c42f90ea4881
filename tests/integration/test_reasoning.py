"""Reasoning kept apart from the answer, on a thinking model built from the real SmolLM2: its chat template opens
``<think>`` at the start of every answer (DeepSeek-R1's style), and a conversation whose earlier answers think
then answer leads the model to do the same (greedy). ``thinker-raw`` is the same model with
``option.reasoning_parser=none``: its text, split at ``</think>``, is what the parser must return."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import jsonschema
import openai
import pytest

from tests.integration.harness import ServerProcess
from tests.real_model import smollm2_folder

TURNS = [{"role": "user", "content": "What is 2 plus 3?"},
         {"role": "assistant", "content": "<think>\n2 plus 3 is 5.\n</think>\nThe answer is 5."},
         {"role": "user", "content": "What is 4 plus 4?"},
         {"role": "assistant", "content": "<think>\n4 plus 4 is 8.\n</think>\nThe answer is 8."}]
QUESTIONS = ["What is 3 plus 3?", "What is 1 plus 6?"]
ANSWER = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
          "additionalProperties": False}


def thinking_folder(root: Path) -> Path:
    """SmolLM2 with a chat template that opens the reasoning in the prompt (weights linked, not copied)."""
    src = smollm2_folder()
    folder = root / "thinker"
    folder.mkdir()
    for f in src.iterdir():
        if f.name != "chat_template.jinja":
            os.symlink(f, folder / f.name)
    template = (src / "chat_template.jinja").read_text()
    opened = template.replace("{{ '<|im_start|>assistant\n' }}", "{{ '<|im_start|>assistant\n<think>\n' }}")
    assert opened != template
    (folder / "chat_template.jinja").write_text(opened)
    return folder


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = thinking_folder(tmp_path_factory.mktemp("thinking"))
    rolling = {"option.rolling_batch": "auto", "option.max_rolling_batch_size": "4", "option.max_model_len": "1024",
               "option.kv_cache_populate": "lazy"}
    srv = ServerProcess.start(tmp_path_factory.mktemp("reasoning"), models={
        "thinker": rolling, "thinker-raw": {**rolling, "option.reasoning_parser": "none"}},
        sources={"thinker": folder, "thinker-raw": folder}, timeout_s=600)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=300)


def chat(client: openai.OpenAI, question: str, model: str = "thinker", **kw: Any) -> Any:
    return client.chat.completions.create(model=model, temperature=0, max_tokens=60,
                                          messages=[*TURNS, {"role": "user", "content": question}], **kw)


def raw_parts(client: openai.OpenAI, question: str) -> tuple[str, str]:
    """The model's own text (no parser), split where it closed its reasoning."""
    text = chat(client, question, "thinker-raw").choices[0].message.content
    assert text.count("</think>") == 1, text  # the model does think, then answers
    thought, answer = text.split("</think>")
    return thought, answer.lstrip()


@pytest.mark.parametrize("question", QUESTIONS)
def test_chat_answers_carry_the_reasoning_apart(client: openai.OpenAI, question: str) -> None:
    thought, answer = raw_parts(client, question)
    whole = chat(client, question)
    message = whole.choices[0].message
    assert (message.reasoning_content, message.content) == (thought, answer)  # type: ignore[attr-defined]
    details = whole.usage.completion_tokens_details  # type: ignore[union-attr]
    assert details is not None and 0 < details.reasoning_tokens < whole.usage.completion_tokens  # type: ignore[union-attr]
    chunks = list(chat(client, question, stream=True, stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    streamed_thought = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert (streamed_thought, streamed) == (thought, answer)
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == details.reasoning_tokens  # type: ignore


def test_a_json_schema_applies_after_the_reasoning(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}}
    for question in QUESTIONS:
        thought, _ = raw_parts(client, question)
        message = chat(client, question, response_format=fmt).choices[0].message
        assert message.reasoning_content == thought  # type: ignore[attr-defined]  # the thinking stayed free
        jsonschema.validate(json.loads(message.content), ANSWER)
        streamed = list(chat(client, question, response_format=fmt, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == message.content


def test_a_model_without_the_parser_answers_the_raw_text(client: openai.OpenAI) -> None:
    message = chat(client, QUESTIONS[0], "thinker-raw").choices[0].message
    assert "</think>" in message.content and getattr(message, "reasoning_content", None) is None


def test_messages_answers_carry_thinking_blocks(server: ServerProcess, client: openai.OpenAI) -> None:
    thought, answer = raw_parts(client, QUESTIONS[0])
    claude = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=300)
    kw: Any = dict(model="thinker", max_tokens=60, messages=[*TURNS, {"role": "user", "content": QUESTIONS[0]}],
                   extra_body={"temperature": 0})
    message = claude.messages.create(**kw)
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in message.content] == [
        ("thinking", thought), ("text", answer)]
    with claude.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in message.content]


def test_responses_answers_carry_a_reasoning_item(client: openai.OpenAI) -> None:
    thought, answer = raw_parts(client, QUESTIONS[0])
    response = client.responses.create(model="thinker", input=[*TURNS, {"role": "user", "content": QUESTIONS[0]}],
                                       temperature=0, max_output_tokens=60)
    kinds = [item.type for item in response.output]
    assert kinds == ["reasoning", "message"]
    reasoning = response.output[0]
    assert "".join(c.text for c in reasoning.content or ()) == thought  # type: ignore[union-attr]
    assert response.output_text == answer
    assert response.usage is not None and response.usage.output_tokens_details.reasoning_tokens > 0
    events = list(client.responses.create(model="thinker", input=[*TURNS, {"role": "user", "content": QUESTIONS[0]}],
                                          temperature=0, max_output_tokens=60, stream=True))
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == thought
