"""Model versions: several endpoints under one model name, one of them the default.

Design note: a model name maps to a ``ModelVersions``: its versions (each a ``ModelEndpoint`` or a
``FailedEndpoint`` with ``version`` set), the folder and registration overrides each was built from (a reload
builds from them again), the pinned default (``model.properties``' ``default_version`` or
``PUT /models/NAME/VERSION/set-default``) and what the last reload of each version did. The default is the
pinned version when it is registered, else the highest version that is READY, else the highest: a version
that is still loading never takes the name's traffic from one that serves. The registry keeps
``endpoints[NAME]`` pointing at the default (one dict assignment: routing switches atomically).

A client names ``NAME`` (the default) or ``NAME:VERSION`` (model names cannot hold ``:``); ``split_ref``
parses it. The route that resolved a request's endpoint gives the metrics its version (``httpio.note_model``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollcore.errors import InvalidRequest
from rollcore.types import ModelState
from serving.models.endpoint_protocol import Endpoint


def split_ref(ref: str) -> tuple[str, str | None]:
    """``"NAME"`` -> ``("NAME", None)``; ``"NAME:VERSION"`` -> ``("NAME", "VERSION")`` (digits, normalised:
    ``"02"`` -> ``"2"``). Raises ``InvalidRequest`` for a version that is not a positive integer."""
    name, sep, version = ref.partition(":")
    if not sep:
        return ref, None
    return name, check_version(version)


def check_version(version: str) -> str:
    """A version as clients and folders spell it: ASCII digits, at most 9, > 0; returned without leading 0s."""
    if not (version.isascii() and version.isdigit()) or len(version) > 9 or int(version) == 0:
        raise InvalidRequest(f"model version must be a positive integer (ASCII digits, at most 9), got {version!r}")
    return str(int(version))


@dataclass
class ReloadRecord:
    """What the last reload of a version did (``GET /models/NAME`` and ``/all`` report it)."""

    status: str  # "reloading", "reloaded", "failed"
    at: float
    error: str | None = None
    duration_s: float | None = None

    def describe(self) -> dict[str, Any]:
        return {"status": self.status, "error": self.error, "at": self.at, "duration_s": self.duration_s}


@dataclass
class ModelVersions:
    """Every version of one model name. Event-loop only; ``lock`` orders reloads, removals and default changes."""

    name: str
    entries: dict[str, Endpoint] = field(default_factory=dict)  # version -> endpoint
    folders: dict[str, Path] = field(default_factory=dict)
    overrides: dict[str, Mapping[str, str]] = field(default_factory=dict)
    reloads: dict[str, ReloadRecord] = field(default_factory=dict)
    pinned: str | None = None  # default_version of model.properties or set over the API
    pinned_by: str | None = None  # "model.properties" or "API"
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def add(self, version: str, ep: Endpoint, folder: Path, overrides: Mapping[str, str]) -> None:
        ep.version = version
        self.entries[version] = ep
        self.folders[version] = folder
        self.overrides[version] = dict(overrides)

    def remove(self, version: str) -> Endpoint:
        self.folders.pop(version, None)
        self.overrides.pop(version, None)
        self.reloads.pop(version, None)
        return self.entries.pop(version)

    def default_version(self) -> str | None:
        """The pinned version if registered, else the highest READY one, else the highest."""
        if not self.entries:
            return None
        if self.pinned in self.entries:
            return self.pinned
        ready = [v for v, ep in self.entries.items() if ep.state is ModelState.READY]
        return max(ready or self.entries, key=int)

    def record(self, version: str, status: str, error: str | None = None, started: float | None = None) -> None:
        now = time.time()
        self.reloads[version] = ReloadRecord(status, now, error,
                                             None if started is None else round(time.monotonic() - started, 3))

    def describe(self, version: str) -> dict[str, Any]:
        """What the management API adds to a version's description."""
        reload = self.reloads.get(version)
        return {"version": version, "default_version": self.default_version(),
                "is_default": version == self.default_version(), "pinned_default": self.pinned,
                "versions": sorted(self.entries, key=int),
                "last_reload": reload.describe() if reload is not None else None}
