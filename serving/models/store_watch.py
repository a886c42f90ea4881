"""The watched model store (``model_store_watch=true``): folders load, reload and unload as they change on disk.

Design note: ``watchfiles`` (inotify on Linux) reports changes under the store; each change marks the top-level
folder it lies in with the time it was seen. A folder is acted on once it has stayed unchanged for the quiet
period (``model_store_watch_quiet_ms``), so a copy in progress, which keeps changing it, is never loaded
half-way; the changes are batched at a quarter of the quiet period at most, so a change is always seen before its
folder's quiet period can end. Then the folder is reconciled with the registry:

- gone: the model (every version) is unregistered; new requests get 404 at once, those in flight finish (within
  ``drain_timeout``) on its workers, which then stop;
- new (a ``serving.properties`` in it, or in a version sub-folder): its versions register and load; an invalid
  configuration is a FAILED version with the file:line error, other models are unaffected;
- changed: each version whose files changed reloads without downtime (``serving.models.reload``); a version folder
  added or removed registers or unregisters that version; ``model.properties`` re-pins the default version.

A folder whose weights are not whole yet (``serving.models.store_layout.incomplete_files``) or whose newest file is
younger than the quiet period waits another quiet period. Hidden and ``_`` folders are ignored, and so is a
model of the same name registered from outside the store (``-m NAME=PATH``, another ``url``). The watcher acts
without the model API (the store is the operator's). One reconcile per folder runs at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from watchfiles import awatch

from rollcore.errors import ServingError
from serving.models.store_layout import MODEL_PROPERTIES, incomplete_files, is_versioned, versions_of

log = logging.getLogger(__name__)
logging.getLogger("watchfiles").setLevel(logging.WARNING)  # its "N changes detected" lines; ours say what they did


class StoreWatcher:
    """Watches ``registry.model_store``; ``start()`` on the event loop, ``await stop()`` at shutdown."""

    def __init__(self, registry: Any, quiet_s: float, drain_timeout_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.registry = registry
        self.store: Path = registry.model_store
        self.quiet_s = quiet_s
        self.drain_timeout_s = drain_timeout_s
        self._clock = clock
        self._changed: dict[str, float] = {}  # folder name -> when a change was last seen
        self._paths: dict[str, set[tuple[str, ...]]] = {}  # folder name -> changed paths (parts below it)
        self._running: dict[str, asyncio.Task[None]] = {}
        self._wake = asyncio.Event()
        self._stopping = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        log.info("model store %s: watched (a folder loads, reloads or unloads %.1fs after its last change)",
                 self.store, self.quiet_s)
        self._tasks = [asyncio.create_task(self._watch()), asyncio.create_task(self._settle())]

    async def stop(self) -> None:
        self._stopping.set()
        self._wake.set()
        for task in [*self._tasks, *self._running.values()]:
            task.cancel()
        await asyncio.gather(*self._tasks, *self._running.values(), return_exceptions=True)

    def mark(self, name: str, parts: tuple[str, ...] = ()) -> None:
        """A change in folder ``name`` (``parts``: the changed path below it)."""
        self._changed[name] = self._clock()
        self._paths.setdefault(name, set()).add(parts)
        self._wake.set()

    async def _watch(self) -> None:
        batch_ms = max(20, int(self.quiet_s * 1000 / 4))
        while not self._stopping.is_set():
            if not self.store.is_dir():
                log.warning("model store %s does not exist: watching for it", self.store)
                while not self.store.is_dir() and not self._stopping.is_set():
                    await asyncio.sleep(self.quiet_s)
                continue
            try:
                async for changes in awatch(self.store, stop_event=self._stopping, debounce=batch_ms,
                                            step=min(50, batch_ms), recursive=True):
                    for _, path in changes:
                        self._note(Path(path))
            except (OSError, RuntimeError) as exc:  # the store itself went away; watch for it again
                log.warning("model store %s: watching stopped (%s); starting again", self.store, exc)
                await asyncio.sleep(self.quiet_s)

    def _note(self, path: Path) -> None:
        try:
            parts = path.relative_to(self.store).parts
        except ValueError:
            return
        if parts and not parts[0].startswith((".", "_")):
            self.mark(parts[0], parts[1:])

    async def _settle(self) -> None:
        while not self._stopping.is_set():
            now = self._clock()
            for name, seen in sorted(self._changed.items()):
                if now - seen >= self.quiet_s and name not in self._running:
                    del self._changed[name]
                    paths = self._paths.pop(name, set())
                    task = asyncio.create_task(self._reconcile(name, paths))
                    self._running[name] = task
                    task.add_done_callback(lambda _, n=name: self._done(n))
            waiting = [seen + self.quiet_s - now for n, seen in self._changed.items() if n not in self._running]
            self._wake.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), max(0.01, min(waiting)) if waiting else None)

    def _done(self, name: str) -> None:
        self._running.pop(name, None)
        self._wake.set()

    async def _reconcile(self, name: str, paths: set[tuple[str, ...]]) -> None:
        try:
            await self.reconcile(name, paths)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - one folder's trouble never stops the watcher
            log.exception("model store: %s could not be reconciled", name)

    async def reconcile(self, name: str, paths: set[tuple[str, ...]]) -> None:
        """Bring the registry in line with folder ``name`` as it is now (see the module note)."""
        folder = self.store / name
        mv = self.registry.versions.get(name)
        ours = mv is not None and any(f == folder or folder in f.parents for f in mv.folders.values())
        if mv is not None and not ours:
            log.warning("model store: %s changed, but model %s is served from elsewhere: left alone", name, name)
            return
        if not folder.is_dir():
            if mv is not None:
                log.info("model store: %s was removed: unloading model %s once its requests finish", name, name)
                await self.registry.remove(name, self.drain_timeout_s)
            return
        if self._unsettled(name, folder):
            return
        if mv is None:
            wanted = versions_of(folder, require_properties=True)
            if wanted:
                log.info("model store: %s appeared: loading version(s) %s", name, ", ".join(sorted(wanted, key=int)))
                await self.registry.add_from_store(name, folder, wanted)
            return
        await self._update(name, folder, mv, paths)

    def _unsettled(self, name: str, folder: Path) -> bool:
        """True (and the folder is looked at again after another quiet period) while it is not whole or a file
        in it is younger than the quiet period."""
        missing = incomplete_files(folder)
        age = time.time() - _newest_mtime(folder)
        if not missing and age >= self.quiet_s:
            return False
        why = f"files not whole yet ({', '.join(missing[:3])})" if missing else f"a file changed {age:.1f}s ago"
        log.info("model store: %s is not settled: %s; looking again in %.1fs", name, why, self.quiet_s)
        self.mark(name)
        return True

    async def _update(self, name: str, folder: Path, mv: Any, paths: set[tuple[str, ...]]) -> None:
        current = dict(mv.folders)
        versioned = is_versioned(folder)
        wanted = versions_of(folder)  # a served folder may lack serving.properties (as at start)
        if not versioned and len(wanted) == 1 and len(current) == 1 and set(wanted) != set(current):
            # a flat folder whose version= changed: a reload switches to the new number without a gap
            await self._reload(f"{name}:{next(iter(current))}")
            return
        for version in sorted(set(current) - set(wanted), key=int):
            log.info("model store: %s: version %s is gone: unloading it", name, version)
            await self.registry.remove(f"{name}:{version}", self.drain_timeout_s)
        added = {v: f for v, f in wanted.items() if v not in current and (f / MODEL_PROPERTIES).is_file()}
        if added:
            log.info("model store: %s: new version(s) %s", name, ", ".join(sorted(added, key=int)))
            await self.registry.add_from_store(name, folder, added)
        for version in sorted(set(current) & set(wanted), key=int):
            touched = not versioned or any(p and p[0].isdigit() and str(int(p[0])) == version for p in paths)
            if touched:
                await self._reload(f"{name}:{version}")
        self.registry.pin_from_store(name, folder)
        self.registry.route(name)

    async def _reload(self, ref: str) -> None:
        try:
            await self.registry.reload(ref)
        except ServingError as exc:  # reported in the version's last_reload; the old one keeps serving
            log.error("model store: %s: %s", ref, exc.message)


def _newest_mtime(folder: Path) -> float:
    newest = 0.0
    for root, _, files in os.walk(folder):
        for f in files:
            with contextlib.suppress(OSError):
                newest = max(newest, os.stat(os.path.join(root, f)).st_mtime)
    return newest
