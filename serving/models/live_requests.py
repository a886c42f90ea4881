"""Request ids: the server's own for its tables, the client's for logs, headers and cancel-by-id.

Design note: batchers and workers key their tables by ``GenerationRequest.request_id``; a client that
could choose it could make two requests collide (one hangs, or two swap outputs). So every request gets
an id generated here when a model accepts it, and the id the client sent (``X-Request-Id``, the gRPC
``id``/``request_id``) is kept as ``client_id``. Client ids must be unique among live requests,
server-wide, because ``DELETE /requests/{id}`` cancels by them: a second live request with the same id is
refused with 409 (``Conflict``). An id is released when its request ends, however it ends. Event loop only.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from typing import Any

from rollcore.errors import Conflict


def counter_ids(prefix: str | None = None) -> Callable[[], str]:
    """Unique, unguessable-prefix ids: ``<8 random hex>-<n>`` (cheap, and never reused in a process)."""
    head = prefix if prefix is not None else os.urandom(4).hex()
    numbers = itertools.count(1)
    return lambda: f"{head}-{next(numbers)}"


class LiveRequests:
    """Client id -> (endpoint, internal id) of every live request."""

    def __init__(self, new_id: Callable[[], str] | None = None) -> None:
        self._new_id = new_id or counter_ids()
        self._live: dict[str, tuple[Any, str]] = {}

    def claim(self, client_id: str, endpoint: Any) -> str:
        """A fresh internal id for a request the client calls ``client_id``. Raises ``Conflict`` when a live
        request already has that client id."""
        if client_id in self._live:
            raise Conflict(f"request id {client_id!r} (X-Request-Id, or the gRPC request id) is already used by a "
                           "request in progress; request ids must be unique among live requests")
        internal = self._new_id()
        self._live[client_id] = (endpoint, internal)
        return internal

    def release(self, client_id: str, internal: str) -> None:
        """Forget ``client_id`` if it still names the request ``internal``."""
        entry = self._live.get(client_id)
        if entry is not None and entry[1] == internal:
            del self._live[client_id]

    def find(self, client_id: str) -> tuple[Any, str] | None:
        """``(endpoint, internal id)`` of the live request the client calls ``client_id``."""
        return self._live.get(client_id)

    def __len__(self) -> int:
        return len(self._live)
