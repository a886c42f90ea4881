"""Worker crashes, graceful shutdown, models that fail to load, and model (un)registration and scaling
through the management API, against real server processes."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from serving.bench.launch import http_client, wait_for
from tests.integration.harness import ServerProcess, write_model

ECHO = {"option.entryPoint": "echo"}
BAD_MODEL_PY = '''
from handlers.base import Handler

class Handler(Handler):
    def initialize(self, ctx):
        raise RuntimeError("weights are corrupt")

    def handle(self, inputs):
        return []
'''


def cpu_ticks(pid: int) -> int:
    """utime + stime of one process, in clock ticks (/proc/<pid>/stat fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


# --- worker killed during a batch -----------------------------------------------------------------

def test_sigkill_worker_during_batch_retries_every_request_and_restarts(tmp_path: Path) -> None:
    s = ServerProcess.start(tmp_path, models={"echo": {**ECHO, "batch_size": "4", "max_batch_delay": "100",
                                                       "option.echo_delay_ms": "1500"}})
    try:
        (old,) = s.describe("echo")["workers"]

        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=60) as client:
                tasks = [asyncio.ensure_future(client.post(f"{s.url}/predictions/echo", json={"inputs": f"k {i}"}))
                         for i in range(4)]
                while s.describe("echo")["batcher"]["in_flight_batches"] != 1:  # the batch is in the worker
                    await asyncio.sleep(0.02)
                os.kill(old["pid"], signal.SIGKILL)
                return await asyncio.gather(*tasks)

        responses = asyncio.run(burst())
        # nothing had reached the clients: the batcher retries the whole batch on the restarted worker
        assert [(r.status_code, r.json()) for r in responses] == \
            [(200, {"generated_text": f"k {i}"}) for i in range(4)]
        info = s.describe("echo")
        assert info["worker_restarts"] == 1
        (new,) = info["workers"]
        assert new["pid"] != old["pid"] and new["status"] == "READY"
        assert new["pid"] in s.worker_pids()
        r = httpx.post(f"{s.url}/predictions/echo", json={"inputs": "after restart"}, timeout=30)
        assert r.status_code == 200 and r.json() == {"generated_text": "after restart"}
    finally:
        s.stop()


class StreamReader(threading.Thread):
    """Reads one LMI jsonlines stream into ``lines`` as they arrive."""

    def __init__(self, url: str, inputs: str, max_new_tokens: int, rid: str) -> None:
        super().__init__(daemon=True)
        self.body = {"inputs": inputs, "stream": True,
                     "parameters": {"max_new_tokens": max_new_tokens, "ignore_eos": True}}
        self.url, self.rid = url, rid
        self.lines: list[dict[str, Any]] = []
        self.status = 0

    def run(self) -> None:
        with httpx.stream("POST", self.url, json=self.body, headers={"X-Request-Id": self.rid}, timeout=120) as r:
            self.status = r.status_code
            for line in r.iter_lines():
                if line.strip():
                    self.lines.append(json.loads(line))


def test_sigkill_rolling_worker_mid_stream(tmp_path: Path) -> None:
    """A rolling worker killed while three requests run: the two that streamed tokens end with a definite
    ``worker_failed`` event; the one still prefilling (nothing sent yet) is retried on the restarted worker
    and answers in full, as it answers alone."""
    s = ServerProcess.start(tmp_path, models={"roll": {
        "option.rolling_batch": "auto", "option.max_rolling_batch_size": "4",
        # a small step budget: the long prompt below prefills over hundreds of steps, nothing streamed yet
        "option.max_rolling_batch_prefill_tokens": "8"}})
    url = f"{s.url}/predictions/roll"
    long_prompt = "hello world " * 900  # ~1800 tokens
    try:
        (old,) = s.describe("roll")["workers"]
        started = [StreamReader(url, f"story {i}", 1500, f"run-{i}") for i in range(2)]
        for t in started:
            t.start()
        wait_for(lambda: all(len(t.lines) >= 2 for t in started), "two streams flowing", 60, step_s=0.1)
        waiting = StreamReader(url, long_prompt, 8, "prefilling")
        waiting.start()

        def engine() -> dict[str, Any]:
            return dict(next(iter(s.describe("roll")["batcher"]["engines"].values())))
        wait_for(lambda: "prefilling" in engine()["blocks_held"], "the long prompt admitted", 30, step_s=0.005)
        assert waiting.lines == []
        os.kill(old["pid"], signal.SIGKILL)
        for t in [*started, waiting]:
            t.join(120)
            assert t.status == 200 and not t.is_alive()
        for t in started:
            *tokens, last = t.lines
            assert len(tokens) >= 2 and all(line["token"]["id"] >= 0 for line in tokens)
            assert last["error_type"] == "worker_failed" and last["details"]["finish_reason"] == "error", last
        assert all("error" not in line for line in waiting.lines), waiting.lines
        assert len(waiting.lines) == 8 and waiting.lines[-1]["details"]["generated_tokens"] == 8
        alone = httpx.post(url, json={"inputs": long_prompt, "parameters": {"max_new_tokens": 8,
                                                                            "ignore_eos": True}}, timeout=60)
        assert waiting.lines[-1]["generated_text"] == alone.json()["generated_text"]
        info = s.describe("roll")
        assert info["worker_restarts"] == 1 and info["workers"][0]["pid"] != old["pid"]
    finally:
        s.stop()


# --- graceful shutdown -----------------------------------------------------------------------------

def test_sigterm_drains_in_flight_requests_then_exits_cleanly(tmp_path: Path) -> None:
    s = ServerProcess.start(tmp_path, models={"echo": {**ECHO, "batch_size": "2", "max_batch_delay": "1000",
                                                       "option.echo_delay_ms": "1500"}})
    url = f"{s.url}/predictions/echo"
    results: list[httpx.Response] = []

    def send(i: int) -> None:
        results.append(httpx.post(url, json={"inputs": f"inflight {i}"}, timeout=30))

    threads = [threading.Thread(target=send, args=(i,)) for i in range(3)]
    try:
        for t in threads[:2]:  # a full batch of 2 goes to the worker at once
            t.start()
        wait_for(lambda: s.describe("echo")["batcher"]["in_flight_batches"] == 1, "the batch in flight", 5, step_s=0.1)
        threads[2].start()  # and one waits in the queue
        wait_for(lambda: s.describe("echo")["batcher"]["queued"] == 1, "a queued request", 5, step_s=0.1)
        s.proc.send_signal(signal.SIGTERM)
        ping = wait_for(lambda: (p := http_client().get(f"{s.url}/ping", timeout=5)).status_code == 503 and p,
                        "ping 503", 2, step_s=0.02)
        assert ping.json()["status"] == "draining"
        r = httpx.post(url, json={"inputs": "too late"}, timeout=5)
        assert r.status_code == 503, r.text
        assert r.json()["error_type"] == "unavailable" and "Retry-After" in r.headers
        for t in threads:
            t.join(30)
        assert sorted(r.status_code for r in results) == [200, 200, 200]
        assert sorted(r.json()["generated_text"] for r in results) == [f"inflight {i}" for i in range(3)]
    finally:
        code = s.stop()  # asserts the whole process group is gone
    assert code == 0


# --- a model that cannot load ----------------------------------------------------------------------

def test_model_failing_to_load_is_failed_and_server_stays_idle(tmp_path: Path) -> None:
    s = ServerProcess.start(tmp_path, models={"good": ECHO, "broken": {"option.entryPoint": "model.py"}},
                            files={"broken": {"model.py": BAD_MODEL_PY}}, wait_ready=False)
    try:
        info = wait_for(lambda: (d := s.describe("broken"))["state"] == "FAILED" and d, "broken FAILED", 30, step_s=0.1)
        assert "weights are corrupt" in info["reason"]
        assert info["workers"] == []
        assert "failed to load (3/3)" in s.log()  # bounded retries
        ping = httpx.get(f"{s.url}/ping", timeout=5)
        assert ping.status_code == 503
        assert ping.json()["models"] == {"good": "READY", "broken": "FAILED"}
        r = httpx.post(f"{s.url}/predictions/broken", json={"inputs": "x"}, timeout=5)
        assert r.status_code == 503 and "weights are corrupt" in r.json()["error"]
        r = httpx.post(f"{s.url}/predictions/good", json={"inputs": "still serving"}, timeout=10)
        assert r.status_code == 200 and r.json() == {"generated_text": "still serving"}
        # idle: no retry loop in the frontend -- no further load attempt over a window of several times the
        # retry backoff, and a small share of one core (a spinning loop would take all of it)
        window_s = 4.0
        before, t0 = cpu_ticks(s.proc.pid), time.monotonic()
        time.sleep(window_s)
        used_s = (cpu_ticks(s.proc.pid) - before) / os.sysconf("SC_CLK_TCK")
        share = used_s / (time.monotonic() - t0)
        assert share < 0.1, f"frontend used {share:.0%} of a core while idle"
        assert len(re.findall(r"model broken: worker \d+ failed to load \(\d/3\)", s.log())) == 3
        assert len(s.worker_pids()) == 1  # only the good model's worker
    finally:
        s.stop()


# --- management API: model store safety, register, scale, unregister -------------------------------

@pytest.fixture(scope="module")
def mgmt_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    workdir = tmp_path_factory.mktemp("mgmt")
    s = ServerProcess.start(workdir, models={"base": ECHO}, config={"load_models": "base", "enable_model_api": "true"})
    store = workdir / "model_store"
    write_model(store, "extra", dict(ECHO))
    outside = workdir / "outside"
    write_model(workdir, "outside", dict(ECHO))
    os.symlink(outside, store / "escape")
    yield s
    s.stop()


@pytest.mark.parametrize("url", ["../outside", "/etc", "escape", "extra/../../outside", "file:///etc",
                                 "does-not-exist"])
def test_register_rejects_paths_outside_the_store(mgmt_server: ServerProcess, url: str) -> None:
    r = httpx.post(f"{mgmt_server.mgmt}/models", params={"url": url, "model_name": "evil"},
                   headers=mgmt_server.mgmt_headers, timeout=10)
    assert r.status_code == 400, r.text
    body = r.json()
    assert set(body) == {"error", "error_type", "request_id"} and body["error_type"] == "invalid_request"
    assert "/etc" not in body["error"] or url == "/etc"
    assert httpx.get(f"{mgmt_server.mgmt}/models/evil", headers=mgmt_server.mgmt_headers, timeout=10).status_code == 404


@pytest.mark.parametrize("name", ["../evil", "bad name", ".hidden", "a/b"])
def test_register_rejects_bad_model_names(mgmt_server: ServerProcess, name: str) -> None:
    r = httpx.post(f"{mgmt_server.mgmt}/models", params={"url": "extra", "model_name": name},
                   headers=mgmt_server.mgmt_headers, timeout=10)
    assert r.status_code == 400, r.text
    assert r.json()["error_type"] == "invalid_request" and "model name" in r.json()["error"]


def test_register_scale_unregister(mgmt_server: ServerProcess) -> None:
    s = mgmt_server
    r = httpx.post(f"{s.mgmt}/models", params={"url": "extra", "model_name": "m2", "batch_size": "2"},
                   headers=s.mgmt_headers, timeout=60)
    assert r.status_code == 200, r.text
    info = s.describe("m2")
    assert info["state"] == "READY" and info["batch_size"] == 2 and len(info["workers"]) == 1
    r = httpx.post(f"{s.url}/predictions/m2", json={"inputs": "hi m2"}, timeout=10)
    assert r.status_code == 200 and r.json() == {"generated_text": "hi m2"}
    # duplicate name
    assert httpx.post(f"{s.mgmt}/models", params={"url": "extra", "model_name": "m2"},
                      headers=s.mgmt_headers, timeout=10).status_code == 400

    r = httpx.put(f"{s.mgmt}/models/m2", params={"min_worker": "2"}, headers=s.mgmt_headers, timeout=60)
    assert r.status_code == 200, r.text
    workers = s.describe("m2")["workers"]
    assert len(workers) == 2 and len({w["pid"] for w in workers}) == 2
    assert {w["pid"] for w in workers} <= set(s.worker_pids())
    assert httpx.put(f"{s.mgmt}/models/m2", params={"min_worker": "0"},
                     headers=s.mgmt_headers, timeout=10).status_code == 400

    r = httpx.delete(f"{s.mgmt}/models/m2", headers=s.mgmt_headers, timeout=60)
    assert r.status_code == 200, r.text
    assert httpx.get(f"{s.mgmt}/models/m2", headers=s.mgmt_headers, timeout=10).status_code == 404
    r = httpx.post(f"{s.url}/predictions/m2", json={"inputs": "gone"}, timeout=10)
    assert r.status_code == 404 and r.json()["error_type"] == "not_found"
    # the unregistered model's workers are gone; the base model's remains
    wait_for(lambda: len(s.worker_pids()) == 1, "m2's workers to exit", 10, step_s=0.1)
    assert s.describe("base")["state"] == "READY"


def test_register_with_an_invalid_override_is_400_and_registers_nothing(tmp_path: Path) -> None:
    server = ServerProcess.start(tmp_path, models={"ok": {"option.entryPoint": "echo"}},
                                 config={"enable_model_api": "true"})
    try:
        r = httpx.post(f"{server.mgmt}/models", params={"url": "ok", "model_name": "bad", "batch_size": "0"},
                       headers=server.mgmt_headers, timeout=30)
        assert r.status_code == 400, r.text
        assert "batch_size" in r.json()["error"]
        assert httpx.get(f"{server.mgmt}/models/bad", headers=server.mgmt_headers, timeout=10).status_code == 404
    finally:
        server.stop()
