"""1,000 requests with random model names, random request ids and bad inputs add no series to /metrics
beyond a constant set (the model label is bounded; ids, paths and user strings are never labels)."""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.harness import ServerProcess


def series(url: str, headers: dict[str, str]) -> set[tuple[str, frozenset[tuple[str, str]]]]:
    text = httpx.get(url + "/metrics", headers=headers, timeout=10).text
    return {(s.name, frozenset(s.labels.items())) for f in text_string_to_metric_families(text) for s in f.samples}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    s = ServerProcess.start(tmp_path_factory.mktemp("cardinality"),
                            models={"echo": {"option.entryPoint": "echo", "max_batch_delay": "1"}})
    yield s
    s.stop()


def test_random_models_and_bad_inputs_add_a_constant_number_of_series(server: ServerProcess) -> None:
    rng = random.Random(7)

    async def one(c: httpx.AsyncClient, i: int) -> None:
        name = uuid.UUID(int=rng.getrandbits(128)).hex
        headers = {"X-Request-Id": f"rid-{name}"}
        kind = i % 5
        if kind == 0:
            await c.post(f"{server.url}/predictions/{name}", json={"inputs": name}, headers=headers)
        elif kind == 1:
            await c.post(f"{server.url}/invocations?model_name={name}", json={"inputs": name}, headers=headers)
        elif kind == 2:
            await c.post(f"{server.url}/predictions/echo", content=name.encode(), headers=headers)
        elif kind == 3:
            await c.post(f"{server.url}/predictions/echo", json={"inputs": name, "parameters": {name: 1}, name: name},
                         headers=headers)
        else:
            await c.post(f"{server.url}/predictions/echo", json={"inputs": f"{name} ok"}, headers=headers)

    async def flood(first: int, count: int, concurrency: int) -> None:
        queue = iter(range(first, first + count))
        async with httpx.AsyncClient(timeout=60) as c:
            async def lane() -> None:
                for i in queue:
                    await one(c, i)
            await asyncio.gather(*(lane() for _ in range(concurrency)))

    asyncio.run(flood(0, 10, 1))  # one of each kind first: the constant set of series every kind creates
    baseline = series(server.mgmt, server.mgmt_headers)
    asyncio.run(flood(10, 1000, 16))
    after = series(server.mgmt, server.mgmt_headers)
    grown = after - baseline
    assert not grown, sorted(grown)[:10]
    text = httpx.get(server.mgmt + "/metrics", headers=server.mgmt_headers, timeout=10).text
    assert "rid-" not in text and "/predictions" not in text
    assert len(after) < 400
