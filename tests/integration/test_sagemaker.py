"""SageMaker hosting contract: the inference API on ``SAGEMAKER_BIND_TO_PORT``, custom attributes reach
the handler, ``/ping`` answers within 2 s under load."""

from __future__ import annotations

import concurrent.futures
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


def test_ping_fast_under_load(echo_server: ServerProcess) -> None:
    stop = time.monotonic() + 3.0

    def load() -> int:
        n = 0
        with httpx.Client(timeout=30) as c:
            while time.monotonic() < stop:
                c.post(f"{echo_server.url}/invocations?model_name=echo", json={"inputs": "x " * 200})
                n += 1
        return n

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(load) for _ in range(6)]
        worst = 0.0
        while time.monotonic() < stop:
            t0 = time.monotonic()
            assert httpx.get(f"{echo_server.url}/ping", timeout=2).status_code == 200
            worst = max(worst, time.monotonic() - t0)
            time.sleep(0.1)
        assert sum(f.result() for f in futures) > 0
    assert worst < 2.0
