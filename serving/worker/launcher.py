"""How the frontend starts worker processes: exec'd (``python -m serving.worker.main``) or forked from the fork
server (``serving.worker.forkserver``), which has torch and transformers imported already.

Design note: ``WorkerHandle`` asks a ``Launcher`` for a process and treats what it gets like an
``asyncio.subprocess.Process`` (``pid``, ``returncode``, ``wait()``, ``send_signal()``). ``ForkLauncher`` starts
the fork server on the first worker that needs torch (an ``echo`` worker never does) and shares it between
every model of the server; a forked worker is the fork server's child, so its exit code arrives as a line on
the fork server's channel. When the fork server cannot start, says forking is unsafe or dies, workers are
exec'd as before (logged once). Torch-free: this runs in the frontend.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import sys
from collections.abc import Mapping
from typing import Any, Protocol

log = logging.getLogger(__name__)

WORKER_MODULE = "serving.worker.main"


# MKL keeps the buffers of its GEMMs in a pool it grows as it meets new row counts, so a worker's memory would
# grow with traffic after load; without the pool the buffers return to malloc, which keeps freed blocks for reuse
# (handlers.engine.planning.cpu), and the GEMMs measured as fast (benchmarks/HISTORY.md, "Measured kernel choice").
MKL_DISABLE_FAST_MM = "1"


def worker_env(env: Mapping[str, str]) -> dict[str, str]:
    """Workers inherit the server's environment, with hub progress bars off and never a network fetch, and MKL's
    own buffer pool off unless the server's environment says otherwise (MKL reads it once, at torch's import)."""
    return {"MKL_DISABLE_FAST_MM": MKL_DISABLE_FAST_MM, **env, "HF_HUB_DISABLE_PROGRESS_BARS": "1",
            "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


class WorkerProcess(Protocol):
    pid: int

    @property
    def returncode(self) -> int | None: ...
    async def wait(self) -> int: ...
    def send_signal(self, sig: int) -> None: ...


class Launcher(Protocol):
    async def spawn(self, argv: list[str], env: Mapping[str, str], *, needs_torch: bool) -> WorkerProcess: ...
    async def close(self) -> None: ...


class ExecLauncher:
    """A fresh interpreter per worker."""

    async def spawn(self, argv: list[str], env: Mapping[str, str], *, needs_torch: bool) -> WorkerProcess:
        return await asyncio.create_subprocess_exec(sys.executable, "-m", WORKER_MODULE, *argv, env=dict(env),
                                                    stdin=asyncio.subprocess.DEVNULL)

    async def close(self) -> None:
        pass


class ForkedProcess:
    """A worker forked by the fork server; its exit code is set from the fork server's report."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._code: int | None = None
        self._exited = asyncio.Event()

    @property
    def returncode(self) -> int | None:
        return self._code

    def exited(self, code: int) -> None:
        if self._code is None:
            self._code = code
            self._exited.set()

    async def wait(self) -> int:
        await self._exited.wait()
        assert self._code is not None
        return self._code

    def send_signal(self, sig: int) -> None:
        if self._code is None:  # once reaped its pid may be another process's
            os.kill(self.pid, sig)


class ForkServerGone(Exception):
    pass


class ForkServer:
    """One running fork server: its process, its channel and the children it reported."""

    def __init__(self, proc: asyncio.subprocess.Process, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
        self.proc = proc
        self._reader = reader
        self._writer = writer
        self._ids = 0
        self._replies: dict[int, asyncio.Future[ForkedProcess]] = {}
        self.children: dict[int, ForkedProcess] = {}
        self._task: asyncio.Task[None] | None = None

    @classmethod
    async def start(cls, env: Mapping[str, str], preload: tuple[str, ...], timeout_s: float) -> ForkServer:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "serving.worker.forkserver", "--fd", str(theirs.fileno()),
                *(f"--preload={module}" for module in preload), env=dict(env), stdin=asyncio.subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),))
        finally:
            theirs.close()
        reader, writer = await asyncio.open_unix_connection(sock=ours)
        server = cls(proc, reader, writer)
        try:
            line = await asyncio.wait_for(reader.readline(), timeout_s)
            hello = json.loads(line) if line else {"ready": False, "reason": "it exited while importing"}
        except (asyncio.TimeoutError, ValueError) as exc:
            hello = {"ready": False, "reason": f"no answer ({type(exc).__name__})"}
        if not hello.get("ready"):
            await server.close()
            raise ForkServerGone(str(hello.get("reason")))
        server._task = asyncio.create_task(server._read())
        return server

    @property
    def alive(self) -> bool:
        return self._task is not None and not self._task.done()

    async def spawn(self, module: str, argv: list[str], env: Mapping[str, str]) -> ForkedProcess:
        self._ids += 1
        reply: asyncio.Future[ForkedProcess] = asyncio.get_running_loop().create_future()
        self._replies[self._ids] = reply
        request = {"id": self._ids, "module": module, "argv": argv, "env": dict(env)}
        self._writer.write(json.dumps(request).encode() + b"\n")
        await self._writer.drain()
        return await reply

    def _answer(self, msg: dict[str, Any]) -> None:
        """A fork's reply: the child is registered here, before any later line (its exit among them) is read;
        the fork server always sends the reply before it reaps that child."""
        reply = self._replies.pop(msg.get("id"), None)
        if reply is None or reply.done():
            return
        if "pid" not in msg:
            reply.set_exception(OSError(f"the fork server could not fork: {msg.get('error')}"))
            return
        child = self.children[msg["pid"]] = ForkedProcess(msg["pid"])
        reply.set_result(child)

    async def _read(self) -> None:
        try:
            while line := await self._reader.readline():
                msg = json.loads(line)
                if "exit" in msg:
                    if (child := self.children.pop(msg["exit"], None)) is not None:
                        child.exited(msg["code"])
                else:
                    self._answer(msg)
        except (ConnectionError, ValueError) as exc:
            log.warning("fork server channel broke: %s", exc)
        finally:
            # Its children die with it (PR_SET_PDEATHSIG); their exit codes are lost with it.
            for reply in self._replies.values():
                if not reply.done():
                    reply.set_exception(ForkServerGone("the fork server exited"))
            for child in list(self.children.values()):
                child.exited(-signal.SIGKILL)
            self.children.clear()

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            self._writer.close()
        try:
            await asyncio.wait_for(self.proc.wait(), 5.0)
        except asyncio.TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            await self.proc.wait()
        if self._task is not None:
            await self._task


class ForkLauncher:
    """Workers that need torch are forked from one shared fork server; others, and all of them once the fork
    server has failed, are exec'd."""

    def __init__(self, env: Mapping[str, str], preload: tuple[str, ...] = (), start_timeout_s: float = 300.0) -> None:
        self._env = worker_env(env)  # what hub settings read at import time see
        self._preload = preload
        self._start_timeout_s = start_timeout_s
        self._exec = ExecLauncher()
        self._server: ForkServer | None = None
        self._starting: asyncio.Task[ForkServer | None] | None = None
        self._failed = False

    async def spawn(self, argv: list[str], env: Mapping[str, str], *, needs_torch: bool) -> WorkerProcess:
        server = await self.fork_server() if needs_torch else None
        if server is not None:
            try:
                return await server.spawn(WORKER_MODULE, argv, env)
            except ForkServerGone:
                log.warning("the fork server exited; starting a new one for the next worker")
                self._server = None
        return await self._exec.spawn(argv, env, needs_torch=needs_torch)

    async def fork_server(self) -> ForkServer | None:
        """The running fork server (started or restarted now if need be), or None once it has failed to start."""
        if self._failed:
            return None
        if self._server is not None and self._server.alive:
            return self._server
        if self._starting is None or self._starting.done():
            self._starting = asyncio.create_task(self._start())
        return await asyncio.shield(self._starting)

    async def _start(self) -> ForkServer | None:
        try:
            self._server = await ForkServer.start(self._env, self._preload, self._start_timeout_s)
        except (ForkServerGone, OSError) as exc:
            log.warning("workers start without the fork server (each imports torch itself): %s", exc)
            self._failed = True
            return None
        log.info("fork server ready (pid %d): workers start with torch and transformers imported",
                 self._server.proc.pid)
        return self._server

    async def close(self) -> None:
        if self._starting is not None:
            await asyncio.gather(self._starting, return_exceptions=True)
        if self._server is not None:
            await self._server.close()
            self._server = None
