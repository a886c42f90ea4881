"""Paged KV-cache bookkeeping: fixed-size blocks, ref counts, prefix caching. Pure Python, no torch.

Design note: the allocator only hands out block *ids*; the runner owns the memory. Three kinds of block:
in use (ref count > 0), free (never hashed or evicted), and cached-free (ref count 0 but holding a full
block of a known token prefix, evictable least-recently-used). A full block's key is the SHA-256 digest
of its parent block's key and its own token ids, so equal prefixes map to equal chains of keys and a hit
needs no verification: two different prefixes sharing a key would take a SHA-256 collision (as vLLM;
Python's ``hash()`` collides trivially, e.g. ``hash(2**61 - 1) == hash(0)``, and would serve one request's
KV to another). The keys come from ``rollcore.prefix_keys``, which the frontend's router shares: the allocator
records the keys it registers and evicts (``take_events``) so that the worker can report them.

Placement favours *contiguous* block tables (a sequence's next block is the one after its last, when
free; a new sequence starts in the middle of the largest free run) because the runner can then read a
sequence's KV as a view instead of gathering it every step.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Sequence as Seq

from rollcore.prefix_keys import block_key, root_key, short_key

__all__ = ["BlockAllocator", "block_key", "root_key"]

_FREE_RUN = re.compile(b"\x01+")


class BlockAllocator:
    """Hands out KV blocks; shares full prefix blocks across sequences when prefix caching is on.

    Not thread-safe; used by the scheduler on the engine thread only.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref = [0] * num_blocks
        self._key: list[bytes | None] = [None] * num_blocks
        self._by_key: dict[bytes, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached-free blocks, LRU first
        self._free_flags = bytearray(b"\x01") * num_blocks  # 1 = free and not cached
        self._num_free = num_blocks
        self._touched = bytearray(num_blocks)  # 1 = handed out at least once (its KV memory has been written)
        self.num_touched_blocks = 0
        self.prefix_queries = 0
        self.prefix_hits = 0
        # short_key -> held (True: registered, False: evicted) since the last take_events, the latest change of
        # each key winning; past the bound nobody took them (an engine with no frontend): dropped, and the next
        # report is the whole set instead
        self._changes: dict[int, bool] = {}
        self._resync = False

    # ----------------------------------------------------------------- gauges
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free plus evictable cached)."""
        return self._num_free + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by at least one live sequence."""
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self._evictable)

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    # ----------------------------------------------------------- prefix cache
    def match_prefix(self, token_ids: Seq[int], max_tokens: int,
                     root: bytes | None = None) -> tuple[list[int], list[bytes]]:
        """Cached full blocks covering the longest prefix of ``token_ids[:max_tokens]`` (``root``: the first
        block's parent key, ``root_key``).

        Returns (block ids, their keys) without taking references; call ``acquire`` to use them.
        """
        if not self.enable_prefix_caching:
            return [], []
        bs = self.block_size
        blocks: list[int] = []
        keys: list[bytes] = []
        parent = root
        for i in range(max_tokens // bs):
            key = block_key(parent, token_ids[i * bs:(i + 1) * bs])
            self.prefix_queries += 1
            block = self._by_key.get(key)
            if block is None:
                break
            self.prefix_hits += 1
            blocks.append(block)
            keys.append(key)
            parent = key
        return blocks, keys

    def acquire(self, block_ids: Seq[int]) -> None:
        """Take a reference on cached blocks returned by ``match_prefix``."""
        for b in block_ids:
            if self._ref[b] == 0:
                del self._evictable[b]
            self._ref[b] += 1

    def register_full_block(self, block_id: int, key: bytes) -> None:
        """Record that ``block_id`` now holds the full block with prefix key ``key``."""
        if not self.enable_prefix_caching or self._key[block_id] is not None:
            return
        if key not in self._by_key:
            self._by_key[key] = block_id
            self._key[block_id] = key
            self._note(key, True)

    def _note(self, key: bytes, held: bool) -> None:
        if self._resync:
            return
        self._changes[short_key(key)] = held
        if len(self._changes) > 2 * self.num_blocks:
            self._changes.clear()
            self._resync = True

    def take_events(self) -> dict[str, object] | None:
        """The prefix keys registered (``add``) and evicted (``del``) since the last call (net of each other), or
        None when none; ``reset``: ``add`` is the whole set the cache holds (earlier changes were dropped)."""
        if self._resync:
            self._resync = False
            return {"reset": True, "add": [short_key(k) for k in self._by_key], "del": []}
        if not self._changes:
            return None
        changes, self._changes = self._changes, {}
        return {"add": [k for k, held in changes.items() if held],
                "del": [k for k, held in changes.items() if not held]}

    # ------------------------------------------------------------- allocation
    def allocate(self, block_table: list[int], num_new: int) -> None:
        """Append ``num_new`` blocks to ``block_table`` (in place).

        Raises ``MemoryError`` (leaving the table unchanged) if fewer blocks are free.
        """
        if num_new > self.num_free_blocks:
            raise MemoryError(f"need {num_new} KV blocks, {self.num_free_blocks} free")
        for _ in range(num_new):
            want = block_table[-1] + 1 if block_table else -1
            if 0 <= want < self.num_blocks and self._free_flags[want]:
                block = want
            elif self._num_free:
                block = self._start_of_free_run()
            else:
                block = self._evict()
            self._take(block)
            block_table.append(block)

    def free(self, block_table: Seq[int]) -> None:
        """Drop one reference on each block; the tail is freed first so it is evicted first."""
        for b in reversed(block_table):
            self._ref[b] -= 1
            if self._ref[b] < 0:
                raise RuntimeError(f"block {b} freed more often than allocated")
            if self._ref[b] == 0:
                if self._key[b] is not None:
                    self._evictable[b] = None
                else:
                    self._free_flags[b] = 1
                    self._num_free += 1

    def _take(self, block: int) -> None:
        if not self._touched[block]:
            self._touched[block] = 1
            self.num_touched_blocks += 1
        if self._free_flags[block]:
            self._free_flags[block] = 0
            self._num_free -= 1
        self._ref[block] = 1

    def _evict(self) -> int:
        block, _ = self._evictable.popitem(last=False)
        key = self._key[block]
        if key is not None and self._by_key.get(key) == block:
            del self._by_key[key]
            self._note(key, False)
        self._key[block] = None
        return block

    def _start_of_free_run(self) -> int:
        """Where a new contiguous range should start: the middle of the largest free run when the run
        follows a block in use (leaving that sequence room to grow), else the run's start."""
        best_start, best_len = -1, 0
        for m in _FREE_RUN.finditer(self._free_flags):
            if m.end() - m.start() > best_len:
                best_start, best_len = m.start(), m.end() - m.start()
        if best_start > 0 and self._ref[best_start - 1] > 0 and best_len > 1:
            return best_start + best_len // 2
        return best_start
