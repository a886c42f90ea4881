"""serving/malloc.py: glibc's mallopt from Python; the frontend's arena cap and its environment override."""

from __future__ import annotations

import subprocess
import sys

import pytest

from serving import malloc

GLIBC = malloc._mallopt() is not None


@pytest.mark.skipif(not GLIBC, reason="not glibc")  # this project's CI image is glibc: never skipped there
def test_limit_arenas_applies_unless_the_environment_sets_it() -> None:
    code = "from serving.malloc import limit_arenas; print(limit_arenas(2))"
    env = {"PATH": "/usr/bin:/bin"}
    plain = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert plain.stdout.strip() == "True"
    told = subprocess.run([sys.executable, "-c", code], env={**env, "MALLOC_ARENA_MAX": "4"}, capture_output=True,
                          text=True, check=True)
    assert told.stdout.strip() == "False"  # glibc already read the variable: it wins

