"""How the suite's files are handed to xdist workers (tests/scheduling.py): files sharing a session server form
one unit, the waiting lane takes only the files that mostly wait, the pinned workers everything else first."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from types import SimpleNamespace

from tests.scheduling import SuiteScheduling, shared_server_units


def _write(root: Path, name: str, text: str) -> None:
    path = root / "tests" / "integration" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_files_linked_through_a_shared_server_form_one_unit(tmp_path: Path) -> None:
    _write(tmp_path, "test_a.py", "def test_x(api_server): ...\n")
    _write(tmp_path, "test_b.py", "def test_y(api_server, smollm2_server): ...\n")
    _write(tmp_path, "test_c.py", "def test_z(smollm2_server): ...\n")
    _write(tmp_path, "test_d.py", "def test_w(hostile_server): ...\n")
    _write(tmp_path, "test_e.py", "def test_v(tmp_path): ...  # my_api_server is another name\n")
    units = shared_server_units(tmp_path)
    files = {f"tests/integration/test_{x}.py" for x in "abc"}
    assert len({units[f] for f in files}) == 1
    assert units["tests/integration/test_d.py"] not in {units[f] for f in files}
    assert "tests/integration/test_e.py" not in units


def _scheduler(record: dict[str, tuple[float, float]], queue: list[str], nodes: int = 3) -> SuiteScheduling:
    sched = SuiteScheduling.__new__(SuiteScheduling)  # the placement logic alone, without an xdist session
    sched.numnodes = nodes
    sched._lane = True
    sched._seconds = {path: s for path, (s, _) in record.items()}
    sched._idle = {path: idle for path, (_, idle) in record.items()}
    sched.workqueue = OrderedDict((scope, {f"{scope}::t": False}) for scope in queue)
    return sched


def _node(worker: str) -> SimpleNamespace:
    return SimpleNamespace(gateway=SimpleNamespace(id=worker))


def test_the_lane_takes_waiting_files_only_and_pinned_workers_take_them_last() -> None:
    record = {"busy.py": (30.0, 2.0), "waits.py": (20.0, 15.0), "shared:api_server": (90.0, 80.0)}
    sched = _scheduler(record, ["shared:api_server", "busy.py", "waits.py"])
    assert sched._next_unit(_node("gw2")) == "waits.py"  # a shared server's unit never goes to the lane
    assert sched._next_unit(_node("gw0")) == "shared:api_server"
    del sched.workqueue["shared:api_server"], sched.workqueue["busy.py"]
    assert sched._next_unit(_node("gw1")) == "waits.py"
    del sched.workqueue["waits.py"]
    sched.workqueue["new.py"] = {"new.py::t": False}  # not in the record: not known to wait
    assert sched._next_unit(_node("gw2")) is None
