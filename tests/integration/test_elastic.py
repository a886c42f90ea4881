"""Worker pools over time, against real servers (echo handlers, no torch): elastic workers between
minWorkers and maxWorkers, and the restart backoff of a worker that keeps crashing. Time is read from the
server's own log (its timestamps and the delays it chose), never bounded by the test's wall clock."""

from __future__ import annotations

import re
import threading
import time
from datetime import datetime
from pathlib import Path

import httpx

from serving.bench.launch import wait_for
from tests.integration.harness import ServerProcess

CRASH_AFTER_READY = '''
import os
import threading

from handlers.base import Output


def initialize(ctx):
    threading.Timer(0.3, os._exit, (3,)).start()  # dies shortly after it reported Ready, every time


def handle(inputs):
    return [Output(request_id=i.request_id, text=i.prompt) for i in inputs]
'''
LOG_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*?: (.*)$")


def log_events(server: ServerProcess, pattern: str) -> list[tuple[float, re.Match[str]]]:
    """(server timestamp in s, match) of every frontend log line whose message matches ``pattern``."""
    out = []
    for line in server.log().splitlines():
        m = LOG_LINE.match(line)
        if m and (hit := re.search(pattern, m.group(2))):
            out.append((datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp(), hit))
    return out


def test_a_crash_looping_worker_is_restarted_with_growing_backoff(tmp_path: Path) -> None:
    server = ServerProcess.start(tmp_path, models={"loop": {"option.entryPoint": "model.py"},
                                                   "echo": {"option.entryPoint": "echo"}},
                                 files={"loop": {"model.py": CRASH_AFTER_READY}}, wait_ready=False)
    try:
        exits = wait_for(lambda: (e := log_events(server, r"model loop: worker \d+ .*exited; restarting in "
                                                          r"([\d.]+)s")) and len(e) >= 5 and e, "5 crashes")
        delays = [float(m.group(1)) for _, m in exits[:5]]
        assert delays == [0.5, 1.0, 2.0, 4.0, 8.0], delays  # doubling: a crash loop, not a steady restart
        readies = [t for t, _ in log_events(server, r"model loop: worker \d+ ready")]
        for (exited_at, _), delay in zip(exits[:4], delays[:4], strict=True):
            restarted_at = min(t for t in readies if t > exited_at)
            assert restarted_at - exited_at >= delay, (exited_at, restarted_at, delay)  # it really waited
        r = httpx.post(f"{server.url}/predictions/echo", json={"inputs": "others keep serving"}, timeout=30)
        assert r.status_code == 200 and r.json() == {"generated_text": "others keep serving"}
    finally:
        server.stop()


def test_workers_scale_up_while_requests_queue_and_down_after_max_idle_time(tmp_path: Path) -> None:
    max_idle_time_s = 3
    server = ServerProcess.start(tmp_path, models={"elastic": {
        "option.entryPoint": "echo", "option.echo_delay_ms": "300", "batch_size": "1", "max_batch_delay": "1",
        "minWorkers": "1", "maxWorkers": "2", "max_idle_time": str(max_idle_time_s)}})
    try:
        info = server.describe("elastic")
        assert (info["target_workers"], len(info["workers"])) == (1, 1), info
        answers: dict[int, httpx.Response] = {}

        def send(i: int) -> None:
            answers[i] = httpx.post(f"{server.url}/predictions/elastic", json={"inputs": f"job {i}"}, timeout=60)

        threads = [threading.Thread(target=send, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        # 16 jobs of 0.3 s on one worker queue for ~5 s: the pool grows to maxWorkers while they do
        grown = wait_for(lambda: (d := server.describe("elastic"))["batcher"]["queued"] > 0 and
                         len(d["workers"]) == 2 and d, "a second worker while requests queue")
        assert grown["target_workers"] == 2 and len({w["pid"] for w in grown["workers"]}) == 2
        for t in threads:
            t.join(60)
        done_at = time.time()
        assert {i: (r.status_code, r.json()) for i, r in answers.items()} == \
            {i: (200, {"generated_text": f"job {i}"}) for i in range(16)}
        wait_for(lambda: len(server.describe("elastic")["workers"]) == 1, "the idle worker to retire")
        [(up_at, _)] = log_events(server, r"model elastic: scaling up to 2 workers \(requests queueing\)")
        [(down_at, _)] = log_events(server, r"model elastic: scaling down to 1 workers \(idle\)")
        assert up_at < done_at
        # retired only after max_idle_time with nothing pending (the autoscaler looks every 0.5 s)
        assert down_at - done_at >= max_idle_time_s - 0.5, (down_at - done_at)
        r = httpx.post(f"{server.url}/predictions/elastic", json={"inputs": "after"}, timeout=30)
        assert r.status_code == 200 and r.json() == {"generated_text": "after"}
    finally:
        server.stop()
