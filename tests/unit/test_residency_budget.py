"""The model memory budget's setting and the /proc readings residency counts with; the residency keys of
config.properties and serving.properties, validated where the other keys are."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rollcore.errors import ConfigError
from serving.config.memory_budget import BudgetSetting, human, mem_available, memory_budget, pss, tree, tree_pss
from serving.config.model_config import load_model_config
from serving.config.server_config import load_server_config


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
