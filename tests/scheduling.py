"""How pytest-xdist hands the test files to its workers (``.ci/run``: ``-n N --dist loadfile``).

Three changes to ``--dist loadfile``, all about the suite's wall time on a few cores:
- **The files that share a session-scoped server go to one worker**: each worker that runs one of them starts
  its own copy of the server (``tests/integration/conftest.py``: the real model's server loads it twice, the
  api server three torch models), so files naming the same server fixture, and files linked to them through
  another one they name, form one unit of work.
- **Longest units first** (by ``tests/file_seconds.json``, the seconds each file took in a recorded run):
  xdist hands units out in collection order, so a long file collected last ran while the other workers had
  finished. A file missing from the record counts a second a test.
- **A waiting lane**: with one worker more than cores (``.ci/run``), the workers ``gw0``.. each keep to a core
  (``pin``) and the last one, on every core, takes the files that mostly wait (a backoff, a watch interval, a
  drain, a timeout: their cores sat idle more than half their time in the record), so their waits overlap the
  other files' work instead of leaving a core idle. It takes nothing else, and the pinned workers take the
  waiting files too once theirs are done.

The record: ``ROLLSERVE_FILE_SECONDS=tests/file_seconds.json PYTEST_WORKERS=<cores> bash .ci/run`` (one
worker a core, so each file's idle time is its own core's); a stale record only orders the work worse.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from xdist.scheduler import LoadFileScheduling

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "tests" / "file_seconds.json"
SHARED_SERVERS = ("api_server", "smollm2_server", "two_workers_server", "echo_server", "hostile_server")
_NAMES = re.compile(r"\b(" + "|".join(SHARED_SERVERS) + r")\b")
WAITING = 0.5  # a file whose core sat idle this share of its time goes to the waiting lane


def pin(workercount: int, index: int) -> bool:
    """Keep xdist worker ``index`` to its share of the cores; True when it has cores of its own (its idle
    time can then be measured), False for the waiting lane (the worker past one a core: every core)."""
    cores = sorted(os.sched_getaffinity(0))
    if workercount < 2 or index >= len(cores):  # the lane's index is the core count (or a crashed one's stand-in)
        return False
    share = min(workercount, len(cores))
    os.sched_setaffinity(0, cores[index % share::share])
    return True


def idle_seconds() -> float:
    """Seconds this process's cores have sat idle since boot (``/proc/stat``: idle + iowait)."""
    cores = os.sched_getaffinity(0)
    ticks = 0
    with open("/proc/stat") as f:
        for line in f:
            name, *fields = line.split()
            if name.startswith("cpu") and name != "cpu" and int(name[3:]) in cores:
                ticks += int(fields[3]) + int(fields[4])
    return ticks / os.sysconf("SC_CLK_TCK")


def shared_server_units(root: Path = ROOT) -> dict[str, str]:
    """Test file (as in node ids) -> the name of its unit, for files that name a shared server fixture; files
    linked through a common fixture share one unit (union-find over the fixture names)."""
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        while parent.setdefault(x, x) != x:
            x = parent[x]
        return x

    uses: dict[str, list[str]] = {}
    for path in sorted((root / "tests").rglob("test_*.py")):
        names = sorted(set(_NAMES.findall(path.read_text(errors="replace"))))
        if names:
            uses[path.relative_to(root).as_posix()] = names
            for other in names[1:]:
                parent[find(other)] = find(names[0])
    return {path: "shared:" + find(names[0]) for path, names in uses.items()}


def write_record(path: str, seconds: dict[str, float], idle: dict[str, float]) -> None:
    """The record, a line a file: ``"tests/x.py": [seconds, idle seconds or null]``."""
    lines = [f"{json.dumps(p)}: [{s:.1f}, {json.dumps(round(idle[p], 1) if p in idle else None)}]"
             for p, s in sorted(seconds.items())]
    Path(path).write_text("{\n" + ",\n".join(lines) + "\n}\n")


class SuiteScheduling(LoadFileScheduling):
    """``--dist loadfile`` with the shared-server units and the longest-first order described above."""

    def __init__(self, config: Any, log: Any = None) -> None:
        super().__init__(config, log)
        self._units = shared_server_units()
        record = json.loads(RECORD.read_text()) if RECORD.exists() else {}
        self._seconds: dict[str, float] = {path: float(v[0]) for path, v in record.items()}
        self._idle: dict[str, float] = {path: float(v[1]) for path, v in record.items() if v[1] is not None}
        self._ordered = False
        self._lane = self.numnodes > len(os.sched_getaffinity(0)) >= 2

    def _waiting(self, scope: str) -> bool:
        if scope.startswith("shared:"):
            return False
        seconds = self._seconds.get(scope, 0.0)
        return seconds > 0 and self._idle.get(scope, 0.0) >= WAITING * seconds

    def _is_lane(self, node: Any) -> bool:
        return self._lane and node.gateway.id == f"gw{self.numnodes - 1}"

    def _next_unit(self, node: Any) -> str | None:
        """The unit ``node`` takes next: the lane's first waiting one; a pinned worker's first other one, else
        a waiting one."""
        lane = self._is_lane(node)
        for scope in self.workqueue:
            if self._waiting(scope) == lane:
                return scope
        return None if lane else next(iter(self.workqueue), None)

    def _split_scope(self, nodeid: str) -> str:
        path = nodeid.split("::", 1)[0]
        return self._units.get(path, path)

    def _cost(self, nodeids: dict[str, bool]) -> float:
        per_file: dict[str, int] = {}
        for nodeid in nodeids:
            path = nodeid.split("::", 1)[0]
            per_file[path] = per_file.get(path, 0) + 1
        return sum(self._seconds.get(path, float(count)) for path, count in per_file.items())

    def _assign_work_unit(self, node: Any) -> None:
        if not self._ordered:  # the queue is complete before the first unit is handed out
            self._ordered = True
            units = sorted(self.workqueue.items(), key=lambda unit: -self._cost(unit[1]))
            self.workqueue.clear()
            self.workqueue.update(units)
        scope = self._next_unit(node)
        if scope is None:  # the lane with no waiting file left
            if not self._pending_of(self.assigned_work.get(node, {})):
                node.shutdown()
            return
        self.workqueue.move_to_end(scope, last=False)
        super()._assign_work_unit(node)
