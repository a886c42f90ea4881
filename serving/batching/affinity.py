"""Which worker an affinity key's requests go to (a SageMaker session, an OpenAI ``user`` or ``prompt_cache_key``,
a health probe's pin): the rolling batcher's memory of where a conversation's prefix cache lives.

Design note: a key remembers its worker, least recently used keys dropped first past ``MAX_AFFINITY_KEYS``. A key
the router placed (``routed``) may move when its worker runs too far ahead of the least loaded one; a pinned key
(the deep health check probing one worker) never moves.
"""

from __future__ import annotations

import collections

MAX_AFFINITY_KEYS = 65536  # sessions remembered per model (each bounded by its own store: frontends/http/sessions.py)


class Affinity:
    def __init__(self, max_keys: int = MAX_AFFINITY_KEYS) -> None:
        self._worker: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._routed: set[str] = set()  # keys whose worker routing chose
        self._max_keys = max_keys

    def pin(self, key: str, worker_id: int) -> None:
        """``key``'s requests go to ``worker_id`` whatever its load."""
        self._worker[key] = worker_id

    def forget(self, key: str) -> None:
        self._worker.pop(key, None)
        self._routed.discard(key)

    def worker_id(self, key: str | None) -> int | None:
        return self._worker.get(key) if key is not None else None

    def routed(self, key: str | None) -> bool:
        """True when routing chose ``key``'s worker (it may move past the imbalance bound)."""
        return key is not None and key in self._routed

    def note_routed(self, key: str) -> None:
        self._routed.add(key)

    def went_to(self, key: str, worker_id: int) -> None:
        """``key``'s latest request went to ``worker_id``: it sticks there, most recently used."""
        self._worker[key] = worker_id
        self._worker.move_to_end(key)
        if len(self._worker) > self._max_keys:
            self._routed.discard(self._worker.popitem(last=False)[0])
