"""The model API's operations on the registry: register, unregister, scale, live knobs, versions' default, reload.

Design note: a mixin of ``serving.models.registry.ModelRegistry`` (which holds the tables these methods change), kept
apart so that the registry's own module stays about lookup, routing and loading. Registering, unregistering and
scaling need ``enable_model_api=true`` (``Forbidden`` otherwise); live knobs, ``set_default`` and ``reload`` need
only the management token, which the frontends check (they start no model that was not registered). Registering a
folder under a name that exists adds its versions to the name (TorchServe's register of a new version); a version
already registered is a 400.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rollcore.errors import ConfigError, Forbidden, InvalidRequest, ModelNotFound, Overloaded
from rollcore.types import ModelState
from serving.config.model_config import validate_model_name
from serving.config.server_config import ServerConfig
from serving.models import knobs
from serving.models.endpoint import FailedEndpoint
from serving.models.endpoint_protocol import Endpoint
from serving.models.store_layout import versions_of
from serving.models.versions import ModelVersions, check_version
from serving.sources.source_error import SourceError


class ModelApi:
    """Model API operations; mixed into ``ModelRegistry``."""

    _server: ServerConfig
    endpoints: dict[str, Endpoint]
    versions: dict[str, ModelVersions]

    # and, from ModelRegistry: get, build, route, remove, resolve_source, _add, _start, pin_from_store,
    # _without_paths

    async def register(self, name: str, model_dir: Path, overrides: Mapping[str, str] = {},
                       wait: bool = True) -> Endpoint:
        """Add a model (or new versions of one) over the model API and start loading it (waits for the load when
        ``wait``); returns the highest version added. Raises ``Forbidden`` (model API off), ``InvalidRequest``,
        ``Overloaded`` (``max_models``). Nothing is registered unless every version's configuration is valid."""
        self.require_model_api("registering a model")
        try:
            validate_model_name(name)
        except ConfigError as exc:  # a client-supplied name: 400, not an internal error
            raise InvalidRequest(str(exc)) from None
        found = versions_of(model_dir)
        mv = self.versions.get(name)
        taken = sorted(set(found) & set(mv.entries), key=int) if mv is not None else []
        if taken:
            raise InvalidRequest(f"model {name!r} is already registered (version {', '.join(taken)})")
        if mv is None and len(self.endpoints) >= self._server.max_models:
            raise Overloaded(f"{len(self.endpoints)} models are registered; at most {self._server.max_models} "
                             "(max_models in config.properties)")
        for key in ("minWorkers", "maxWorkers"):
            if key in overrides:
                self.check_num_workers(int(overrides[key]), "min_worker" if key == "minWorkers" else "max_worker",
                                       minimum=0 if key == "minWorkers" else 1)
        built: list[tuple[str, Path, Endpoint]] = []
        for version, folder in sorted(found.items(), key=lambda item: int(item[0])):
            try:
                resolved = await self.resolve_source(name, folder, overrides)
            except SourceError as exc:
                raise InvalidRequest(f"model {name!r}: {self._without_paths(str(exc), name, folder)}") from None
            ep = self.build(name, folder, resolved, version)
            if isinstance(ep, FailedEndpoint):
                raise InvalidRequest(f"model {name!r} has an invalid configuration: {ep.reason}")
            built.append((version, folder, ep))
        for version, folder, ep in built:
            self._add(name, version, ep, folder, overrides)
        self.pin_from_store(name, model_dir)
        task = asyncio.gather(*(self._start(name, ep) for _, _, ep in built))
        if wait:
            await task
        return built[-1][2]

    async def unregister(self, name: str, drain_timeout_s: float) -> None:
        """Remove a model (``NAME``: every version; ``NAME:VERSION``: that one) over the model API; its pending
        requests end when the drain ends."""
        self.require_model_api("unregistering a model")
        await self.remove(name, drain_timeout_s)

    async def scale(self, name: str, num_workers: int) -> Endpoint:
        """Set a model's number of workers over the model API (1..``max_workers_per_model``)."""
        self.require_model_api("scaling a model")
        ep = self.get(name)
        self.check_num_workers(num_workers, "the number of workers", minimum=1)
        await ep.scale(num_workers)
        return ep

    async def update_model(self, name: str, values: Mapping[str, int]) -> dict[str, Any]:
        """Change live knobs of a model (names and values checked by ``serving.models.knobs``). ``min_worker`` and
        ``max_worker`` need the model API (as scaling) and lie in 1..``max_workers_per_model``."""
        workers = [key for key in knobs.WORKER_KNOBS if key in values]
        if workers:
            self.require_model_api(f"changing a model's workers ({', '.join(workers)})")
            for key in workers:
                self.check_num_workers(values[key], key, minimum=1)
        return await self.get(name).update(values)

    def set_default(self, name: str, version: str) -> dict[str, Any]:
        """Pin the version that serves ``name`` (until another set-default, or ``model.properties`` on a server
        restart). A FAILED version cannot serve: 400."""
        version = check_version(version)
        mv = self.versions.get(name)
        if mv is None or version not in mv.entries:
            raise ModelNotFound(f"model {name!r} version {version} is not registered")
        ep = mv.entries[version]
        if ep.state is ModelState.FAILED:
            raise InvalidRequest(f"model {name!r} version {version} is FAILED ({ep.reason}); it cannot serve")
        previous = mv.default_version()
        mv.pinned, mv.pinned_by = version, "API"
        self.route(name)
        return {"status": f"model {name!r} version {version} is the default", "modelName": name,
                "default_version": version, "previous_default": previous, "state": ep.state.value}

    def require_model_api(self, what: str) -> None:
        """Raise ``Forbidden`` unless ``enable_model_api=true``."""
        if not self._server.enable_model_api:
            raise Forbidden(f"{what} needs the model API: set enable_model_api=true in config.properties "
                            "(it is off by default; models of load_models load at start)")

    def check_num_workers(self, value: int, field: str, minimum: int) -> int:
        cap = self._server.max_workers_per_model
        if not minimum <= value <= cap:
            raise InvalidRequest(f"{field} must be between {minimum} and {cap} (max_workers_per_model), "
                                 f"got {value}")
        return value
