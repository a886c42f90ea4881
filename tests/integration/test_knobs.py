"""Knobs of a live model (``PUT /models/{name}``, gRPC ``UpdateModel``) through a real server under load.

The acceptance runs: on a rolling model ``max_rolling_batch_size`` 32 -> 4 -> 32 while 64 requests run, and on
a dynamic model ``batch_size``/``max_batch_delay`` while 64 requests run; no request fails and every answer is
the model's own. What the engine did is read from its own stats (``GET /models/{name}``: the limits in force
and what the steps since the last change admitted) and from the Prometheus gauge and histogram, never from a
wall clock. Then: where each value came from, refused and bad knobs (each a 400 naming it, nothing changed),
tokens and the model API switch, worker counts (both bounds apply; scaling down retires the idlest worker
after its requests finish), and the gRPC equivalent.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from serving.bench.launch import wait_for
from serving.frontends.proto.gen.rollserve.v1 import generate_pb2 as pb
from serving.frontends.proto.gen.rollserve.v1 import generate_pb2_grpc as pb_grpc
from tests.integration.harness import ServerProcess, greedy_references
from tests.integration.knob_server import (
    HANG_S,
    LONG,
    PROMPTS,
    Load,
    batch_buckets,
    check_answers,
    error,
    gauge,
    greedy,
    job,
    put,
    roll_state,
    running,
    start_server,
    workers,
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    s = start_server(tmp_path_factory.mktemp("knobs"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    """Greedy token ids of every prompt from transformers' own generate, alone, EOS ignored (as the requests)."""
    return greedy_references(PROMPTS, LONG, ignore_eos=True)


# --- acceptance: rolling ------------------------------------------------------------------------------

def test_rolling_batch_size_32_to_4_to_32_under_64_requests(server: ServerProcess,
                                                            reference: dict[str, list[int]]) -> None:
    url = f"{server.url}/predictions/roll"
    # 32 long requests fill the batch; their lengths differ, so they finish one by one
    first = [greedy(PROMPTS[i % 8], 80 + 2 * i) for i in range(32)]
    finished_before = int(roll_state(server)[1].get("num_requests_finished_total", 0))
    load1 = Load(url, first)
    wait_for(lambda: running(server) == (32, 32), "32 requests running", HANG_S)
    second = [greedy(PROMPTS[i % 8], 40 + 2 * (i % 8)) for i in range(32)]
    load2 = Load(url, second)

    def all_64_arrived() -> bool:
        # every request of both loads is waiting, running or finished (on a slow machine the first of the 32
        # may finish, and a waiting one take its place, before the last of the second load arrives)
        batcher, stats = roll_state(server)
        finished = int(stats.get("num_requests_finished_total", 0)) - finished_before
        return int(batcher["waiting"]) + int(batcher["running"]) + finished >= 64 and int(batcher["waiting"]) > 0

    wait_for(all_64_arrived, "the second 32 requests queued", HANG_S)

    # 32 -> 4 with 32 running: nothing is preempted, nothing admitted until fewer than 4 run
    r = put(server, "roll", max_rolling_batch_size=4)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["changed"] == {"max_rolling_batch_size": 4}
    (engine,) = answer["engines"].values()
    assert engine["max_num_seqs"] == 4 and engine["max_num_batched_tokens"] == 2048
    running_at_change = engine["limits"]["running_at_change"]
    assert running_at_change > 4, engine  # the change really came while more than 4 ran
    wait_for(lambda: roll_state(server)[1]["num_running"] < 4, "fewer than 4 running", HANG_S)
    samples: list[float] = []
    # until 12 requests were admitted under the new limit, every reading stays within it
    while True:
        batcher, stats = roll_state(server)
        samples.append(gauge(server, "rollserve_num_requests_running", "roll"))
        assert batcher["running"] <= 4 and stats["num_running"] <= 4, (batcher, stats)
        assert stats["limits"]["peak_running_admitting"] <= 4, stats
        if stats["limits"]["admitted_since_change"] >= 12:
            break
        time.sleep(0.01)
    assert max(samples) <= 4 and samples, samples
    limits = stats["limits"]
    assert limits["first_step_admitted"] == 0  # the first step after the change ran 32: it admitted none
    assert limits["peak_running_admitting"] == 4  # refilled to exactly the new limit, never past it
    assert stats["num_preemptions_total"] == 0 and stats["num_requests_aborted_total"] == 0
    assert batcher["max_rolling_batch_size"] == 4 and batcher["waiting"] > 0

    # 4 -> 32: the waiting requests go to the engine before the new limit and join it at its next step
    r = put(server, "roll", max_rolling_batch_size=32)
    assert r.status_code == 200, r.text
    (engine,) = r.json()["engines"].values()
    assert engine["max_num_seqs"] == 32
    raised = engine["limits"]
    assert raised["waiting_at_change"] > 0 and raised["running_at_change"] <= 4, raised
    def stepped_since_raise() -> dict[str, Any] | None:
        stats = roll_state(server)[1]
        limits = stats["limits"]
        return stats if limits["changes"] == raised["changes"] and limits["first_step_admitted"] is not None \
            else None

    stats = wait_for(stepped_since_raise, "a step after the raise", HANG_S)
    assert stats["limits"]["first_step_admitted"] == raised["waiting_at_change"]  # all of them, at once
    assert stats["limits"]["peak_running_admitting"] == raised["running_at_change"] + raised["waiting_at_change"]
    wait_for(lambda: gauge(server, "rollserve_num_requests_running", "roll") > 4, "the gauge above the old limit",
             HANG_S)

    check_answers(load1.wait(), first, reference)
    check_answers(load2.wait(), second, reference)
    batcher, stats = roll_state(server)
    assert stats["num_preemptions_total"] == 0 and stats["num_requests_aborted_total"] == 0
    assert batcher["running"] == 0 and batcher["waiting"] == 0
    knob = server.describe("roll")["knobs"]["max_rolling_batch_size"]
    assert knob == {"value": 32, "source": "API", "from": "API", "applies": True}


# --- acceptance: dynamic ------------------------------------------------------------------------------

def test_dynamic_batch_size_and_delay_change_while_64_requests_run(server: ServerProcess) -> None:
    before = batch_buckets(server, "dyn")
    bodies = [{"inputs": f"request number {i}"} for i in range(64)]
    load = Load(f"{server.url}/predictions/dyn", bodies)
    wait_for(lambda: server.describe("dyn")["batcher"]["batches_total"] >= 2, "two batches of 8", HANG_S)
    r = put(server, "dyn", batch_size=4, max_batch_delay=590000)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["changed"] == {"batch_size": 4, "max_batch_delay": 590000}
    old = answer["batches_before"]
    assert 2 <= old <= 7, answer  # the change came while requests ran
    responses = load.wait()
    for r, body in zip(responses, bodies, strict=True):
        assert r.status_code == 200 and r.json() == {"generated_text": body["inputs"]}, r.text
    after = batch_buckets(server, "dyn")
    grown = {k: after[k] - before.get(k, 0.0) for k in after}
    new = (64 - 8 * old) // 4
    # the batches before the change had 8 requests each, every one after it 4 (a full batch: the delay is long)
    assert grown["count"] == old + new and grown["sum"] == 64
    assert grown["3.0"] == 0 and grown["4.0"] == new and grown["6.0"] == new and grown["8.0"] == old + new
    described = server.describe("dyn")
    assert (described["batch_size"], described["max_batch_delay"]) == (4, 590000)
    assert described["batcher"]["batch_size"] == 4

    # the delay of the batch being gathered: a lone request waits ten minutes for batch-mates, until the change
    lone = Load(f"{server.url}/predictions/dyn", [{"inputs": "alone"}])
    wait_for(lambda: gauge(server, "rollserve_num_requests_running", "dyn") == 1, "the lone request gathering", HANG_S)
    assert server.describe("dyn")["batcher"]["batches_total"] == old + new  # not sent yet
    assert put(server, "dyn", max_batch_delay=5).status_code == 200
    (r,) = lone.wait(60)
    assert r.status_code == 200 and r.json() == {"generated_text": "alone"}
    assert batch_buckets(server, "dyn")["1.0"] - before.get("1.0", 0.0) == 1


# --- GET: every value and where it came from -----------------------------------------------------------

def test_get_shows_every_knob_with_its_source(server: ServerProcess) -> None:
    knobs = server.describe("dyn")["knobs"]
    assert set(knobs) == {"batch_size", "max_batch_delay", "max_rolling_batch_size",
                          "max_rolling_batch_prefill_tokens", "max_itl_ms", "job_queue_size", "min_worker",
                          "max_worker"}
    assert knobs["max_itl_ms"] == {"value": "auto", "source": "default", "from": "default", "applies": False}
    prefill = knobs["max_rolling_batch_prefill_tokens"]
    assert prefill == {"value": 2048, "source": "env", "from": "env OPTION_MAX_ROLLING_BATCH_PREFILL_TOKENS",
                       "applies": False}
    assert knobs["job_queue_size"]["source"] == "file" and knobs["job_queue_size"]["value"] == 500
    assert knobs["job_queue_size"]["from"].startswith("server config (config.properties:")
    assert knobs["max_rolling_batch_size"] == {"value": 32, "source": "default", "from": "default", "applies": False}
    pool = server.describe("pool")
    assert pool["knobs"]["batch_size"] == {"value": 1, "source": "file", "from": "serving.properties:3",
                                           "applies": True}
    assert pool["sources"]["option.echo_delay_ms"] == {"source": "file", "from": "serving.properties:2"}
    r = put(server, "pool", job_queue_size=77)
    assert r.status_code == 200, r.text
    after = server.describe("pool")
    assert after["knobs"]["job_queue_size"] == {"value": 77, "source": "API", "from": "API", "applies": True}
    assert after["job_queue_size"] == 77 and after["batcher"]["job_queue_size"] == 77
    assert after["sources"]["job_queue_size"] == {"source": "API", "from": "API"}
    assert {k: v for k, v in after["knobs"].items() if k != "job_queue_size"} == \
        {k: v for k, v in pool["knobs"].items() if k != "job_queue_size"}


# --- refused and bad knobs ------------------------------------------------------------------------------

@pytest.mark.parametrize(("query", "named"), [
    ({"option.dtype": "bf16"}, ("'option.dtype'", "needs a reload")),
    ({"tensor_parallel_degree": "2", "kv_cache_memory_mb": "64"},
     ("'tensor_parallel_degree' (option.tensor_parallel_degree)", "'kv_cache_memory_mb'", "they need a reload")),
    ({"batch_size": "2", "dtype": "fp16"}, ("'dtype' (option.dtype)",)),
    ({"bogus": "1"}, ("unknown parameter 'bogus'",)),
    ({"minWorkers": "2"}, ("this API calls it min_worker",)),
    ({"batch_size": "0"}, ("batch_size must be an integer >= 1",)),
    ({"max_batch_delay": "-1"}, ("max_batch_delay must be an integer >= 0",)),
    ({"job_queue_size": "1e3"}, ("job_queue_size must be an integer >= 1",)),
    ({"max_rolling_batch_size": "4"}, ("max_rolling_batch_size does not apply to model 'dyn'", "dynamic batching")),
    ({"min_worker": "3", "max_worker": "2"}, ("min_worker (3) must be <= max_worker (2)",)),
    ({"max_worker": "4"}, ("max_worker must be between 1 and 3 (max_workers_per_model), got 4",)),
    ({}, ("give at least one knob",)),
])
def test_a_bad_knob_is_a_400_naming_it_and_changes_nothing(server: ServerProcess, query: dict[str, str],
                                                           named: tuple[str, ...]) -> None:
    before = server.describe("dyn")
    error(httpx.put(f"{server.mgmt}/models/dyn", params=query, headers=server.mgmt_headers, timeout=30), 400, *named)
    after = server.describe("dyn")
    assert after["knobs"] == before["knobs"] and after["target_workers"] == before["target_workers"]


def test_a_rolling_only_or_dynamic_only_knob_is_refused_on_the_other_kind(server: ServerProcess) -> None:
    error(put(server, "roll", batch_size=4, max_rolling_batch_size=8), 400,
          "batch_size does not apply to model 'roll': it uses rolling batching")
    assert server.describe("roll")["knobs"]["max_rolling_batch_size"]["value"] == 32
    error(put(server, "nope", batch_size=2), 404, "'nope'")


def test_the_management_token_is_required(server: ServerProcess) -> None:
    before = server.describe("dyn")["knobs"]
    for headers in ({}, {"Authorization": "Bearer wrong-token"}, server.inference_headers):
        r = put(server, "dyn", headers=headers, batch_size=2)
        assert r.status_code == 401 and r.headers["WWW-Authenticate"].startswith("Bearer"), r.text
    assert server.describe("dyn")["knobs"] == before


def test_without_the_model_api_batching_knobs_change_and_worker_counts_are_refused(tmp_path: Path) -> None:
    s = ServerProcess.start(tmp_path, models={"echo": {"option.entryPoint": "echo", "batch_size": "2"}})
    try:
        error(put(s, "echo", batch_size=3, min_worker=2), 403, "enable_model_api", "min_worker")
        assert s.describe("echo")["knobs"]["batch_size"]["value"] == 2  # the whole request changed nothing
        r = put(s, "echo", batch_size=3, max_batch_delay=7)
        assert r.status_code == 200, r.text
        assert s.describe("echo")["knobs"]["batch_size"] == {"value": 3, "source": "API", "from": "API",
                                                             "applies": True}
        r = httpx.post(f"{s.url}/predictions/echo", json={"inputs": "still serving"}, timeout=30)
        assert r.status_code == 200 and r.json() == {"generated_text": "still serving"}
    finally:
        s.stop()


# --- workers: both bounds apply, and scaling down retires the idlest after its requests ---------------

@pytest.mark.parametrize("model", ["pool", "steps"])
def test_min_and_max_worker_both_apply_and_scaling_down_retires_the_idlest_after_its_requests(
        server: ServerProcess, model: str) -> None:
    url = f"{server.url}/predictions/{model}"
    r = put(server, model, min_worker=2, max_worker=3)
    assert r.status_code == 200, r.text
    assert r.json()["changed"] == {"min_worker": 2, "max_worker": 3} and r.json()["target_workers"] == 2
    info = server.describe(model)
    assert (info["min_workers"], info["max_workers"], info["target_workers"]) == (2, 3, 2)
    assert [w["status"] for w in info["workers"]] == ["READY", "READY"]
    assert info["knobs"]["max_worker"] == {"value": 3, "source": "API", "from": "API", "applies": True}

    # one worker busy, one idle: going down to one worker retires the idle one at once
    body, expected = job(model, "keep")
    busy = Load(url, [body])
    def one_busy() -> dict[int, int] | None:
        loads = {w["in_flight"]: w["id"] for w in workers(server, model)}
        return loads if sorted(loads) == [0, 1] else None

    loads = wait_for(one_busy, "one busy worker", HANG_S)  # in flight -> worker id
    busy_id, idle_id = loads[1], loads[0]
    r = put(server, model, min_worker=1, max_worker=1)
    assert r.status_code == 200, r.text
    assert r.json()["retiring_workers"] == [idle_id] and r.json()["target_workers"] == 1
    (answer,) = busy.wait()
    assert (answer.status_code, answer.json()) == (200, expected)
    wait_for(lambda: [w["id"] for w in workers(server, model)] == [busy_id], "the idle worker to stop", HANG_S)

    # two busy workers: the one retired gets no new request and stops only once its own finished
    assert put(server, model, min_worker=2, max_worker=2).status_code == 200
    wait_for(lambda: len(workers(server, model)) == 2, "two workers", HANG_S)
    jobs = [job(model, name) for name in ("first", "second", "third")]
    both = Load(url, [body for body, _ in jobs[:2]])
    wait_for(lambda: [w["in_flight"] for w in workers(server, model)] == [1, 1], "both workers busy", HANG_S)
    r = put(server, model, max_worker=1)
    assert r.status_code == 200, r.text
    assert r.json()["changed"] == {"min_worker": 1, "max_worker": 1}  # min follows a max below it
    (retiring,) = r.json()["retiring_workers"]
    states = {w["id"]: (w["status"], w["in_flight"]) for w in workers(server, model)}
    assert states[retiring] == ("RETIRING", 1), states  # still finishing its request
    third = Load(url, [jobs[2][0]])  # goes to the other worker
    responses = both.wait() + third.wait()
    assert [(r.status_code, r.json()) for r in responses] == [(200, expected) for _, expected in jobs]
    wait_for(lambda: len(workers(server, model)) == 1, "the retired worker to stop", HANG_S)
    assert retiring not in [w["id"] for w in workers(server, model)]
    assert server.describe(model)["worker_restarts"] == 0


# --- gRPC -------------------------------------------------------------------------------------------

def test_grpc_update_model(server: ServerProcess) -> None:
    md = server.grpc_metadata
    with grpc.insecure_channel(server.grpc_target) as channel:
        mgmt = pb_grpc.ManagementStub(channel)
        answer = mgmt.UpdateModel(pb.UpdateModelRequest(name="pool", job_queue_size=55, batch_size=2),
                                  timeout=60, metadata=md)
        assert answer.name == "pool"
        assert dict(answer.details["changed"]) == {"batch_size": 2, "job_queue_size": 55}
        assert answer.details["knobs"]["batch_size"]["source"] == "API"
        described = mgmt.DescribeModel(pb.DescribeModelRequest(name="pool"), timeout=10, metadata=md)
        assert described.details["knobs"]["job_queue_size"]["value"] == 55
        for request, code, named in (
                (pb.UpdateModelRequest(name="pool", batch_size=0), grpc.StatusCode.INVALID_ARGUMENT,
                 "batch_size must be an integer between 1 and 999999999, got 0"),
                (pb.UpdateModelRequest(name="pool", max_batch_delay=-5), grpc.StatusCode.INVALID_ARGUMENT,
                 "max_batch_delay must be an integer between 0"),
                (pb.UpdateModelRequest(name="pool", max_rolling_batch_size=3), grpc.StatusCode.INVALID_ARGUMENT,
                 "max_rolling_batch_size does not apply to model 'pool'"),
                (pb.UpdateModelRequest(name="pool"), grpc.StatusCode.INVALID_ARGUMENT, "give at least one knob"),
                (pb.UpdateModelRequest(name="nope", batch_size=2), grpc.StatusCode.NOT_FOUND, "'nope'")):
            with pytest.raises(grpc.RpcError) as info:
                mgmt.UpdateModel(request, timeout=10, metadata=md)
            assert info.value.code() == code and named in info.value.details(), info.value.details()
        with pytest.raises(grpc.RpcError) as info:
            mgmt.UpdateModel(pb.UpdateModelRequest(name="pool", batch_size=3), timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert server.describe("pool")["knobs"]["batch_size"]["value"] == 2
