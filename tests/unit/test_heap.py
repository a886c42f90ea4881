"""``serving.heap``: glibc's malloc_trim gives a fragmented heap's free pages back (the frontend runs it
periodically: the soak's RSS drift)."""

from __future__ import annotations

import asyncio
import ctypes
from pathlib import Path

from serving.heap import malloc_trim, trim_periodically


def rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_malloc_trim_returns_the_free_pages_of_a_fragmented_heap() -> None:
    trim = malloc_trim()
    assert trim is not None  # glibc: the machines this server runs on
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    # 96 MiB of 8 KiB blocks (below the mmap threshold: they live in the heap), then free all but one in 64:
    # the kept blocks pin the heap's top, so free() alone cannot give the pages back
    blocks = [libc.malloc(8192) for _ in range(12288)]
    assert all(blocks)
    for b in blocks:
        ctypes.memset(b, 1, 8192)  # touch: resident
    kept = blocks[::64]
    for i, b in enumerate(blocks):
        if i % 64:
            libc.free(b)
    before = rss_kib()
    assert trim(0) == 1
    after = rss_kib()
    for b in kept:
        libc.free(b)
    assert before - after > 64 * 1024, (before, after)  # most of the 94.5 MiB freed went back


def test_trim_periodically_runs_until_cancelled() -> None:
    async def main() -> bool:
        task = asyncio.create_task(trim_periodically(0.01))
        await asyncio.sleep(0.05)
        running = not task.done()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return running and task.cancelled()

    assert asyncio.run(main())
