"""The same weight files on every host of a tensor-parallel group: the leader's manifest, the check of a copy
against it, and the stream of the leader's files to a follower that has none.

Design note: the leader's ranks load a local folder (its model folder, or the cache entry ``serving.sources``
resolved ``option.model_id`` into). A follower host has its own disk, so before it starts a rank it gets a copy
(resolved from the same source on its own, or streamed from the leader here) and checks it against the leader's
manifest: every file's name, size and SHA-256, and no file besides. Streaming uses the group's rendezvous
(``handlers.engine.execution.parallel.rendezvous``): an authenticated connection that may read only the files the leader
listed. Torch-free: the follower's agent runs it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from handlers.engine.execution.parallel.rendezvous import MAX_READ, recv_frame, send_frame
from rollcore.errors import ConfigError
from rollcore.model_folder import file_sha256

logger = logging.getLogger(__name__)

# Not weights: the model's own settings travel in the assignment (the follower's may differ), dot-files are
# cache bookkeeping (the cache's .complete marker).
_NOT_WEIGHTS = frozenset({"serving.properties", "model.py", "requirements.txt"})


class WeightsMismatch(ConfigError):
    """A follower's copy is not the leader's: a file missing, extra, or of another size or SHA-256. Permanent:
    fetching the same source again gives the same bytes (the source changed, or one host's cache is stale)."""


@dataclass(frozen=True, slots=True)
class FileEntry:
    """One file of a weights folder: its path relative to the folder (``/``-separated), size and SHA-256."""

    name: str
    size: int
    sha256: str

    def to_wire(self) -> dict[str, Any]:
        return {"name": self.name, "size": self.size, "sha256": self.sha256}

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> FileEntry:
        return cls(str(d["name"]), int(d["size"]), str(d["sha256"]))


def weight_files(folder: Path) -> dict[str, Path]:
    """Relative name -> path of every file a rank may read in ``folder`` (links followed; no dot-files and no
    model settings)."""
    found: dict[str, Path] = {}
    for root, dirs, files in os.walk(folder, followlinks=True):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        rel_root = Path(root).relative_to(folder)
        for f in sorted(files):
            if f.startswith(".") or (rel_root == Path(".") and f in _NOT_WEIGHTS):
                continue
            path = Path(root) / f
            if path.is_file():
                found[(rel_root / f).as_posix()] = path
    return found


def manifest(folder: Path) -> list[FileEntry]:
    """The leader's manifest of ``folder``: every weight file's name, size and SHA-256 (each file read once)."""
    return [FileEntry(name, path.stat().st_size, file_sha256(path)) for name, path in weight_files(folder).items()]


def check(folder: Path, expected: Iterable[FileEntry], what: str) -> tuple[int, int]:
    """Raise ``WeightsMismatch`` naming the first file of ``folder`` that differs from ``expected`` (``what``
    says whose copy it is); returns (files, bytes) checked."""
    have = weight_files(folder)
    want = {e.name: e for e in expected}
    extra = sorted(set(have) - set(want))
    if extra:
        raise WeightsMismatch(f"{what} holds {extra[0]}, which the leader's copy does not")
    for name, entry in want.items():  # names and sizes first: cheap, and the usual way a copy differs
        path = have.get(name)
        if path is None:
            raise WeightsMismatch(f"{what} lacks {name}, which the leader's copy holds")
        size = path.stat().st_size
        if size != entry.size:
            raise WeightsMismatch(f"{what}: {name} has {size} bytes, the leader's {entry.size}")
    for name, entry in want.items():
        digest = file_sha256(have[name])
        if digest != entry.sha256:
            raise WeightsMismatch(f"{what}: {name} has SHA-256 {digest[:16]}..., the leader's {entry.sha256[:16]}...")
    return len(want), sum(e.size for e in want.values())


def stream(sock: socket.socket, entries: Iterable[FileEntry], dest: Path,
           progress: Callable[[str], None] = lambda _line: None) -> None:
    """Follower side: copy the leader's files over ``sock`` (an authenticated rendezvous connection) into
    ``dest``, checking each file's SHA-256 as it arrives. Raises ``WeightsMismatch`` when a file arrives other than
    listed (the leader's file changed under it), ``ConnectionError`` when the leader stops answering."""
    entries = list(entries)
    total, done = sum(e.size for e in entries), 0
    for entry in entries:
        target = dest / entry.name
        target.parent.mkdir(parents=True, exist_ok=True)
        h = hashlib.sha256()
        with target.open("wb") as out:
            offset = 0
            while offset < entry.size:
                send_frame(sock, {"op": "file", "name": entry.name, "offset": offset, "length": MAX_READ})
                answer = recv_frame(sock)
                if "error" in answer:
                    raise ConnectionError(f"the leader cannot send {entry.name}: {answer['error']}")
                data = answer["data"]
                if not data:
                    break
                out.write(data)
                h.update(data)
                offset += len(data)
        if offset != entry.size or h.hexdigest() != entry.sha256:
            raise WeightsMismatch(f"{entry.name} arrived from the leader with {offset} bytes and SHA-256 "
                                  f"{h.hexdigest()[:16]}..., not the {entry.size} bytes it listed")
        done += entry.size
        progress(f"streamed {entry.name} ({done / 2**20:.1f} of {total / 2**20:.1f} MiB)")
