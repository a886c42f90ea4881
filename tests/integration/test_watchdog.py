"""The liveness watchdog: a rolling worker that hangs (SIGSTOP mid-stream) or loses a tensor-parallel rank gives
its clients a definite error, is replaced, and the model serves again. ``predict_timeout`` is 600 s so only
the liveness watchdog (``option.liveness_timeout=3``) or the rank check can explain the error seen."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.integration.harness import ServerProcess, rank_processes
from tests.integration.hostile import assert_no_leaks, lmi_body, post, twelve_afterwards

ROLLING = {"option.rolling_batch": "auto", "option.num_kv_blocks": "256", "option.predict_timeout": "600"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    s = ServerProcess.start(tmp_path_factory.mktemp("watchdog"), models={
        "roll": {**ROLLING, "option.liveness_timeout": "3"},
        "tp2": {**ROLLING, "option.tensor_parallel_degree": "2", "option.liveness_timeout": "30"},
    }, timeout_s=300)
    yield s
    s.stop()


class Stream:
    """A long jsonlines stream read on a thread; ``lines`` grow as tokens arrive."""

    def __init__(self, server: ServerProcess, model: str) -> None:
        self.lines: list[dict[str, Any]] = []
        self.ended = threading.Event()
        self.ended_at = 0.0
        body = {**lmi_body(max_new_tokens=1500), "stream": True}
        self.thread = threading.Thread(target=self._read, args=(server, model, body), daemon=True)
        self.thread.start()

    def _read(self, server: ServerProcess, model: str, body: dict[str, Any]) -> None:
        with httpx.stream("POST", f"{server.url}/predictions/{model}", json=body, timeout=600,
                          headers=server.inference_headers) as r:
            for line in r.iter_lines():
                if line.strip():
                    self.lines.append(json.loads(line))
        self.ended_at = time.monotonic()
        self.ended.set()

    def wait_tokens(self, n: int) -> None:
        deadline = time.monotonic() + 120
        while len(self.lines) < n:
            assert time.monotonic() < deadline and not self.ended.is_set(), self.lines[-1:]
            time.sleep(0.02)


def worker_pid(server: ServerProcess, model: str) -> int:
    return int(server.describe(model)["workers"][0]["pid"])


def wait_replaced(server: ServerProcess, model: str, old_pid: int) -> None:
    deadline = time.monotonic() + 180
    while True:
        d = server.describe(model)
        if d["state"] == "READY" and d["workers"] and d["workers"][0]["pid"] != old_pid:
            return
        assert time.monotonic() < deadline, d
        time.sleep(0.1)


def test_a_stopped_worker_fails_its_streams_and_is_replaced(server: ServerProcess) -> None:
    pid = worker_pid(server, "roll")
    streams = [Stream(server, "roll") for _ in range(2)]
    for s in streams:
        s.wait_tokens(3)
    os.kill(pid, signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        for s in streams:
            assert s.ended.wait(120), "the stream never ended"
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    for s in streams:
        last = s.lines[-1]
        assert last["error_type"] == "worker_failed" and "liveness_timeout" in last["error"], last
        # the window is 3 s; the predict timeout (600 s) is not what ended them
        assert s.ended_at - stopped_at < 60
    wait_replaced(server, "roll", pid)
    assert server.describe("roll")["batcher"]["watchdog_restarts"] == 1
    twelve_afterwards(server, "roll")
    assert_no_leaks(server, "roll")


def rank_pid(worker: int) -> int:
    ranks = rank_processes(worker)
    assert list(ranks.values()) == ["tp-rank1"], ranks
    return next(iter(ranks))


def test_a_dead_tensor_parallel_rank_restarts_its_worker(server: ServerProcess) -> None:
    worker = worker_pid(server, "tp2")
    rank1 = rank_pid(worker)
    stream = Stream(server, "tp2")
    stream.wait_tokens(3)
    os.kill(rank1, signal.SIGKILL)
    assert stream.ended.wait(120), "the stream never ended"
    last = stream.lines[-1]
    assert last.get("error_type") == "worker_failed", last
    wait_replaced(server, "tp2", worker)
    assert "tensor-parallel rank" in server.log()
    body = lmi_body(max_new_tokens=6)
    r = post(server, "/predictions/tp2", body)
    assert r.status_code == 200 and r.json()["generated_text"] == post(server, "/predictions/roll", body).json()[
        "generated_text"]
    twelve_afterwards(server, "tp2")
    assert_no_leaks(server, "tp2")
