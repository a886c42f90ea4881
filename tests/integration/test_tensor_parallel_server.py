"""A rolling model with option.tensor_parallel_degree=2 served end to end: the worker's second rank is a
process of its own (a child of the worker) that takes part in every step -- with it stopped, the model
cannot answer while the single-rank model can -- the two ranks answer like the single-rank model, and
shutdown leaves no rank process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from pathlib import Path

import httpx

from tests.integration.harness import ServerProcess, rank_processes

BODY = {"inputs": "Tensor parallel serving", "parameters": {"max_new_tokens": 12, "details": True}}


def token_ids(server: ServerProcess, model: str) -> list[int]:
    r = httpx.post(f"{server.url}/predictions/{model}", json=BODY, timeout=120)
    assert r.status_code == 200, r.text
    return [t["id"] for t in r.json()["details"]["tokens"]]


def children(pid: int) -> dict[int, str]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return {int(p): Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode() for p in out}


def test_tp2_model_runs_on_a_second_rank_process_and_serves_like_tp1(tmp_path: Path) -> None:
    rolling = {"option.rolling_batch": "auto", "option.num_kv_blocks": "256"}
    server = ServerProcess.start(tmp_path, models={"tp1": rolling,
                                                   "tp2": {**rolling, "option.tensor_parallel_degree": "2"}})
    try:
        expected = token_ids(server, "tp1")
        assert token_ids(server, "tp2") == expected
        (tp1_worker,) = [w["pid"] for w in server.describe("tp1")["workers"]]
        (tp2_worker,) = [w["pid"] for w in server.describe("tp2")["workers"]]
        assert set(server.worker_pids()) == {tp1_worker, tp2_worker}
        assert children(tp1_worker) == {}
        ranks = rank_processes(tp2_worker)
        assert list(ranks.values()) == ["tp-rank1"], ranks
        (rank1,) = ranks
        answer: list[list[int]] = []
        os.kill(rank1, signal.SIGSTOP)  # rank 1 frozen: no step of tp2 can complete its all-reduce
        try:
            waiter = threading.Thread(target=lambda: answer.append(token_ids(server, "tp2")), daemon=True)
            waiter.start()
            for _ in range(3):  # meanwhile tp1 answers three times over
                assert token_ids(server, "tp1") == expected
            assert waiter.is_alive() and not answer
        finally:
            os.kill(rank1, signal.SIGCONT)
        waiter.join(120)
        assert answer == [expected]  # rank 1 resumed, and the held request completes exactly
    finally:
        server.stop()  # asserts the whole process group, rank 1 included, is gone
