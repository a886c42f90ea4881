"""LMI's schema over raw HTTP: whole answers, jsonlines and SSE token streams, tgi_compat shapes,
timing headers and last-event timings."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.integration.harness import ServerProcess

BODY = {"inputs": "The sky is", "parameters": {"max_new_tokens": 6, "details": True}}


@pytest.fixture(scope="module")
def formats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Two rolling models sharing one worker budget: SSE output formatter and TGI compatibility."""
    rb = {"option.entryPoint": "huggingface", "option.rolling_batch": "auto", "option.max_rolling_batch_size": "4"}
    server = ServerProcess.start(Path(tmp_path_factory.mktemp("formats")), models={
        "sse": {**rb, "option.output_formatter": "sse"}, "tgi": {**rb, "option.tgi_compat": "true"}},
        timeout_s=240)
    yield server
    server.stop()


def _lines(r: httpx.Response) -> list[dict]:  # type: ignore[type-arg]
    return [json.loads(line) for line in r.iter_lines() if line.strip()]


def _events(r: httpx.Response) -> list[dict]:  # type: ignore[type-arg]
    return [json.loads(line[len("data:"):]) for line in r.iter_lines() if line.startswith("data:")]


def test_jsonlines_stream_matches_whole(api_server: ServerProcess) -> None:
    url = f"{api_server.url}/predictions/tiny-rb"
    whole = httpx.post(url, json=BODY, timeout=60)
    assert whole.status_code == 200
    answer = whole.json()
    with httpx.stream("POST", url, json={**BODY, "stream": True}, timeout=60,
                      headers={"X-Request-Id": "lmi-stream-1"}) as r:
        assert r.headers["content-type"].startswith("application/jsonlines")
        assert r.headers["x-request-id"] == "lmi-stream-1"
        lines = _lines(r)
    assert "".join(line["token"]["text"] for line in lines) == answer["generated_text"]
    last = lines[-1]
    assert last["generated_text"] == answer["generated_text"]
    assert last["details"]["finish_reason"] == answer["details"]["finish_reason"]
    assert last["details"]["generated_tokens"] == len(lines) == last["timings"]["generated_tokens"]
    t = last["timings"]
    assert t["ttft_ms"] <= t["e2e_ms"] and t["queue_ms"] <= t["ttft_ms"]
    h = whole.headers
    assert float(h["x-ttft-ms"]) <= float(h["x-e2e-ms"])
    assert int(h["x-generated-tokens"]) == answer["details"]["generated_tokens"]


def test_list_inputs_on_dynamic_model(api_server: ServerProcess) -> None:
    r = httpx.post(f"{api_server.url}/predictions/tiny", json={"inputs": ["a b", "c d"], "parameters": {
        "max_new_tokens": 2}}, timeout=60)
    assert r.status_code == 200 and len(r.json()) == 2


def test_sse_output_formatter(formats_server: ServerProcess) -> None:
    with httpx.stream("POST", f"{formats_server.url}/predictions/sse", json={**BODY, "stream": True},
                      timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = _events(r)
    assert events and events[-1]["details"]["generated_tokens"] == len(events)
    assert "".join(e["token"]["text"] for e in events) == events[-1]["generated_text"]


def test_tgi_compat(formats_server: ServerProcess) -> None:
    r = httpx.post(f"{formats_server.url}/predictions/tgi", json=BODY, timeout=60)
    assert r.status_code == 200
    body = r.json()
    assert isinstance(body, list) and body[0]["details"]["finish_reason"] in ("length", "eos_token")
    with httpx.stream("POST", f"{formats_server.url}/predictions/tgi", json={**BODY, "stream": True},
                      timeout=60) as s:
        assert s.headers["content-type"].startswith("text/event-stream")
        events = _events(s)
    assert events[-1]["generated_text"] == body[0]["generated_text"]
    assert all(set(e["token"]) == {"id", "text", "logprob", "special"} for e in events if e.get("token"))
