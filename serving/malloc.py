"""glibc malloc tuning through ``mallopt`` (torch-free: the frontend and the workers both use it).

Design note: the frontend is one asyncio thread plus short-lived helper threads (the tokenization pool, gRPC's
threads). glibc gives each thread that allocates concurrently an arena of its own (up to 8 per core), and
memory freed into a helper thread's arena is reused only by allocations that land in that arena: under steady
traffic the frontend's RSS crept up after warm-up while Python's own heap stayed flat (tracemalloc). Two arenas
are what an event-loop server needs (the main one and one for every helper thread); ``MALLOC_ARENA_MAX`` in
the environment, when set, wins. Where the C library is not glibc these calls do nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from functools import lru_cache
from typing import Any

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
FRONTEND_ARENAS = 2


@lru_cache(maxsize=1)
def _mallopt() -> Any:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        fn = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def mallopt(param: int, value: int) -> bool:
    """glibc's ``mallopt``; False where it is not available or refuses the value."""
    fn = _mallopt()
    return fn is not None and bool(fn(param, value))


def limit_arenas(count: int = FRONTEND_ARENAS) -> bool:
    """Cap the number of malloc arenas of this process (call before threads start allocating), unless
    ``MALLOC_ARENA_MAX`` is set (glibc read it at start). True when the cap is in force."""
    if os.environ.get("MALLOC_ARENA_MAX"):
        return False
    return mallopt(M_ARENA_MAX, count)
