"""The live options of a rolling model's engines (``max_rolling_batch_size``, ``max_rolling_batch_prefill_tokens``,
the LoRA adapters registered over the API): sent to every worker in a ``Configure`` frame, each answered by a
``Configured``, and to a worker started later before its first request.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Mapping
from typing import Any

from serving.batching.ports import Worker
from serving.ipc.messages import Configure, Configured

log = logging.getLogger("serving.batching.rolling")


class EngineOptions:
    def __init__(self, model: str) -> None:
        self.model = model
        self.options: dict[str, int] = {}  # changed over the API (sent to every worker)
        self.adapters: dict[str, str] | None = None  # LoRA adapters registered over the API (sent likewise)
        self._seq = itertools.count(1)
        self._acks: dict[tuple[int, int], asyncio.Future[Configured | None]] = {}  # (worker id, seq)

    def __bool__(self) -> bool:
        """True once anything was changed over the API: a new worker needs it before any request."""
        return bool(self.options or self.adapters)

    def update(self, options: Mapping[str, int] | None, adapters: Mapping[str, str] | None) -> None:
        self.options.update(options or {})
        if adapters is not None:
            self.adapters = dict(adapters)

    def send(self, worker: Worker) -> asyncio.Future[Configured | None]:
        """A ``Configure`` frame to ``worker``; the future resolves with its answer (None if it went away)."""
        seq = next(self._seq)
        future: asyncio.Future[Configured | None] = asyncio.get_running_loop().create_future()
        try:
            worker.send(Configure(seq=seq, options=dict(self.options), adapters=self.adapters))
        except ConnectionError:
            future.set_result(None)  # a restarted worker gets the options when it is ready
            return future
        self._acks[(worker.worker_id, seq)] = future
        return future

    def answered(self, worker_id: int, msg: Configured, stats: dict[int, dict[str, Any]]) -> None:
        if msg.error is None:
            stats[worker_id] = msg.stats
        else:
            log.error("model %s: worker %d refused the new engine options: %s", self.model, worker_id, msg.error)
        future = self._acks.pop((worker_id, msg.seq), None)
        if future is not None and not future.done():
            future.set_result(msg)

    def forget(self, worker_id: int) -> None:
        """``worker_id`` went away: whoever waits on its answers gets None."""
        for key in [k for k in self._acks if k[0] == worker_id]:
            future = self._acks.pop(key)
            if not future.done():
                future.set_result(None)
