"""What this CPU can do, read once from /proc/cpuinfo (torch-free, so the memory plan can use it too).

Design note: what an instruction set decides is read here (fast bf16); which GEMM kernel a linear layer runs
is measured at load instead (``handlers.engine.execution.kernels.linear_choice``), as it depends on the layer's shape
as much as on the CPU.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

from rollcore.types import CORE_SHARERS_ENV

CPUINFO = Path("/proc/cpuinfo")


@lru_cache(maxsize=4)
def cpu_flags(cpuinfo: Path = CPUINFO) -> frozenset[str]:
    """The ``flags`` of the first CPU in ``cpuinfo`` (empty when unreadable, e.g. not Linux)."""
    try:
        with open(cpuinfo, encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@lru_cache(maxsize=1)
def cpu_model_name(cpuinfo: Path = CPUINFO) -> str:
    """The ``model name`` of the first CPU in ``cpuinfo`` ("unknown" when unreadable)."""
    try:
        with open(cpuinfo, encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def has_fast_bf16(flags: frozenset[str] | None = None) -> bool:
    """AVX512-BF16 or AMX: bf16 matmuls run at 2x fp32 or more."""
    f = cpu_flags() if flags is None else flags
    return "avx512_bf16" in f or "amx_bf16" in f


_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


_MMAP_THRESHOLD_MAX = 32 << 20


@lru_cache(maxsize=1)
def _libc() -> Any:
    """The C library, found once: ``find_library`` forks this process for ``ldconfig -p`` on every call, and a GGUF
    load trims after each tensor. Raises ``OSError`` where there is none."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name is None:
        raise OSError("no C library found")
    return ctypes.CDLL(name)


def keep_freed_memory(max_block_bytes: int = _MMAP_THRESHOLD_MAX) -> bool:
    """Tell glibc's malloc to keep freed blocks (up to ``max_block_bytes``, at most 32 MiB) for reuse instead
    of returning them to the kernel. A step's activations are large (a 2048-token prefill of a 110M model allocates
    ~0.5 GB of temporaries); by default each is a fresh mmap whose pages fault in one by one and are unmapped
    at free (a page fault per page and system time every such step; benchmarks/HISTORY.md). The heap then
    holds the peak activation memory, which the memory plan budgets anyway. Returns False where it does not
    apply (not glibc). Process-wide: call it once in a worker process."""
    import ctypes

    try:
        mallopt = _libc().mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    # glibc caps the mmap threshold at HEAP_MAX (32 MiB on 64-bit): larger blocks are still mmapped.
    return bool(mallopt(_M_MMAP_THRESHOLD, min(max_block_bytes, _MMAP_THRESHOLD_MAX))) and \
        bool(mallopt(_M_TRIM_THRESHOLD, (1 << 31) - 1))


def return_freed_memory() -> bool:
    """Give the heap's free memory back to the kernel once (glibc's ``malloc_trim``): after a load whose
    temporaries ``keep_freed_memory`` would otherwise keep for good. False where it does not apply."""
    import ctypes

    try:
        trim = _libc().malloc_trim
    except (OSError, AttributeError):
        trim = None
    if trim is None:
        return False
    trim.argtypes = [ctypes.c_size_t]
    return bool(trim(0))


def auto_threads(num_workers: int = 1, ranks_per_worker: int = 1, environ: Mapping[str, str] | None = None) -> int:
    """``option.num_threads=auto``: the cores this process may run on (its affinity mask, which taskset and
    container CPU sets narrow), shared evenly by the model's workers and their tensor-parallel ranks, and by the
    models the server loaded at start (``ROLLSERVE_MODELS_SHARING_CORES``, set by the frontend for its workers):
    OpenMP threads that outnumber the cores spin against each other."""
    env = os.environ if environ is None else environ
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    try:
        models = max(1, int(env.get(CORE_SHARERS_ENV, "1")))
    except ValueError:
        models = 1
    return max(1, cores // max(1, num_workers * ranks_per_worker * models))


CACHES = Path("/sys/devices/system/cpu/cpu0/cache")


@lru_cache(maxsize=1)
def last_level_cache_bytes(caches: Path = CACHES) -> int:
    """The size of the first CPU's last-level cache, from sysfs (0 when unreadable)."""
    best_level, size = 0, 0
    try:
        for index in caches.glob("index*"):
            level = int((index / "level").read_text())
            text = (index / "size").read_text().strip().upper()
            scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
            value = int(text.rstrip("KMG")) * scale
            if (level, value) > (best_level, size):
                best_level, size = level, value
    except (OSError, ValueError):
        return 0
    return size
