"""Through real servers: no request waits forever. A queue-wait limit answers 503 with a
measured Retry-After; a model that turns FAILED, or is unregistered while requests wait, fails them at
once; a malformed output fails its own request while its batch-mates are answered."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from serving.bench.launch import wait_for
from tests.integration.harness import ServerProcess
from tests.integration.hostile import POISON_HANDLER, error_of, lmi_body, post, twelve_afterwards

FLAKY_HANDLER = '''
import time
from pathlib import Path

from handlers.base import Output

MARKER = Path(__file__).with_name("loaded-once")


def initialize(ctx):
    if MARKER.exists():  # every load after the first fails: a model that turns FAILED once its worker dies
        raise RuntimeError("the weights changed under the server")
    MARKER.write_text("1")


def handle(inputs):
    if any(i.prompt == "slow" for i in inputs):
        time.sleep(3)
    return [Output(request_id=i.request_id, text=i.prompt) for i in inputs]
'''


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    s = ServerProcess.start(tmp_path_factory.mktemp("no-hangs"), models={
        "slow": {"option.entryPoint": "echo", "option.echo_delay_ms": "2000", "max_queue_time": "0.5"},
        "slowroll": {"option.entryPoint": "model.py", "option.rolling_batch": "auto", "max_queue_time": "0.5",
                     "option.max_rolling_batch_size": "1"},
        "flaky": {"option.entryPoint": "model.py", "max_queue_time": "600"},
        "echo": {"option.entryPoint": "echo"},
        "spare": {"option.entryPoint": "echo", "option.echo_delay_ms": "3000", "max_queue_time": "600"},
    }, files={"slowroll": {"model.py": POISON_HANDLER}, "flaky": {"model.py": FLAKY_HANDLER}},
        config={"enable_model_api": "true", "drain_timeout": "1", "ping_requires": "any"})
    deadline = time.monotonic() + 120  # ping_requires=any: ready at the first model, so wait for all
    while any(s.describe(m)["state"] != "READY" for m in ("slow", "slowroll", "flaky", "echo", "spare")):
        assert time.monotonic() < deadline and "FAILED" not in str(s.describe("flaky")), s.log()[-3000:]
        time.sleep(0.1)
    yield s
    s.stop()


def in_worker(server: ServerProcess, model: str) -> int:
    """Requests the model's worker holds now: a dynamic model's batches in flight, a rolling one's running."""
    b = server.describe(model)["batcher"]
    return int(b["running"] if "running" in b else b["in_flight_batches"])


def timed(fn: object, *args: object) -> tuple[httpx.Response, float]:
    r = fn(*args)  # type: ignore[operator]
    return r, time.monotonic()


def test_queue_wait_limit_answers_503_with_retry_after_before_the_busy_request_ends(server: ServerProcess) -> None:
    for model, busy_body in (("slow", {"inputs": "busy"}), ("slowroll", lmi_body("busy", max_new_tokens=150))):
        with ThreadPoolExecutor(4) as pool:
            busy = pool.submit(timed, post, server, f"/predictions/{model}", busy_body)
            wait_for(lambda model=model: in_worker(server, model) == 1, f"the busy request in {model}'s worker")
            queued = [pool.submit(timed, post, server, f"/predictions/{model}", lmi_body(f"q{i}", max_new_tokens=2)
                                  if model == "slowroll" else {"inputs": f"q{i}"}) for i in range(3)]
            busy_response, busy_end = busy.result()
            answers = [q.result() for q in queued]
        assert busy_response.status_code == 200, busy_response.text
        for r, end in answers:
            error_of(r, 503, "max_queue_time")
            assert int(r.headers["Retry-After"]) >= 1
            assert end < busy_end  # answered while the request ahead was still running: no waiting it out
        twelve_afterwards(server, "echo")


def test_a_model_that_turns_failed_fails_its_queued_requests(server: ServerProcess) -> None:
    s = server
    pid = s.describe("flaky")["workers"][0]["pid"]
    with ThreadPoolExecutor(4) as pool:
        slow = pool.submit(post, s, "/predictions/flaky", {"inputs": "slow"}, 120)
        wait_for(lambda: in_worker(s, "flaky") == 1, "the slow request in the worker")
        queued = [pool.submit(post, s, "/predictions/flaky", {"inputs": f"q{i}"}, 120) for i in range(3)]
        wait_for(lambda: s.describe("flaky")["batcher"]["queued"] == 3, "three requests queued behind it")
        os.kill(pid, signal.SIGKILL)  # its restarts fail to load: the model turns FAILED
        responses = [slow.result(), *[q.result() for q in queued]]
    for r in responses:
        error_of(r, 503, "flaky", "FAILED")
    assert s.describe("flaky")["state"] == "FAILED"
    assert "the weights changed under the server" in s.describe("flaky")["reason"]
    twelve_afterwards(s, "echo")  # the other models are fine


def test_unregistering_a_model_fails_the_requests_its_drain_left(server: ServerProcess) -> None:
    s = server
    with ThreadPoolExecutor(4) as pool:
        pending = [pool.submit(post, s, "/predictions/spare", {"inputs": f"r{i}"}, 120) for i in range(3)]
        wait_for(lambda: in_worker(s, "spare") == 1 and s.describe("spare")["batcher"]["queued"] == 2,
                 "one request in the worker, two queued")
        r = httpx.delete(f"{s.mgmt}/models/spare", headers=s.mgmt_headers, timeout=60)
        assert r.status_code == 200, r.text
        responses = [p.result() for p in pending]
    # drain_timeout=1 s: the request in the worker (3 s) completes as its worker stops; the two queued behind
    # it are failed at once instead of waiting forever
    assert sorted(r.status_code for r in responses) == [200, 503, 503], [r.text for r in responses]
    for r in responses:
        if r.status_code == 503:
            error_of(r, 503, "spare", "unloaded")
    twelve_afterwards(s, "echo")


def test_a_malformed_output_fails_alone_and_its_batch_mates_are_answered(hostile_server: ServerProcess) -> None:
    s = hostile_server
    barrier = threading.Barrier(4)

    def one(prompt: str) -> httpx.Response:
        barrier.wait()
        return post(s, "/predictions/custom", {"inputs": prompt}, 60)

    with ThreadPoolExecutor(4) as pool:
        responses = list(pool.map(one, ["malformed", "a", "b", "c"]))
    error_of(responses[0], 424, "malformed")
    for prompt, r in zip("abc", responses[1:], strict=True):
        assert r.status_code == 200 and r.json() == {"echo": {"inputs": prompt}}, r.text
    twelve_afterwards(s, "custom")

