"""What memory this worker may still use when it starts loading: the smaller of ``MemAvailable``
(``/proc/meminfo``) and the headroom (limit minus usage) of every memory-limited cgroup the process is in,
cgroup v2 (``memory.max``, ``memory.current``) or v1 (``memory.limit_in_bytes``, ``memory.usage_in_bytes``).
Measured once, at load; workers that load at the same time each see the same free memory. Page cache counted
in a cgroup's usage makes its headroom conservative. Every path is a parameter, so tests use fake files."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

MEMINFO = Path("/proc/meminfo")
CGROUP_ROOT = Path("/sys/fs/cgroup")
SELF_CGROUP = Path("/proc/self/cgroup")
FALLBACK_AVAILABLE = 4 << 30  # when /proc/meminfo cannot be read
_V1_UNLIMITED = 1 << 60  # cgroup v1 reports "no limit" as a page-rounded 2**63 - 1


@dataclass(frozen=True, slots=True)
class MemoryBudget:
    """What this worker may use: min(``MemAvailable``, the tightest cgroup's limit minus usage)."""

    mem_available: int
    cgroup_limit: int | None = None
    cgroup_usage: int | None = None
    cgroup_file: str | None = None  # the limit file of the tightest cgroup
    # how a device's budget was measured (``handlers.engine.execution.gpu.device``), for describe()
    note: str | None = None

    @property
    def cgroup_headroom(self) -> int | None:
        if self.cgroup_limit is None or self.cgroup_usage is None:
            return None
        return max(0, self.cgroup_limit - self.cgroup_usage)

    @property
    def bytes(self) -> int:
        headroom = self.cgroup_headroom
        return self.mem_available if headroom is None else min(self.mem_available, headroom)

    def describe(self) -> str:
        if self.note is not None:
            return self.note
        headroom = self.cgroup_headroom
        if headroom is None or self.cgroup_limit is None or self.cgroup_usage is None:
            return f"MemAvailable {format_bytes(self.mem_available)}; no cgroup memory limit"
        return (f"min(MemAvailable {format_bytes(self.mem_available)}, cgroup {self.cgroup_file} "
                f"{format_bytes(self.cgroup_limit)} - usage {format_bytes(self.cgroup_usage)} = "
                f"{format_bytes(headroom)})")


def read_mem_available(meminfo: Path = MEMINFO) -> int:
    """``MemAvailable`` of ``meminfo`` in bytes; ``FALLBACK_AVAILABLE`` (4 GiB) when it cannot be read."""
    try:
        for line in meminfo.read_text(encoding="ascii").splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return FALLBACK_AVAILABLE


def _read_int(path: Path) -> int | None:
    """The integer in a cgroup file; None when absent, unreadable or unlimited (``max``, v1's 2**63)."""
    try:
        text = path.read_text(encoding="ascii").strip()
    except OSError:
        return None
    if not text.isdigit():
        return None
    value = int(text)
    return None if value >= _V1_UNLIMITED else value


def _cgroup_paths(self_cgroup: Path) -> tuple[str, str]:
    """(v2 path, v1 memory-controller path) of this process, ``/`` when unknown."""
    v2 = v1 = "/"
    try:
        lines = self_cgroup.read_text(encoding="ascii").splitlines()
    except OSError:
        return v2, v1
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            v2 = parts[2] or "/"
        elif "memory" in parts[1].split(","):
            v1 = parts[2] or "/"
    return v2, v1


def _ancestors(root: Path, cgroup_path: str) -> list[Path]:
    """``root`` joined with ``cgroup_path`` and each of its parents up to ``root`` itself."""
    parts = [p for p in cgroup_path.split("/") if p and p != ".."]
    return [root.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]


def read_cgroup_limit(cgroup_root: Path = CGROUP_ROOT,
                      self_cgroup: Path = SELF_CGROUP) -> tuple[int, int, str] | None:
    """(limit, usage, limit file) of the memory-limited cgroup with the least headroom among this process's
    cgroup and its ancestors -- v2 ``memory.max``/``memory.current`` under ``cgroup_root``, v1
    ``memory.limit_in_bytes``/``memory.usage_in_bytes`` under ``cgroup_root/memory`` -- or None when no
    cgroup limits memory."""
    v2, v1 = _cgroup_paths(self_cgroup)
    candidates = [(d / "memory.max", d / "memory.current") for d in _ancestors(cgroup_root, v2)]
    candidates += [(d / "memory.limit_in_bytes", d / "memory.usage_in_bytes")
                   for d in _ancestors(cgroup_root / "memory", v1)]
    best: tuple[int, int, str] | None = None
    for limit_file, usage_file in candidates:
        limit, usage = _read_int(limit_file), _read_int(usage_file)
        if limit is None or usage is None:
            continue
        if best is None or limit - usage < best[0] - best[1]:
            best = (limit, usage, str(limit_file))
    return best


def memory_budget(meminfo: Path = MEMINFO, cgroup_root: Path = CGROUP_ROOT,
                  self_cgroup: Path = SELF_CGROUP) -> MemoryBudget:
    """Measure the budget now (see ``MemoryBudget``)."""
    cgroup = read_cgroup_limit(cgroup_root, self_cgroup)
    if cgroup is None:
        return MemoryBudget(read_mem_available(meminfo))
    limit, usage, path = cgroup
    return MemoryBudget(read_mem_available(meminfo), limit, usage, path)


def format_bytes(n: int) -> str:
    """Bytes as GiB / MiB / KiB with two, one or no decimals."""
    if abs(n) >= 1 << 30:
        return f"{n / (1 << 30):.2f} GiB"
    if abs(n) >= 1 << 20:
        return f"{n / (1 << 20):.1f} MiB"
    if abs(n) >= 1 << 10:
        return f"{n / (1 << 10):.1f} KiB"
    return f"{n} B"
