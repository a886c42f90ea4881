"""The watched model store (``model_store_watch=true``, the model API off) against real server processes: a
folder copied in while another model serves is taken up within 5 s of its last file and serves its weights; a
deleted folder's requests in flight finish and new ones get 404; a folder whose weights are still being written
never loads half-way; a changed folder reloads without a failed request and an invalid one is FAILED with its file:line.
Every wait is on the state the server reports."""

from __future__ import annotations

import re
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from serving.bench.launch import wait_for
from tests.integration.harness import ServerProcess, greedy_references, write_model
from tests.integration.store_models import (
    ECHO,
    NEW_TOKENS,
    PROMPT,
    TINY,
    Load,
    build_pair,
    copy_model,
    greedy,
    state,
    swap_weights,
)

WATCH = {"model_store_watch": "true"}  # the default quiet period: 1 s
QUIET_S = 1.0


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[int], list[int]]:
    a, b = build_pair(tmp_path_factory.mktemp("weights"))
    refs = [greedy_references([PROMPT], NEW_TOKENS, model_dir=d)[PROMPT] for d in (a, b)]
    assert refs[0] != refs[1]
    return a, b, refs[0], refs[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, pair: tuple[Path, Path, list[int], list[int]]
           ) -> Iterator[ServerProcess]:
    workdir = tmp_path_factory.mktemp("watched")
    copy_model(pair[0], workdir / "model_store" / "busy", TINY)
    s = ServerProcess.start(workdir, config=WATCH)
    yield s
    s.stop()


def store(server: ServerProcess) -> Path:
    return server.workdir / "model_store"


class Busy(threading.Thread):
    """Whole requests to a model, one after another, until stopped; ``statuses`` of every answer."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.statuses: list[int] = []
        self.stopped = threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=60) as c:
            while not self.stopped.is_set():
                self.statuses.append(c.post(self.url, json={"inputs": PROMPT,
                                                            "parameters": {"max_new_tokens": 8}}).status_code)


def test_a_copied_folder_is_taken_up_within_5s_of_its_last_file_and_serves_its_weights(
        server: ServerProcess, pair: tuple[Path, Path, list[int], list[int]], tmp_path: Path) -> None:
    """While another model serves, a built tiny Llama copied into the store is registered (the watcher's part: its
    quiet period, then the weights checked whole) within 5 s of its last file, then loads its weights and answers
    with them. The load itself is the worker's, bounded by nothing here: it depends on the machine."""
    busy = Busy(f"{server.url}/predictions/busy")
    busy.start()
    try:
        wait_for(lambda: len(busy.statuses) >= 3, "the other model serving", 60, step_s=0.05)
        staged = copy_model(pair[1], tmp_path / "fresh", TINY)
        shutil.copytree(staged, store(server) / "fresh")
        copied = time.monotonic()  # the copy's last file is written
        wait_for(lambda: state(server, "fresh") is not None, "the copied folder registered", 60, step_s=0.02)
        taken_up = time.monotonic() - copied
        wait_for(lambda: state(server, "fresh") == "READY", "the copied folder READY", 120, step_s=0.05)
        print(f"watch latency: copy complete -> registered {taken_up:.2f}s, -> READY "
              f"{time.monotonic() - copied:.2f}s")
        assert taken_up < 5.0, taken_up
        assert greedy(server, "/predictions/fresh") == pair[3]  # its own weights, not the busy model's
    finally:
        busy.stopped.set()
        busy.join(60)
    assert busy.statuses and set(busy.statuses) == {200}


def test_a_deleted_folder_finishes_its_requests_in_flight_then_answers_404(server: ServerProcess) -> None:
    write_model(store(server), "doomed", {**ECHO, "batch_size": "4", "max_batch_delay": "50",
                                          "option.echo_delay_ms": "8000"})  # past a worker's 5 s stop grace
    wait_for(lambda: state(server, "doomed") == "READY", "doomed READY", 60, step_s=0.05)
    results: list[httpx.Response] = []
    threads = [threading.Thread(target=lambda i=i: results.append(httpx.post(
        f"{server.url}/predictions/doomed", json={"inputs": f"last words {i}"}, timeout=60))) for i in range(3)]
    for t in threads:
        t.start()
    wait_for(lambda: server.describe("doomed")["batcher"]["in_flight_batches"] == 1, "the batch in flight", 30,
             step_s=0.02)
    (worker,) = server.describe("doomed")["workers"]
    shutil.rmtree(store(server) / "doomed")
    wait_for(lambda: state(server, "doomed") is None, "doomed unregistered", 30, step_s=0.02)
    assert all(t.is_alive() for t in threads)  # unregistered while its requests were still running
    r = httpx.post(f"{server.url}/predictions/doomed", json={"inputs": "too late"}, timeout=10)
    assert r.status_code == 404 and r.json()["error_type"] == "not_found"
    for t in threads:
        t.join(60)
    assert sorted((r.status_code, r.json()["generated_text"]) for r in results) == \
        [(200, f"last words {i}") for i in range(3)]
    wait_for(lambda: worker["pid"] not in server.worker_pids(), "its worker to stop", 30, step_s=0.1)
    assert state(server, "busy") == "READY"


def test_a_folder_whose_weights_are_still_being_written_never_loads_half_way(
        server: ServerProcess, pair: tuple[Path, Path, list[int], list[int]]) -> None:
    a, _, ref_a, _ = pair
    folder = store(server) / "half"
    folder.mkdir()
    seen: list[str | None] = []
    writing = threading.Event()
    writing.set()

    def watch() -> None:
        while writing.is_set():
            seen.append(state(server, "half"))
            time.sleep(0.05)

    monitor = threading.Thread(target=watch, daemon=True)
    monitor.start()
    # the configuration first, then the weights in pieces: a piece every 0.2 s, and once a pause longer than
    # the quiet period (a stalled copy), after which only the weights' own length tells they are not whole
    (folder / "serving.properties").write_text("".join(f"{k}={v}\n" for k, v in TINY.items()))
    for f in a.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copyfile(f, folder / f.name)
    data = (a / "model.safetensors").read_bytes()
    pieces = 16
    with open(folder / "model.safetensors", "wb") as out:
        for i in range(pieces):
            out.write(data[i * len(data) // pieces:(i + 1) * len(data) // pieces])
            out.flush()
            time.sleep(2.5 * QUIET_S if i == pieces // 2 else 0.2)
    written = time.monotonic()
    writing.clear()
    monitor.join(10)
    assert seen and set(seen) == {None}, sorted(set(map(str, seen)))  # not registered while being written
    wait_for(lambda: state(server, "half") == "READY", "the whole folder READY", 90, step_s=0.05)
    print(f"watch latency of a torch model (weights whole -> READY): {time.monotonic() - written:.2f}s")
    assert greedy(server, "/predictions/half") == ref_a
    log = server.log()
    assert "half is not settled: files not whole yet (model.safetensors)" in log
    assert "model half: invalid configuration" not in log and not re.search(r"model half: worker \d+ failed", log)


def test_a_changed_folder_reloads_without_a_failed_request_and_an_invalid_one_is_failed(
        server: ServerProcess, pair: tuple[Path, Path, list[int], list[int]]) -> None:
    a, b, ref_a, ref_b = pair
    copy_model(a, store(server) / "live", TINY)
    wait_for(lambda: state(server, "live") == "READY", "live READY", 90, step_s=0.05)
    assert greedy(server, "/predictions/live") == ref_a
    load = Load(f"{server.url}/predictions/live", minimum=40, concurrency=6)
    load.start()
    wait_for(lambda: len(load.outcomes) >= 5, "requests flowing", 60, step_s=0.05)
    swap_weights(store(server) / "live", b)
    wait_for(lambda: (server.describe("live").get("last_reload") or {}).get("status") == "reloaded",
             "the watched reload", 90, step_s=0.05)
    load.finish()
    load.join(120)
    assert [o for o in load.outcomes if not o.ok] == []
    assert greedy(server, "/predictions/live") == ref_b
    # an invalid folder: FAILED with the file and line, the others unaffected
    write_model(store(server), "broken", {**ECHO, "batch_size": "two"})
    wait_for(lambda: state(server, "broken") == "FAILED", "broken FAILED", 30, step_s=0.05)
    assert server.describe("broken")["reason"].startswith("broken/serving.properties:2: batch_size = 'two'")
    # an invalid change to a served folder: the old workers keep serving, the error is reported
    props = store(server) / "live" / "serving.properties"
    props.write_text(props.read_text() + "option.rolling_batch=sometimes\n")
    wait_for(lambda: server.describe("live")["last_reload"]["status"] == "failed", "the failed reload", 60,
             step_s=0.05)
    assert "serving.properties:" in server.describe("live")["last_reload"]["error"]
    assert state(server, "live") == "READY" and greedy(server, "/predictions/live") == ref_b
    assert state(server, "busy") == "READY" and state(server, "fresh") in ("READY", None)
