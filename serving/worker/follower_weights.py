"""How a follower host of a multi-host tensor-parallel group gets the weights the leader's ranks load.

Design note: the leader's assignment carries the manifest of its weights folder, the source it came from
(``option.origin_model_id``: an S3 prefix, a hub id, a package file or a GGUF file the registry fetched; absent
for a local folder) and ``option.follower_weights``. ``resolve`` fetches that source here, with this host's
credentials, environment and cache (``serving.sources``), or for a local folder takes the same folder from this
host's model store; ``stream`` copies the leader's files over the group's authenticated rendezvous
(``handlers.engine.execution.parallel.host_weights``) into this host's cache, under the manifest's digest so a restart
of the agent reuses the copy; ``auto`` resolves where this host can reach the source and streams where it cannot.
The agent then checks whichever copy against the manifest before any rank starts.
"""

from __future__ import annotations

import hashlib
import json
import logging
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from handlers.engine.execution.parallel.host_weights import FileEntry, stream
from serving.sources import cache
from serving.sources.resolve import local_path, needs_resolving, resolve
from serving.sources.source_error import SourceError

log = logging.getLogger(__name__)

MODES = ("auto", "resolve", "stream")


@dataclass(frozen=True, slots=True)
class Placed:
    """The folder this host's ranks load and how it got here (for the logs and the leader's)."""

    folder: Path
    how: str


@dataclass(frozen=True, slots=True)
class WeightsPlacer:
    """This host's side of the weights: its model store, its cache of fetched sources, its environment."""

    model_store: Path
    cache_root: Path
    env: Mapping[str, str]

    def place(self, assignment: Mapping[str, Any], open_stream: Callable[[], socket.socket]) -> Placed:
        """A local folder holding the weights of ``assignment`` (not yet checked against its manifest).
        ``open_stream`` opens an authenticated connection to the leader. Raises ``SourceError`` when the
        configuration says resolve and this host cannot, ``ConnectionError`` when a stream breaks."""
        weights = assignment["weights"]
        mode = weights.get("mode") or "auto"
        if mode not in MODES:
            raise SourceError(f"option.follower_weights={mode!r}: expected one of {', '.join(MODES)}")
        entries = [FileEntry.from_wire(e) for e in weights["manifest"]]
        if mode != "stream":
            try:
                placed = self._resolve(assignment["model"], weights.get("origin"), assignment["options"])
            except SourceError as exc:
                if mode == "resolve":
                    raise
                log.warning("cannot resolve the weights on this host (%s): streaming them from the leader", exc)
            else:
                if placed is not None:
                    return placed
                if mode == "resolve":
                    raise SourceError(f"model folder {assignment['model']} is not in this host's model store "
                                      f"{self.model_store} (option.follower_weights=resolve)")
        return Placed(self._stream(entries, open_stream), "streamed from the leader")

    def _resolve(self, model: str, origin: str | None, options: Mapping[str, str]) -> Placed | None:
        """The source resolved on this host; None for a local folder this host's model store lacks."""
        model_dir = self.model_store / model
        if origin:  # the registry fetched it on the leader: fetch it here the same way
            folder = resolve(model_dir, origin, gguf_file=options.get("gguf_file") or None,
                             allow_unsafe=str(options.get("allow_unsafe_weights", "false")).lower() == "true",
                             env=self.env, root=self.cache_root, progress=lambda line: log.info("%s", line))
            return Placed(folder, f"resolved {origin} on this host")
        if not model_dir.is_dir():
            return None
        model_id = options.get("model_id")
        if model_id and needs_resolving(model_dir, model_id):
            return None  # the leader's options name its own cache: not a folder of this host
        folder = local_path(model_dir, model_id) if model_id else model_dir
        if folder is None:
            return None
        return Placed(folder, "this host's model store")

    def _stream(self, entries: list[FileEntry], open_stream: Callable[[], socket.socket]) -> Path:
        listing = json.dumps([e.to_wire() for e in entries], sort_keys=True).encode()
        entry = self.cache_root / f"stream-{hashlib.sha256(listing).hexdigest()[:16]}"
        if cache.cached(entry):
            log.info("the leader's weights are in this host's cache already (%s)", entry.name)
            return entry

        def fill(dest: Path) -> None:
            sock = open_stream()
            try:
                stream(sock, entries, dest, progress=lambda line: log.info("%s", line))
            finally:
                sock.close()

        return cache.publish(entry, fill)
