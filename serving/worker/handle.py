"""WorkerHandle: the frontend's view of one backend worker process.

Design note: runs on the frontend's asyncio loop. ``start`` has the launcher start a worker process
(``serving.worker.launcher``: exec'd, or forked from the fork server) with a private unix socket in a 0700 temp
directory, sends ``Init`` and waits for ``Ready``/``LoadFailed`` within
the loading timeout. Afterwards a reader task hands every frame to the ``listener`` (a batcher); when the
process exits or the channel breaks, ``listener.on_worker_exit`` is called exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import tempfile
import time
from typing import Any, Protocol

from serving.ipc import codec
from serving.ipc.messages import Init, LoadFailed, Message, ProtocolError, Ready, Shutdown
from serving.worker.launcher import ExecLauncher, Launcher, WorkerProcess

log = logging.getLogger(__name__)


class WorkerListener(Protocol):
    def on_worker_message(self, worker: WorkerHandle, msg: Message) -> None: ...
    def on_worker_exit(self, worker: WorkerHandle) -> None: ...


class WorkerLoadError(Exception):
    """The worker could not load its model (message is the handler's reason); ``permanent``: a retry would fail
    the same way."""

    def __init__(self, reason: str, permanent: bool = False) -> None:
        super().__init__(reason)
        self.permanent = permanent


class WorkerHandle:
    """One worker process and its channel. Not thread-safe: use from the event loop only."""

    def __init__(self, worker_id: int, init: Init, env: dict[str, str] | None = None,
                 launcher: Launcher | None = None) -> None:
        self.worker_id = worker_id
        self.init = init
        self.info: dict[str, Any] = {}
        self.live_options: frozenset[str] = frozenset()  # what the handler's configure() changes (Ready)
        self.pid: int | None = None
        self.alive = False
        self.ready_at: float | None = None  # time.monotonic() when the worker answered Ready
        self.started_at = time.time()  # wall clock, for DJL's describe (``startTime``)
        self._env = env if env is not None else dict(os.environ)
        self._launcher = launcher or ExecLauncher()
        self._proc: WorkerProcess | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._tmpdir: str | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._listener: WorkerListener | None = None
        self._exit_reported = False
        self.exit_cause = "crash"  # why the process went away, for the restart counts: crash or watchdog

    async def start(self, listener: WorkerListener, timeout_s: float) -> None:
        """Spawn, load, and wait for Ready. Raises WorkerLoadError or TimeoutError; never leaves a process."""
        self._listener = listener
        self._tmpdir = tempfile.mkdtemp(prefix="rollserve-")
        path = os.path.join(self._tmpdir, "w.sock")
        connected: asyncio.Future[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = \
            asyncio.get_running_loop().create_future()

        def on_connect(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            if not connected.done():
                connected.set_result((r, w))
            else:
                w.close()

        server = await asyncio.start_unix_server(on_connect, path=path)
        try:
            self._proc = await self._launcher.spawn(["--socket", path], self._env,
                                                    needs_torch=self.init.entry_point != "echo")
            self.pid = self._proc.pid
            reader, writer = await asyncio.wait_for(self._race(connected), timeout_s)
            self._writer = writer
            writer.write(codec.encode(self.init))
            await writer.drain()
            decoder = codec.FrameDecoder()
            first = await asyncio.wait_for(self._read_one(reader, decoder), timeout_s)
            if isinstance(first, LoadFailed):
                raise WorkerLoadError(first.reason, first.permanent)
            if not isinstance(first, Ready):
                raise WorkerLoadError("worker exited before it was ready")
            self.info = dict(first.info)
            self.live_options = frozenset(first.live_options)
            self.alive = True
            self.ready_at = time.monotonic()
            self._reader_task = asyncio.create_task(self._read_loop(reader, decoder))
        except BaseException:
            await self.kill()
            raise
        finally:
            server.close()

    async def _race(self, connected: asyncio.Future[Any]) -> Any:
        assert self._proc is not None
        wait_exit = asyncio.create_task(self._proc.wait())
        done, _ = await asyncio.wait({connected, wait_exit}, return_when=asyncio.FIRST_COMPLETED)
        if connected in done:
            wait_exit.cancel()
            return connected.result()
        raise WorkerLoadError(f"worker process exited with code {self._proc.returncode} before connecting")

    @staticmethod
    async def _read_one(reader: asyncio.StreamReader, decoder: codec.FrameDecoder) -> Message | None:
        while True:
            data = await reader.read(1 << 16)
            if not data:
                return None
            msgs = decoder.feed(data)
            if msgs:
                return msgs[0]

    async def _read_loop(self, reader: asyncio.StreamReader, decoder: codec.FrameDecoder) -> None:
        broken = False
        try:
            while not broken:
                data = await reader.read(1 << 20)
                if not data:
                    break
                for msg in decoder.feed(data):
                    assert self._listener is not None
                    try:
                        self._listener.on_worker_message(self, msg)
                    except Exception:
                        # A frame half-processed leaves its requests in an unknown state: restart the worker
                        # so every one of them is retried or failed definitely instead of hanging.
                        log.exception("worker %s: failed to process a %s frame; restarting it", self.pid,
                                      type(msg).__name__)
                        self.kill_soon()
                        broken = True
                        break
        except (ConnectionError, ProtocolError) as exc:
            log.warning("worker %s channel broke: %s", self.pid, exc)
        finally:
            self.alive = False
            await self._reap()
            self._report_exit()

    def _report_exit(self) -> None:
        if not self._exit_reported and self._listener is not None:
            self._exit_reported = True
            self._listener.on_worker_exit(self)

    def send(self, msg: Message) -> None:
        """Queue a frame to the worker (ordered; raises ConnectionError if the worker is gone)."""
        if not self.alive or self._writer is None:
            raise ConnectionError("worker is not running")
        self._writer.write(codec.encode(msg))

    async def stop(self, timeout_s: float = 5.0) -> None:
        """Ask the worker to exit, then kill it if it does not within ``timeout_s``."""
        if self._proc is None:
            return
        with contextlib.suppress(ConnectionError, RuntimeError):
            self.send(Shutdown())
        try:
            await asyncio.wait_for(self._proc.wait(), timeout_s)
        except asyncio.TimeoutError:
            await self.kill()
        await self._reap()

    def kill_soon(self, cause: str = "crash") -> None:
        """Kill the process from a synchronous context (e.g. a stuck handler); exit is reported as usual."""
        self.exit_cause = cause
        if self._proc is not None and self._proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.send_signal(signal.SIGKILL)

    async def kill(self) -> None:
        if self._proc is not None and self._proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.send_signal(signal.SIGKILL)
            await self._proc.wait()
        await self._reap()

    async def _reap(self) -> None:
        self.alive = False
        if self._writer is not None:
            with contextlib.suppress(Exception):
                self._writer.close()
        if self._proc is not None and self._proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.send_signal(signal.SIGKILL)
            await self._proc.wait()
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None
