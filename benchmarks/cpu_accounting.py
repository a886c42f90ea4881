"""CPU accounting of pinned servers from /proc (compare.py, quantized_speed.py): process trees, CPU-seconds, every
thread's allowed cores, our own share of the load average, and the load check before a measured pass."""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time
from pathlib import Path
from typing import Any

HZ = os.sysconf("SC_CLK_TCK")


def cpulist(cores: list[int]) -> str:
    return ",".join(map(str, cores))


def parse_cpulist(s: str) -> list[int]:
    """'0,2-3' -> [0, 2, 3] (taskset / Cpus_allowed_list syntax)."""
    return sorted({c for p in s.strip().split(",") for c in range(int(p.split("-")[0]), int(p.split("-")[-1]) + 1)})


def read_proc(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def _stat(path: str) -> list[str]:
    """Fields of a /proc stat file after the command name (state is [0], ppid [1]); [] when gone."""
    return read_proc(path).rpartition(")")[2].split()


def _tasks(pid: int) -> list[str]:
    with contextlib.suppress(OSError):
        return os.listdir(f"/proc/{pid}/task")
    return []


def tree(root: int) -> list[int]:
    """``root`` and all its descendants (by ppid)."""
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit() and (f := _stat(f"/proc/{d}/stat")):
            kids.setdefault(int(f[1]), []).append(int(d))
    out, todo = [], [root]
    while todo:
        out.append(todo.pop())
        todo.extend(kids.get(out[-1], []))
    return out


def pss_mb(pids: list[int]) -> float:
    """Proportional set size of the processes, summed, in MB (shared pages counted once across them)."""
    total = 0
    for p in pids:
        for line in read_proc(f"/proc/{p}/smaps_rollup").splitlines():
            if line.startswith("Pss:"):
                total += int(line.split()[1])
    return total / 1024


def cpu_s(pids: list[int]) -> dict[int, float]:
    """utime+stime (all threads, s) of each live process."""
    return {p: (int(f[11]) + int(f[12])) / HZ for p in pids if (f := _stat(f"/proc/{p}/stat"))}


def pins(root: int, cores: list[int]) -> dict[str, Any]:
    """Cpus_allowed_list of every thread of every process of the tree; ok iff all within ``cores``."""
    procs: dict[str, Any] = {}
    for pid in tree(root):
        lists: dict[str, int] = {}
        for tid in _tasks(pid):
            for line in read_proc(f"/proc/{pid}/task/{tid}/status").splitlines():
                if line.startswith("Cpus_allowed_list:"):
                    v = line.split(":", 1)[1].strip()
                    lists[v] = lists.get(v, 0) + 1
        cmd = read_proc(f"/proc/{pid}/cmdline").replace("\0", " ").strip()[:160]
        procs[str(pid)] = {"cmd": cmd, "threads_by_cpus_allowed": lists}
    seen = {k for v in procs.values() for k in v["threads_by_cpus_allowed"]}
    ok = all(set(parse_cpulist(k)) <= set(cores) for k in seen)
    n = sum(sum(v["threads_by_cpus_allowed"].values()) for v in procs.values())
    summary = f"{len(procs)} processes, {n} threads, Cpus_allowed_list {sorted(seen)}: {'ok' if ok else 'ESCAPED'}"
    return {"ok": ok, "summary": summary, "processes": procs}


def machine_cpu() -> tuple[float, float]:
    """(busy, steal) CPU-s of the machine since boot (/proc/stat: user+nice+system+irq+softirq; steal)."""
    v = [int(x) for x in read_proc("/proc/stat").split("\n", 1)[0].split()[1:]]
    return (v[0] + v[1] + v[2] + v[5] + v[6]) / HZ, v[7] / HZ


class OwnLoad(threading.Thread):
    """Our share of the 1-minute load average: the kernel's EWMA (exp(-1/60) per 1 s sample) of the runnable (R/D)
    threads of the live server trees and of this process (minus this sampler)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.roots: list[int] = []
        self.value = 0.0

    def run(self) -> None:
        decay, me = math.exp(-1 / 60), str(threading.get_native_id())
        while True:
            pids = [os.getpid()] + [p for r in list(self.roots) for p in tree(r)]
            n = sum(1 for pid in pids for tid in _tasks(pid)
                    if tid != me and (f := _stat(f"/proc/{pid}/task/{tid}/stat")) and f[0] in "RD")
            self.value = self.value * decay + n * (1 - decay)
            time.sleep(1.0)


def snap(pids: list[int]) -> tuple[dict[int, float], float, float, float, float]:
    """(the tree's CPU-s per pid, machine busy CPU-s, machine steal, this process's CPU-s, time)."""
    t = os.times()
    return (cpu_s(pids), *machine_cpu(), t.user + t.system, time.monotonic())


def others_cores(a: tuple[Any, ...], b: tuple[Any, ...]) -> float:
    """Cores used between two snaps by processes outside the tree and this one."""
    return max(0.0, (b[1] - a[1]) - sum(b[0].values()) + sum(a[0].values()) - (b[3] - a[3])) / (b[4] - a[4])


def wait_quiet(own: OwnLoad, pids: list[int], thr: float, settle_s: float) -> dict[str, Any]:
    """Probe 3 s; every 5 s until quiet or ``settle_s``."""
    t0 = time.monotonic()
    while True:
        a = snap(pids)
        time.sleep(3.0)
        la, others = [round(x, 2) for x in os.getloadavg()], others_cores(a, snap(pids))
        p = {"load1": la[0], "loadavg": la, "own_load": round(own.value, 2), "others_cores": round(others, 2),
             "quiet": others <= thr and la[0] - own.value <= thr, "waited_s": round(time.monotonic() - t0, 1)}
        if p["quiet"] or time.monotonic() - t0 >= settle_s:
            return p
        time.sleep(2.0)

