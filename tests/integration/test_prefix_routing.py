"""Prefix-aware routing over a model's two rolling workers (serving/batching/routing.py): a conversation's next
turn goes to the worker whose prefix cache holds its earlier turns even when least-loaded routing would pick the
other one; ``cache_salt`` keeps one salt's prefix blocks from another's; usage reports the engine's prefix hit."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.integration.harness import ServerProcess

MODEL = "chat"


@pytest.fixture
def server(two_workers_server: ServerProcess) -> ServerProcess:
    return two_workers_server  # conftest.py: the default model, two rolling workers with the prefix cache


def complete(server: ServerProcess, prompt: list[int], max_tokens: int = 4, **extra: Any) -> httpx.Response:
    r = httpx.post(f"{server.url}/v1/completions", headers=server.inference_headers, timeout=120, json={
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra})
    assert r.status_code == 200, r.text
    return r


def cached(r: httpx.Response) -> int:
    return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_the_next_turn_goes_to_the_worker_holding_the_conversation(server: ServerProcess) -> None:
    assert len(server.describe(MODEL)["workers"]) == 2
    turn1 = [11 + (i * 7) % 300 for i in range(70)]
    # a long answer holds one worker while the first turn arrives: least loaded, the turn goes to the other one
    with httpx.stream("POST", f"{server.url}/v1/completions", headers=server.inference_headers, timeout=120, json={
            "model": MODEL, "prompt": [5] * 40, "max_tokens": 48, "temperature": 0, "ignore_eos": True,
            "stream": True}) as busy:
        lines = busy.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # admitted: its worker is busy
        first = complete(server, turn1)
        assert [line for line in lines if line.startswith("data: ")][-1] == "data: [DONE]"
    holder = first.headers["X-Worker-Id"]
    assert cached(first) == 0
    unrelated = complete(server, [7] * 40)  # both idle, no prefix held: the tie goes to the other worker
    assert unrelated.headers["X-Worker-Id"] != holder
    # both workers idle now: least-loaded routing would pick the first one again; the prefix picks the holder
    second = complete(server, turn1 + [17, 18, 19, 20])
    assert second.headers["X-Worker-Id"] == holder
    assert cached(second) == 64  # the first turn's four full blocks (16 tokens each)
    assert server.describe(MODEL)["batcher"]["routing"]["routed_by_prefix_total"] >= 1


def test_a_salted_prompt_never_hits_another_salts_blocks(server: ServerProcess) -> None:
    prompt = [400 + (i * 13) % 200 for i in range(80)]
    # one user: every request goes to one worker, so only the salt can keep a request from the blocks
    first = complete(server, prompt, cache_salt="tenant-a", user="salt-test")
    same = complete(server, prompt, cache_salt="tenant-a", user="salt-test")
    other = complete(server, prompt, cache_salt="tenant-b", user="salt-test")
    unsalted = complete(server, prompt, user="salt-test")
    assert {r.headers["X-Worker-Id"] for r in (first, same, other, unsalted)} == {first.headers["X-Worker-Id"]}
    assert (cached(first), cached(other), cached(unsalted)) == (0, 0, 0)
    assert cached(same) == 64
    assert complete(server, prompt, cache_salt="tenant-b", user="salt-test").json()["usage"][
        "prompt_tokens_details"] == {"cached_tokens": 64}


@pytest.mark.parametrize(("body", "field"), [({"cache_salt": ""}, "cache_salt"), ({"cache_salt": 7}, "cache_salt"),
                                             ({"cache_salt": "x" * 257}, "cache_salt"),
                                             ({"prompt_cache_key": ["k"]}, "prompt_cache_key")])
def test_bad_cache_fields_are_400s_naming_them(server: ServerProcess, body: dict[str, Any], field: str) -> None:
    r = httpx.post(f"{server.url}/v1/chat/completions", headers=server.inference_headers, timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    assert field in r.text
