"""The Responses API's store: answers kept in memory for ``GET``, ``DELETE``, ``cancel`` and ``previous_response_id``.

Design note: bounded twice, both constructor arguments: at most ``max_entries`` responses (default 1000; the
oldest is dropped first) and each for at most ``ttl_s`` seconds after it was last written (default 3600), so
an idle server holds nothing for long and a busy one a fixed number. An entry keeps the answer (the
``Response`` object) and the conversation it continues (the plain input items of every earlier turn and
this one), so a chain of ``previous_response_id`` costs one lookup. Entries live in a namespace: the digest
of the inference token the request carried when tokens are required, one shared namespace otherwise; a
response is invisible from another namespace (404, as an unknown id). An entry in progress (streamed or
``background``) holds a ``cancel`` callable. Nothing is persisted: a restart forgets every response.
Event loop only (no locks).
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

DEFAULT_MAX_ENTRIES = 1000
DEFAULT_TTL_S = 3600.0


@dataclass
class Stored:
    """One response: the answer, the items it continues plus its own input, and how to stop it while it runs."""

    response: dict[str, Any]
    history: list[dict[str, Any]]  # plain input items of every turn up to and including this one's input
    cancel: Callable[[], None] | None = None
    job: Any = None  # the generation in progress (``responses.Job``), to await its end after a cancel
    written_at: float = field(default=0.0)

    @property
    def in_progress(self) -> bool:
        return self.response["status"] in ("queued", "in_progress")

    def conversation(self) -> list[dict[str, Any]]:
        """The items a continuation starts from: this turn's input history, then its output."""
        return [*self.history, *self.response["output"]]


def namespace(authorization: str | None, tokens_required: bool) -> str:
    """The store namespace of a request: its token's digest when inference tokens are required, else ``""``."""
    if not tokens_required or not authorization:
        return ""
    return hashlib.sha256(authorization.strip().encode("utf-8", "replace")).hexdigest()


class ResponseStore:
    """Responses by (namespace, id), bounded by count and age (see the module note)."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, ttl_s: float = DEFAULT_TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_entries < 1 or ttl_s <= 0:
            raise ValueError("a response store needs max_entries >= 1 and ttl_s > 0")
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: OrderedDict[tuple[str, str], Stored] = OrderedDict()

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    def put(self, ns: str, entry: Stored) -> None:
        """Add or replace ``entry`` (newest last); the oldest entries beyond the bound are dropped."""
        key = (ns, entry.response["id"])
        entry.written_at = self._clock()
        self._entries.pop(key, None)
        self._entries[key] = entry
        self._expire()
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, ns: str, response_id: str) -> Stored | None:
        self._expire()
        return self._entries.get((ns, response_id))

    def delete(self, ns: str, response_id: str) -> Stored | None:
        self._expire()
        return self._entries.pop((ns, response_id), None)

    def _expire(self) -> None:
        """Drop entries older than the TTL (the oldest come first: written order)."""
        cutoff = self._clock() - self.ttl_s
        while self._entries:
            key, oldest = next(iter(self._entries.items()))
            if oldest.written_at > cutoff:
                return
            del self._entries[key]
