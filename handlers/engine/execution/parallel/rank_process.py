"""Starting the rank processes of a tensor-parallel group (ranks 1..N-1 of this host) from a zygote.

Design note: a rank spends seconds importing torch and transformers' model classes before it reads its shard.
Each rank is forked from one process per host process that imported them once (the standard library's
``forkserver``, started with this module's ``PRELOAD`` at the first rank and kept for later groups: a worker's
restarted group, a second model, a test suite's many groups), so a rank starts in the time its shard takes to
load and shares the imported pages with its siblings. The zygote only imports (no tensor is computed there, so no
OpenMP pool exists to be lost in the fork) and is exec'd fresh, never forked from a process that ran torch. It
exits when the process that started it exits, and each rank dies with it (``PR_SET_PDEATHSIG``), so no rank is
orphaned. A rank gets the environment its starter had at ``spawn_rank`` (the group's secret travels in it, over
the zygote's private socket, never on a command line); variables read only while importing torch are those of the
zygote's start. As with any ``multiprocessing`` start method but fork, a rank imports its starter's main module
again (as ``__mp_main__``): a script that builds a tensor-parallel engine keeps that under a ``__main__`` guard
(the server's processes do).
"""

from __future__ import annotations

import ctypes
import importlib
import json
import multiprocessing
import os
import signal
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

RANK_MODULE = "handlers.engine.execution.parallel.ranks"  # by name, as ``python -m`` would run it: it imports this
# A model class pulls what every family shares (generation, masking, accelerate, ...): the family's own module
# then imports in milliseconds.
PRELOAD = ("torch", "transformers.models.llama.modeling_llama", RANK_MODULE)
_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


class RankProcess:
    """A started rank, with the part of ``subprocess.Popen``'s interface the group uses."""

    def __init__(self, rank: int, process: Any) -> None:
        self.rank = rank
        self._process = process

    @property
    def pid(self) -> int:
        return int(self._process.pid)

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode  # type: ignore[no-any-return]

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(f"tensor-parallel rank {self.rank}", timeout or 0.0)
        return self.returncode

    def terminate(self) -> None:
        if self.returncode is None:
            self._process.terminate()

    def kill(self) -> None:
        if self.returncode is None:
            self._process.kill()


def _context() -> Any:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))  # read when the zygote starts, at the first rank
    return ctx


def spawn_rank(rank: int, world_size: int, store: tuple[str, int], model_dir: Path, options: Mapping[str, str],
               device: str, env: Mapping[str, str]) -> RankProcess:
    """Start rank ``rank``; ``env`` (the group's secret, the interface to meet on) is added to this process's
    environment for it."""
    argv = ["--rank", str(rank), "--world-size", str(world_size), "--store", f"{store[0]}:{store[1]}",
            "--model-dir", str(model_dir), "--options", json.dumps(dict(options)), "--device", device]
    # daemonic: a starter that exits normally terminates its ranks (the zygote's exit kills any left)
    process = _context().Process(target=_rank_entry, args=(rank, argv, {**os.environ, **env}),
                                 name=f"tp-rank{rank}", daemon=True)
    process.start()
    return RankProcess(rank, process)


def _rank_entry(rank: int, argv: list[str], env: dict[str, str]) -> None:
    """In the forked rank: its starter's environment, death with the zygote, a name ``ps`` shows (``tp-rankN``),
    then the rank's loop."""
    os.environ.clear()
    os.environ.update(env)
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        libc.prctl(_PR_SET_NAME, f"tp-rank{rank}".encode(), 0, 0, 0)
    except OSError:
        pass
    importlib.import_module(RANK_MODULE).rank_main(argv)
