"""DJL Serving's shapes, as its own integration-test client and output formatter read them: the model description
(``res[0]["models"][0]["workerGroups"][0]["workers"]``), the management reads on the inference port behind the
management token, ``/models/{name}/invoke``, ``X-Request-Id`` on every answer, token log-probabilities always a
number in streams, jsonlines streaming without ``stream`` on a rolling model, ``stream`` answered whole by a
dynamic-batching model, and tgi_compat answers in TGI's shape with details."""

from __future__ import annotations

import datetime
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.integration.harness import ServerProcess

ROLLING = {"option.rolling_batch": "auto", "option.max_rolling_batch_size": "4"}
BODY = {"inputs": "The sky is", "parameters": {"max_new_tokens": 5}}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = ServerProcess.start(Path(tmp_path_factory.mktemp("djl")), models={
        "jsonl": {**ROLLING, "option.output_formatter": "jsonlines", "minWorkers": "2", "maxWorkers": "2"},
        "tgi": {**ROLLING, "option.tgi_compat": "true"},
        "dyn": {"batch_size": "2", "max_batch_delay": "10"}}, timeout_s=300)
    try:
        yield srv
    finally:
        srv.stop()


def check_worker_number(url: str, headers: dict[str, str], desired: int) -> None:
    """DJL's client check (tests/integration/llm/client.py): either count works."""
    res = httpx.get(url, headers=headers, timeout=10).json()
    assert desired in (len(res[0]["models"][0]["workerGroups"]), len(res[0]["models"][0]["workerGroups"][0]["workers"]))


def test_describe_is_djls_list_of_workflows(server: ServerProcess) -> None:
    check_worker_number(f"{server.mgmt}/models/jsonl", server.mgmt_headers, 2)
    body = httpx.get(f"{server.mgmt}/models/jsonl", headers=server.mgmt_headers, timeout=10).json()
    assert isinstance(body, list) and len(body) == 1 and body[0]["workflowName"] == "jsonl"
    model = body[0]["models"][0]
    assert (model["modelName"], model["status"], model["state"], model["loadedAtStartup"]) == (
        "jsonl", "Healthy", "READY", True)
    group = model["workerGroups"][0]
    assert group["device"] == {"deviceType": "cpu", "deviceId": -1} and group["minWorkers"] == 2
    ids = sorted(w["id"] for w in group["workers"])
    assert ids == sorted(w["id"] for w in model["workers"])  # rollserve's own fields sit in the same object
    for w in group["workers"]:
        assert w["status"] == "READY" and w["device"] == group["device"]
        started = datetime.datetime.fromisoformat(w["startTime"])
        assert started.tzinfo is not None and started <= datetime.datetime.now(datetime.UTC)
    assert body[0]["models"][0]["queueSize"] == model["job_queue_size"] and model["batching"] == "rolling"


def test_management_reads_on_the_inference_port_need_the_management_token(server: ServerProcess) -> None:
    listed = httpx.get(f"{server.url}/models", headers=server.mgmt_headers, timeout=10)
    assert listed.status_code == 200
    assert {m["modelName"] for m in listed.json()["models"]} == {"jsonl", "tgi", "dyn"}
    check_worker_number(f"{server.url}/models/jsonl", server.mgmt_headers, 2)
    for headers in ({}, server.inference_headers):
        r = httpx.get(f"{server.url}/models/jsonl", headers=headers, timeout=10)
        assert r.status_code == 401 and "management" in r.json()["error"]
    # writes stay on the management address
    r = httpx.delete(f"{server.url}/models/dyn", headers=server.mgmt_headers, timeout=10)
    assert r.status_code == 404 and server.describe("dyn")["state"] == "READY"


def test_invoke_and_request_ids_everywhere(server: ServerProcess) -> None:
    r = httpx.post(f"{server.url}/models/dyn/invoke", json=BODY, timeout=60)
    direct = httpx.post(f"{server.url}/predictions/dyn", json=BODY, timeout=60)
    assert r.status_code == 200 and r.json() == direct.json()
    for url in (f"{server.url}/ping", f"{server.url}/openapi.json", f"{server.mgmt}/ping"):
        plain = httpx.get(url, headers=server.mgmt_headers, timeout=10)
        assert len(plain.headers["x-request-id"]) == 32, url
        mine = httpx.get(url, headers={**server.mgmt_headers, "X-Request-Id": "djl-1"}, timeout=10)
        assert mine.headers["x-request-id"] == "djl-1", url


def test_jsonlines_streams_unasked_with_numeric_log_probs(server: ServerProcess) -> None:
    with httpx.stream("POST", f"{server.url}/predictions/jsonl", json=BODY, timeout=60) as r:
        assert r.headers["content-type"].startswith("application/jsonlines")
        lines = [json.loads(line) for line in r.iter_lines() if line.strip()]
    assert len(lines) == 5 and all(isinstance(line["token"]["log_prob"], float) for line in lines)
    assert lines[-1]["generated_text"] == "".join(line["token"]["text"] for line in lines)
    # a list of prompts is answered whole
    r = httpx.post(f"{server.url}/predictions/jsonl", json={**BODY, "inputs": ["a", "b"]}, timeout=60)
    assert r.status_code == 200 and len(r.json()) == 2


def test_dynamic_batching_answers_stream_whole(server: ServerProcess) -> None:
    r = httpx.post(f"{server.url}/predictions/dyn", json={**BODY, "stream": True}, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    assert r.json() == httpx.post(f"{server.url}/predictions/dyn", json=BODY, timeout=60).json()


def test_tgi_compat_answers_in_tgis_shape_with_details(server: ServerProcess) -> None:
    r = httpx.post(f"{server.url}/predictions/tgi", json=BODY, timeout=60)
    assert r.status_code == 200
    [answer] = r.json()
    details = answer["details"]
    assert details["generated_tokens"] == 5 and len(details["tokens"]) == 5
    assert all(set(t) == {"id", "text", "logprob", "special"} and isinstance(t["logprob"], float)
               for t in details["tokens"])
    assert answer["generated_text"] == "".join(t["text"] for t in details["tokens"])
    with httpx.stream("POST", f"{server.url}/predictions/tgi", json={**BODY, "stream": True}, timeout=60) as s:
        events = [json.loads(line[5:]) for line in s.iter_lines() if line.startswith("data:")]
    assert all(isinstance(e["token"]["logprob"], float) for e in events)
