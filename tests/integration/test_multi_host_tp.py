"""Tensor parallelism across two hosts: two network namespaces with their own addresses, joined by a veth pair
(and one more pair from the test's namespace to the leader's, for the client). The leader ``serving`` runs in
one, a follower ``serving worker`` in the other, each its own process tree and working directory; the TP=2
model answers exactly as the single-process model; a follower with the wrong secret is refused; killing the
follower fails the in-flight stream at once, turns readiness to 503, and the model serves again once a new
follower joins; the leader's death makes the follower exit.

Needs root (``ip netns``), as CI runs.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from serving.bench.launch import wait_for
from tests.integration.harness import DEFAULT_MODEL, ServerProcess, greedy_references
from tests.integration.test_watchdog import Stream

SECRET = "a-secret-the-test-made-up"
PORT = 29500  # the rendezvous port: each namespace has its own port space
PROMPTS = ("The capital of", "Once upon a time there was", "one two three")
PROPERTIES = {"option.rolling_batch": "scheduler", "option.tensor_parallel_degree": "2",
              "option.num_kv_blocks": "256", "option.predict_timeout": "600"}


@dataclass
class Hosts:
    """Namespace ``leader`` (``leader_ip`` toward the follower, ``client_ip`` toward the test) and ``follower``."""

    leader: str
    follower: str
    leader_ip: str
    follower_ip: str
    client_ip: str


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    n = os.getpid() % 100000
    net = 20 + os.getpid() % 200  # a pair of /24s per test process: xdist workers may run this at once
    h = Hosts(f"rsl{n}", f"rsf{n}", f"10.{net}.1.1", f"10.{net}.1.2", f"10.{net}.2.1")
    try:
        for ns in (h.leader, h.follower):
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip("link", "add", f"rsa{n}", "netns", h.leader, "type", "veth", "peer", "name", f"rsb{n}", "netns",
            h.follower)
        _ip("-n", h.leader, "addr", "add", f"{h.leader_ip}/24", "dev", f"rsa{n}")
        _ip("-n", h.follower, "addr", "add", f"{h.follower_ip}/24", "dev", f"rsb{n}")
        _ip("link", "add", f"rsc{n}", "type", "veth", "peer", "name", f"rsd{n}", "netns", h.leader)
        _ip("-n", h.leader, "addr", "add", f"{h.client_ip}/24", "dev", f"rsd{n}")
        _ip("addr", "add", f"10.{net}.2.2/24", "dev", f"rsc{n}")
        for ns, dev in ((h.leader, f"rsa{n}"), (h.follower, f"rsb{n}"), (h.leader, f"rsd{n}")):
            _ip("-n", ns, "link", "set", dev, "up")
        _ip("link", "set", f"rsc{n}", "up")
        yield h
    finally:
        subprocess.run(["ip", "link", "del", f"rsc{n}"], capture_output=True)
        for ns in (h.leader, h.follower):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


class Follower:
    """``serving worker`` in the follower's namespace, from a working directory and model store of its own."""

    def __init__(self, hosts: Hosts, workdir: Path, secret: str) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        store = workdir / "model_store"
        if not store.exists():
            shutil.copytree(DEFAULT_MODEL, store / "tp2")
        self.log_path = workdir / f"follower-{time.monotonic_ns()}.log"
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", hosts.follower, sys.executable, "-m", "serving", "worker", "--leader",
             f"{hosts.leader_ip}:{PORT}", "--model-store", str(store)],
            cwd=workdir, env={**os.environ, "ROLLSERVE_CLUSTER_SECRET": secret, "PYTHONUNBUFFERED": "1"},
            stdout=open(self.log_path, "wb"), stderr=subprocess.STDOUT, start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)


def _ready(server: ServerProcess) -> int:
    return httpx.get(f"{server.url}/health/ready", timeout=5).status_code


def _answers(server: ServerProcess) -> dict[str, list[int]]:
    out = {}
    for p in PROMPTS:
        r = httpx.post(f"{server.url}/predictions/tp2", headers=server.inference_headers, timeout=120, json={
            "inputs": p, "parameters": {"max_new_tokens": 16, "do_sample": False, "details": True}})
        assert r.status_code == 200, r.text
        out[p] = [t["id"] for t in r.json()["details"]["tokens"]]
    return out


def test_a_model_split_over_two_hosts(hosts: Hosts, tmp_path: Path) -> None:
    server = ServerProcess.start(
        tmp_path / "leader", models={"tp2": PROPERTIES}, wait_ready=False, timeout_s=120,
        prefix=["ip", "netns", "exec", hosts.leader], host=hosts.client_ip,
        config={"inference_address": "http://0.0.0.0:0", "management_address": "http://0.0.0.0:0",
                "grpc_address": "0.0.0.0:0"},
        env={"ROLLSERVE_TP_NODES": "2", "ROLLSERVE_CLUSTER_SECRET": SECRET, "MASTER_PORT": str(PORT)})
    followers: list[Follower] = []
    try:
        wait_for(lambda: "waiting for 1 follower host(s) on port 29500" in server.log(), "the leader's rendezvous",
                 timeout_s=120)
        intruder = Follower(hosts, tmp_path / "intruder", "not-the-secret")
        assert intruder.proc.wait(60) == 2
        assert "wrong cluster secret" in intruder.log()
        wait_for(lambda: "refused a peer from" in server.log(), "the leader's refusal")
        assert _ready(server) == 503

        followers.append(Follower(hosts, tmp_path / "follower", SECRET))
        server.wait_ready(300)
        assert "tensor parallel group of 2 ranks up on 2 hosts" in server.log()
        assert _answers(server) == greedy_references(PROMPTS, 16)  # token for token the single-process model

        stream = Stream(server, "tp2")
        stream.wait_tokens(3)
        followers[0].kill()
        killed_at = time.monotonic()
        assert stream.ended.wait(120), "the stream never ended"
        assert stream.lines[-1].get("error_type") == "worker_failed", stream.lines[-1]
        print(f"the stream failed {stream.ended_at - killed_at:.2f} s after the follower was killed")
        wait_for(lambda: _ready(server) == 503, "readiness to turn 503", timeout_s=60)

        followers.append(Follower(hosts, tmp_path / "follower", SECRET))
        server.wait_ready(300)
        assert _answers(server) == greedy_references(PROMPTS, 16)

        server.kill()  # the leader dies: its follower leaves at once, with its ranks
        assert followers[-1].proc.wait(60) == 1
        assert "the leader went away" in followers[-1].log()
    except BaseException:
        print(server.log()[-6000:], *(f.log()[-3000:] for f in followers), sep="\n----\n")
        raise
    finally:
        server.kill()
        for f in followers:
            f.kill()
