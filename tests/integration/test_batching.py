"""Dynamic batching and queue limits, observed from outside through a real server and real HTTP clients
(echo entry point: no torch, fast workers)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from serving.bench.launch import wait_for
from tests.integration.harness import ServerProcess

BATCH_DELAY_MS = 1500


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    s = ServerProcess.start(tmp_path_factory.mktemp("batching"), models={
        "echo8": {"option.entryPoint": "echo", "batch_size": "8", "max_batch_delay": str(BATCH_DELAY_MS),
                  "option.echo_fail_on": "FAIL"},
        # a full batch of 8 goes out at once: its delay (an hour) is never what sends it
        "full8": {"option.entryPoint": "echo", "batch_size": "8", "max_batch_delay": "3600000"},
        "slow": {"option.entryPoint": "echo", "batch_size": "1", "max_batch_delay": "1", "job_queue_size": "2",
                 "option.echo_delay_ms": "3000"},
    })
    yield s
    s.stop()


def batches_total(server: ServerProcess, model: str) -> int:
    return int(server.describe(model)["batcher"]["batches_total"])


async def post_many(url: str, bodies: list[dict[str, Any]]) -> list[tuple[httpx.Response, float]]:
    async with httpx.AsyncClient(timeout=30) as client:
        async def one(body: dict[str, Any]) -> tuple[httpx.Response, float]:
            t0 = time.monotonic()
            r = await client.post(url, json=body)
            return r, time.monotonic() - t0
        return await asyncio.gather(*(one(b) for b in bodies))


def test_lone_request_waits_for_the_batch_delay(server: ServerProcess) -> None:
    before = batches_total(server, "echo8")
    t0 = time.monotonic()
    r = httpx.post(f"{server.url}/predictions/echo8", json={"inputs": "alone here"}, timeout=30)
    elapsed = time.monotonic() - t0
    assert r.status_code == 200, r.text
    assert r.json() == {"generated_text": "alone here"}
    # lower bounds (a slow machine cannot break them): it waited for batch-mates for the whole delay
    assert elapsed >= BATCH_DELAY_MS / 1000
    assert float(r.headers["X-Queue-Time-Ms"]) >= BATCH_DELAY_MS
    assert batches_total(server, "echo8") == before + 1


def test_full_batch_is_served_together_before_the_delay(server: ServerProcess) -> None:
    before = batches_total(server, "full8")
    bodies = [{"inputs": f"prompt number {i}"} for i in range(8)]
    results = asyncio.run(post_many(f"{server.url}/predictions/full8", bodies))
    for (r, _), body in zip(results, bodies, strict=True):
        assert r.status_code == 200, r.text
        assert r.json()["generated_text"] == body["inputs"]
    assert batches_total(server, "full8") == before + 1


def test_one_failing_item_does_not_fail_its_batch_mates(server: ServerProcess) -> None:
    bodies = [{"inputs": f"ok {i}"} for i in range(7)] + [{"inputs": "please FAIL"}]
    results = asyncio.run(post_many(f"{server.url}/predictions/echo8", bodies))
    codes = [r.status_code for r, _ in results]
    assert codes[:7] == [200] * 7
    assert codes[7] == 424
    err = results[7][0].json()
    assert err["error_type"] == "handler_error" and "FAIL" in err["error"] and err["request_id"]


def test_queue_full_gets_503_with_retry_after_promptly(server: ServerProcess) -> None:
    url = f"{server.url}/predictions/slow"
    accepted: list[httpx.Response] = []

    def send(i: int) -> None:
        accepted.append(httpx.post(url, json={"inputs": f"queued {i}"}, timeout=60))

    def batcher() -> dict[str, Any]:
        return dict(server.describe("slow")["batcher"])

    # one request runs in the worker (3 s), two fill the queue (job_queue_size=2)
    threads = [threading.Thread(target=send, args=(i,)) for i in range(3)]
    for i, t in enumerate(threads):
        t.start()
        want = (1, 0) if i == 0 else (1, i)
        wait_for(lambda want=want: (lambda b: (b["in_flight_batches"], b["queued"]) == want)(batcher()),
                 f"batches in flight and queued = {want}", 30)
    for _ in range(2):
        r = httpx.post(url, json={"inputs": "one too many"}, timeout=30)
        assert r.status_code == 503, r.text
        assert int(r.headers["Retry-After"]) >= 1
        body = r.json()
        assert body["error_type"] == "overloaded" and "queue is full" in body["error"] and body["request_id"]
    # promptly: refused while the first request was still in the worker, nothing dequeued yet
    b = batcher()
    assert (b["in_flight_batches"], b["queued"], b["batches_total"]) == (1, 2, 1), b
    for t in threads:
        t.join(60)
    assert sorted(r.status_code for r in accepted) == [200, 200, 200]
    assert sorted(r.json()["generated_text"] for r in accepted) == [f"queued {i}" for i in range(3)]

