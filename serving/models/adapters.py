"""LoRA adapters registered over the API on one rolling-batch model (DJL LMI's adapter API).

Design note: the frontend owns the set (name -> folder) and every worker's engine gets the whole of it in a
``Configure`` frame, after the requests already sent to it; a worker started later gets it before its first
request, so a restarted worker serves the same adapters. A change is all or nothing: when one engine refuses
it (a folder it cannot read, an unsupported adapter), the previous set is sent again and the client gets the
engine's reason. The model folder's own adapters (``adapters/NAME/``) are part of the model and not listed here.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Mapping
from typing import Any

from rollcore.errors import Conflict, InvalidRequest, ModelNotFound
from serving.batching.rolling import RollingBatcher

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


class ApiAdapters:
    """The adapters of one model registered over the API."""

    def __init__(self, model: str, batcher: RollingBatcher, timeout_s: float) -> None:
        self.model = model
        self._batcher = batcher
        self._timeout_s = timeout_s
        self._lock = asyncio.Lock()

    @property
    def registered(self) -> dict[str, str]:
        return dict(self._batcher.adapters or {})

    def check_name(self, name: str, builtin: list[str]) -> None:
        """Raise unless ``name`` may be registered (checked before its source is fetched, and again here)."""
        if not NAME.fullmatch(name):
            raise InvalidRequest(f"adapter name {name!r}: 1-64 letters, digits, '.', '_' or '-', starting with a "
                                 "letter or digit")
        if name in builtin:
            raise Conflict(f"adapter {name!r} is one of model {self.model!r}'s own adapters (its adapters/ folder)")

    async def register(self, name: str, folder: str, builtin: list[str]) -> None:
        self.check_name(name, builtin)
        async with self._lock:
            await self._apply({**self.registered, name: folder}, name)

    async def unregister(self, name: str) -> None:
        async with self._lock:
            current = self.registered
            if name not in current:
                raise ModelNotFound(f"LoRA adapter {name!r} was not registered over the API for model {self.model!r}")
            del current[name]
            await self._apply(current, name)

    async def _apply(self, wanted: Mapping[str, str], name: str) -> None:
        before = self.registered
        refusals = await _refusals(self._batcher.configure(adapters=wanted), self._timeout_s)
        if refusals:
            await _refusals(self._batcher.configure(adapters=before), self._timeout_s)
            raise InvalidRequest(f"adapter {name!r}: {refusals[0]}")


async def _refusals(acks: Mapping[int, asyncio.Future[Any]], timeout_s: float) -> list[str]:
    """The workers' refusals of a change (a worker that went away or has not answered refuses nothing)."""
    if not acks:
        return []
    done, _ = await asyncio.wait(acks.values(), timeout=timeout_s)
    return [f.result().error for f in done if f.result() is not None and f.result().error is not None]
