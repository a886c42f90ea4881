"""Worker crashes, graceful shutdown, models that fail to load, and model (un)registration and scaling
through the management API, against real server processes."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

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


def wait_for(cond: Any, timeout_s: float, what: str, step_s: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(step_s)


def cpu_ticks(pid: int) -> int:
    """utime + stime of one process, in clock ticks (/proc/<pid>/stat fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


# --- worker killed during a batch -----------------------------------------------------------------

def test_sigkill_worker_during_batch_answers_everyone_and_restarts(tmp_path: Path) -> None:
    s = ServerProcess.start(tmp_path, models={"echo": {**ECHO, "batch_size": "4", "max_batch_delay": "100",
                                                       "option.echo_delay_ms": "1500"}})
    try:
        (old,) = s.describe("echo")["workers"]

        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=30) as client:
                tasks = [asyncio.ensure_future(client.post(f"{s.url}/predictions/echo", json={"inputs": f"k {i}"}))
                         for i in range(4)]
                await asyncio.sleep(0.7)  # the batch is inside the worker's 1.5 s handler call
                assert s.describe("echo")["batcher"]["in_flight_batches"] == 1
                os.kill(old["pid"], signal.SIGKILL)
                return await asyncio.gather(*tasks)

        t0 = time.monotonic()
        responses = asyncio.run(burst())
        assert time.monotonic() - t0 < 25
        for i, r in enumerate(responses):
            if r.status_code == 200:
                assert r.json() == {"generated_text": f"k {i}"}
            else:  # a definite error, never a hang
                assert 500 <= r.status_code < 600, r.text
                assert set(r.json()) == {"error", "error_type", "request_id"}
        info = wait_for(lambda: (d := s.describe("echo"))["workers"] and d, 20, "a restarted worker")
        assert info["worker_restarts"] >= 1
        (new,) = info["workers"]
        assert new["pid"] != old["pid"] and new["status"] == "READY"
        assert new["pid"] in s.worker_pids()
        r = httpx.post(f"{s.url}/predictions/echo", json={"inputs": "after restart"}, timeout=30)
        assert r.status_code == 200 and r.json() == {"generated_text": "after restart"}
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
        wait_for(lambda: s.describe("echo")["batcher"]["in_flight_batches"] == 1, 5, "the batch in flight")
        threads[2].start()  # and one waits in the queue
        wait_for(lambda: s.describe("echo")["batcher"]["queued"] == 1, 5, "a queued request")
        s.proc.send_signal(signal.SIGTERM)
        ping = wait_for(lambda: (p := httpx.get(f"{s.url}/ping", timeout=5)).status_code == 503 and p, 2,
                        "ping 503", 0.02)
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
        info = wait_for(lambda: (d := s.describe("broken"))["status"] == "FAILED" and d, 30, "broken FAILED")
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
        # idle: no retry loop spinning in the frontend
        time.sleep(0.5)
        before = cpu_ticks(s.proc.pid)
        time.sleep(2.0)
        used_s = (cpu_ticks(s.proc.pid) - before) / os.sysconf("SC_CLK_TCK")
        assert used_s < 0.2, f"frontend used {used_s:.2f}s CPU in 2s while idle"
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
    assert info["status"] == "READY" and info["batch_size"] == 2 and len(info["workers"]) == 1
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
    wait_for(lambda: len(s.worker_pids()) == 1, 10, "m2's workers to exit")
    assert s.describe("base")["status"] == "READY"


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
