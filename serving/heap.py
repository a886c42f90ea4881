"""Give the frontend's freed heap back to the operating system (glibc's ``malloc_trim``).

The frontend's C libraries (gRPC's core, the tokenizers, the h11/asyncio buffers of streamed responses)
allocate with the C allocator, on the event loop's thread and on the tokenizer pool's. glibc returns a
freed chunk to the system only from the top of an arena: chunks freed in the middle of the heap stay in the
process's resident set, which under steady streaming load grows slowly as the free space fragments (the
soak of ``benchmarks/soak.py``; benchmarks/README.md, "Soak"). ``malloc_trim(0)`` releases every free page
of every arena, so a periodic call bounds that growth; it costs well under a millisecond on a heap of tens
of MiB. Elsewhere than glibc it is a no-op.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
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
