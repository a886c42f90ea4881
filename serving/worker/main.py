"""Backend worker process entry point: ``python -m serving.worker.main --socket PATH``.

Design note: this is the only module where ``serving`` meets ``handlers``. The worker connects to the
frontend's private unix socket, receives ``Init``, loads the handler and answers ``Ready`` (or
``LoadFailed``). A reader thread turns incoming frames into an inbox queue; the main thread owns the
handler and all writes. Dynamic mode runs ``handle(batch)`` per ``Batch``; rolling mode runs the engine
loop (``rolling_loop``): drain Add/Abort, ``step()``, send one ``Deltas`` frame per step. If the frontend
goes away the worker exits at once (no orphans). Every text bound for a client (load failures, handler
and engine errors) is scrubbed of file-system paths first (the log keeps them); an output that cannot be
encoded fails its own request only.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import queue
import signal
import socket
import sys
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from rollcore.errors import ConfigError, ServingError
from rollcore.types import BatchOutput, GenerationRequest
from serving.heap import IdleTrim
from serving.ipc import codec
from serving.ipc.messages import (
    Batch,
    BatchResult,
    Init,
    LoadFailed,
    Message,
    Ready,
    Shutdown,
)
from serving.logs import setup_logging
from serving.redact import scrub_paths
from serving.worker.rolling_loop import RollingLoop, WorkerUnhealthy

log = logging.getLogger("serving.worker")


class WorkerConnection:
    """Blocking side of the channel: a reader thread feeds ``inbox``; ``send`` is for the main thread."""

    def __init__(self, path: str) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.connect(path)
        self.inbox: queue.Queue[Message | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, name="ipc-reader", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        decoder = codec.FrameDecoder()
        try:
            while True:
                data = self._sock.recv(1 << 20)
                if not data:
                    break
                for msg in decoder.feed(data):
                    self.inbox.put(msg)
        except OSError:
            pass
        self.inbox.put(None)  # frontend gone

    def send(self, msg: Message) -> None:
        self._sock.sendall(codec.encode(msg))


def to_input(req: GenerationRequest) -> Any:
    """The handler's view of a request (``handlers.base.Input``: what a handler reads of it)."""
    from handlers.base import Input

    return Input(request_id=req.request_id, prompt=req.prompt, params=req.params,
                 prompt_token_ids=req.prompt_token_ids, payload=req.payload, attributes=req.attributes)


def serve_dynamic(conn: WorkerConnection, handler: Any, model: str = "-", redact: Callable[[str], str] = str,
                  idle: Callable[[], object] | None = None) -> None:
    """Run ``handle(batch)`` per ``Batch``; ``idle`` (default: ``IdleTrim``) runs whenever no batch waits."""
    idle = IdleTrim() if idle is None else idle
    while True:
        msg = conn.inbox.get()
        if msg is None or isinstance(msg, Shutdown):
            return
        if not isinstance(msg, Batch):
            continue
        inputs = [to_input(d) for d in msg.requests]
        try:
            outputs = handler.handle(inputs)
            if len(outputs) != len(inputs):
                raise RuntimeError(f"handler returned {len(outputs)} outputs for {len(inputs)} inputs")
        except ServingError as exc:
            outputs = [BatchOutput.failure(i.request_id, exc.message, exc.kind) for i in inputs]
        except Exception as exc:  # noqa: BLE001 - a handler bug fails this batch only
            rids = ",".join(i.request_id for i in inputs)
            log.exception("request %s model %s: handler failed on a batch of %d", rids, model,
                          len(inputs), extra={"request_id": rids, "model": model})
            outputs = [BatchOutput.failure(i.request_id, f"handler error: {type(exc).__name__}: {exc}")
                       for i in inputs]
        conn.send(_result(msg.batch_id, outputs, model, redact))
        if conn.inbox.empty():
            idle()


def _result(batch_id: int, outputs: list[Any], model: str, redact: Callable[[str], str]) -> BatchResult:
    """The batch's answer, errors scrubbed of paths; encoded once, and only when that fails is each output tried
    alone, so that one the channel cannot carry (an integer over 64 bits, a lone surrogate, not an ``Output``)
    fails its own request."""
    outs = [_scrubbed(o, redact) for o in outputs]
    result = BatchResult(batch_id=batch_id, outputs=outs)
    try:
        codec.encode(result)
        return result
    except Exception:  # noqa: BLE001 - find the output at fault below
        pass
    return BatchResult(batch_id=batch_id, outputs=[_sendable(o, model) for o in outs])


def _scrubbed(out: Any, redact: Callable[[str], str]) -> Any:
    if isinstance(out, BatchOutput) and out.error:
        return replace(out, error=redact(out.error))
    return out


def _sendable(out: Any, model: str) -> BatchOutput:
    rid = str(getattr(out, "request_id", ""))
    try:
        if not isinstance(out, BatchOutput):
            raise TypeError(f"a {type(out).__name__}, not handlers.base.Output")
        codec.encode(BatchResult(batch_id=0, outputs=[out]))
        return out
    except Exception as exc:  # noqa: BLE001 - one bad output fails one request
        log.error("request %s model %s: the handler's output cannot be sent: %s: %s", rid, model,
                  type(exc).__name__, exc, extra={"request_id": rid, "model": model})
        return BatchOutput.failure(rid, f"the handler returned an output that cannot be sent ({type(exc).__name__}"
                                   "; integers must fit in 64 bits, strings must be valid Unicode)")


def serve_rolling(conn: WorkerConnection, handler: Any, model: str = "-", redact: Callable[[str], str] = str
                  ) -> None:
    """Run the rolling engine loop; raises ``WorkerUnhealthy`` when the worker must be restarted."""
    RollingLoop(conn, handler, to_input, model, redact).run()


# Load failures that come out the same on every try: the files or the code are wrong, not the moment
# (ConfigError covers the engine's refusals of a checkpoint, e.g. a GGUF file it cannot read).
_PERMANENT: tuple[type[BaseException], ...] = (ImportError, SyntaxError, FileNotFoundError, NotADirectoryError,
                                               IsADirectoryError, json.JSONDecodeError, ConfigError)


def is_permanent(exc: BaseException) -> bool:
    """Whether a load failure would repeat on a new worker (then the frontend does not retry it): its type, or that
    of an exception it was explicitly raised from (the loader wraps a model.py's ImportError in a ValueError)."""
    seen: BaseException | None = exc
    while seen is not None:
        if type(seen).__name__ == "InsufficientMemory":  # memory others hold may be free on the next try
            return False
        if isinstance(seen, _PERMANENT):
            return True
        seen = seen.__cause__
    return False


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", required=True)
    args = ap.parse_args(argv)
    # The frontend owns shutdown: a terminal's Ctrl-C or a SIGTERM sent to the whole process group must not
    # kill workers under in-flight requests; they exit on Shutdown or when the frontend's socket closes.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    setup_logging("text", process_tag="worker")
    conn = WorkerConnection(args.socket)
    init = conn.inbox.get()
    if not isinstance(init, Init):
        return
    setup_logging(init.log_format, process_tag="worker")
    from handlers.base import Context
    from handlers.loader import load_handler

    ctx = Context(model_name=init.model_name, model_dir=Path(init.model_dir), properties=init.properties,
                  device_id=init.device_id)
    redact = functools.partial(scrub_paths, replacements={init.model_dir: init.model_name})
    try:
        handler = load_handler(ctx, init.entry_point)
        handler.initialize(ctx)
    except Exception as exc:  # noqa: BLE001 - reported to the frontend, which marks the model FAILED
        log.exception("model %s failed to load", init.model_name)
        conn.send(LoadFailed(reason=redact(f"{type(exc).__name__}: {exc}"), permanent=is_permanent(exc)))
        return
    from handlers.base import RollingHandler

    if init.rolling != isinstance(handler, RollingHandler):
        want = "a rolling-batch handler" if init.rolling else "a dynamic-batching handler"
        conn.send(LoadFailed(reason=f"entry point {init.entry_point!r} is not {want} "
                                    "(check option.rolling_batch and option.entryPoint)"))
        return
    conn.send(Ready(pid=os.getpid(), info=handler.describe(),
                    live_options=sorted(getattr(handler, "live_options", frozenset()))))
    try:
        if init.rolling:
            serve_rolling(conn, handler, init.model_name, redact)
        else:
            serve_dynamic(conn, handler, init.model_name, redact)
    except WorkerUnhealthy as exc:
        # Exit at once: closing the handler could wait on a dead tensor-parallel rank. The frontend's pool
        # restarts the worker; the other ranks die with this process (PR_SET_PDEATHSIG).
        log.error("model %s: worker restarts: %s", init.model_name, exc)
        sys.stderr.flush()
        os._exit(3)
    finally:
        handler.close()


if __name__ == "__main__":
    main()
