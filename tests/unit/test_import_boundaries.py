"""The dependency rules of docs/architecture.md, read from the source: every ``import`` statement, at module level
or inside a function, counts."""

from __future__ import annotations

import ast
import subprocess
import sys
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
    path = ROOT / "handlers" / "engine" / "execution" / "parallel" / "ranks.py"
    assert "handlers.engine.execution.weights.loading" in imports_of(path)  # imported inside rank_main


def test_handlers_import_nothing_of_the_frontend() -> None:
    """The backend shares only the core package with the frontend: no ``serving`` module reaches a worker's
    handler side, and the built-in handlers parse their options with the core's schema."""
    offenders = {m: sorted(i for i in deps if _inside(i, "serving")) for m, deps in modules("handlers").items()}
    assert {m: deps for m, deps in offenders.items() if deps} == {}
    users = {m for m, deps in modules("handlers").items() if "rollcore.options" in deps}
    assert {"handlers.engine.planning.engine_config", "handlers.huggingface", "handlers.echo"} <= users


def test_the_core_imports_neither_side() -> None:
    """``rollcore`` depends on nothing of the project outside itself (and on no torch)."""
    offenders = {m: sorted(i for i in deps if i.split(".")[0] in ("serving", "handlers", "torch", "transformers"))
                 for m, deps in modules("rollcore").items()}
    assert {m: deps for m, deps in offenders.items() if deps} == {}


def test_the_frontend_reaches_the_backend_through_preflight_and_the_worker_entry_only() -> None:
    """``serving`` imports ``handlers.preflight`` (torch-free questions before a worker starts) and, in the
    worker processes' entry points (``serving.worker``: a worker, a follower host's agent), the handler API, the
    loader and the follower agent; nothing else of
    ``handlers``."""
    allowed = {"handlers", "handlers.preflight", "handlers.preflight.engine_admission",
               "handlers.preflight.memory_plan_text", "handlers.preflight.checkpoint_parameters",
               "handlers.preflight.planned_memory", "handlers.preflight.PlannedMemory",
               "handlers.preflight.whole_gguf", "handlers.preflight.gguf_header_held"}
    worker = {"handlers.base", "handlers.loader", "handlers.engine.execution.parallel.follower_host",
              "handlers.engine.execution.parallel.rendezvous", "handlers.engine.execution.parallel.cluster",
              "handlers.engine.execution.parallel.host_weights"}  # the agent: torch-free
    offenders = {}
    for m, deps in modules("serving").items():
        mine = {i for i in deps if _inside(i, "handlers")} - allowed
        if _inside(m, "serving.worker"):
            mine = {i for i in mine if not any(_inside(i, w) for w in worker)}
        if mine:
            offenders[m] = sorted(mine)
    assert offenders == {}


def test_the_engine_folder_by_role_and_its_torch_free_parts() -> None:
    """``handlers/engine``: ``core`` (scheduling, the KV bookkeeping) and ``planning`` (what is decided before a
    load) import no torch, transformers or triton and nothing of ``execution`` (running the model); in a fresh
    interpreter importing every one of their modules loads none of those libraries."""
    heavy = ("torch", "transformers", "triton")
    for part in ("handlers.engine.core", "handlers.engine.planning"):
        deps = modules(part)
        assert deps, part
        above = ("handlers.engine.execution", "handlers.engine.engine", "handlers.engine.build")
        offenders = {m: sorted(i for i in d if i.split(".")[0] in heavy or any(_inside(i, a) for a in above))
                     for m, d in deps.items()}
        assert {m: d for m, d in offenders.items() if d} == {}, part
    names = sorted(m for part in ("handlers.engine.core", "handlers.engine.planning") for m in modules(part))
    code = ("import importlib, sys\n" + "".join(f"importlib.import_module({n!r})\n" for n in names)
            + f"print(sorted(m for m in {heavy!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_a_follower_hosts_agent_is_torch_free() -> None:
    """``serving worker`` only supervises its ranks: it starts at once, and a torch import would double that."""
    code = ("import sys, serving.worker.follower, serving.worker.follower_weights, "
            "handlers.engine.execution.parallel.follower_host\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
