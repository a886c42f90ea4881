"""``serving.sources.cache.publish`` fills an entry once when several servers share the cache (replicas on one
claim): the second waits on the first's lock (seen blocked in /proc/locks), then finds the entry complete."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

from serving.sources.cache import cached, publish


def _publish(entry: str, log: str, go: str) -> None:
    def fill(dest: Path) -> None:
        with open(log, "a") as f:
            f.write("fill\n")
        while not Path(go).exists():  # held until the test has seen the other server waiting
            time.sleep(0.01)
        (dest / "weights").write_text("bytes")

    publish(Path(entry), fill)


def _blocked_flock_waiters() -> int:
    return sum(1 for line in Path("/proc/locks").read_text().splitlines() if "->" in line and "FLOCK" in line)


def test_two_servers_sharing_a_cache_fill_an_entry_once(tmp_path: Path) -> None:
    entry, log, go = tmp_path / "cache" / "s3-abc", tmp_path / "fills", tmp_path / "go"
    ctx = multiprocessing.get_context("spawn")
    first = ctx.Process(target=_publish, args=(str(entry), str(log), str(go)))
    first.start()
    deadline = time.monotonic() + 60
    while not log.exists():
        assert first.is_alive() and time.monotonic() < deadline
        time.sleep(0.01)
    before = _blocked_flock_waiters()
    second = ctx.Process(target=_publish, args=(str(entry), str(log), str(go)))
    second.start()
    while _blocked_flock_waiters() <= before:  # the second server waits on the first one's lock
        assert second.is_alive() and time.monotonic() < deadline
        time.sleep(0.01)
    go.touch()
    for p in (first, second):
        p.join(60)
        assert p.exitcode == 0
    assert log.read_text() == "fill\n"
    assert cached(entry) and (entry / "weights").read_text() == "bytes"
    assert sorted(p.name for p in entry.parent.iterdir()) == ["s3-abc"]  # no lock file left beside the entry
