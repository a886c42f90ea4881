"""Large zeroed buffers that cost nothing until used: the KV pool's memory.

Design note: the KV pool is the largest allocation of a worker (4.5 GiB for a 110M model's 32 sequences of
2048 tokens). Zeroing it at load made it the slowest part of a start: on a virtual machine whose memory the
host backs on first touch, writing 4.5 GiB took 12-42 s (this project's 2-core VM: 36 s of a 49 s start;
the model itself loaded in 13 s). An anonymous private mapping is zero by definition and costs nothing
until a page is touched, so ``ZeroRegion`` maps the memory and, by default (``lazy``), leaves each page to
fault in when the engine first writes KV into it: only the blocks a workload uses are ever paid for.

Measured before choosing (``serving bench`` on the 110M model, 32 requests right after a start, alternating):
``lazy`` matched ``eager`` (burst 87.1 / 82.2 vs 73.4 / 88.7 / 76.2 output tok/s), while faulting the whole
region in a background idle-priority thread (``madvise(MADV_POPULATE_WRITE)``) slowed that first burst to
55-58 tok/s: on this VM the host-side faults of 4.5 GiB interfere with the steps even at idle priority.

Trade-off: with ``lazy`` the worker's RSS grows as the pool is used (up to the planned KV size; the memory
plan checked at load that it is available), and a page first touched inside a step costs that step its
fault. ``eager`` zeroes everything at load, as before: memory committed up front, flat RSS, slow start.
"""

from __future__ import annotations

import mmap

import torch

POPULATE_MODES = ("lazy", "eager")


class ZeroRegion:
    """``nbytes`` of zeroed anonymous memory, viewed as tensors with ``view``."""

    def __init__(self, nbytes: int, populate: str = "lazy") -> None:
        if populate not in POPULATE_MODES:
            raise ValueError(f"populate mode {populate!r}: expected one of {', '.join(POPULATE_MODES)}")
        self.nbytes = nbytes
        # MAP_PRIVATE: plain anonymous memory (mmap's default, MAP_SHARED, would be shmem).
        self._map = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)[:nbytes]
        if populate == "eager":
            self.tensor.zero_()  # already zero: this only faults every page in now

    def view(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A contiguous tensor of ``shape`` and ``dtype`` over the bytes from ``offset`` (a multiple of the
        element size)."""
        count = 1
        for dim in shape:
            count *= dim
        return self.tensor[offset:offset + count * dtype.itemsize].view(dtype).view(shape)
