"""The dependency rules of docs/architecture.md, read from the source: every ``import`` statement, at module level
or inside a function, counts."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Absolute names of the modules ``path`` imports (``from a.b import c`` gives ``a.b`` and ``a.b.c``)."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def modules(package: str) -> dict[str, set[str]]:
    return {module_name(p): imports_of(p) for p in sorted((ROOT / package.replace(".", "/")).rglob("*.py"))}


def _inside(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


@pytest.mark.parametrize(("importer", "imported"), [("serving.batching", "serving.worker"),
                                                    ("serving.worker", "serving.batching")])
def test_batchers_and_the_worker_package_do_not_import_each_other(importer: str, imported: str) -> None:
    offenders = {m: sorted(i for i in deps if _inside(i, imported)) for m, deps in modules(importer).items()}
    assert {m: deps for m, deps in offenders.items() if deps} == {}


def test_both_sides_of_the_worker_channel_use_the_ipc_package() -> None:
    users = {m for pkg in ("serving.batching", "serving.worker") for m, deps in modules(pkg).items()
             if any(_inside(i, "serving.ipc") for i in deps)}
    assert {"serving.batching.dynamic", "serving.batching.rolling", "serving.worker.main"} <= users


def test_no_import_cycle_among_the_engine_modules() -> None:
    engine = modules("handlers.engine")
    graph = {m: sorted(i for i in deps if i in engine and i != m) for m, deps in engine.items()}
    state: dict[str, str] = {}
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:  # depth-first; a grey node met again closes a cycle
        state[node] = "grey"
        for nxt in graph[node]:
            if state.get(nxt) == "grey":
                cycles.append([*path[path.index(nxt):], nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = "black"

    for start in sorted(graph):
        if start not in state:
            visit(start, [start])
    assert cycles == []


def test_the_reader_sees_function_level_imports() -> None:
    """The checks above can fail: an import inside a function is found."""
    path = ROOT / "handlers" / "engine" / "parallel.py"
    assert "handlers.engine.loading" in imports_of(path)  # imported inside rank_main


# serving.step_cost: the engine's step-cost sums, read back by serving tune (standard library only)
SERVING_FOR_HANDLERS = {"serving.types", "serving.errors", "serving.options", "serving.values", "serving.step_cost"}


def test_handlers_import_only_the_kernel_of_serving() -> None:
    """Handlers parse their options with the frontend's schema (``serving.options``), and nothing else of
    ``serving`` but the kernel reaches the worker's side."""
    offenders = {m: sorted(i for i in deps if _inside(i, "serving") and i.rpartition(".")[0] not in
                           SERVING_FOR_HANDLERS and i not in SERVING_FOR_HANDLERS)
                 for m, deps in modules("handlers").items()}
    assert {m: deps for m, deps in offenders.items() if deps} == {}
    users = {m for m, deps in modules("handlers").items() if "serving.options" in deps}
    assert {"handlers.engine.config", "handlers.huggingface", "handlers.echo"} <= users


@pytest.mark.parametrize("module", ["serving/options.py", "serving/values.py", "serving/step_cost.py"])
def test_the_option_schema_is_kernel(module: str) -> None:
    """The schema and the value parsers import no more of the project than the kernel (no torch either)."""
    project = {i for i in imports_of(ROOT / module) if i.split(".")[0] in ("serving", "handlers")}
    assert {i.rpartition(".")[0] if i.rpartition(".")[0] in SERVING_FOR_HANDLERS else i for i in project} \
        <= {"serving.errors", "serving.values"}
