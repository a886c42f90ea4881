"""Give the frontend's freed heap back to the operating system (glibc's ``malloc_trim``).

The frontend's C libraries (gRPC's core, the tokenizers, the h11/asyncio buffers of streamed responses)
allocate with the C allocator, on the event loop's thread and on the tokenizer pool's. glibc returns a
freed chunk to the system only from the top of an arena: chunks freed in the middle of the heap stay in the
process's resident set, which under steady streaming load grows slowly as the free space fragments (the
soak of ``benchmarks/soak.py``; benchmarks/HISTORY.md, "Soak"). ``malloc_trim(0)`` releases every free page
of every arena, so a periodic call bounds that growth; it costs well under a millisecond on a heap of tens
of MiB. Elsewhere than glibc it is a no-op.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

TRIM_EVERY_S = 30.0


def malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim`` (pad bytes kept at the top -> 1 if memory was released), or None."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        fn = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # musl, macOS: no malloc_trim
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


async def trim_periodically(every_s: float = TRIM_EVERY_S) -> None:
    """Run ``malloc_trim(0)`` every ``every_s`` seconds until cancelled (returns at once without glibc)."""
    trim = malloc_trim()
    if trim is None:
        log.debug("malloc_trim is not available: the frontend's freed heap stays with the allocator")
        return
    while True:
        await asyncio.sleep(every_s)
        trim(0)


class IdleTrim:
    """A dynamic-batching worker's trim: called when it has no batch to run, it returns the freed heap to the
    system at most once every ``every_s`` seconds.

    Workers keep freed blocks on purpose (``keep_freed_memory``: a step's temporaries do not fault their pages
    in again), so their resident set is the high-water mark of every batch since the start: one batch of a
    larger shape than any before raised a dynamic worker's RSS by 12 MiB for good in a 30-minute soak
    (benchmarks/HISTORY.md, "Soak"). Trimming when idle bounds it by the current load instead; the cost is
    one batch's page faults per ``every_s``. Rolling workers are not trimmed: their steps reuse the same
    shapes (packed kernels built at load) and a trim between two bursts would fault the next step's pages in.
    """

    def __init__(self, every_s: float = TRIM_EVERY_S, trim: Callable[[int], int] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._trim = trim if trim is not None else malloc_trim()
        self._every_s = every_s
        self._clock = clock
        self._last = clock()

    def __call__(self) -> bool:
        """Trim if ``every_s`` has passed since the last one; True when it trimmed."""
        if self._trim is None or self._clock() - self._last < self._every_s:
            return False
        self._trim(0)
        self._last = self._clock()
        return True
