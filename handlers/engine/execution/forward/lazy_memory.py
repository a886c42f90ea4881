"""Large zeroed buffers that cost nothing until used: the KV pool's memory.

Design note: the KV pool is the largest allocation of a worker (4.5 GiB for a 110M model's 32 sequences of
2048 tokens). Writing it at load is the slowest part of a start on a virtual machine whose host backs
memory on first touch: 12-42 s for 4.5 GiB on this project's 2-core VM (36 s of a 49 s start; the model
itself loads in 13 s). An anonymous private mapping is zero by definition and costs nothing until a page is
touched, so ``ZeroRegion`` maps the memory, then either touches every page now (``eager``, the default) or
leaves each page to fault in when the engine first writes KV into it (``lazy``).

Why eager stays the default: until the pool has been used once, new requests keep landing on pages never
touched and each such fault lands inside a step, so every early measurement and user pays it; faulting the
region in a background thread was no better (the host-side faults interfere with the steps at any
priority). ``lazy`` is for fast starts where the first minutes' latency matters less: development, tests,
scale-from-zero. Figures: benchmarks/HISTORY.md, "Prepacked weights and the lazy KV cache".

With ``lazy`` the worker's RSS grows with use up to the planned KV size (the memory plan checked at load
that it is available); engine stats report ``kv_blocks_touched``. Huge pages are for ``eager`` only: touched
lazily, a single token's KV would fault in 2 MiB per layer, head and K/V.
"""

from __future__ import annotations

import math
import mmap

import torch

POPULATE_MODES = ("eager", "lazy")


def huge_pages(region: mmap.mmap) -> bool:
    """Ask the kernel to back ``region`` with transparent huge pages (2 MiB on x86-64) before it is touched;
    True when it accepted. Where THP is ``madvise`` (the common default) memory is otherwise mapped in 4 KiB
    pages, and a decode step that reads KV blocks scattered over the pool misses the TLB at every 4 KiB block
    of every head (on a virtual machine each miss walks two page tables); huge pages made the decode-attention
    kernel faster over scattered blocks (benchmarks/HISTORY.md, "Prepacked weights and the lazy KV cache"). A
    no-op where THP is off."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None:
        return False
    try:
        region.madvise(advice)
    except OSError:  # THP compiled out or disabled
        return False
    return True


class ZeroRegion:
    """``nbytes`` of zeroed anonymous memory, viewed as tensors with ``view``."""

    def __init__(self, nbytes: int, populate: str = "eager") -> None:
        if populate not in POPULATE_MODES:
            raise ValueError(f"populate mode {populate!r}: expected one of {', '.join(POPULATE_MODES)}")
        self.nbytes = nbytes
        # MAP_PRIVATE: plain anonymous memory (mmap's default, MAP_SHARED, would be shmem).
        self._map = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        # lazy: 4 KiB pages, so memory is paid as KV is written (a 2 MiB page per layer, head and K/V at the first
        # token was 4 GiB for a 7B model's first step)
        self.huge_pages = populate == "eager" and huge_pages(self._map)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)[:nbytes]
        if populate == "eager":
            self.tensor.zero_()  # already zero: this only faults every page in now

    def view(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A contiguous tensor of ``shape`` and ``dtype`` over the bytes from ``offset`` (a multiple of the
        element size)."""
        return self.tensor[offset:offset + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
