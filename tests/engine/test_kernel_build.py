"""The C kernels are built once per CPU and cache: a process that needs one another process is building waits for
that build and loads its file (the largest takes half a minute; every worker and test process built it again)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from serving.bench.launch import wait_for

LOAD = """
import logging, sys
logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
from handlers.engine.execution.kernels import native
print("loaded" if native.shared_library("argmax.c", "-") is not None else "none")
"""


def _waiting_on_a_lock(pid: int) -> bool:
    """Whether ``pid`` waits for a file lock (``/proc/locks`` lists a blocked request as ``N: -> FLOCK ...``)."""
    return any("->" in line and line.split()[5] == str(pid)
               for line in Path("/proc/locks").read_text().splitlines())


def test_a_kernel_another_process_is_building_is_waited_for_not_built_again(tmp_path: Path) -> None:
    import fcntl

    env = {**os.environ, "HOME": str(tmp_path)}  # an empty kernel cache
    first = subprocess.run([sys.executable, "-c", LOAD], env=env, capture_output=True, text=True, timeout=300)
    assert first.stdout.splitlines()[-1] == "loaded", first.stderr
    assert any(line.startswith("built ") for line in first.stdout.splitlines()), first.stdout
    cache = tmp_path / ".cache" / "rollserve" / "kernels"
    (built,) = cache.glob("argmax-*.so")
    kept = built.read_bytes()
    built.unlink()  # as before the first build; this test now plays the process that is building it
    with open(built.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        second = subprocess.Popen([sys.executable, "-c", LOAD], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        wait_for(lambda: second.poll() is not None or _waiting_on_a_lock(second.pid), "the lock or an exit",
                 timeout_s=300)
        assert second.poll() is None, "it built the kernel instead of waiting for the build under way"
        built.write_bytes(kept)  # the other builder's file lands, then its lock is released
    out, err = second.communicate(timeout=300)
    assert out.splitlines()[-1] == "loaded", err
    assert not any(line.startswith("built ") for line in out.splitlines()), out
