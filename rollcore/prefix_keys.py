"""Prefix-cache block keys, shared by the engine's KV cache and the frontend's prefix-aware routing.

Design note: a full block's key is the SHA-256 digest of its parent block's key and its own token ids, so equal
prefixes map to equal chains of keys and the frontend, knowing only the prompt's token ids, the engine's block size,
the LoRA adapter and the request's ``cache_salt``, computes the very keys a worker's cache holds. The first block's
parent (``root_key``) mixes in the adapter (the same tokens under another adapter hold other KV) and the salt (one
tenant's blocks never serve another's). Workers report their keys to the frontend as ``short_key`` integers: the
first 8 bytes are enough to steer a request (a collision only misroutes it; the engine's own lookups use the
whole digest).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

_ROOT = b"\x00" * 32  # the parent of a sequence's first block (no adapter, no salt)


def block_key(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    """Prefix-cache key of a full block: ``sha256(parent key + token ids as little-endian uint64)``, 32
    bytes; it depends on every token of the prefix up to the block's end."""
    return hashlib.sha256((parent or _ROOT) + struct.pack(f"<{len(tokens)}Q", *tokens)).digest()


def root_key(adapter: str | None, salt: str | None = None) -> bytes | None:
    """The parent key of a sequence's first block: None for the base model without salt; else a key of its own
    for the LoRA adapter and the cache salt (NUL-separated: neither value can fake the other's part)."""
    if adapter is None and salt is None:
        return None
    if salt is None:
        return hashlib.sha256(b"adapter\x00" + adapter.encode()).digest()  # type: ignore[union-attr]
    return hashlib.sha256(b"salt\x00" + salt.encode() + b"\x00adapter\x00" + (adapter or "").encode()
                          + (b"\x01" if adapter is not None else b"\x00")).digest()


def short_key(key: bytes) -> int:
    """The integer a worker reports for ``key`` (its first 8 bytes, little-endian)."""
    return int.from_bytes(key[:8], "little")


def prompt_keys(token_ids: Sequence[int], block_size: int, adapter: str | None = None,
                salt: str | None = None, max_tokens: int | None = None) -> list[int]:
    """``short_key`` of each full block of ``token_ids[:max_tokens]``, first block first."""
    n = len(token_ids) if max_tokens is None else min(len(token_ids), max_tokens)
    keys: list[int] = []
    parent = root_key(adapter, salt)
    for i in range(n // block_size):
        parent = block_key(parent, token_ids[i * block_size:(i + 1) * block_size])
        keys.append(short_key(parent))
    return keys
