"""Residency under a memory budget, on a real server: copies of a small built model that load on demand under a
budget that holds two of them. Each request is answered; loads and unloads show in /metrics; the pinned model is
never unloaded; what the loaded models' workers hold never exceeds the budget, by the server's report and by this
test's own reading of /proc; a model whose load fails, and one too big for the budget, fail only their own
requests."""

from __future__ import annotations

import json
import math
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from handlers.preflight import planned_memory
from serving.bench.launch import http_client
from serving.config.model_config import load_model_config
from serving.models.residency import WORKER_OVERHEAD
from tests.integration.harness import DEFAULT_MODEL, ServerProcess, write_model
from tests.integration.store_models import TINY

ON_DEMAND = {**TINY, "load_on_demand": "true"}
COPIES = ("b", "c", "d")


def predicted(folder: Path) -> int:
    """What the server predicts a copy takes before it loaded once: the engine's plan and a worker's overhead."""
    cfg = load_model_config(folder)
    plan = planned_memory(cfg.model_dir, cfg.model_id, cfg.handler_properties())
    assert plan is not None
    return plan.weight_bytes + plan.prepack_bytes + plan.activation_bytes + plan.kv_cache_bytes + WORKER_OVERHEAD


def proc_pss(pids: list[int]) -> int:
    """The PSS of ``pids`` and their descendants, read here from /proc (not through the server)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat[stat.rfind(")") + 2:].split()[1]), []).append(int(entry.name))
    total, todo, seen = 0, list(pids), set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        todo += children.get(pid, [])
        try:
            text = Path(f"/proc/{pid}/smaps_rollup").read_text()
        except OSError:
            continue
        total += sum(int(line.split()[1]) for line in text.splitlines() if line.startswith("Pss:")) * 1024
    return total


def metrics(server: ServerProcess) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    text = httpx.get(server.mgmt + "/metrics", headers=server.mgmt_headers, timeout=10).text
    return {(s.name, frozenset(s.labels.items())): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def model(server: ServerProcess, name: str) -> dict[str, Any]:
    r = httpx.get(f"{server.mgmt}/models/{name}", headers=server.mgmt_headers, timeout=10)
    r.raise_for_status()
    return dict(r.json()[0]["models"][0])


class Watch(threading.Thread):
    """Samples, until stopped, what the loaded models' workers hold: the sum of the server's figures and this test's
    own /proc reading of the workers the server lists."""

    def __init__(self, server: ServerProcess, names: list[str]) -> None:
        super().__init__(daemon=True)
        self.server, self.names = server, names
        self.stop = threading.Event()
        self.reported: list[int] = []
        self.measured: list[int] = []
        self.pinned_states: list[str] = []

    def run(self) -> None:
        with httpx.Client(headers=self.server.mgmt_headers, timeout=10) as client:
            while not self.stop.wait(0.1):
                entries = [client.get(f"{self.server.mgmt}/models/{n}").json()[0]["models"][0] for n in self.names]
                self.reported.append(sum(e["residency"]["memory_bytes"] for e in entries))
                self.measured.append(proc_pss([w["pid"] for e in entries for w in e["workers"]]))
                self.pinned_states.append(entries[0]["residency"]["state"])


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, int]]:
    root = tmp_path_factory.mktemp("residency")
    store = root / "model_store"
    write_model(store, "a", {**ON_DEMAND, "pin": "true"}, DEFAULT_MODEL)
    for name in COPIES:
        write_model(store, name, ON_DEMAND, DEFAULT_MODEL)
    # loads like the others until its worker reads the weights: half a checkpoint
    broken = write_model(store, "broken", ON_DEMAND, DEFAULT_MODEL)
    (broken / "model.safetensors").unlink()
    data = (DEFAULT_MODEL / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: len(data) // 2])
    # a KV cache of 256 sequences: more than the whole budget
    write_model(store, "huge", {**ON_DEMAND, "option.max_rolling_batch_size": "256"}, DEFAULT_MODEL)
    budget = int(2.2 * predicted(store / "b"))  # two copies fit, three do not
    server = ServerProcess.start(root, config={"model_memory_budget": str(budget), "model_load_wait": "120"})
    yield server, budget
    server.stop()


def test_models_load_on_demand_and_take_turns_under_the_budget(store: tuple[ServerProcess, int]) -> None:
    server, budget = store
    names = ["a", *COPIES]
    answer = httpx.get(server.mgmt + "/models", headers=server.mgmt_headers).json()
    listed = {m["modelName"]: m for m in answer["models"]}
    assert {listed[n]["residency"]["state"] for n in names} == {"registered"}  # nothing loaded before a request
    assert model(server, "b")["residency"]["memory_bytes"] == 0
    watch = Watch(server, names)
    watch.start()
    try:
        for name in ["a", "b", "c", "d", "b", "a", "c", "d"]:
            r = httpx.post(f"{server.url}/predictions/{name}", json={"inputs": "hello there",
                                                                      "parameters": {"max_new_tokens": 4}}, timeout=180)
            assert r.status_code == 200, (name, r.text)
    finally:
        watch.stop.set()
        watch.join()
    m = metrics(server)
    loads = {n: m[("rollserve_model_loads_total", frozenset({("model", n), ("version", "1")}))] for n in names}
    unloads = {n: m[("rollserve_model_unloads_total", frozenset({("model", n), ("version", "1"),
                                                                   ("reason", "budget")}))] for n in names}
    assert loads["a"] == 1 and unloads["a"] == 0  # pinned: loaded once, never unloaded
    # a and one copy fit: every request to another copy unloaded the one loaded before
    assert [loads[n] for n in COPIES] == [2, 2, 2]
    assert sum(unloads.values()) == 5
    assert m[("rollserve_model_memory_budget_bytes", frozenset())] == budget
    entries = {n: model(server, n) for n in names}
    assert entries["a"]["residency"]["state"] == "ready"
    assert sorted(n for n in COPIES if entries[n]["residency"]["state"] == "ready") == ["d"]
    assert {entries[n]["residency"]["state"] for n in ("b", "c")} == {"unloaded"}
    assert entries["b"]["residency"]["unloads"] == {"budget": 2}
    assert entries["d"]["residency"]["last_used"] > entries["c"]["residency"]["last_used"]
    assert entries["b"]["workers"] == []
    # what the workers hold stayed under the budget, as the server reported it and as /proc says
    assert watch.reported and max(watch.reported) <= budget
    assert watch.measured and max(watch.measured) <= budget
    assert max(watch.measured) > budget // 3  # the samples saw loaded models, not empty lists
    assert "unloaded" not in watch.pinned_states


def test_a_model_with_a_request_in_flight_is_unloaded_only_once_it_finished(store: tuple[ServerProcess, int]) -> None:
    """b streams while c is asked for: c needs b's room (a, pinned, holds the rest), so c's load waits until b's
    stream ended whole; then b is unloaded."""
    server, _ = store
    ok = httpx.post(f"{server.url}/predictions/b", json={"inputs": "hi", "parameters": {"max_new_tokens": 1}},
                    timeout=180)
    assert ok.status_code == 200, ok.text
    before = model(server, "b")["residency"]["unloads"].get("budget", 0)
    first = threading.Event()
    lines: list[str] = []

    def stream() -> None:
        body = {"model": "b", "prompt": "once upon a time", "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=180) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines.append(line)
                    first.set()

    streaming = threading.Thread(target=stream)
    streaming.start()
    assert first.wait(120)
    r = httpx.post(f"{server.url}/predictions/c", json={"inputs": "hi", "parameters": {"max_new_tokens": 2}},
                   timeout=180)
    streaming.join()
    assert r.status_code == 200, r.text
    chunks = [json.loads(line[6:]) for line in lines if line != "data: [DONE]"]
    assert lines[-1] == "data: [DONE]" and not any("error" in c for c in chunks)
    assert sum(1 for c in chunks if c["choices"] and c["choices"][0]["text"] is not None
               and c.get("usage") is None) >= 1
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" or any(
        c["choices"] and c["choices"][0].get("finish_reason") == "length" for c in chunks)
    assert model(server, "b")["residency"]["unloads"]["budget"] == before + 1
    assert model(server, "c")["residency"]["state"] == "ready"


def test_a_model_that_fails_to_load_fails_only_its_own_requests(store: tuple[ServerProcess, int]) -> None:
    server, _ = store
    r = httpx.post(f"{server.url}/predictions/broken", json={"inputs": "hi"}, timeout=180)
    assert r.status_code == 503, r.text
    assert "broken" in r.json()["error"] and "FAILED" in r.json()["error"]
    assert model(server, "broken")["residency"]["state"] == "failed"
    r = httpx.post(f"{server.url}/predictions/b", json={"inputs": "hi", "parameters": {"max_new_tokens": 2}},
                   timeout=180)
    assert r.status_code == 200, r.text


def test_a_model_bigger_than_the_budget_is_refused_naming_both_figures(store: tuple[ServerProcess, int]) -> None:
    server, budget = store
    before = {n: model(server, n)["residency"]["state"] for n in ("a", "d")}
    r = httpx.post(f"{server.url}/v1/completions", json={"model": "huge", "prompt": "hi", "max_tokens": 2},
                   timeout=60)
    assert r.status_code == 503, r.text
    error = r.json()["error"]
    message = error["message"] if isinstance(error, dict) else error
    entry = model(server, "huge")["residency"]
    assert entry["refusal"] and entry["refusal"] in message
    assert "model_memory_budget" in message and "needs" in message
    assert entry["predicted_bytes"] > budget and entry["loads"] == 0
    assert {n: model(server, n)["residency"]["state"] for n in ("a", "d")} == before  # nothing was unloaded for it


@pytest.fixture(scope="module")
def echo_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Models of the echo handler (no weights: they load in a moment) that a request never waits for
    (``model_load_wait=0``), one unloaded after a second without requests."""
    root = tmp_path_factory.mktemp("residency-echo")
    for version in ("1", "2"):  # a model of two versions, each loaded on demand
        write_model(root / "model_store" / "ver", version, {"option.entryPoint": "echo"})
    echo = {"option.entryPoint": "echo"}
    server = ServerProcess.start(root, models={"e1": {**echo, "idle_ttl": "1"}, "e2": echo, "e3": echo},
                                 config={"model_load_wait": "0", "load_on_demand": "true", "model_store_watch": "true",
                                         "model_store_watch_quiet_ms": "200"})
    yield server
    server.stop()


def wait_state(server: ServerProcess, name: str, state: str, timeout_s: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        entry = model(server, name)
        if entry["residency"]["state"] == state:
            return entry
        time.sleep(0.05)
    raise AssertionError(f"{name} not {state}: {model(server, name)['residency']}")


def test_a_load_longer_than_the_wait_answers_503_with_retry_after_from_the_load_time(echo_store: ServerProcess
                                                                                     ) -> None:
    server = echo_store
    assert model(server, "e1")["residency"]["state"] == "registered"  # the server's load_on_demand
    r = httpx.post(f"{server.url}/predictions/e1", json={"inputs": "hi"}, timeout=30)
    assert r.status_code == 503, r.text
    assert r.headers["retry-after"] == "10"  # no load of it was timed yet
    assert "model_load_wait" in r.json()["error"]
    entry = wait_state(server, "e1", "ready")  # the load went on
    r = httpx.post(f"{server.url}/predictions/e1", json={"inputs": "hi"}, timeout=30)
    assert r.status_code == 200, r.text
    entry = wait_state(server, "e1", "unloaded")  # idle for its idle_ttl
    assert entry["residency"]["unloads"] == {"idle_ttl": 1} and entry["workers"] == []
    r = httpx.post(f"{server.url}/predictions/e1", json={"inputs": "hi"}, timeout=30)
    assert r.status_code == 503, r.text
    assert r.headers["retry-after"] == str(max(1, math.ceil(entry["load_time_s"])))  # the load it measured
    m = metrics(server)
    assert m[("rollserve_model_unloads_total", frozenset({("model", "e1"), ("version", "1"),
                                                          ("reason", "idle_ttl")}))] == 1
    assert m[("rollserve_model_loads_total", frozenset({("model", "e1"), ("version", "1")}))] >= 1


def test_versions_and_reloads_of_models_loaded_on_demand(echo_store: ServerProcess) -> None:
    server = echo_store
    # every version has its own residency: a request for version 1 loads version 1 alone
    assert httpx.post(f"{server.url}/predictions/ver/1", json={"inputs": "hi"}, timeout=30).status_code == 503
    wait_state(server, "ver/1", "ready")
    assert model(server, "ver/2")["residency"]["state"] == "registered"
    r = httpx.post(f"{server.url}/predictions/ver/1", json={"inputs": "hi"}, timeout=30)
    assert r.status_code == 200, r.text
    # a reload of a model that is not loaded leaves it so: the new configuration loads on its next request
    r = httpx.put(f"{server.mgmt}/models/e2/reload", headers=server.mgmt_headers, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["workers"] == []
    entry = model(server, "e2")
    assert entry["residency"]["state"] == "registered" and entry["last_reload"]["status"] == "reloaded"
    assert httpx.post(f"{server.url}/predictions/e2", json={"inputs": "hi"}, timeout=30).status_code == 503
    wait_state(server, "e2", "ready")
    # a loaded one reloads as before: new workers, loaded (and counted) at once
    r = httpx.put(f"{server.mgmt}/models/e2/reload", headers=server.mgmt_headers, timeout=60)
    assert r.status_code == 200, r.text
    assert len(r.json()["workers"]) == 1
    entry = model(server, "e2")
    assert entry["residency"]["state"] == "ready" and entry["residency"]["loads"] == 1
    assert httpx.post(f"{server.url}/predictions/e2", json={"inputs": "hi"}, timeout=30).status_code == 200


def test_a_readiness_check_loads_nothing(echo_store: ServerProcess) -> None:
    server = echo_store
    r = httpx.get(f"{server.url}/v2/models/e3/ready", timeout=30)
    assert r.status_code == 503, r.text
    assert "loads on its first request" in r.text
    assert httpx.get(f"{server.url}/ping", timeout=30).status_code == 200  # it waits for no model loaded on demand
    entry = model(server, "e3")
    assert entry["residency"]["state"] == "registered" and entry["residency"]["loads"] == 0


def test_the_watched_store_registers_a_new_folder_without_loading_it(echo_store: ServerProcess) -> None:
    server = echo_store
    folder = write_model(server.workdir / "model_store", "e4", {"option.entryPoint": "echo"})
    deadline = time.monotonic() + 60
    while http_client().get(f"{server.mgmt}/models/e4", headers=server.mgmt_headers, timeout=10).status_code == 404:
        assert time.monotonic() < deadline, "the watched store did not register e4"
        time.sleep(0.05)
    assert model(server, "e4")["residency"]["state"] == "registered"
    assert httpx.post(f"{server.url}/predictions/e4", json={"inputs": "hi"}, timeout=30).status_code == 503
    wait_state(server, "e4", "ready")
    assert httpx.post(f"{server.url}/predictions/e4", json={"inputs": "hi"}, timeout=30).status_code == 200
    shutil.rmtree(folder)  # removed: unregistered, its workers stopped
    while http_client().get(f"{server.mgmt}/models/e4", headers=server.mgmt_headers, timeout=10).status_code != 404:
        assert time.monotonic() < deadline + 60, "the watched store did not unregister e4"
        time.sleep(0.05)
