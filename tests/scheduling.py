"""How pytest-xdist hands the test files to its workers (``.ci/run``: ``-n N --dist loadfile``).

Two changes to ``--dist loadfile``, both about the suite's wall time on a few cores:
- **The files that share a session-scoped server go to one worker**: each worker that runs one of them starts
  its own copy of the server (``tests/integration/conftest.py``: the real model's server loads it twice, the
  api server three torch models), so files naming the same server fixture, and files linked to them through
  another one they name, form one unit of work.
- **Longest units first** (by ``tests/file_seconds.json``, the seconds each file took in a recorded run):
  xdist hands units out in collection order, so a long file collected last ran while the other workers had
  finished. A file missing from the record counts a second a test. Rewrite the record with
  ``ROLLSERVE_FILE_SECONDS=tests/file_seconds.json`` on a full run; a stale one only orders the work worse.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from xdist.scheduler import LoadFileScheduling

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "tests" / "file_seconds.json"
SHARED_SERVERS = ("api_server", "smollm2_server", "two_workers_server", "echo_server", "hostile_server")
_NAMES = re.compile(r"\b(" + "|".join(SHARED_SERVERS) + r")\b")


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


class SuiteScheduling(LoadFileScheduling):
    """``--dist loadfile`` with the shared-server units and the longest-first order described above."""

    def __init__(self, config: Any, log: Any = None) -> None:
        super().__init__(config, log)
        self._units = shared_server_units()
        self._seconds: dict[str, float] = json.loads(RECORD.read_text()) if RECORD.exists() else {}
        self._ordered = False

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
        super()._assign_work_unit(node)
