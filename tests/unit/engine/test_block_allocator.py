"""Property tests of the block allocator (no model, no torch)."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from handlers.engine.core.kv_cache import BlockAllocator, block_key


def _check(alloc: BlockAllocator, tables: list[list[int]]) -> None:
    refs = Counter(b for t in tables for b in t)
    for b in range(alloc.num_blocks):
        assert alloc.ref_count(b) == refs.get(b, 0)
    assert alloc.num_used_blocks == len(refs)
    assert alloc.num_free_blocks + alloc.num_used_blocks == alloc.num_blocks


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 5)), max_size=60), st.integers(1, 24))
def test_allocate_free_accounting(ops: list[tuple[bool, int]], num_blocks: int) -> None:
    alloc = BlockAllocator(num_blocks, 4)
    tables: list[list[int]] = []
    ever: set[int] = set()
    for is_alloc, n in ops:
        if is_alloc or not tables:
            table: list[int] = []
            try:
                alloc.allocate(table, n)
            except MemoryError:
                assert n > alloc.num_free_blocks and table == []
            tables.append(table)
            ever.update(table)
        else:
            alloc.free(tables.pop(n % len(tables)))
        _check(alloc, tables)
        assert alloc.num_touched_blocks == len(ever)  # the pages a lazily mapped KV pool has paid for
    for t in tables:
        alloc.free(t)
    assert alloc.num_used_blocks == 0


def test_growth_is_contiguous_when_room() -> None:
    alloc = BlockAllocator(64, 4)
    a: list[int] = []
    b: list[int] = []
    for _ in range(10):
        alloc.allocate(a, 1)
        alloc.allocate(b, 1)
    assert a == list(range(a[0], a[0] + 10))
    assert b == list(range(b[0], b[0] + 10))


def test_prefix_sharing_and_lru_eviction() -> None:
    alloc = BlockAllocator(4, 2)
    tokens = [1, 2, 3, 4, 5]
    t1: list[int] = []
    alloc.allocate(t1, 3)
    k0 = block_key(None, tokens[0:2])
    k1 = block_key(k0, tokens[2:4])
    alloc.register_full_block(t1[0], k0)
    alloc.register_full_block(t1[1], k1)
    blocks, keys = alloc.match_prefix(tokens, 4)
    assert blocks == t1[:2] and keys == [k0, k1]
    alloc.acquire(blocks)
    assert alloc.ref_count(t1[0]) == 2
    alloc.free(t1)
    alloc.free(blocks)
    assert alloc.num_used_blocks == 0 and alloc.num_cached_free_blocks == 2
    # Needing every block evicts the cached ones; the prefix is gone afterwards.
    t2: list[int] = []
    alloc.allocate(t2, 4)
    assert sorted(t2) == [0, 1, 2, 3]
    assert alloc.match_prefix(tokens, 4) == ([], [])
