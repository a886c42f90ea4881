"""The model memory budget's setting and the /proc readings residency counts with; the residency keys of
config.properties and serving.properties, validated where the other keys are."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from rollcore.errors import ConfigError
from rollcore.types import ModelState
from serving.config.memory_budget import BudgetSetting, human, mem_available, memory_budget, pss, tree, tree_pss
from serving.config.model_config import load_model_config
from serving.config.server_config import load_server_config
from serving.models import residency
from serving.models.residency import Residence


@pytest.mark.parametrize(("text", "expected"), [
    ("6GiB", 6 << 30), ("512MiB", 512 << 20), ("2G", 2_000_000_000), ("1.5GiB", 3 << 29), ("800000000", 800_000_000),
    ("64 mib", 64 << 20), ("1TiB", 1 << 40),
])
def test_sizes(text: str, expected: int) -> None:
    assert memory_budget(text) == BudgetSetting(bytes=expected)


def test_a_share_of_the_available_memory(tmp_path: Path) -> None:
    (tmp_path / "meminfo").write_text("MemTotal: 16000000 kB\nMemAvailable:    8000000 kB\n")
    setting = memory_budget("25%")
    assert setting == BudgetSetting(share=0.25)
    assert setting.resolve(tmp_path) == 2_000_000 * 1024
    assert mem_available(tmp_path) == 8_000_000 * 1024
    assert BudgetSetting(bytes=5).resolve(tmp_path) == 5


@pytest.mark.parametrize("text", ["lots", "6 GiBs", "0", "0%", "150%", "-1GiB", "GiB", "1e9"])
def test_bad_sizes(text: str) -> None:
    with pytest.raises(ValueError, match="expected a size"):
        memory_budget(text)


def test_human() -> None:
    assert [human(n) for n in (512, 3 << 29, 96 << 20, 250 << 30)] == ["512 B", "1.5 GiB", "96 MiB", "250 GiB"]


def test_pss_of_a_process_tree_counts_the_children() -> None:
    """A child that touches 64 MiB of its own: the tree holds at least that more than the parent alone."""
    child = subprocess.Popen([sys.executable, "-c", "import sys; b = bytearray(64 << 20); sys.stdout.write('x\\n'); "
                              "sys.stdout.flush(); sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline() == b"x\n"
        me = os.getpid()
        assert child.pid in tree([me])
        assert tree([child.pid]) == [child.pid]
        assert pss(child.pid) >= 64 << 20
        assert tree_pss([me]) >= pss(me) + (64 << 20)
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(timeout=30)
    assert pss(child.pid) == 0  # gone


def test_server_keys(tmp_path: Path) -> None:
    path = tmp_path / "config.properties"
    path.write_text("model_memory_budget=6GiB\nmodel_load_wait=5\nload_on_demand=true\n")
    cfg = load_server_config(path)
    assert (cfg.model_memory_budget, cfg.model_load_wait_s, cfg.load_on_demand) == (BudgetSetting(bytes=6 << 30),
                                                                                     5.0, True)
    default = load_server_config(None)
    assert (default.model_memory_budget, default.model_load_wait_s, default.load_on_demand) == (
        BudgetSetting(share=0.8), 60.0, False)
    path.write_text("\nmodel_memory_budget=lots\n")
    with pytest.raises(ConfigError, match=r"config\.properties:2: model_memory_budget = 'lots': expected a size"):
        load_server_config(path)


def test_model_keys_and_the_server_default(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "serving.properties").write_text("option.entryPoint=echo\npin=true\nidle_ttl=30\n")
    server = load_server_config(None, env={"SERVING_LOAD_ON_DEMAND": "true"})
    cfg = load_model_config(folder, server=server)
    assert {k: cfg.extra[k] for k in ("pin", "idle_ttl", "load_on_demand")} == {"pin": "true", "idle_ttl": "30",
                                                                               "load_on_demand": "true"}
    assert cfg.sources["load_on_demand"].startswith("server config (env SERVING_LOAD_ON_DEMAND")
    assert "load_on_demand" not in load_model_config(folder, server=load_server_config(None)).extra
    (folder / "serving.properties").write_text("option.entryPoint=echo\nidle_ttl=0\n")
    with pytest.raises(ConfigError, match=r"serving\.properties:2: idle_ttl = '0': expected a number > 0"):
        load_model_config(folder)


def _fake_proc(root: Path, parents: dict[int, int], children_files: bool) -> Path:
    for pid, ppid in parents.items():
        (root / str(pid) / "task" / str(pid)).mkdir(parents=True)
        (root / str(pid) / "stat").write_text(f"{pid} (a (b) c) S {ppid} 0 0\n")
        if children_files:
            kids = " ".join(str(k) for k, p in parents.items() if p == pid)
            (root / str(pid) / "task" / str(pid) / "children").write_text(kids + " " if kids else "")
        (root / str(pid) / "smaps_rollup").write_text(f"Rss: 9 kB\nPss: {pid} kB\n")
    return root


@pytest.mark.parametrize("children_files", [True, False])
def test_trees_from_children_lists_or_from_every_stat(tmp_path: Path, children_files: bool) -> None:
    """A worker (10) with a child (11) and a grandchild (12), beside an unrelated process (20): the kernel's children
    lists where it keeps them, else every process's parent from its stat line (a name with spaces and parentheses)."""
    proc = _fake_proc(tmp_path, {10: 1, 11: 10, 12: 11, 20: 1}, children_files)
    assert sorted(tree([10], proc)) == [10, 11, 12]
    assert tree_pss([10], proc) == (10 + 11 + 12) * 1024
    assert tree([], proc) == []


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def _endpoint(pid: int, on_demand: bool, state: ModelState) -> SimpleNamespace:
    return SimpleNamespace(residence=Residence(on_demand=on_demand, pinned=False, idle_ttl_s=None, weights=f"w{pid}",
                                               predicted_bytes=1 << 20, predicted_from="preflight"),
                           state=state, pool=SimpleNamespace(workers={1: SimpleNamespace(pid=pid)}),
                           batcher=SimpleNamespace(num_pending=lambda: 0))


@pytest.mark.parametrize("with_on_demand", [False, True])
def test_the_monitor_reads_workers_memory_every_second_only_while_the_budget_has_something_to_decide(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, with_on_demand: bool) -> None:
    """Reading a worker's PSS walks its page tables on the engine's core: with no model that loads on demand
    nothing is ever unloaded, so the figures are refreshed every 30 s (a model never sampled at once); with one
    registered (here not loaded), every second."""
    proc = _fake_proc(tmp_path, {10: 1, 20: 1}, children_files=True)
    served = _endpoint(10, on_demand=False, state=ModelState.READY)
    eps = [served] + ([_endpoint(20, on_demand=True, state=ModelState.UNLOADED)] if with_on_demand else [])
    reads: list[list[int]] = []
    monkeypatch.setattr(residency, "tree_pss", lambda pids, p: reads.append(list(pids)) or tree_pss(pids, p))
    clock = _Clock()
    monkeypatch.setattr(residency, "time", clock)
    res = residency.Residency(1 << 40, "test", 5.0, lambda: [(f"m{i}", "1", ep) for i, ep in enumerate(eps)],
                              proc=proc)

    async def monitor() -> None:  # the monitor's checks, one a second of the clock
        for _ in range(61):
            await res.check()
            clock.now += residency.SAMPLE_EVERY_S

    asyncio.run(monitor())
    assert served.residence.memory_bytes == 10 * 1024
    assert len(reads) == (61 if with_on_demand else 3)  # at 0 s (never sampled), 30 s and 60 s


def test_a_model_loaded_later_is_sampled_at_the_next_check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    proc = _fake_proc(tmp_path, {10: 1, 20: 1}, children_files=True)
    first, second = _endpoint(10, False, ModelState.READY), _endpoint(20, False, ModelState.LOADING)
    clock = _Clock()
    monkeypatch.setattr(residency, "time", clock)
    res = residency.Residency(1 << 40, "test", 5.0, lambda: [("a", "1", first), ("b", "1", second)], proc=proc)
    asyncio.run(res.check())
    second.state = ModelState.READY
    clock.now += residency.SAMPLE_EVERY_S
    asyncio.run(res.check())
    assert (first.residence.memory_bytes, second.residence.memory_bytes) == (10 * 1024, 20 * 1024)
