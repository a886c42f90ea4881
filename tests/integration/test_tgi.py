"""The TGI routes through the real ``text-generation`` client, plus raw ``/generate`` and ``/info``."""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest

from tests.integration.harness import ServerProcess

text_generation = pytest.importorskip("text_generation")


def test_client_generate_and_stream_agree(api_server: ServerProcess) -> None:
    client = text_generation.Client(f"{api_server.url}?model_name=tiny-rb", timeout=60)
    whole = client.generate("Hello world", max_new_tokens=6, decoder_input_details=True)
    assert whole.details.generated_tokens == len(whole.details.tokens) <= 6
    assert whole.details.prefill and whole.details.prefill[0].id == 1  # BOS
    events = list(client.generate_stream("Hello world", max_new_tokens=6))
    assert "".join(e.token.text for e in events) == events[-1].generated_text == whole.generated_text
    assert all(e.details is None for e in events[:-1])
    assert events[-1].details is not None
    assert events[-1].details.finish_reason.value == whole.details.finish_reason.value


def test_async_client_on_dynamic_model(api_server: ServerProcess) -> None:
    client = text_generation.AsyncClient(f"{api_server.url}?model_name=tiny", timeout=60)
    answer = asyncio.run(client.generate("Hello world", max_new_tokens=4, stop_sequences=["zzz"]))
    assert answer.details.generated_tokens <= 4


def test_client_maps_errors(api_server: ServerProcess) -> None:
    client = text_generation.Client(f"{api_server.url}?model_name=tiny", timeout=60)
    with pytest.raises(text_generation.errors.ValidationError, match="rolling_batch"):
        list(client.generate_stream("Hello", max_new_tokens=2))
    with pytest.raises(text_generation.errors.ValidationError, match="max_new_tokens"):
        client.generate("Hello", max_new_tokens=100000)


def test_generate_raw_and_info(api_server: ServerProcess) -> None:
    r = httpx.post(f"{api_server.url}/generate?model_name=tiny", json={
        "inputs": "Hello world", "parameters": {"max_new_tokens": 3, "details": True, "top_n_tokens": 2,
                                                "grammar": None, "watermark": False}}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["details"]["generated_tokens"] == int(r.headers["x-generated-tokens"])
    assert all(len(top) == 2 for top in body["details"]["top_tokens"])
    # a constraint holds whatever the weights (structured output): random weights, text of the pattern only
    r = httpx.post(f"{api_server.url}/generate?model_name=tiny", json={
        "inputs": "Hello", "parameters": {"grammar": {"type": "regex", "value": "(ab|c)+"}, "max_new_tokens": 6}},
        timeout=60)
    assert r.status_code == 200, r.text
    assert re.fullmatch(r"(ab|c)*a?", r.json()["generated_text"]), r.text  # cut by max_new_tokens anywhere
    r = httpx.post(f"{api_server.url}/generate?model_name=tiny", json={
        "inputs": "Hello", "parameters": {"grammar": {"type": "regex", "value": "(a"}}}, timeout=60)
    assert r.status_code == 422 and "'grammar.value' cannot be used as a constraint" in r.json()["error"], r.text
    # truncate keeps the last tokens: a long prompt truncated fits and answers
    r = httpx.post(f"{api_server.url}/generate?model_name=tiny", json={
        "inputs": "word " * 3000, "parameters": {"max_new_tokens": 2, "truncate": 10, "details": True}},
        timeout=60)
    assert r.status_code == 200, r.text
    assert int(r.headers["x-prompt-tokens"]) == 10
    info = httpx.get(f"{api_server.url}/info?model_name=tiny-rb", timeout=10).json()
    assert info["model_id"] == "tiny-rb" and info["max_total_tokens"] == 2048 and info["rolling_batch"]
