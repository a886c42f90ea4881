"""SageMaker hosting contract: the inference API on ``SAGEMAKER_BIND_TO_PORT``, custom attributes reach
the handler, ``/ping`` answers within 2 s under load."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import httpx

from tests.integration.harness import ServerProcess


def test_inference_binds_sagemaker_port(echo_server: ServerProcess) -> None:
    assert echo_server.ports["inference"] == echo_server.sagemaker_port  # type: ignore[attr-defined]
    r = httpx.get(f"http://127.0.0.1:{echo_server.sagemaker_port}/ping", timeout=5)  # type: ignore[attr-defined]
    assert r.status_code == 200


def test_custom_attributes_reach_the_handler(echo_server: ServerProcess) -> None:
    attrs = "trace_id=abc;tenant=t1"
    r = httpx.post(f"{echo_server.url}/invocations?model_name=attrs", json={"inputs": "hi"},
                   headers={"X-Amzn-SageMaker-Custom-Attributes": attrs}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["attributes"] == {"custom_attributes": attrs}
    r = httpx.post(f"{echo_server.url}/invocations?model_name=attrs", json={"inputs": "hi"},
                   headers={"X-Amzn-SageMaker-Custom-Attributes": "x" * 1025}, timeout=30)
    assert r.status_code == 400 and r.json()["error_type"] == "invalid_request"


def test_invocations_lmi_body(echo_server: ServerProcess) -> None:
    r = httpx.post(f"{echo_server.url}/invocations?model_name=echo", json={"inputs": "a b c"}, timeout=30)
    assert r.status_code == 200 and r.json()["generated_text"] == "a b c"


def test_ping_answers_at_once_under_load(echo_server: ServerProcess) -> None:
    """SageMaker wants /ping within 2 s whatever the load: /ping never waits behind inference work. Checked by
    event order: ten pings all answer while requests sent before them are still queued on a saturated model,
    and while other clients keep the server's CPU busy."""
    url = echo_server.url
    stop = threading.Event()

    def busy() -> None:
        with httpx.Client(timeout=30) as c:
            while not stop.is_set():
                c.post(f"{url}/invocations?model_name=echo", json={"inputs": "x " * 200})

    def queued() -> int:
        return int(echo_server.describe("slow")["batcher"]["queued"])

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        load = [pool.submit(busy) for _ in range(4)]
        slow = [pool.submit(httpx.post, f"{url}/predictions/slow", json={"inputs": f"s {i}"}, timeout=60)
                for i in range(8)]
        deadline = time.monotonic() + 30
        while queued() < 6:  # one in the worker, the rest queued: about 3.5 s of work ahead
            assert time.monotonic() < deadline
            time.sleep(0.01)
        pings = [httpx.get(f"{url}/ping", timeout=30) for _ in range(10)]
        still_queued = queued()
        stop.set()
        answers = [f.result() for f in slow]
        for f in load:
            f.result()
    assert [p.status_code for p in pings] == [200] * 10
    assert still_queued > 0, "the pings waited for the queue to drain"
    assert sorted(r.json()["generated_text"] for r in answers) == sorted(f"s {i}" for i in range(8))
