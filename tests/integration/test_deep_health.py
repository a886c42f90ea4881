"""Health with teeth on a real server with two real rolling workers of the tiny model: a worker SIGKILLed under a
load of whole answers costs no request (each runs again elsewhere, greedy answers unchanged), and a worker frozen
with SIGSTOP mid-decode is named by ``GET /health/generate`` and restarted by the forward-progress watchdog within
``option.liveness_timeout``, while the other worker's stream goes on. ``predict_timeout`` is 600 s so only the
watchdog can end the frozen worker's stream."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.integration.harness import ServerProcess
from tests.integration.hostile import assert_no_leaks, lmi_body, post
from tests.integration.test_watchdog import Stream as LongStream

LIVENESS_S = 4.0  # option.liveness_timeout
PROBE_S = 2.0  # health_generate_timeout: shorter than the watchdog, so the frozen worker is seen before its restart
MODEL = {"option.rolling_batch": "auto", "option.num_kv_blocks": "512", "option.predict_timeout": "600",
         "option.liveness_timeout": f"{LIVENESS_S:g}", "minWorkers": "2", "maxWorkers": "2"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    s = ServerProcess.start(tmp_path_factory.mktemp("deep-health"), models={"roll": MODEL},
                            config={"health_generate_timeout": f"{PROBE_S:g}", "health_generate_interval": "0.2"},
                            timeout_s=300)
    yield s
    s.stop()


def wait_for(what: str, check: Callable[[], Any], timeout_s: float = 120.0) -> Any:
    """Poll state the server reports until ``check`` returns something truthy."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.02)


def metric(server: ServerProcess, name: str, **labels: str) -> float:
    text = httpx.get(f"{server.mgmt}/metrics", headers=server.mgmt_headers, timeout=30).text
    want = {"model": "roll", **labels}
    for line in text.splitlines():
        m = re.fullmatch(rf'{name}\{{(.*)\}} (\S+)', line)
        if m and dict(re.findall(r'(\w+)="([^"]*)"', m.group(1))).items() >= want.items():
            return float(m.group(2))
    return 0.0


def deep(server: ServerProcess) -> httpx.Response:
    return httpx.get(f"{server.url}/health/generate", timeout=60)  # no token: a probe cannot send one


class Stream(LongStream):
    """A jsonlines stream of ``max_new_tokens`` read on a thread."""

    def __init__(self, server: ServerProcess, max_new_tokens: int) -> None:
        self.lines: list[dict[str, Any]] = []
        self.ended = threading.Event()
        self.ended_at = 0.0
        # prompts that share no first token: prefix-aware routing has no cached prefix to follow, load decides
        body = {**lmi_body(f"{max_new_tokens} words of a story", max_new_tokens=max_new_tokens), "stream": True}
        self.thread = threading.Thread(target=self._read, args=(server, "roll", body), daemon=True)
        self.thread.start()


def workers(server: ServerProcess) -> dict[int, dict[str, Any]]:
    return {w["id"]: w for w in server.describe("roll")["workers"]}


def test_the_deep_check_answers_200_naming_every_worker(server: ServerProcess) -> None:
    r = deep(server)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["status"] == "Healthy" and body["timeout_s"] == PROBE_S
    probed = body["models"]["roll"]["workers"]
    assert sorted(int(w) for w in probed) == sorted(workers(server)) and all(p["ok"] for p in probed.values())


def test_a_worker_killed_under_whole_answer_load_costs_no_request(server: ServerProcess) -> None:
    prompts = [f"The number {i} is" for i in range(16)]

    def answer_all() -> list[httpx.Response]:
        with ThreadPoolExecutor(16) as pool:
            return list(pool.map(lambda p: post(server, "/predictions/roll", lmi_body(p, max_new_tokens=160),
                                                timeout=300), prompts))

    undisturbed = answer_all()
    assert all(r.status_code == 200 for r in undisturbed), [r.text for r in undisturbed if r.status_code != 200]
    retries = metric(server, "rollserve_request_retries_total")
    crashes = metric(server, "rollserve_worker_restarts_total", cause="crash")
    steps = server.describe("roll")["batcher"]["steps_total"]
    with ThreadPoolExecutor(1) as load:
        pending = load.submit(answer_all)
        # both workers decoding: the victim has computed tokens it will lose
        victim = wait_for("both workers busy", lambda: server.describe("roll")["batcher"]["steps_total"] >= steps + 8
                          and all(w["in_flight"] > 0 for w in workers(server).values()) and min(workers(server)))
        held = workers(server)[victim]["in_flight"]
        os.kill(workers(server)[victim]["pid"], signal.SIGKILL)
        disturbed = pending.result()
    assert [r.status_code for r in disturbed] == [200] * 16, [r.text for r in disturbed if r.status_code != 200]
    assert [r.json()["generated_text"] for r in disturbed] == [r.json()["generated_text"] for r in undisturbed]
    assert metric(server, "rollserve_worker_restarts_total", cause="crash") == crashes + 1
    assert retries + 1 <= metric(server, "rollserve_request_retries_total") <= retries + held
    wait_for("the killed worker replaced", lambda: len(workers(server)) == 2 and victim not in workers(server))
    assert_no_leaks(server, "roll")


def test_a_frozen_worker_is_named_by_the_deep_check_and_restarted_by_the_watchdog(server: ServerProcess) -> None:
    watchdog = metric(server, "rollserve_worker_restarts_total", cause="watchdog")
    frozen_stream = Stream(server, 1500)  # still decoding when frozen
    frozen_stream.wait_tokens(3)
    frozen = wait_for("the stream's worker", lambda: next(
        (wid for wid, w in workers(server).items() if w["in_flight"] == 1), None))
    other_stream = Stream(server, 600)  # to the least loaded worker: the other one
    other_stream.wait_tokens(3)
    other = next(wid for wid in workers(server) if wid != frozen)
    assert workers(server)[other]["in_flight"] == 1
    pid = workers(server)[frozen]["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        r = deep(server)
        assert r.status_code == 503, r.text
        body = r.json()
        assert body["failed"] == ["roll"], body
        probed = body["models"]["roll"]["workers"]
        assert probed[str(frozen)]["ok"] is False and f"no token within {PROBE_S:g}s" in probed[str(frozen)]["error"]
        assert probed[str(other)]["ok"] is True
        assert frozen_stream.ended.wait(120), "the frozen worker's stream never ended"
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    last = frozen_stream.lines[-1]
    assert last["error_type"] == "worker_failed" and "liveness_timeout" in last["error"], last
    kill = server.describe("roll")["batcher"]["last_watchdog"]
    # the watchdog checks every liveness_timeout/4 (at most 1 s): it acts within one such period of the limit
    assert kill["worker"] == frozen and LIVENESS_S <= kill["silent_s"] <= LIVENESS_S * 1.5, kill
    # the kill's exit is reported once the process is reaped: wait for it, then it must be exactly one
    wait_for("the watchdog's restart counted", lambda: metric(
        server, "rollserve_worker_restarts_total", cause="watchdog") >= watchdog + 1)
    assert metric(server, "rollserve_worker_restarts_total", cause="watchdog") == watchdog + 1
    wait_for("the frozen worker replaced", lambda: len(workers(server)) == 2 and frozen not in workers(server))
    assert wait_for("the deep check healthy again", lambda: deep(server).status_code == 200)
    assert other_stream.ended.wait(300), "the other worker's stream never ended"
    final = other_stream.lines[-1]
    assert "error" not in final and final["details"]["generated_tokens"] == 600, final
    assert_no_leaks(server, "roll")


def test_the_deep_check_is_reused_for_its_interval_and_probes_dynamic_batching_once(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    # a custom handler (the echo test handler) on dynamic batching: its probe is its raw payload's one-token form
    s = ServerProcess.start(tmp_path_factory.mktemp("deep-health-cached"), models={
        "dyn": {"option.entryPoint": "echo", "option.echo_delay_ms": "0", "batch_size": "2", "minWorkers": "2",
                "maxWorkers": "2"}},
        config={"health_generate_interval": "3600"}, timeout_s=300)
    try:
        with ThreadPoolExecutor(4) as pool:  # concurrent callers share one run
            first = [r.json() for r in pool.map(lambda _: deep(s), range(4))]
        assert all(b["status"] == "Healthy" and b["age_s"] == 0.0 for b in first), first
        assert all(b["models"] == first[0]["models"] for b in first)
        (probe,) = first[0]["models"]["dyn"]["workers"].values()  # one probe: any worker may take the batch
        assert probe["ok"] is True
        assert s.describe("dyn")["batcher"]["batches_total"] == 1  # four callers, one probe
        later = deep(s).json()
        assert later["models"] == first[0]["models"] and later["age_s"] > 0  # the same result, not a new probe
        assert s.describe("dyn")["batcher"]["batches_total"] == 1
    finally:
        s.stop()
