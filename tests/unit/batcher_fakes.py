"""A fake Worker and the helpers the batcher tests drive it with: requests, outputs and deltas as a worker
sends them, and a bounded event loop per test."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import Any

from rollcore.types import BatchOutput, FinishReason, GenerationRequest, TokenDelta, TokenInfo
from serving.batching.dynamic import DynamicBatcher
from serving.ipc.messages import Add


class FakeWorker:
    """What a batcher sees of a worker: records every message it is sent."""

    def __init__(self, worker_id: int = 1) -> None:
        self.worker_id = worker_id
        self.alive = True
        self.info: dict[str, Any] = {}
        self.sent: list[Any] = []
        self.killed = False

    def send(self, msg: Any) -> None:
        if not self.alive:
            raise ConnectionError("worker is not running")
        self.sent.append(msg)

    def kill_soon(self, cause: str = "crash") -> None:
        self.killed = True
        self.kill_cause = cause

    def of(self, kind: type) -> list[Any]:
        return [m for m in self.sent if isinstance(m, kind)]


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 10))


def req(rid: str, prompt: str = "p") -> GenerationRequest:
    return GenerationRequest(request_id=rid, model="m", prompt=prompt)


def ok_output(rid: str, text: str = "out") -> BatchOutput:
    return BatchOutput(request_id=rid, text=text, tokens=(TokenInfo(1, text),), prompt_tokens=1)


async def until(cond: Any, timeout_s: float = 2.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)


def dynamic(**kw: Any) -> DynamicBatcher:
    args: dict[str, Any] = {"batch_size": 4, "max_batch_delay_ms": 50, "job_queue_size": 100, "predict_timeout_s": 30}
    args.update(kw)
    b = DynamicBatcher("m", **args)
    b.start()
    return b


def delta(rid: str, tok: int, finish: FinishReason | None = None) -> TokenDelta:
    return TokenDelta(request_id=rid, tokens=(TokenInfo(tok, f"t{tok}"),), text=f"t{tok}",
                      finish_reason=finish, prompt_tokens=1)


def added(w: FakeWorker) -> list[str]:
    return [r.request_id for m in w.of(Add) for r in m.requests]

