"""A follower host's weights: streamed from the leader's rendezvous or taken from the host's own store, always
checked against the leader's manifest (name, size, SHA-256); a copy that differs fails the model naming the file.

The rendezvous and the agent's weight step run for real on 127.0.0.1 (no rank is started, so these are cheap);
the last test runs a real leader ``serving`` and ``serving worker`` on loopback. The model split over hosts with
separate filesystems is in ``test_multi_host_tp.py``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from handlers.engine.execution.parallel.follower_host import run_follower
from handlers.engine.execution.parallel.host_weights import FileEntry, WeightsMismatch, check, manifest, weight_files
from handlers.engine.execution.parallel.rendezvous import Rendezvous, connect, recv_frame, send_frame
from serving.bench.launch import wait_for
from serving.worker.follower_weights import WeightsPlacer
from tests.integration.conftest import free_port
from tests.integration.harness import DEFAULT_MODEL, ServerProcess

SECRET = b"a-secret-for-the-weights-test"


@pytest.fixture
def leader_folder(tmp_path: Path) -> Path:
    """A model folder of the leader's own (copies, with a weights file in a subfolder too)."""
    folder = tmp_path / "leader" / "tiny"
    shutil.copytree(DEFAULT_MODEL, folder)
    (folder / "extra").mkdir()
    (folder / "extra" / "notes.json").write_text('{"a": 1}')
    return folder


@pytest.fixture
def rendezvous(leader_folder: Path) -> Rendezvous:
    r = Rendezvous(SECRET, "127.0.0.1", 0)
    r.share(weight_files(leader_folder))
    yield r
    r.close()


def _assignment(entries: list[FileEntry], mode: str, origin: str | None = None) -> dict:
    return {"model": "tiny", "options": {}, "weights": {"manifest": [e.to_wire() for e in entries],
                                                         "mode": mode, "origin": origin}}


def test_the_manifest_lists_the_weights_not_the_settings(leader_folder: Path) -> None:
    (leader_folder / ".complete").write_text("")
    names = [e.name for e in manifest(leader_folder)]
    assert names == ["chat_template.jinja", "config.json", "generation_config.json", "model.safetensors",
                     "tokenizer.json", "tokenizer_config.json", "extra/notes.json"]
    sizes = {e.name: e.size for e in manifest(leader_folder)}
    assert sizes["model.safetensors"] == (leader_folder / "model.safetensors").stat().st_size


def test_a_follower_without_the_files_gets_them_streamed_and_checked(leader_folder: Path, rendezvous: Rendezvous,
                                                                      tmp_path: Path) -> None:
    entries = manifest(leader_folder)
    placer = WeightsPlacer(tmp_path / "follower" / "store", tmp_path / "follower" / "cache", {})
    opened = []

    def open_stream():
        opened.append(1)
        return connect("127.0.0.1", rendezvous.port, SECRET)

    placed = placer.place(_assignment(entries, "auto"), open_stream)
    assert placed.how == "streamed from the leader"
    assert placed.folder.parent == tmp_path / "follower" / "cache"
    assert check(placed.folder, entries, "copy") == (7, sum(e.size for e in entries))
    for e in entries:
        assert (placed.folder / e.name).read_bytes() == (leader_folder / e.name).read_bytes()
    again = placer.place(_assignment(entries, "auto"), open_stream)
    assert again.folder == placed.folder and len(opened) == 1  # the cached copy, not a second stream


def test_the_stream_reads_only_the_listed_files(leader_folder: Path, rendezvous: Rendezvous) -> None:
    sock = connect("127.0.0.1", rendezvous.port, SECRET)
    try:
        for name in ("serving.properties", "../tiny/model.safetensors", "/etc/passwd"):
            send_frame(sock, {"op": "file", "name": name, "offset": 0, "length": 100})
            assert recv_frame(sock) == {"error": f"{name!r} is not among the leader's weight files"}
        send_frame(sock, {"op": "file", "name": "config.json", "offset": 2, "length": 5})
        assert recv_frame(sock) == {"data": (leader_folder / "config.json").read_bytes()[2:7]}
    finally:
        sock.close()


def test_a_changed_file_in_the_hosts_own_copy_is_named(leader_folder: Path, tmp_path: Path) -> None:
    entries = manifest(leader_folder)
    own = tmp_path / "follower" / "store" / "tiny"
    shutil.copytree(leader_folder, own)
    data = bytearray((own / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF  # the same size, another byte
    (own / "model.safetensors").write_bytes(bytes(data))
    placer = WeightsPlacer(own.parent, tmp_path / "follower" / "cache", {})
    placed = placer.place(_assignment(entries, "resolve"), lambda: pytest.fail("resolve must not stream"))
    assert (placed.folder, placed.how) == (own, "this host's model store")
    with pytest.raises(WeightsMismatch, match=r"^copy: model\.safetensors has SHA-256 [0-9a-f]{16}\.\.\., the "
                                              r"leader's [0-9a-f]{16}\.\.\.$"):
        check(own, entries, "copy")
    (own / "extra" / "notes.json").unlink()
    with pytest.raises(WeightsMismatch, match=r"^copy lacks extra/notes\.json, which the leader's copy holds$"):
        check(own, entries, "copy")
    (own / "extra" / "notes.json").write_text('{"a": 1}')
    (own / "model-00002.safetensors").write_bytes(b"x")
    with pytest.raises(WeightsMismatch, match=r"^copy holds model-00002\.safetensors, which the leader's copy "):
        check(own, entries, "copy")


def test_resolve_without_the_folder_is_refused_and_auto_streams(leader_folder: Path, rendezvous: Rendezvous,
                                                                 tmp_path: Path) -> None:
    entries = manifest(leader_folder)
    placer = WeightsPlacer(tmp_path / "empty-store", tmp_path / "cache", {})
    with pytest.raises(Exception, match=r"model folder tiny is not in this host's model store"):
        placer.place(_assignment(entries, "resolve"), lambda: pytest.fail("resolve must not stream"))
    unreachable = "s3://bucket/model"  # no endpoint answers on this port: the host cannot reach the source
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}", "AWS_ACCESS_KEY_ID": "x",
           "AWS_SECRET_ACCESS_KEY": "x", "AWS_MAX_ATTEMPTS": "1", "AWS_DEFAULT_REGION": "us-east-1"}
    placer = WeightsPlacer(tmp_path / "empty-store", tmp_path / "cache", env)
    placed = placer.place(_assignment(entries, "auto", unreachable),
                          lambda: connect("127.0.0.1", rendezvous.port, SECRET))
    assert placed.how == "streamed from the leader"
    with pytest.raises(Exception, match=r"s3://bucket/model"):
        placer.place(_assignment(entries, "resolve", unreachable), lambda: pytest.fail("resolve must not stream"))


def test_the_leader_hears_why_a_follower_cannot_run(leader_folder: Path, tmp_path: Path) -> None:
    """The agent's answer on its lifeline: a copy that differs is permanent and names the file; the agent exits 2
    without starting a rank."""
    rendezvous = Rendezvous(SECRET, "127.0.0.1", 0)
    own = tmp_path / "store" / "tiny"
    shutil.copytree(leader_folder, own)
    (own / "tokenizer.json").write_text("{}")
    status: list[int] = []
    agent = threading.Thread(target=lambda: status.append(run_follower(
        ("127.0.0.1", rendezvous.port), SECRET.decode(), WeightsPlacer(own.parent, tmp_path / "cache", {}),
        connect_timeout_s=30)))
    agent.start()
    try:
        (follower,) = rendezvous.wait_followers(1)
        rendezvous.assign(follower, {"world_size": 2, "first_rank": 1, "ranks": 1, "gpu": False,
                                     **_assignment(manifest(leader_folder), "resolve")})
        answer = rendezvous.weights_answer(follower)
        agent.join(60)
        assert status == [2]
        size = (own / "tokenizer.json").stat().st_size
        assert answer == {"error": f"this host's copy (this host's model store): tokenizer.json has {size} bytes, "
                                   f"the leader's {(leader_folder / 'tokenizer.json').stat().st_size}",
                          "permanent": True}
        assert rendezvous.lost == []  # never watched: the group did not form
    finally:
        rendezvous.close()


def test_a_model_whose_follower_copy_differs_is_failed_naming_the_file(tmp_path: Path) -> None:
    """A real leader and agent on loopback: the follower's own model folder has another tokenizer.json."""
    port = free_port()
    server = ServerProcess.start(
        tmp_path / "leader", models={"tp2": {"option.rolling_batch": "scheduler",
                                             "option.tensor_parallel_degree": "2",
                                             "option.follower_weights": "resolve"}},
        wait_ready=False, env={"ROLLSERVE_TP_NODES": "2", "ROLLSERVE_CLUSTER_SECRET": SECRET.decode(),
                               "MASTER_PORT": str(port), "ROLLSERVE_CLUSTER_BIND": "127.0.0.1"})
    store = tmp_path / "follower" / "model_store"
    shutil.copytree(DEFAULT_MODEL, store / "tp2")
    (store / "tp2" / "tokenizer.json").write_text("{}")
    try:
        agent = subprocess.Popen(
            [sys.executable, "-m", "serving", "worker", "--leader", f"127.0.0.1:{port}", "--model-store", str(store),
             "--model-cache", str(tmp_path / "follower" / "cache"), "--connect-timeout", "90"],
            env={**os.environ, "ROLLSERVE_CLUSTER_SECRET": SECRET.decode()}, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True)
        try:  # the agent gives up on a leader that never listens first, saying so in its stderr
            _, stderr = agent.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            agent.kill()
            _, stderr = agent.communicate()
        assert agent.returncode == 2, f"{stderr}\n--- the leader's log:\n{server.log()[-4000:]}"
        assert "tokenizer.json has 2 bytes, the leader's" in stderr
        wait_for(lambda: server.describe("tp2")["state"] == "FAILED", "the model to fail", timeout_s=60)
        reason = str(server.describe("tp2"))
        assert "follower host 127.0.0.1: this host's copy (this host's model store): tokenizer.json has 2 bytes, " \
               "the leader's" in reason, reason
    finally:
        server.kill()
