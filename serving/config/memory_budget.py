"""The host's memory budget for models, and what models hold of it, read from /proc.

Design note: ``model_memory_budget`` is a size (``6GiB``, ``512MiB``, ``2G``, plain bytes) or a share of the memory
available when the server starts (``60%`` of ``MemAvailable``). What a loaded model holds is measured, never
guessed: the proportional set size (``Pss`` of ``/proc/PID/smaps_rollup``) of each of its workers and their child
processes. PSS splits a page that several processes map (the fork server's imported libraries, a weights file two
copies of one model map) among them, so the figures of every worker add up to what they hold together. Before a
model loads, what it will take comes from its memory plan (``handlers.preflight.planned_memory``) or from an
earlier load of the same weights (``serving.models.residency``). Pure standard library: the frontend reads this.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "ki": 1 << 10, "kib": 1 << 10, "mi": 1 << 20, "mib": 1 << 20,
          "gi": 1 << 30, "gib": 1 << 30, "ti": 1 << 40, "tib": 1 << 40}
_SIZE = re.compile(r"^(\d+(?:\.\d+)?)\s*([A-Za-z]*)$")
_SHARE = re.compile(r"^(\d+(?:\.\d+)?)\s*%$")


@dataclass(frozen=True, slots=True)
class BudgetSetting:
    """``model_memory_budget`` as parsed: a fixed number of bytes, or a share of MemAvailable at start."""

    bytes: int | None = None
    share: float | None = None

    def resolve(self, proc: Path = PROC) -> int:
        """The budget in bytes (a share: of MemAvailable now)."""
        if self.bytes is not None:
            return self.bytes
        assert self.share is not None
        return int(mem_available(proc) * self.share)

    def describe(self) -> str:
        return f"{self.bytes} bytes" if self.bytes is not None else f"{self.share * 100:g}% of MemAvailable at start"


def memory_budget(text: str) -> BudgetSetting:
    """A ``model_memory_budget`` value: ``6GiB``, ``512MiB``, ``1.5G``, ``800000000`` or ``60%``. Raises
    ``ValueError(reason)`` (the keys' parser convention, ``rollcore.values``)."""
    reason = "expected a size (6GiB, 512MiB, 2G, bytes) or a share of the available memory (60%)"
    if (m := _SHARE.match(text)) is not None:
        share = float(m.group(1)) / 100
        if not 0 < share <= 1:
            raise ValueError(reason + " between 0% and 100%")
        return BudgetSetting(share=share)
    m = _SIZE.match(text)
    if m is None or m.group(2).lower() not in _UNITS:
        raise ValueError(reason)
    size = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if size <= 0:
        raise ValueError(reason + " above 0")
    return BudgetSetting(bytes=size)


def mem_available(proc: Path = PROC) -> int:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes (0 when unreadable)."""
    try:
        for line in (proc / "meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def human(n: float) -> str:
    """Bytes as the budget's keys spell them: ``1.50 GiB``, ``96.0 MiB``."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}" if n / size < 100 else f"{n / size:.0f} {unit}"
    return f"{int(n)} B"


def children_of(proc: Path = PROC) -> dict[int, list[int]]:
    """Parent pid -> child pids, from every ``/proc/PID/stat``: where the kernel keeps no ``children`` lists."""
    out: dict[int, list[int]] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        # the command name in parentheses may hold spaces: the fields after its closing parenthesis
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) > 1:
            out.setdefault(int(fields[1]), []).append(int(entry.name))
    return out


def _kids(pid: int, proc: Path) -> list[int] | None:
    """The children of ``pid`` from its threads' ``children`` lists; None where the kernel has none."""
    out: list[int] = []
    try:
        tasks = list((proc / str(pid) / "task").iterdir())
    except OSError:
        return []  # gone
    for task in tasks:
        try:
            out += [int(child) for child in (task / "children").read_text().split()]
        except FileNotFoundError:
            if not (task / "children").parent.exists():
                continue  # the thread ended
            return None
        except OSError:
            continue
    return out


def tree(pids: Iterable[int], proc: Path = PROC) -> list[int]:
    """``pids`` and every process below them."""
    scanned: dict[int, list[int]] | None = None
    seen: list[int] = []
    todo = [p for p in pids if p]
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.append(pid)
        kids = _kids(pid, proc) if scanned is None else None
        if kids is None:
            scanned = scanned if scanned is not None else children_of(proc)
            kids = scanned.get(pid, [])
        todo.extend(kids)
    return seen


def pss(pid: int, proc: Path = PROC) -> int:
    """The process's proportional set size in bytes (``smaps_rollup``; ``smaps`` summed where the kernel lacks
    it); 0 for a process that is gone."""
    for name in ("smaps_rollup", "smaps"):
        try:
            text = (proc / str(pid) / name).read_text()
        except FileNotFoundError:
            continue
        except OSError:
            return 0
        return sum(int(line.split()[1]) for line in text.splitlines() if line.startswith("Pss:")) * 1024
    return 0


def tree_pss(pids: Iterable[int], proc: Path = PROC) -> int:
    """What the processes ``pids`` and their descendants hold together (the sum of their PSS)."""
    return sum(pss(pid, proc) for pid in tree(pids, proc))
