"""Zero-downtime reload of one model version: new workers first, one switch, then the old ones drain.

Design note: ``reload_version`` builds a new endpoint from the version's folder as it is now (with the overrides
it was registered with), starts its workers and sends it one warm-up request (one token; a custom handler gets
the LMI body ``{"inputs", "parameters"}``); LoRA adapters registered over the API on the old endpoint are
registered on the new one first. Only when that answered does routing switch: the version's entry
is replaced and ``endpoints[NAME]`` re-pointed in one step on the event loop, so a request resolves either the
old endpoint or the new one. The old endpoint forwards any request that resolved it before the switch but
submits after it (``ModelEndpoint.successor``), keeps running what it had (in-flight streams finish on its
workers), and is stopped once nothing is pending (at most ``drain_timeout`` later). Meanwhile both endpoints'
workers run: a reload needs the memory of both for a moment.

A reload that fails (invalid configuration, workers that cannot load, a failing warm-up) stops the new workers
and leaves the old version serving untouched; the error goes back to the caller (``ReloadFailed``) and into the
version's ``last_reload`` record (``GET /models/NAME``). A flat folder whose ``version=`` changed becomes that
version (the old one goes); a version that exists already is an error. Reloads of one model are serialised.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

from rollcore.errors import ModelNotFound, ServingError
from rollcore.types import GenerationRequest, ModelState, SamplingParams
from serving.models.endpoint import FailedEndpoint, ModelEndpoint
from serving.models.endpoint_protocol import Endpoint
from serving.models.store_layout import declared_version, is_versioned
from serving.models.versions import ModelVersions, split_ref
from serving.sources.source_error import SourceError

log = logging.getLogger(__name__)
TEXT_ENTRY_POINTS = ("huggingface", "djl_python.huggingface", "rolling")
WARMUP_PROMPT = "Hello"


class ReloadFailed(ServingError):
    """The new endpoint could not replace the old one; the old one keeps serving."""

    def __init__(self, message: str, name: str, version: str, serving: str | None) -> None:
        super().__init__(message)
        self.name, self.version, self.serving = name, version, serving


async def reload_version(registry: Any, ref: str, drain_timeout_s: float) -> dict[str, Any]:
    """Reload ``NAME`` (its default version) or ``NAME:VERSION``; returns what was switched. Raises
    ``ModelNotFound`` or ``ReloadFailed``."""
    name, asked = split_ref(ref)
    registry.lookup(ref)
    mv: ModelVersions = registry.versions[name]
    started = time.monotonic()
    async with mv.lock:
        version = asked or mv.default_version()
        if registry.versions.get(name) is not mv or version not in mv.entries:
            raise ModelNotFound(f"model {name!r} version {version} is not registered")
        old: Endpoint = mv.entries[version]
        folder, overrides = mv.folders[version], mv.overrides[version]
        in_versioned_folder = folder.name.isdigit() and is_versioned(folder.parent)
        target = version if in_versioned_folder else declared_version(folder)
        mv.record(version, "reloading")
        log.info("model %s: reloading version %s from its folder", name, version)

        def fail(reason: str) -> ReloadFailed:
            mv.record(version, "failed", reason, started)
            log.error("model %s: reload of version %s failed, version %s keeps serving: %s", name, version,
                      version, reason)
            return ReloadFailed(f"model {name!r} version {version} was not reloaded: {reason}; the running "
                                "version keeps serving", name, version, version)

        if target != version and target in mv.entries:
            raise fail(f"its serving.properties now says version={target}, which is registered already")
        try:
            resolved = await registry.resolve_source(name, folder, overrides)
        except SourceError as exc:
            raise fail(registry._without_paths(str(exc), name, folder)) from None
        new = registry.build(name, folder, resolved, target)
        if isinstance(new, FailedEndpoint):
            raise fail(f"invalid configuration: {new.reason}")
        assert isinstance(new, ModelEndpoint)
        # a model loaded on demand that is not loaded now stays so: the new configuration loads on its next request
        unloaded = registry.residency.defers(new) and old.state in (ModelState.PENDING, ModelState.UNLOADED)
        if not unloaded:
            await new.start()
            registry.residency.loaded(new)
        if not unloaded and new.state is not ModelState.READY:
            reason = new.reason or f"its workers did not load ({new.state.value})"
            await new.stop()
            raise fail(f"the new workers failed to load: {reason}")
        try:
            await carry_adapters(old, new)
            if not unloaded:
                await warm_up(new)
        except ServingError as exc:
            await new.stop()
            raise fail(f"the new workers were not ready: {exc.message}") from None
        # the switch: one step on the event loop
        if target != version:
            mv.remove(version)
        mv.add(target, new, folder, overrides)
        if isinstance(old, ModelEndpoint):
            old.successor = new
        registry.route(name)
        mv.record(target, "reloaded", started=started)
    retiring = [w["pid"] for w in old.describe().get("workers", [])]
    in_flight = old.batcher.num_pending() if isinstance(old, ModelEndpoint) else 0
    log.info("model %s: version %s reloaded in %.1fs; %d old workers finish their %d requests, then stop", name,
             target, time.monotonic() - started, len(retiring), in_flight)
    registry.retiring.add(old)
    task = asyncio.create_task(_retire(registry, old, drain_timeout_s))
    _RETIRING.add(task)
    task.add_done_callback(_RETIRING.discard)
    return {"status": f"model {name!r} version {target} reloaded", "modelName": name, "version": target,
            "replaced_version": version, "default_version": mv.default_version(), "state": new.state.value,
            "reload_s": round(time.monotonic() - started, 3),
            "workers": [w["pid"] for w in new.describe()["workers"]], "retiring_workers": retiring,
            "retiring_in_flight": in_flight}


_RETIRING: set[asyncio.Task[None]] = set()  # keeps the retiring tasks referenced until they end


async def _retire(registry: Any, old: Endpoint, drain_timeout_s: float) -> None:
    """Let the replaced endpoint finish what it runs (new requests go to its successor), then stop it."""
    try:
        if isinstance(old, ModelEndpoint):
            deadline = time.monotonic() + drain_timeout_s
            while old.batcher.num_pending() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        await old.stop()
    finally:
        registry.retiring.discard(old)


async def carry_adapters(old: Endpoint, new: ModelEndpoint) -> None:
    """The LoRA adapters registered over the API on the old endpoint (``serving.models.adapters``), registered on the
    new one before it takes requests. Raises the engine's refusal."""
    registered = getattr(getattr(old, "adapters", None), "registered", None) or {}
    if registered and new.adapters is not None:
        for name, folder in sorted(registered.items()):
            await new.adapters.register(name, folder, [])


async def warm_up(ep: ModelEndpoint) -> None:
    """One request through the new endpoint's own workers (one token). Raises its ``ServingError``."""
    text = ep.config.entry_point in TEXT_ENTRY_POINTS
    params = SamplingParams(max_new_tokens=1)
    payload = None if text else {"inputs": WARMUP_PROMPT, "parameters": {"max_new_tokens": 1}}
    stream = ep.submit(GenerationRequest(request_id=f"reload-warm-up-{uuid.uuid4().hex}", model=ep.name,
                                         prompt=WARMUP_PROMPT, params=params, payload=payload))
    await stream.collect()
