"""The ``serving`` command and the server's startup as a new user meets them, each through the real command in a
subprocess: ``--help`` lists every command, a taken port is one line naming the setting, a folder with nothing to
load says what to add, a typo'd key suggests the known one, uvicorn's lines appear once, and no answer carries a
server path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.harness import REPO

COMMANDS = ("start", "config", "serve", "bench", "tune", "k8s", "worker")


def clean_env(**extra: str) -> dict[str, str]:
    """The test process's environment without settings a developer's shell may carry into the server."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPTION_", "SERVING_", "SAGEMAKER_", "HF_"))}
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


def serving(*args: str, cwd: Path = REPO, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "serving", *args], cwd=cwd, env=clean_env(), capture_output=True,
                          text=True, timeout=timeout)


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
