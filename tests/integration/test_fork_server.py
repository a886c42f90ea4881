"""The fork server (serving.worker.forkserver) and the frontend's side of it (serving.worker.launcher): a forked
child runs with torch and transformers already imported, in the environment it was given, with its own random
state, and its OpenMP matrix product runs; its exit code and its death by signal reach the frontend; it dies with
the fork server, after which the next worker starts a new one; imports that start a thread pool turn forking off
and workers are exec'd. Through the server: a worker killed under a model is forked again, and
``worker_fork_server=false`` restores exec'd workers."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from serving.worker.launcher import ForkedProcess, ForkLauncher, ForkServer, ForkServerGone
from tests.integration.harness import ServerProcess

PROBE = "tests.integration.fork_probe"
ENV = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
       "PROBE_MARK": "given"}


async def wait_file(path: Path, proc: ForkedProcess) -> dict:
    """The probe's facts, once written (or its exit code, if it died first)."""
    while not path.exists():
        assert proc.returncode is None, f"probe exited with {proc.returncode} before writing {path}"
        await asyncio.sleep(0.02)
    return json.loads(path.read_text())


def test_forked_children_exit_codes_signals_environment_and_seeds(tmp_path: Path) -> None:
    async def run() -> None:
        server = await ForkServer.start({**os.environ, "PROBE_INHERITED": "server's"}, (), timeout_s=120)
        try:
            a = await server.spawn(PROBE, [str(tmp_path / "a.json"), "3", "exit"], ENV)
            b = await server.spawn(PROBE, [str(tmp_path / "b.json"), "0", "wait"], ENV)
            facts_a = await wait_file(tmp_path / "a.json", a)
            facts_b = await wait_file(tmp_path / "b.json", b)
            assert await a.wait() == 3
            assert facts_a["preloaded"] and facts_a["ppid"] == server.proc.pid == facts_b["ppid"]
            assert facts_a["env"]["PROBE_MARK"] == "given" and "PROBE_INHERITED" not in facts_a["env"]
            assert facts_a["product"] == 512.0 and facts_a["comm"] == "rollserve-wrk"
            assert facts_a["rand"] != facts_b["rand"]  # each child reseeded torch's generator
            assert b.returncode is None
            b.send_signal(signal.SIGKILL)
            assert await b.wait() == -signal.SIGKILL
            b.send_signal(signal.SIGKILL)  # reaped: a no-op, never a signal to a reused pid
        finally:
            await server.close()
        assert server.proc.returncode == 0  # it exits when the frontend closes its channel

    asyncio.run(run())


def test_children_die_with_the_fork_server_and_the_next_worker_starts_a_new_one(tmp_path: Path) -> None:
    async def run() -> None:
        launcher = ForkLauncher(os.environ)
        try:
            first = await launcher.fork_server()
            assert first is not None
            child = await first.spawn(PROBE, [str(tmp_path / "c.json"), "0", "wait"], ENV)
            facts = await wait_file(tmp_path / "c.json", child)
            first.proc.kill()
            assert await child.wait() == -signal.SIGKILL
            while Path(f"/proc/{facts['pid']}").exists():  # PR_SET_PDEATHSIG: killed with its parent
                await asyncio.sleep(0.02)
            second = await launcher.fork_server()
            assert second is not None and second is not first and second.proc.pid != first.proc.pid
        finally:
            await launcher.close()

    asyncio.run(run())


def test_imports_that_start_a_thread_pool_turn_forking_off(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    async def run() -> None:
        with pytest.raises(ForkServerGone, match="the imports started threads"):
            await ForkServer.start(os.environ, ("tests.integration.fork_probe_omp",), timeout_s=120)
        launcher = ForkLauncher(os.environ, ("tests.integration.fork_probe_omp",))
        try:
            with caplog.at_level(logging.WARNING, logger="serving.worker.launcher"):
                proc = await launcher.spawn(["--socket", str(tmp_path / "absent.sock")], os.environ,
                                            needs_torch=True)
            assert isinstance(proc, asyncio.subprocess.Process)  # exec'd: our own child
            assert await proc.wait() != 0  # no frontend socket there
            assert "workers start without the fork server" in caplog.text
        finally:
            await launcher.close()

    asyncio.run(run())


def parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def comm(pid: int) -> str:
    return Path(f"/proc/{pid}/comm").read_text().strip()


def worker_pid(server: ServerProcess, model: str, other_than: int | None = None) -> int:
    """The model's serving worker, as the server reports it (a new one after ``other_than`` was killed)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        pids = [w["pid"] for w in server.describe(model)["workers"]
                if w["status"] == "READY" and w["pid"] != other_than]
        if pids:
            return int(pids[0])
        time.sleep(0.05)
    raise AssertionError(f"no new worker for {model}:\n{server.log()}")


def answer(server: ServerProcess, model: str) -> str:
    r = httpx.post(f"{server.url}/predictions/{model}", json={"inputs": "Fork", "parameters": {"max_new_tokens": 4}},
                   timeout=60)
    assert r.status_code == 200, r.text
    return r.text


def test_a_killed_worker_is_forked_again_and_the_switch_turns_it_off(tmp_path: Path) -> None:
    models = {"rb": {"option.rolling_batch": "auto"}, "echo": {"option.entryPoint": "echo"}}
    server = ServerProcess.start(tmp_path / "fork", models=models)
    try:
        expected = answer(server, "rb")
        first = worker_pid(server, "rb")
        fork_server = parent(first)
        assert comm(fork_server) == "rollserve-fork" and parent(fork_server) == server.proc.pid
        assert parent(worker_pid(server, "echo")) == server.proc.pid  # no torch: exec'd
        os.kill(first, signal.SIGKILL)
        again = worker_pid(server, "rb", other_than=first)
        assert parent(again) == fork_server
        assert answer(server, "rb") == expected
    finally:
        server.stop()
    plain = ServerProcess.start(tmp_path / "exec", models=models, config={"worker_fork_server": "false"})
    try:
        assert parent(worker_pid(plain, "rb")) == plain.proc.pid
        assert "rollserve-fork" not in {comm(int(p)) for p in plain.worker_pids()}
        assert answer(plain, "rb") == expected
    finally:
        plain.stop()
