"""The ``serving`` command and the server's startup as a new user meets them, each through the real command in a
subprocess: ``--help`` lists every command, a taken port is one line naming the setting, a folder with nothing to
load says what to add, a typo'd key suggests the known one, uvicorn's lines appear once, and no answer carries a
server path."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.harness import REPO, write_model

COMMANDS = ("start", "config", "serve", "bench", "tune", "k8s", "worker")


def clean_env(**extra: str) -> dict[str, str]:
    """The test process's environment without settings a developer's shell may carry into the server."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPTION_", "SERVING_", "SAGEMAKER_", "HF_"))}
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


def serving(*args: str, cwd: Path = REPO, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "serving", *args], cwd=cwd, env=clean_env(), capture_output=True,
                          text=True, timeout=timeout)


def start_server(workdir: Path, config: dict[str, str], env: dict[str, str] | None = None,
                 timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``serving --config ... --ports-file ...`` in ``workdir`` (a model store with an echo model) until it exits; its
    process group must be gone by then."""
    store = workdir / "model_store"
    write_model(store, "echo", {"option.entryPoint": "echo"})
    cfg = {"inference_address": "http://127.0.0.1:0", "management_address": "http://127.0.0.1:0",
           "grpc_address": "127.0.0.1:0", "model_store": str(store)}
    cfg = {**{k: v for k, v in cfg.items() if k not in config}, **config}  # the test's own keys last
    (workdir / "config.properties").write_text("".join(f"{k}={v}\n" for k, v in cfg.items()))
    proc = subprocess.Popen([sys.executable, "-m", "serving", "--config", "config.properties", "--ports-file",
                             "ports.json"], cwd=workdir, env=clean_env(**(env or {})), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
    left = subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert left == [], f"processes of the server's group left: {left}"
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def first_line(text: str) -> str:
    return text.splitlines()[0] if text else ""


# --- 1. every command is listed, each with its own help ---

def test_help_lists_every_command_with_a_description() -> None:
    proc = serving("--help")
    assert proc.returncode == 0 and proc.stderr == ""
    assert first_line(proc.stdout) == "usage: serving [-h] COMMAND ..."
    section = proc.stdout.split("\ncommands:\n", 1)[1].split("\n\n", 1)[0]  # up to the usage lines below
    listed = {}
    for line in section.splitlines():
        words = line.split(maxsplit=1)
        if line.startswith("    ") and not line.startswith("     ") and len(words) == 2:
            listed[words[0]] = words[1]
    assert set(listed) == set(COMMANDS), proc.stdout
    assert all(len(desc) > 10 for desc in listed.values()), listed


@pytest.mark.parametrize("command", COMMANDS)
def test_each_command_has_its_own_help(command: str) -> None:
    proc = serving(command, "--help")
    assert proc.returncode == 0 and proc.stderr == ""
    prog = "start" if command == "serve" else command  # SageMaker's `serve` is start
    assert first_line(proc.stdout).startswith(f"usage: serving {prog} [-h]"), proc.stdout


# --- 2. a taken address: one line naming the setting, exit 2, nothing left behind ---

@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port another process's socket listens on (as a second server on the same port would find it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.mark.parametrize("setting", ["inference_address", "management_address", "metrics_address", "grpc_address"])
def test_a_taken_address_is_one_line_naming_its_setting(tmp_path: Path, taken_port: int, setting: str) -> None:
    value = f"127.0.0.1:{taken_port}" if setting == "grpc_address" else f"http://127.0.0.1:{taken_port}"
    proc = start_server(tmp_path, {setting: value})
    line = 5 if setting == "metrics_address" else 4  # the last line of config.properties: four others before it
    assert (tmp_path / "config.properties").read_text().splitlines()[line - 1].startswith(setting)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        f"rollserve: cannot listen on 127.0.0.1:{taken_port} ({setting}, from config.properties:{line}): address "
        f"already in use; set {setting} in config.properties or env SERVING_{setting.upper()} (port 0: any free port)"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.properties", "model_store"]  # no key/ports file


def test_a_taken_address_from_the_environment_says_so(tmp_path: Path, taken_port: int) -> None:
    proc = start_server(tmp_path, {}, env={"SERVING_INFERENCE_ADDRESS": f"http://127.0.0.1:{taken_port}"})
    assert proc.returncode == 2
    assert first_line(proc.stderr) == (
        f"rollserve: cannot listen on 127.0.0.1:{taken_port} (inference_address, from env SERVING_INFERENCE_ADDRESS): "
        "address already in use; set inference_address in config.properties or env SERVING_INFERENCE_ADDRESS "
        "(port 0: any free port)")
    assert not (tmp_path / "key_file.json").exists() and not (tmp_path / "ports.json").exists()


def test_sagemakers_taken_port_names_its_variable(tmp_path: Path, taken_port: int) -> None:
    proc = start_server(tmp_path, {}, env={"SAGEMAKER_BIND_TO_PORT": str(taken_port)})
    assert proc.returncode == 2
    assert first_line(proc.stderr) == (
        f"rollserve: cannot listen on 127.0.0.1:{taken_port} (SAGEMAKER_BIND_TO_PORT, from env "
        "SAGEMAKER_BIND_TO_PORT): address already in use; set another port in env SAGEMAKER_BIND_TO_PORT")
    assert not (tmp_path / "key_file.json").exists() and not (tmp_path / "ports.json").exists()
