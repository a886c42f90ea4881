"""The inter-token latency target through a real server (a rolling tiny llama): its measured default in
``GET /models/{name}``, the live knob (PUT), the steps over it in ``/metrics`` and each request's longest gap in
its timings, read through the openai SDK."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from openai.types import Completion

from tests.integration.harness import ServerProcess
from tests.integration.knob_server import error, gauge, put

ROLL = {"option.rolling_batch": "auto", "option.max_rolling_batch_size": "8", "option.max_model_len": "256"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    s = ServerProcess.start(tmp_path_factory.mktemp("itl"), models={"roll": ROLL})
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def _engine(server: ServerProcess) -> dict:
    engines = server.describe("roll")["batcher"]["engines"]
    assert len(engines) == 1
    return next(iter(engines.values()))


def _stream_timings(client: openai.OpenAI, n: int) -> tuple[list[str], dict]:
    stream = client.completions.create(model="roll", prompt="The quick brown fox", max_tokens=n, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert all(isinstance(c, Completion) for c in chunks)
    last = Completion.model_validate(chunks[-1].model_dump()).model_extra or {}  # the last chunk carries a finish
    return ["".join(ch.text for ch in c.choices) for c in chunks], last["timings"]


def test_the_default_is_measured_at_load_and_reported(server: ServerProcess) -> None:
    described = server.describe("roll")
    assert described["knobs"]["max_itl_ms"] == {"value": "auto", "source": "default", "from": "default",
                                                "applies": True}
    itl = described["itl_target"]  # from the worker's load, before any step
    assert itl["source"] == "auto" and itl["derived_ms"] > 0 and itl["max_itl_ms"] == itl["derived_ms"]
    assert itl["steps_over_total"] == 0


def test_a_request_reports_its_longest_gap(server: ServerProcess, client: openai.OpenAI) -> None:
    texts, timings = _stream_timings(client, 12)
    assert len([t for t in texts if t]) >= 2
    assert 0 < timings["max_itl_ms"] <= timings["decode_ms"]
    raw = client.completions.with_raw_response.create(model="roll", prompt="Hello", max_tokens=6, temperature=0,
                                                      extra_body={"ignore_eos": True})
    whole = Completion.model_validate(raw.parse().model_dump())
    assert whole.usage is not None and whole.usage.completion_tokens == 6
    assert 0 < float(raw.headers["X-Max-ITL-Ms"]) <= float(raw.headers["X-Decode-Time-Ms"])


def test_the_knob_changes_at_run_time_and_steps_over_it_are_counted(server: ServerProcess,
                                                                     client: openai.OpenAI) -> None:
    before = gauge(server, "rollserve_itl_target_exceeded_steps_total", "roll")
    r = put(server, "roll", max_itl_ms=1)  # no step of a model is that short: every gap runs over
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["changed"] == {"max_itl_ms": 1}
    assert [e["itl_target"]["max_itl_ms"] for e in answer["engines"].values()] == [1.0]
    assert answer["knobs"]["max_itl_ms"] == {"value": 1, "source": "API", "from": "API", "applies": True}
    _stream_timings(client, 16)
    steps = gauge(server, "rollserve_itl_target_exceeded_steps_total", "roll") - before
    assert steps >= 15  # each of the 15 gaps after the first token
    assert gauge(server, "rollserve_itl_target_excess_seconds_total", "roll") > 0
    assert _engine(server)["itl_over_target_steps_total"] >= steps
    r = put(server, "roll", max_itl_ms=0)  # off: nothing more is counted
    assert r.status_code == 200 and r.json()["engines"]["1"]["itl_target"]["max_itl_ms"] == 0
    off = gauge(server, "rollserve_itl_target_exceeded_steps_total", "roll")
    _stream_timings(client, 8)
    assert gauge(server, "rollserve_itl_target_exceeded_steps_total", "roll") == off


@pytest.mark.parametrize("value", ["-1", "abc", "1.5", "1000000000"])
def test_a_bad_target_is_a_400_naming_it(server: ServerProcess, value: str) -> None:
    r = httpx.put(f"{server.mgmt}/models/roll", params={"max_itl_ms": value}, headers=server.mgmt_headers,
                  timeout=60)
    error(r, 400, "max_itl_ms must be an integer >= 0")
    assert server.describe("roll")["knobs"]["max_itl_ms"]["source"] in ("default", "API")


def test_a_target_set_in_the_properties_is_the_engines(tmp_path: Path) -> None:
    s = ServerProcess.start(tmp_path, models={"roll": {**ROLL, "option.max_itl_ms": "750"}})
    try:
        described = s.describe("roll")
        assert described["knobs"]["max_itl_ms"]["value"] == 750
        assert described["knobs"]["max_itl_ms"]["source"] == "file"
        itl = described["itl_target"]
        assert itl["max_itl_ms"] == 750.0 and itl["source"] == "option" and itl["derived_ms"] > 0
    finally:
        s.stop()
