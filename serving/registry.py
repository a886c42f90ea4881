"""ModelRegistry: the models of the model store and their endpoints.

Design note: every sub-folder of ``model_store`` is a model named after the folder. A name or URL from a
client is resolved inside the model store only: symlinks are resolved first, then the path must still lie
inside the store (no ``..``, no absolute paths). A model whose configuration is invalid is registered as
FAILED with the reason, and the others keep serving.

The model API (register, scale, unregister) is refused unless ``enable_model_api=true``; registrations are
capped (``max_models`` models, ``max_workers_per_model`` workers). ``update_model`` changes a live model's
knobs (``serving.knobs``): batching and queue knobs need only the management token (the frontends check it),
worker counts are scaling and need the model API too. ``startup_models`` are the models of
``load_models`` that readiness waits for (see ``serving.health``); ``live`` maps client request ids.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rollcore.errors import ConfigError, Forbidden, InvalidRequest, ModelNotFound, Overloaded
from rollcore.types import CORE_SHARERS_ENV
from serving import knobs
from serving.batching.ports import BatchObserver
from serving.config import ModelConfig, load_model_config, validate_model_name
from serving.devices import DevicePlan, plan_devices, visible_devices
from serving.endpoint import AnyEndpoint, FailedEndpoint, ModelEndpoint
from serving.live_requests import LiveRequests
from serving.server_config import ServerConfig
from serving.sources.cache import default_root
from serving.sources.errors import SourceError
from serving.sources.resolve import needs_resolving, resolve

log = logging.getLogger(__name__)


class ModelRegistry:
    """Holds every endpoint by name. Event-loop only."""

    def __init__(self, server: ServerConfig, env: Mapping[str, str], observer: BatchObserver | None = None) -> None:
        self._server = server
        self._env = env
        self._observer = observer
        self._store = server.model_store.resolve()
        self.endpoints: dict[str, AnyEndpoint] = {}
        self.startup_models: set[str] | None = None  # known once discover() ran
        self.live = LiveRequests()
        # GPUs the server may hand to workers, learned once without torch (serving.devices); none on a CPU host
        self.visible_devices = visible_devices(env)
        if self.visible_devices:
            log.info("devices: %d GPU(s) visible (%s)", len(self.visible_devices), ",".join(self.visible_devices))

    @property
    def model_store(self) -> Path:
        return self._store

    def discover(self, extra: Mapping[str, str] = {}) -> dict[str, Path]:
        """Models to load at startup: ``load_models`` of the config (ALL = every folder) plus ``extra``
        (``-m NAME=PATH`` from the command line, trusted operator input)."""
        found: dict[str, Path] = {}
        for entry in self._server.load_models:
            if entry.upper() == "ALL":
                if self._store.is_dir():
                    for d in sorted(self._store.iterdir()):
                        if d.is_dir() and not d.name.startswith((".", "_")):
                            found[d.name] = d
            elif "=" in entry:
                name, _, path = entry.partition("=")
                found[name.strip()] = self.resolve_url(path.strip())
            elif entry:
                found[entry] = self.resolve_url(entry)
        for name, path in extra.items():
            p = Path(path)
            found[name] = p if p.is_absolute() else (Path.cwd() / p)
        if not found:
            where = "does not exist" if not self._store.is_dir() else "holds no model folder"
            log.warning("no model to serve: the model store %s %s (run `serving` in the repository root, or pass "
                        "--model-store DIR or -m NAME=PATH); /ping answers 503 until a model is registered",
                        self._store, where)
        self.startup_models = set(found)
        return found

    def resolve_url(self, url: str) -> Path:
        """A client-supplied model folder -> a path inside the model store, or InvalidRequest."""
        if not url or url.startswith(("/", "\\")) or "\x00" in url:
            raise InvalidRequest(f"url {url!r} must name a folder inside the model store")
        if url.startswith("file://"):
            raise InvalidRequest("url must be a folder name inside the model store, not a file:// URL")
        candidate = (self._store / url).resolve()
        if candidate != self._store and self._store not in candidate.parents:
            raise InvalidRequest(f"url {url!r} is outside the model store")
        if not candidate.is_dir():
            raise InvalidRequest(f"url {url!r} is not a model folder in the model store")
        return candidate

    def get(self, name: str) -> AnyEndpoint:
        ep = self.endpoints.get(name)
        if ep is None:
            raise ModelNotFound(f"model {name!r} is not registered")
        return ep

    def only(self) -> AnyEndpoint:
        """The single model (SageMaker ``/invocations`` without ``model_name``)."""
        if len(self.endpoints) == 1:
            return next(iter(self.endpoints.values()))
        if not self.endpoints:
            raise ModelNotFound("no model is registered")
        raise InvalidRequest(f"{len(self.endpoints)} models are registered: name one with ?model_name= "
                             f"(one of {sorted(self.endpoints)})")

    def build(self, name: str, model_dir: Path, overrides: Mapping[str, str] = {}) -> AnyEndpoint:
        """Parse the model's config and create its endpoint (FAILED endpoint on a config error)."""
        try:
            cfg: ModelConfig = load_model_config(model_dir, name=name, env=self._env, overrides=overrides,
                                                 server=self._server, num_devices=len(self.visible_devices) or None)
            devices: DevicePlan = plan_devices(self.visible_devices, cfg.parallel.load_on_devices,
                                               cfg.parallel.tensor_parallel_degree)
        except ConfigError as exc:
            log.error("model %s: invalid configuration: %s", name, exc)
            return FailedEndpoint(name, self._without_paths(str(exc), name, model_dir))
        for warning in cfg.warnings:  # an unknown option.* key that looks like a typo of a known one
            log.warning("model %s: %s", name, warning)
        # Workers of different models share the machine's cores: option.num_threads=auto divides the cores by
        # the models loaded at start too (more OpenMP threads than cores spin; benchmarks/README.md, Soak).
        env = {**self._env, CORE_SHARERS_ENV: str(max(1, len(self.startup_models or ())))}
        return ModelEndpoint(cfg, self._observer, env=env, log_format=self._server.log_format, live=self.live,
                             devices=devices)

    def _without_paths(self, message: str, name: str, model_dir: Path) -> str:
        """Clients see a model's files by model name, never by where they live on the server."""
        for prefix in {str(model_dir.resolve()), str(model_dir)}:
            message = message.replace(prefix, name)
        return message.replace(str(self._store), "<model_store>")

    async def register(self, name: str, model_dir: Path, overrides: Mapping[str, str] = {},
                       wait: bool = True) -> AnyEndpoint:
        """Add a model over the model API and start loading it (waits for the load when ``wait``).
        Raises ``Forbidden`` (model API off), ``InvalidRequest``, ``Overloaded`` (``max_models``)."""
        self.require_model_api("registering a model")
        try:
            validate_model_name(name)
        except ConfigError as exc:  # a client-supplied name: 400, not an internal error
            raise InvalidRequest(str(exc)) from None
        if name in self.endpoints:
            raise InvalidRequest(f"model {name!r} is already registered")
        if len(self.endpoints) >= self._server.max_models:
            raise Overloaded(f"{len(self.endpoints)} models are registered; at most {self._server.max_models} "
                             "(max_models in config.properties)")
        for key in ("minWorkers", "maxWorkers"):
            if key in overrides:
                self.check_num_workers(int(overrides[key]), "min_worker" if key == "minWorkers" else "max_worker",
                                       minimum=0 if key == "minWorkers" else 1)
        try:
            overrides = await self.resolve_source(name, model_dir, overrides)
        except SourceError as exc:
            raise InvalidRequest(f"model {name!r}: {self._without_paths(str(exc), name, model_dir)}") from None
        ep = self.build(name, model_dir, overrides)
        if isinstance(ep, FailedEndpoint):
            raise InvalidRequest(f"model {name!r} has an invalid configuration: {ep.reason}")
        self.endpoints[name] = ep
        task = asyncio.ensure_future(ep.start())
        if wait:
            await task
        return ep

    async def unregister(self, name: str, drain_timeout_s: float) -> None:
        """Remove a model over the model API; its pending requests end when the drain ends."""
        self.require_model_api("unregistering a model")
        ep = self.get(name)
        del self.endpoints[name]
        if self.startup_models is not None:
            self.startup_models.discard(name)
        await ep.drain(drain_timeout_s)

    async def scale(self, name: str, num_workers: int) -> AnyEndpoint:
        """Set a model's number of workers over the model API (1..``max_workers_per_model``)."""
        self.require_model_api("scaling a model")
        ep = self.get(name)
        self.check_num_workers(num_workers, "the number of workers", minimum=1)
        await ep.scale(num_workers)
        return ep

    async def update_model(self, name: str, values: Mapping[str, int]) -> dict[str, Any]:
        """Change live knobs of a model (names and values checked by ``serving.knobs``). ``min_worker`` and
        ``max_worker`` need the model API (as scaling) and lie in 1..``max_workers_per_model``."""
        workers = [key for key in knobs.WORKER_KNOBS if key in values]
        if workers:
            self.require_model_api(f"changing a model's workers ({', '.join(workers)})")
            for key in workers:
                self.check_num_workers(values[key], key, minimum=1)
        return await self.get(name).update(values)

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

    async def start_all(self, models: Mapping[str, Path]) -> None:
        """Resolve, build and start every model, each on its own (a model that downloads delays no other)."""

        async def one(name: str, path: Path) -> None:
            try:
                name = validate_model_name(name)
            except ConfigError as exc:
                log.error("model %s: %s", name, exc)
                if self.startup_models is not None:
                    self.startup_models.discard(name)
                return
            try:
                overrides = await self.resolve_source(name, path, {})
            except SourceError as exc:
                log.error("model %s: %s", name, exc)
                self.endpoints[name] = FailedEndpoint(name, self._without_paths(str(exc), name, path))
                return
            ep = self.endpoints[name] = self.build(name, path, overrides)
            await ep.start()

        await asyncio.gather(*(one(name, path) for name, path in models.items()))

    async def resolve_source(self, name: str, model_dir: Path, overrides: Mapping[str, str]) -> Mapping[str, str]:
        """``overrides``, with ``option.model_id`` pointing at a local folder when the model's names a remote or
        GGUF source (``serving.sources.resolve``; fetched or converted in a thread, cached). Raises
        ``SourceError``; a configuration error is left for ``build`` to report."""
        try:
            cfg = load_model_config(model_dir, name=name, env=self._env, overrides=overrides, server=self._server)
        except ConfigError:
            return overrides
        if not needs_resolving(model_dir, cfg.model_id):
            return overrides
        assert cfg.model_id is not None
        root = self._server.model_cache_dir or default_root()
        local = await asyncio.to_thread(
            resolve, model_dir, cfg.model_id, gguf_file=cfg.options.get("gguf_file") or None,
            allow_unsafe=str(cfg.options.get("allow_unsafe_weights", "false")).lower() == "true", env=self._env,
            root=root, progress=lambda line: log.info("model %s: %s", name, line))
        log.info("model %s: option.model_id=%s is served from %s", name, cfg.model_id, local)
        return {**overrides, "option.model_id": str(local)}

    async def stop_all(self, drain_timeout_s: float) -> None:
        await asyncio.gather(*(ep.drain(drain_timeout_s) for ep in self.endpoints.values()),
                             return_exceptions=True)

    def num_pending(self) -> int:
        total = 0
        for ep in self.endpoints.values():
            if isinstance(ep, ModelEndpoint):
                total += ep.batcher.num_pending()
        return total
