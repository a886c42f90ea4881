"""/metrics of a real server (echo models): families move as requests flow, a full queue moves the rejected
counter, the separate metrics address serves the same registry, request logs are JSON lines with request
id and model and no prompt."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from serving.bench.launch import wait_for
from tests.integration.harness import ServerProcess

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
SECRET = "zebra-quartz-prompt-marker"


def scrape(url: str, headers: dict[str, str] | None = None) -> Samples:
    text = httpx.get(url + "/metrics", headers=headers, timeout=10).text
    return {(s.name, frozenset(s.labels.items())): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    """A sample by its labels; a model's series carry its ``version`` (1 here; empty for ``__unknown__``)."""
    if "model" in labels:
        labels.setdefault("version", "" if labels["model"] == "__unknown__" else "1")
    return samples.get((name, frozenset(labels.items())), 0.0)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    s = ServerProcess.start(
        tmp_path_factory.mktemp("metrics"),
        models={"echo": {"option.entryPoint": "echo", "batch_size": "4", "max_batch_delay": "5"},
                "slow": {"option.entryPoint": "echo", "option.echo_delay_ms": "400", "batch_size": "1",
                         "job_queue_size": "2"}},
        config={"metrics_address": "http://127.0.0.1:0"}, extra_args=["--log-format", "json"])
    yield s
    s.stop()


def test_families_move_as_requests_flow(server: ServerProcess) -> None:
    before = scrape(server.mgmt, server.mgmt_headers)
    with httpx.Client(timeout=30) as c:
        for _ in range(7):
            assert c.post(server.url + "/predictions/echo", json={"inputs": f"{SECRET} two three"}).status_code == 200
        assert c.post(server.url + "/predictions/echo", content=b"{not json").status_code == 400
        assert c.post(server.url + "/predictions/no-such-model", json={"inputs": "x"}).status_code == 404
    after = scrape(server.mgmt, server.mgmt_headers)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("rollserve_requests_total", model="echo", status_class="2xx") == 7
    assert moved("rollserve_requests_total", model="echo", status_class="4xx") == 1
    assert moved("rollserve_requests_total", model="__unknown__", status_class="4xx") == 1
    assert moved("rollserve_requests_rejected_total", model="echo", reason="invalid") == 1
    for family in ("rollserve_e2e_request_latency_seconds", "rollserve_request_queue_time_seconds",
                   "rollserve_time_to_first_token_seconds"):
        assert moved(family + "_count", model="echo") == 7, family
    assert moved("rollserve_prompt_tokens_total", model="echo") == 21
    assert moved("rollserve_generation_tokens_total", model="echo") == 21
    assert moved("rollserve_batch_size_sum", model="echo") == 7
    assert value(after, "rollserve_workers", model="echo", state="ready") == 1
    assert value(after, "rollserve_model_state", model="echo", state="READY") == 1
    assert value(after, "rollserve_model_load_time_seconds", model="echo") > 0
    # the separate metrics address serves the same registry
    other = scrape(f"http://127.0.0.1:{server.ports['metrics']}")
    assert value(other, "rollserve_requests_total", model="echo", status_class="2xx") >= 7


def test_full_queue_moves_the_rejected_counter(server: ServerProcess) -> None:
    before = scrape(server.mgmt, server.mgmt_headers)
    with ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(lambda i: httpx.post(server.url + "/predictions/slow", json={"inputs": "a"},
                                                   timeout=30).status_code, range(8)))
    full = codes.count(503)
    assert full >= 1 and codes.count(200) + full == 8, codes
    after = scrape(server.mgmt, server.mgmt_headers)
    moved = (value(after, "rollserve_requests_rejected_total", model="slow", reason="queue_full")
             - value(before, "rollserve_requests_rejected_total", model="slow", reason="queue_full"))
    assert moved == full
    assert value(after, "rollserve_requests_total", model="slow", status_class="5xx") >= full


def test_request_logs_are_json_with_request_id_and_model_and_no_prompt(server: ServerProcess) -> None:
    httpx.post(server.url + "/predictions/echo", json={"inputs": f"{SECRET} again"},
               headers={"X-Request-Id": "log-check-1"}, timeout=30)

    def request_lines() -> list[dict[str, Any]]:
        lines = [json.loads(line) for line in Path(server.log_path or "").read_text().splitlines()
                 if line.startswith("{")]
        return [rec for rec in lines if rec.get("name") == "serving.requests"]

    # the access line is written once the answer has gone out: wait for it, not for a time
    wait_for(lambda: any(rec.get("request_id") == "log-check-1" and rec.get("model") == "echo"
                         for rec in request_lines()), "the request's log line", timeout_s=30)
    assert all(rec.get("request_id") and rec.get("model") for rec in request_lines())
    assert SECRET not in server.log()
