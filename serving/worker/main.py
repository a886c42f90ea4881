"""Backend worker process entry point: ``python -m serving.worker.main --socket PATH``.

Design note: this is the only module where ``serving`` meets ``handlers``. The worker connects to the
frontend's private unix socket, receives ``Init``, loads the handler and answers ``Ready`` (or
``LoadFailed``). A reader thread turns incoming frames into an inbox queue; the main thread owns the
handler and all writes. Dynamic mode runs ``handle(batch)`` per ``Batch``; rolling mode runs the engine
loop: drain Add/Abort, ``step()``, send one ``Deltas`` frame per step. If the frontend goes away the
worker exits at once (no orphans).
"""

from __future__ import annotations

import argparse
import logging
import os
import queue
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

from serving.errors import ErrorKind, ServingError
from serving.logs import setup_logging
from serving.types import GenerationRequest
from serving.worker import codec
from serving.worker.messages import (
    Abort,
    Add,
    Batch,
    BatchResult,
    Deltas,
    Init,
    LoadFailed,
    Message,
    Ready,
    Reject,
    Shutdown,
)

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


def to_input(d: dict[str, Any]) -> Any:
    from handlers.base import Input

    req = GenerationRequest.from_wire(d)
    return Input(request_id=req.request_id, prompt=req.prompt, params=req.params,
                 prompt_token_ids=req.prompt_token_ids, payload=req.payload, attributes=req.attributes)


def output_to_wire(out: Any) -> dict[str, Any]:
    """``handlers.base.Output`` -> msgpack-safe dict (the inverse lives in ``batching.dynamic``)."""
    return {
        "request_id": out.request_id,
        "text": out.text,
        "finish_reason": out.finish_reason.value,
        "tokens": [[t.id, t.text, t.logprob, [list(p) for p in t.top_logprobs]] for t in out.tokens],
        "prompt_tokens": out.prompt_tokens,
        "payload": out.payload,
        "error": out.error,
        "error_kind": out.error_kind.value if out.error else None,
    }


def serve_dynamic(conn: WorkerConnection, handler: Any, model: str = "-") -> None:
    from handlers.base import Output

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
            outputs = [Output.failure(i.request_id, exc.message, exc.kind) for i in inputs]
        except Exception as exc:  # noqa: BLE001 - a handler bug fails this batch only
            rids = ",".join(i.request_id for i in inputs)
            log.exception("request %s model %s: handler failed on a batch of %d", rids, model,
                          len(inputs), extra={"request_id": rids, "model": model})
            outputs = [Output.failure(i.request_id, f"handler error: {type(exc).__name__}: {exc}") for i in inputs]
        conn.send(BatchResult(batch_id=msg.batch_id, outputs=[output_to_wire(o) for o in outputs]))


def serve_rolling(conn: WorkerConnection, handler: Any, model: str = "-") -> None:
    step = 0
    active: set[str] = set()
    while True:
        block = not handler.has_work()
        aborted = False
        while True:
            try:
                msg = conn.inbox.get(block=block, timeout=None)
            except queue.Empty:
                break
            block = False
            if msg is None or isinstance(msg, Shutdown):
                return
            if isinstance(msg, Add):
                for d in msg.requests:
                    if _add(conn, handler, d, model):
                        active.add(d["request_id"])
            elif isinstance(msg, Abort):
                for rid in msg.request_ids:
                    handler.abort(rid)
                    active.discard(rid)
                aborted = True
        if not handler.has_work():
            if aborted:  # no step will follow: publish the freed blocks now
                conn.send(Deltas(step=step, deltas=[], stats=handler.stats()))
            continue
        t0 = time.perf_counter()
        try:
            deltas = handler.step()
        except Exception as exc:  # noqa: BLE001 - fail the running requests, keep the worker
            rids = ",".join(sorted(active))
            log.exception("request %s model %s: engine step failed; failing %d requests", rids,
                          model, len(active),
                          extra={"request_id": rids, "model": model})
            for rid in sorted(active):
                handler.abort(rid)
                conn.send(Reject(request_id=rid, kind=ErrorKind.HANDLER.value,
                                 message=f"engine step failed: {type(exc).__name__}: {exc}"))
            active.clear()
            continue
        step += 1
        for d in deltas:
            if d.finish_reason is not None:
                active.discard(d.request_id)
        conn.send(Deltas(step=step, deltas=[d.to_wire() for d in deltas], stats=handler.stats(),
                         step_s=time.perf_counter() - t0))


def _add(conn: WorkerConnection, handler: Any, d: dict[str, Any], model: str = "-") -> bool:
    """Queue one request in the engine; a refused one is answered with Reject. True if accepted."""
    inp = to_input(d)
    try:
        handler.add(inp)
        return True
    except ServingError as exc:
        conn.send(Reject(request_id=inp.request_id, kind=exc.kind.value, message=exc.message))
    except Exception as exc:  # noqa: BLE001
        log.exception("request %s model %s: add failed", inp.request_id, model,
                      extra={"request_id": inp.request_id, "model": model})
        conn.send(Reject(request_id=inp.request_id, kind=ErrorKind.HANDLER.value,
                         message=f"{type(exc).__name__}: {exc}"))
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
    try:
        handler = load_handler(ctx, init.entry_point)
        handler.initialize(ctx)
    except Exception as exc:  # noqa: BLE001 - reported to the frontend, which marks the model FAILED
        log.exception("model %s failed to load", init.model_name)
        conn.send(LoadFailed(reason=f"{type(exc).__name__}: {exc}"))
        return
    from handlers.base import RollingHandler

    if init.rolling != isinstance(handler, RollingHandler):
        want = "a rolling-batch handler" if init.rolling else "a dynamic-batching handler"
        conn.send(LoadFailed(reason=f"entry point {init.entry_point!r} is not {want} "
                                    "(check option.rolling_batch and option.entryPoint)"))
        return
    conn.send(Ready(pid=os.getpid(), info=handler.describe()))
    try:
        if init.rolling:
            serve_rolling(conn, handler, init.model_name)
        else:
            serve_dynamic(conn, handler, init.model_name)
    finally:
        handler.close()


if __name__ == "__main__":
    main()
