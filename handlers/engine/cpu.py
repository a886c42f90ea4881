"""What this CPU can do, read once from /proc/cpuinfo (torch-free, so the memory plan can use it too).

Design note: kernel choices follow the instruction set, not one machine's measurement. Measured with
torch 2.13's oneDNN, one thread (see benchmarks/README.md): on AVX-512 CPUs the oneDNN-packed weight is
as fast or faster than the plain one at every row count from 1 to 2048 (1.4-2x at 8-64 rows), so the
plain copy that hybrid prepacking keeps for prefill is not needed there; on AVX2-only CPUs the packed
weight is 10-30% slower for prefill-sized inputs, so hybrid keeps both.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

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


def packed_weights_win_everywhere(flags: frozenset[str] | None = None) -> bool:
    """True on AVX-512 CPUs, where packed weights beat plain ones for prefill-sized inputs too."""
    return "avx512f" in (cpu_flags() if flags is None else flags)


def has_fast_bf16(flags: frozenset[str] | None = None) -> bool:
    """AVX512-BF16 or AMX: bf16 matmuls run at 2x fp32 or more."""
    f = cpu_flags() if flags is None else flags
    return "avx512_bf16" in f or "amx_bf16" in f
