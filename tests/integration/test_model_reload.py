"""Zero-downtime reload (``PUT /models/{name}/reload``) against a real server: 100 concurrent requests, half of
them streams, across a reload lose none; the new weights answer afterwards and the old workers are gone; a
reload that cannot load leaves the old workers serving and reports why."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from serving.bench.launch import wait_for
from tests.integration.harness import ServerProcess, greedy_references
from tests.integration.store_models import (
    NEW_TOKENS,
    PROMPT,
    STREAM_TOKENS,
    TINY,
    Load,
    build_pair,
    copy_model,
    greedy,
    swap_weights,
)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[int], list[int]]:
    """Two models and their greedy answers of ``STREAM_TOKENS`` (a whole answer is the first ``NEW_TOKENS``)."""
    a, b = build_pair(tmp_path_factory.mktemp("weights"))
    refs = [greedy_references([PROMPT], STREAM_TOKENS, model_dir=d)[PROMPT] for d in (a, b)]
    assert refs[0][:NEW_TOKENS] != refs[1][:NEW_TOKENS]  # the two models answer differently
    return a, b, refs[0], refs[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, pair: tuple[Path, Path, list[int], list[int]]
           ) -> Iterator[ServerProcess]:
    workdir = tmp_path_factory.mktemp("reload")
    copy_model(pair[0], workdir / "model_store" / "swap", TINY)
    s = ServerProcess.start(workdir, config={"drain_timeout": "60"})
    yield s
    s.stop()


def answers(ref: list[int]) -> tuple[list[int], list[int]]:
    return ref[:NEW_TOKENS], ref


def test_reload_needs_the_management_token_and_a_registered_model(server: ServerProcess) -> None:
    assert httpx.put(f"{server.mgmt}/models/swap/reload", timeout=10).status_code == 401
    r = httpx.put(f"{server.mgmt}/models/nope/reload", headers=server.mgmt_headers, timeout=10)
    assert r.status_code == 404 and r.json()["error_type"] == "not_found"


def test_a_reload_that_cannot_load_leaves_the_old_version_serving(
        server: ServerProcess, pair: tuple[Path, Path, list[int], list[int]]) -> None:
    _, _, ref_a, _ = pair
    (old,) = server.describe("swap")["workers"]
    props = server.workdir / "model_store" / "swap" / "serving.properties"
    good = props.read_text()
    props.write_text(good + "batch_size=lots\n")
    r = httpx.put(f"{server.mgmt}/models/swap/reload", headers=server.mgmt_headers, timeout=120)
    assert r.status_code == 500, r.text
    body = r.json()
    line = len(good.splitlines()) + 1
    assert body["error_type"] == "reload_failed" and f"serving.properties:{line}" in body["error"], body
    assert "keeps serving" in body["error"]
    info = server.describe("swap")
    assert info["state"] == "READY" and [w["pid"] for w in info["workers"]] == [old["pid"]]
    assert info["last_reload"]["status"] == "failed" and f"serving.properties:{line}" in info["last_reload"]["error"]
    assert greedy(server, "/predictions/swap") == ref_a[:NEW_TOKENS]
    # fixed: the next reload goes through
    props.write_text(good)
    r = httpx.put(f"{server.mgmt}/models/swap/reload", headers=server.mgmt_headers, timeout=120)
    assert r.status_code == 200, r.text
    assert server.describe("swap")["last_reload"]["status"] == "reloaded"
    assert greedy(server, "/predictions/swap") == ref_a[:NEW_TOKENS]


def test_100_requests_across_a_reload_lose_none_and_the_new_weights_answer(
        server: ServerProcess, pair: tuple[Path, Path, list[int], list[int]]) -> None:
    _, b, ref_a, ref_b = pair
    assert greedy(server, "/predictions/swap") == ref_a[:NEW_TOKENS]
    (old,) = server.describe("swap")["workers"]
    load = Load(f"{server.url}/predictions/swap", minimum=100, concurrency=12)
    load.start()
    wait_for(lambda: len(load.outcomes) >= 10, "requests flowing before the reload", 120, step_s=0.05)
    swap_weights(server.workdir / "model_store" / "swap", b)
    asked = time.monotonic()
    r = httpx.put(f"{server.mgmt}/models/swap/reload", headers=server.mgmt_headers, timeout=120)
    switched = time.monotonic()
    load.finish()
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["version"] == "1" and answer["state"] == "READY" and answer["retiring_workers"] == [old["pid"]]
    # the server switched under load: requests were running on the old worker, which finished them
    assert answer["retiring_in_flight"] > 0, answer
    load.join(300)
    outcomes = load.outcomes
    assert len(outcomes) >= 100 and sum(o.stream for o in outcomes) >= 50
    failed = [o for o in outcomes if not o.ok]
    assert failed == [], failed[:3]
    # every answer is one model's whole greedy answer: the old weights' until the reload was asked, the new
    # ones' once it had answered
    assert all(o.tokens in (*answers(ref_a), *answers(ref_b)) for o in outcomes), [o.tokens for o in outcomes][:4]
    before = [o for o in outcomes if o.started < asked]  # routed to the old worker: finished there
    assert len(before) >= 10 and all(o.tokens in answers(ref_a) for o in before)
    assert any(o.stream and o.ended > asked for o in before)  # a stream was running when the reload began
    after = [o for o in outcomes if o.started > switched]
    assert after and all(o.tokens in answers(ref_b) for o in after)
    assert greedy(server, "/predictions/swap") == ref_b[:NEW_TOKENS]
    info = server.describe("swap")
    assert info["last_reload"]["status"] == "reloaded" and info["state"] == "READY"
    (new,) = info["workers"]
    assert new["pid"] != old["pid"]
    wait_for(lambda: old["pid"] not in server.worker_pids(), "the old worker to stop", 60, step_s=0.1)
