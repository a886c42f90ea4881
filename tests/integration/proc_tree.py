"""What a server's processes hold and spend, read here from /proc (not through the server): its process tree, each
process's RSS, peak RSS (``VmHWM``), PSS and CPU-seconds. For the residency tests and ``benchmarks/residency.py``,
which check the server's own figures against these."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
FORK_SERVER = "rollserve-fork"  # the fork server's process name: it holds no model (workers are forked from it)
TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Proc:
    pid: int
    comm: str
    rss: int  # bytes
    hwm: int  # the largest RSS the process had since it started, bytes


def descendants(root: int) -> list[int]:
    """``root`` and every process below it."""
    children: dict[int, list[int]] = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat[stat.rfind(")") + 2:].split()[1]), []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def status(pid: int) -> Proc | None:
    """The process's name, RSS and peak RSS; None once it exited."""
    try:
        text = (PROC / str(pid) / "status").read_text()
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    kib = {k: int(fields[k].split()[0]) * 1024 if k in fields else 0 for k in ("VmRSS", "VmHWM")}
    return Proc(pid, fields.get("Name", "").strip(), kib["VmRSS"], kib["VmHWM"])


def tree(root: int) -> list[Proc]:
    return [p for p in (status(pid) for pid in descendants(root)) if p is not None]


def model_processes(server_pid: int) -> list[Proc]:
    """The server's processes that hold models: all of its tree but the frontend and the fork server (which exist
    with no model loaded; ``model_memory_budget`` is what the models' workers hold)."""
    return [p for p in tree(server_pid) if p.pid != server_pid and p.comm != FORK_SERVER]


def pss(pids: list[int]) -> int:
    """The PSS of ``pids`` and their descendants, in bytes."""
    total = 0
    for pid in {d for p in pids for d in descendants(p)}:
        try:
            text = (PROC / str(pid) / "smaps_rollup").read_text()
        except OSError:
            continue
        total += sum(int(line.split()[1]) for line in text.splitlines() if line.startswith("Pss:")) * 1024
    return total


def cpu_seconds(pid: int) -> float:
    """The process's user and system CPU-seconds so far, its threads included (0 once it exited)."""
    try:
        stat = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return 0.0
    fields = stat[stat.rfind(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def tree_cpu(root: int) -> dict[int, float]:
    """The CPU-seconds so far of ``root`` and each process below it."""
    return {pid: cpu_seconds(pid) for pid in descendants(root)}


def spent(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU-seconds a process tree spent between two ``tree_cpu`` readings (a process started since counts whole;
    one that exited since is lost: read ``after`` before it exits)."""
    return sum(cpu - before.get(pid, 0.0) for pid, cpu in after.items())
