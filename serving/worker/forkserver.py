"""The fork server: a process that imports torch, transformers and the built-in handlers once, then forks
each backend worker from itself: ``python -m serving.worker.forkserver --fd N [--preload MODULE ...]``.

Design note: a worker started with ``python -m serving.worker.main`` spends seconds importing torch and
transformers before it reads its model; forked from this process it starts with them in memory (shared
copy-on-write), so a second worker, a restart after a crash or a scale-up is ready in the time its model takes
to load. The frontend (``serving.worker.launcher``) talks to it over the socket ``--fd``, one JSON object a
line: it asks ``{"id", "module", "argv", "env"}`` (the child runs ``module.main(argv)``) and gets
``{"id", "pid"}`` back, then ``{"exit": pid, "code": c}`` when that child ends (this process is its parent and
reaps it; ``c`` as ``Popen.returncode``, ``-N`` for signal N). No thread is started here and no tensor is
computed: GNU OpenMP's thread pool does not survive a fork (a child of a process that ran a parallel region
hangs in its first one). The first line says whether the imports left the process with the threads it had
after importing torch (``{"ready": true}``); if not, the frontend starts workers the plain way. Each child
takes the environment it was given, reseeds its random generators and dies with this process, which dies
with the frontend.
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import importlib
import json
import os
import select
import signal
import socket
import sys
import traceback
from typing import Any, NoReturn

# A model class pulls what every family shares (generation, masking, accelerate, ...): the next family's module
# then imports in milliseconds.
PRELOAD = ("torch", "transformers", "transformers.models.llama.modeling_llama", "serving.worker.main",
           "handlers.rolling_handler", "handlers.huggingface")
PRELOAD_ATTRS = (("transformers", ("AutoConfig", "AutoModelForCausalLM", "AutoTokenizer")),)  # resolved lazily
_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


def _prctl(option: int, arg: int | bytes) -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(option, arg, 0, 0, 0)
    except OSError:
        pass


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def preload(extra: tuple[str, ...] = ()) -> str | None:
    """Import what workers import (and ``extra``); the reason it is unsafe to fork afterwards, or None."""
    import torch  # noqa: F401

    # The baseline: OpenBLAS's thread pools (numpy's, with torch; scipy's, which transformers imports) stop
    # before a fork and start again after it (pthread_atfork); an OpenMP pool would not.
    try:
        import scipy.linalg  # noqa: F401
    except ImportError:
        pass
    baseline = _threads()
    for name in (*PRELOAD[1:], *extra):
        importlib.import_module(name)
    for module, attrs in PRELOAD_ATTRS:
        for attr in attrs:
            getattr(sys.modules[module], attr)
    if _threads() != baseline:
        return f"the imports started threads ({_threads()} running, {baseline} after importing torch and scipy)"
    return None


class Children:
    """Forks workers and reports their exits over ``chan``."""

    def __init__(self, chan: socket.socket) -> None:
        self.chan = chan
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # a Python handler, so the wakeup fd is written
        signal.set_wakeup_fd(self._wake_w)

    def send(self, obj: dict[str, Any]) -> None:
        self.chan.sendall(json.dumps(obj).encode() + b"\n")

    def serve(self) -> None:
        buf = b""
        while True:
            readable, _, _ = select.select([self.chan, self._wake_r], [], [])
            if self._wake_r in readable:
                os.read(self._wake_r, 4096)
                self._reap()
            if self.chan in readable:
                data = self.chan.recv(1 << 16)
                if not data:
                    return  # the frontend closed the channel or went away: its workers see their sockets close
                buf += data
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    self._spawn(json.loads(line))

    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.send({"exit": pid, "code": os.waitstatus_to_exitcode(status)})

    def _spawn(self, req: dict[str, Any]) -> None:
        parent = os.getpid()
        try:
            pid = os.fork()
        except OSError as exc:
            self.send({"id": req["id"], "error": str(exc)})
            return
        if pid == 0:
            self._child(req, parent)
        self.send({"id": req["id"], "pid": pid})

    def _child(self, req: dict[str, Any], parent: int) -> None:
        code = 1
        try:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            self.chan.close()
            os.close(self._wake_r)
            os.close(self._wake_w)
            _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
            if os.getppid() != parent:
                os._exit(1)
            _prctl(_PR_SET_NAME, b"rollserve-wrk")
            os.environ.clear()
            os.environ.update(req["env"])
            _reseed()
            sys.argv = [req["module"], *req["argv"]]
            importlib.import_module(req["module"]).main(req["argv"])
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:  # noqa: BLE001 - this is a process's last frame: say why and exit
            traceback.print_exc()
        finally:
            _exit(code)


def _exit(code: int) -> NoReturn:
    """End this process as a normal interpreter exit would for what matters (the exit hooks: torch's and logging's;
    stdio flushed), without tearing torch and transformers down module by module (~1.5 s)."""
    try:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def _reseed() -> None:
    """A forked child starts with its parent's generator states; ``random`` reseeds itself at fork."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fd", type=int, required=True)
    ap.add_argument("--preload", action="append", default=[])
    args = ap.parse_args(argv)
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    _prctl(_PR_SET_NAME, b"rollserve-fork")
    # the frontend owns shutdown, as for the workers themselves: it closes the channel
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    chan = socket.socket(fileno=args.fd)
    try:
        unsafe = preload(tuple(args.preload))
    except Exception as exc:  # noqa: BLE001 - reported: the frontend starts workers the plain way
        unsafe = f"{type(exc).__name__}: {exc}"
    children = Children(chan)
    children.send({"ready": unsafe is None, "reason": unsafe})
    if unsafe is None:
        children.serve()
    _exit(0)  # as its children do: every server's shutdown waited on the teardown


if __name__ == "__main__":
    main()
