"""The local cache of resolved model sources: one folder per source, published whole or not at all.

Design note: a fetch or conversion fills a private temporary folder beside its final place and is renamed into
place only when it finished, with a ``.complete`` marker inside, so a failed or interrupted one never leaves a
half-filled folder that a later start would take for a model (the temporary folder is removed on failure; one
left by a killed process is swept by the next fill of the same entry). Servers sharing one cache (replicas on a
shared volume, several servers on a host) fill an entry once: a fill holds an exclusive lock on the entry's lock
file, and whoever waited on it finds the entry complete.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

from rollcore.model_folder import file_sha256  # noqa: F401 - the cache's entries are named by it (sources, tests)

MARKER = ".complete"


def default_root() -> Path:
    """``~/.cache/rollserve/models`` (``XDG_CACHE_HOME`` honoured)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "rollserve" / "models"


def cached(entry: Path) -> bool:
    return (entry / MARKER).is_file()


def publish(entry: Path, fill: Callable[[Path], None]) -> Path:
    """``entry``, filled by ``fill(folder)`` unless a complete copy is there already."""
    if cached(entry):
        return entry
    entry.parent.mkdir(parents=True, exist_ok=True)
    with _locked(entry.parent / f".{entry.name}.lock"):
        if cached(entry):  # another server filled it while this one waited
            return entry
        return _fill(entry, fill)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` (released when the file closes, or its process dies), removed afterwards so
    the cache holds only entries: a server that waited on the removed file re-checks the entry before filling."""
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


def _fill(entry: Path, fill: Callable[[Path], None]) -> Path:
    for stale in entry.parent.glob(f".{entry.name}.tmp-*"):
        if not _owner_alive(stale):
            shutil.rmtree(stale, ignore_errors=True)
    tmp = entry.parent / f".{entry.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        fill(tmp)
        (tmp / MARKER).write_text("")
        if entry.exists() and not cached(entry):
            shutil.rmtree(entry)  # an incomplete entry of an older layout: never served
        try:
            os.rename(tmp, entry)
        except OSError:
            if not cached(entry):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return entry


def newest(root: Path, prefix: str) -> Path | None:
    """The most recently completed entry whose name starts with ``prefix``, or None."""
    done = [e for e in root.glob(f"{prefix}*") if cached(e)] if root.is_dir() else []
    return max(done, key=lambda e: (e / MARKER).stat().st_mtime_ns, default=None)


def prune(root: Path, prefix: str, keep: int) -> None:
    """Remove all but the ``keep`` newest completed entries starting with ``prefix`` (workers of a model that
    still maps a removed entry's files keep their bytes: an unlinked file lives while it is open)."""
    done = sorted((e for e in root.glob(f"{prefix}*") if cached(e)), key=lambda e: (e / MARKER).stat().st_mtime_ns)
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def _owner_alive(tmp: Path) -> bool:
    """Whether the process that made ``tmp`` (``.<entry>.tmp-<pid>-<id>``) still runs."""
    try:
        pid = int(tmp.name.rsplit(".tmp-", 1)[1].split("-", 1)[0])
        os.kill(pid, 0)
    except (ValueError, IndexError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True
