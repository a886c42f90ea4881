"""Which of a model's workers a rolling request goes to: the one whose prefix cache holds most of its prompt.

Design note: each worker's engine reports the prefix-cache keys it registers and evicts with its step frames
(``Deltas.prefix``: ``rollcore.prefix_keys.short_key`` integers and the block size they cover); ``PrefixIndex``
keeps them per worker, bounded. For a request whose token ids the frontend knows, ``Router`` computes the keys of
its prompt's full blocks with the engine's own function (``rollcore.prefix_keys.prompt_keys``: token ids, LoRA
adapter, ``cache_salt``) and picks the worker holding the longest run of them from the first, the least loaded
one on a tie. Load bounds it: a worker is chosen only while it runs fewer than ``max_imbalance`` requests more
than the least loaded one, so the busiest worker never gets more than that ahead through routing (a popular
system prompt cannot pile every conversation onto one worker). The same bound holds for sticky sessions: a key's
worker is kept while it is within the bound, else the key moves (``within_bound``). With ``policy`` least_loaded
the prefix is not looked at (the imbalance bound is then moot: the least loaded worker is always chosen).

Keys reported but never confirmed, or a worker's report lost, only misroute a request: the engine looks its
prefix up again on admission and computes what it does not hold.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Generic, TypeVar

from rollcore.prefix_keys import prompt_keys
from rollcore.types import GenerationRequest

PREFIX, LEAST_LOADED = "prefix", "least_loaded"
POLICIES = (PREFIX, LEAST_LOADED)
DEFAULT_MAX_IMBALANCE = 4
MAX_KEYS_PER_WORKER = 1 << 20  # far above any engine's block count; bounds a worker that misreports

W = TypeVar("W")


class PrefixIndex:
    """The prefix-cache keys each worker holds, as its engine reported them. Event-loop only."""

    def __init__(self, max_keys: int = MAX_KEYS_PER_WORKER) -> None:
        self.max_keys = max_keys
        self._held: dict[int, dict[int, None]] = {}  # worker id -> keys, least recently added first
        self.block_size: int | None = None  # the engines' block size (every worker of a model has the same)

    def update(self, worker_id: int, events: Mapping[str, Any]) -> None:
        """Apply one report: ``del`` keys dropped, then ``add`` keys added (``reset``: ``add`` is the whole set)."""
        held = self._held.setdefault(worker_id, {})
        if events.get("reset"):
            held.clear()
        for key in _ints(events.get("del")):
            held.pop(key, None)
        for key in _ints(events.get("add")):
            held.pop(key, None)
            held[key] = None
        while len(held) > self.max_keys:
            del held[next(iter(held))]
        size = events.get("block_size")
        if isinstance(size, int) and not isinstance(size, bool) and size > 0:
            self.block_size = size

    def forget(self, worker_id: int) -> None:
        """``worker_id`` is gone: its cache went with it."""
        self._held.pop(worker_id, None)

    def num_keys(self, worker_id: int) -> int:
        return len(self._held.get(worker_id, ()))

    def matched(self, worker_id: int, keys: Sequence[int]) -> int:
        """How many of ``keys`` (a prompt's blocks, first first) ``worker_id`` holds from the first on."""
        held = self._held.get(worker_id)
        if not held:
            return 0
        n = 0
        for key in keys:
            if key not in held:
                break
            n += 1
        return n


class Router(Generic[W]):
    """Picks a worker for a request from the candidates' loads and the prefix index."""

    def __init__(self, policy: str = PREFIX, max_imbalance: int = DEFAULT_MAX_IMBALANCE) -> None:
        if policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {', '.join(POLICIES)}, not {policy!r}")
        if max_imbalance < 1:
            raise ValueError(f"max_imbalance must be >= 1, not {max_imbalance}")
        self.policy = policy
        self.max_imbalance = max_imbalance
        self.index = PrefixIndex()
        self.num_routed = 0
        self.num_routed_by_prefix = 0  # chosen for the blocks it held (more than another candidate held)

    def prompt_keys(self, request: GenerationRequest) -> list[int]:
        """The keys of ``request``'s full prompt blocks; empty when the prefix cannot steer it (policy
        least_loaded, no token ids known in the frontend, or no engine has reported its block size yet)."""
        ids = request.prompt_token_ids
        size = self.index.block_size
        if self.policy != PREFIX or not ids or size is None:
            return []
        # the engine reuses no block that holds the prompt's last token (its logits are computed anew)
        return prompt_keys(ids, size, request.params.adapter, request.params.cache_salt, max_tokens=len(ids) - 1)

    def within_bound(self, load: int, floor: int) -> bool:
        """Whether a worker running ``load`` requests may take one more while the least loaded runs ``floor``."""
        return load < floor + self.max_imbalance

    def choose(self, candidates: Sequence[tuple[W, int, int]], capacity: int, keys: Sequence[int]) -> W | None:
        """The worker for a request with prompt ``keys``: ``candidates`` are (worker, worker id, load) of the
        workers that may take work; None when every one runs ``capacity`` requests."""
        if not candidates:
            return None
        floor = min(load for _, _, load in candidates)
        best: tuple[W, int, int] | None = None
        best_match = -1
        matches: list[int] = []
        for cand in candidates:
            _, wid, load = cand
            if load >= capacity or not self.within_bound(load, floor):
                continue
            match = self.index.matched(wid, keys) if keys else 0
            matches.append(match)
            if best is None or match > best_match or (match == best_match and load < best[2]):
                best, best_match = cand, match
        if best is None:
            return None
        self.num_routed += 1
        if best_match > 0 and min(matches) < best_match:
            self.num_routed_by_prefix += 1
        return best[0]

    def describe(self) -> dict[str, Any]:
        return {"policy": self.policy, "max_imbalance": self.max_imbalance, "routed_total": self.num_routed,
                "routed_by_prefix_total": self.num_routed_by_prefix, "block_size": self.index.block_size}


def _ints(values: Any) -> list[int]:
    """The integers of a reported key list (anything else in it is ignored: a report only steers routing)."""
    if not isinstance(values, list):
        return []
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool)]
