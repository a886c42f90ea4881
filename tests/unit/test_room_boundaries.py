"""The rooms of docs/architecture.md, read from the source: ``serving/`` by role, floor by floor, with no import
running back up; the execution rooms of the engine without a circle; the size rules of the code."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.test_import_boundaries import ROOT, imports_of, module_name, modules

# serving's rooms, lowest floor first: a room imports only rooms on floors below its own (and itself)
FLOORS: tuple[tuple[str, ...], ...] = (
    ("serving.config", "serving.ipc", "serving.sources", "serving.heap", "serving.logs", "serving.redact",
     "serving.frontends.proto"),
    ("serving.requests",),
    ("serving.batching",),
    ("serving.worker",),
    ("serving.models", "serving.auth", "serving.listeners", "serving.deploy"),
    ("serving.telemetry",),
    ("serving.frontends.grpc",),
    ("serving.frontends.http",),
    ("serving.server", "serving.bench"),
    ("serving.tune",),
    ("serving.cli",),
    ("serving.__main__",),
)
ROOM_FLOOR = {room: floor for floor, rooms in enumerate(FLOORS) for room in rooms}

EXECUTION = "handlers.engine.execution"
GENERATED = "serving/frontends/proto/gen/"
MAX_LINES = 400
MAX_TOP_LEVEL = 12


def room_of(name: str) -> str | None:
    """The room a module (or a name imported from one) belongs to: the longest room name it lies in."""
    found = [r for r in ROOM_FLOOR if name == r or name.startswith(r + ".")]
    return max(found, key=len) if found else None


def serving_modules() -> dict[str, set[str]]:
    return {m: deps for m, deps in modules("serving").items() if not m.startswith("serving.frontends.proto.gen")}


def test_every_serving_module_lives_in_a_room() -> None:
    """A new module at serving's top level or in a new folder must be given a floor here (and in the docs)."""
    homeless = sorted(m for m in serving_modules() if m not in ("serving", "serving.frontends") and room_of(m) is None)
    assert homeless == []


def test_no_import_runs_back_up_in_serving() -> None:
    upward = {}
    for m, deps in serving_modules().items():
        mine = room_of(m)
        if mine is None:
            continue
        up = sorted(i for i in deps
                    if (r := room_of(i)) is not None and r != mine and ROOM_FLOOR[r] >= ROOM_FLOOR[mine])
        if up:
            upward[m] = up
    assert upward == {}


@pytest.mark.parametrize(("room", "forbidden"), [
    ("serving.config", ("serving.frontends", "serving.models", "serving.requests", "serving.batching",
                        "serving.worker", "serving.telemetry")),
    ("serving.models", ("serving.frontends", "serving.telemetry", "serving.server")),
    ("serving.requests", ("serving.batching", "serving.worker", "serving.models", "serving.frontends")),
    ("serving.telemetry", ("serving.frontends", "serving.server")),
    ("serving.frontends.grpc", ("serving.frontends.http",)),
])
def test_the_named_rules_of_the_rooms(room: str, forbidden: tuple[str, ...]) -> None:
    """The rules docs/architecture.md states in words (the floors above imply them; these name the offence)."""
    offenders = {m: sorted(i for i in deps if any(i == f or i.startswith(f + ".") for f in forbidden))
                 for m, deps in serving_modules().items() if m == room or m.startswith(room + ".")}
    assert {m: d for m, d in offenders.items() if d} == {}


def test_the_leaves_import_nothing_of_serving() -> None:
    """Log setup and path redaction serve the workers, the models and the frontends alike: they import no room."""
    offenders = {m: sorted(i for i in deps if i.startswith("serving.") and i not in ("serving.logs", "serving.redact"))
                 for m, deps in serving_modules().items() if m in ("serving.logs", "serving.redact")}
    assert {m: d for m, d in offenders.items() if d} == {}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    state: dict[str, str] = {}
    found: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:  # depth-first; a grey node met again closes a circle
        state[node] = "grey"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "grey":
                found.append([*path[path.index(nxt):], nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = "black"

    for start in sorted(graph):
        if start not in state:
            visit(start, [start])
    return found


def execution_room(name: str) -> str | None:
    """``handlers.engine.execution.kernels.native`` -> ``kernels``; a module at execution's top level is its own
    room."""
    if not name.startswith(EXECUTION + "."):
        return None
    return name[len(EXECUTION) + 1:].split(".")[0]


def test_the_execution_rooms_have_no_circle() -> None:
    rooms = {execution_room(m) for m in modules(EXECUTION)} - {None}
    assert {"kernels", "weights", "gpu", "parallel", "decoding", "forward"} <= rooms
    graph: dict[str, set[str]] = {}
    for m, deps in modules(EXECUTION).items():
        mine = execution_room(m)
        if mine is None:
            continue
        graph.setdefault(mine, set()).update(r for i in deps if (r := execution_room(i)) and r in rooms and r != mine)
    assert _cycles(graph) == []


def test_the_execution_rooms_stand_on_floors() -> None:
    """Kernels and the device below; sampling and the forward on them; loading on the forward; the ranks on top."""
    floors = (("kernels", "gpu"), ("decoding", "forward"), ("weights",), ("parallel", "self_check", "itl_calibration"))
    floor_of = {room: n for n, rooms in enumerate(floors) for room in rooms}
    upward = {}
    for m, deps in modules(EXECUTION).items():
        mine = execution_room(m)
        if mine not in floor_of:
            continue
        up = sorted(i for i in deps if (r := execution_room(i)) in floor_of and r != mine
                    and floor_of[r] >= floor_of[mine])
        if up:
            upward[m] = up
    assert upward == {}


def test_the_cycle_finder_finds_a_circle() -> None:
    """The check above can fail."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_the_room_reader_sees_a_moved_import() -> None:
    """The floors are read from real imports: the server imports the HTTP frontends, the batcher the IPC."""
    server = imports_of(ROOT / "serving" / "server.py")
    assert any(room_of(i) == "serving.frontends.http" for i in server)
    assert module_name(ROOT / "serving" / "config" / "model_config.py") == "serving.config.model_config"


def test_serving_top_level_holds_few_modules() -> None:
    top = sorted(p.name for p in (ROOT / "serving").glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL, top


def hand_written() -> list[Path]:
    return [p for part in ("serving", "handlers", "rollcore") for p in sorted((ROOT / part).rglob("*.py"))
            if not p.relative_to(ROOT).as_posix().startswith(GENERATED)]


def test_no_hand_written_module_is_over_the_size_limit() -> None:
    """One job a module: none over the limit (the generated protobuf stubs are exempt)."""
    long = {p.relative_to(ROOT).as_posix(): n for p in hand_written()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_no_two_modules_share_a_file_name() -> None:
    """A file name says what the module is: two modules of the same name would mean two things."""
    seen: dict[str, list[str]] = {}
    for p in hand_written():
        if p.name != "__init__.py":
            seen.setdefault(p.name, []).append(p.relative_to(ROOT).as_posix())
    assert {n: ps for n, ps in seen.items() if len(ps) > 1} == {}
