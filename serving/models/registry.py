"""ModelRegistry: the models of the model store and their endpoints.

Design note: every sub-folder of ``model_store`` is a model named after the folder. A name or URL from a
client is resolved inside the model store only: symlinks are resolved first, then the path must still lie
inside the store (no ``..``, no absolute paths). A model whose configuration is invalid is registered as
FAILED with the reason, and the others keep serving.

The model API (register, scale, unregister) is refused unless ``enable_model_api=true``; registrations are
capped (``max_models`` models, ``max_workers_per_model`` workers). ``update_model`` changes a live model's
knobs (``serving.models.knobs``): batching and queue knobs need only the management token (the frontends check it),
worker counts are scaling and need the model API too. ``startup_models`` are the models of
``load_models`` that readiness waits for (see ``serving.telemetry.health``); ``live`` maps client request ids.

Versions (``serving.models.versions``, ``serving.models.store_layout``): a model name holds one or more versions;
``endpoints[NAME]`` is always the default version's endpoint, ``versions[NAME]`` all of them. ``lookup`` (also
``get``) is the one place a client's ``NAME`` or ``NAME:VERSION`` becomes an endpoint. ``reload`` rebuilds a
version from its folder without downtime (``serving.models.reload``); the watched store (``serving.models.store_watch``)
adds, reloads and removes models through ``add_from_store``, ``reload`` and ``remove``, which need no model API.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rollcore.errors import ConfigError, InvalidRequest, ModelNotFound
from rollcore.types import CORE_SHARERS_ENV
from serving.batching.ports import BatchObserver
from serving.config.devices import DevicePlan, plan_devices, visible_devices
from serving.config.model_config import ModelConfig, load_model_config, validate_model_name
from serving.config.server_config import ServerConfig
from serving.models.adapter_source import adapter_folder
from serving.models.endpoint import FailedEndpoint, ModelEndpoint
from serving.models.endpoint_protocol import Endpoint
from serving.models.live_requests import LiveRequests
from serving.models.model_files import nothing_to_load
from serving.models.registry_api import ModelApi
from serving.models.reload import reload_version
from serving.models.residency import Residency
from serving.models.served_version import DEFAULT_VERSION
from serving.models.store_layout import is_versioned, pinned_default, versions_of
from serving.models.versions import ModelVersions, split_ref
from serving.redact import scrub_paths
from serving.sources.cache import default_root
from serving.sources.resolve import needs_resolving, resolve
from serving.sources.source_error import SourceError
from serving.worker.launcher import ExecLauncher, ForkLauncher, Launcher

log = logging.getLogger(__name__)


class ModelRegistry(ModelApi):
    """Holds every endpoint by name. Event-loop only."""

    def __init__(self, server: ServerConfig, env: Mapping[str, str], observer: BatchObserver | None = None) -> None:
        self._server = server
        self._env = env
        self._observer = observer
        self._store = server.model_store.resolve()
        self.endpoints: dict[str, Endpoint] = {}  # name -> its default version's endpoint
        self.versions: dict[str, ModelVersions] = {}
        self.retiring: set[Endpoint] = set()  # replaced by a reload, finishing their requests
        self.startup_models: set[str] | None = None  # known once discover() ran
        self.live = LiveRequests()
        # every model's workers fork from one process that has torch imported (exec'd when it cannot)
        self.launcher: Launcher = ForkLauncher(env, server.worker_preload) if server.worker_fork_server \
            else ExecLauncher()
        # GPUs the server may hand to workers, learned once without torch (serving.config.devices); none on a CPU host
        self.visible_devices = visible_devices(env)
        # the models' memory budget: loads on demand, unloads of idle models (serving.models.residency)
        self.residency = Residency(server.model_memory_budget.resolve(), server.model_memory_budget.describe(),
                                   server.model_load_wait_s, self.all_endpoints, lambda: self.retiring)
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

    async def adapter_folder(self, model: str, name: str, src: str) -> Path:
        """The checked local folder of a LoRA adapter registered over the API: ``src`` in the model store, on S3
        or on the hub, resolved with the models' cache (``serving.models.adapter_source``); InvalidRequest."""
        return await adapter_folder(name, src, in_store=self.resolve_url, env=self._env, store=self._store,
                                    cache_root=self._server.model_cache_dir or default_root(), model=model)

    def lookup(self, ref: str) -> Endpoint:
        """``NAME`` (its default version) or ``NAME:VERSION`` -> the endpoint, or ``ModelNotFound`` (also for a
        version that is not a number: the name may be something else's, e.g. a LoRA adapter's)."""
        try:
            name, version = split_ref(ref)
        except InvalidRequest as exc:
            raise ModelNotFound(f"model {ref!r} is not registered ({exc.message})") from None
        if version is None:
            ep = self.endpoints.get(name)
        else:
            mv = self.versions.get(name)
            ep = mv.entries.get(version) if mv is not None else None
        if ep is None:
            what = f"model {name!r}" + (f" version {version}" if version is not None else "")
            raise ModelNotFound(f"{what} is not registered")
        return ep

    def get(self, name: str) -> Endpoint:
        """As ``lookup``: every frontend resolves names here."""
        return self.lookup(name)

    def versions_of(self, name: str) -> list[str]:
        mv = self.versions.get(name)
        return sorted(mv.entries, key=int) if mv is not None else []

    def version_info(self, ep: Endpoint) -> dict[str, Any]:
        """The version's place among its model's (``ModelVersions.describe``); {} for an unregistered one."""
        mv = self.versions.get(ep.name)
        return mv.describe(ep.version) if mv is not None and mv.entries.get(ep.version) is ep else {}

    def all_endpoints(self) -> list[tuple[str, str, Endpoint]]:
        """``(name, version, endpoint)`` of every registered version."""
        return [(name, v, ep) for name, mv in sorted(self.versions.items())
                for v, ep in sorted(mv.entries.items(), key=lambda item: int(item[0]))]

    def route(self, name: str) -> None:
        """Point ``endpoints[name]`` at the model's default version (one assignment: atomic for requests)."""
        mv = self.versions.get(name)
        version = mv.default_version() if mv is not None else None
        if mv is None or version is None:
            self.versions.pop(name, None)
            self.endpoints.pop(name, None)
            return
        ep = mv.entries[version]
        if self.endpoints.get(name) is not ep:
            if name in self.endpoints:
                log.info("model %s: version %s now serves the name", name, version)
            self.endpoints[name] = ep

    def pin_from_store(self, name: str, folder: Path) -> None:
        """``default_version`` of a versioned folder's ``model.properties`` (a pin set over the API stays)."""
        mv = self.versions.get(name)
        if mv is None or mv.pinned_by == "API" or not is_versioned(folder):
            return
        try:
            mv.pinned = pinned_default(folder)
        except ConfigError as exc:
            log.error("model %s: %s (the highest version serves the name)", name,
                      self._without_paths(str(exc), name, folder))
            mv.pinned = None
        mv.pinned_by = "model.properties" if mv.pinned is not None else None

    def only(self) -> Endpoint:
        """The single model (SageMaker ``/invocations`` without ``model_name``)."""
        if len(self.endpoints) == 1:
            return next(iter(self.endpoints.values()))
        if not self.endpoints:
            raise ModelNotFound("no model is registered")
        raise InvalidRequest(f"{len(self.endpoints)} models are registered: name one with ?model_name= "
                             f"(one of {sorted(self.endpoints)})")

    def build(self, name: str, model_dir: Path, overrides: Mapping[str, str] = {},
              version: str = DEFAULT_VERSION) -> Endpoint:
        """Parse the model's config and create its endpoint (FAILED endpoint on a config error)."""
        try:
            cfg: ModelConfig = load_model_config(model_dir, name=name, env=self._env, overrides=overrides,
                                                 server=self._server, num_devices=len(self.visible_devices) or None)
            devices: DevicePlan = plan_devices(self.visible_devices, cfg.parallel.load_on_devices,
                                               cfg.parallel.tensor_parallel_degree)
        except ConfigError as exc:
            log.error("model %s: invalid configuration: %s", name, exc)
            failed = FailedEndpoint(name, self._without_paths(str(exc), name, model_dir))
            failed.version = version
            return failed
        if (empty := nothing_to_load(cfg)) is not None:  # permanent: no worker could ever load it, none is tried
            log.error("model %s: %s", name, empty)
            failed = FailedEndpoint(name, empty)
            failed.version = version
            return failed
        for warning in cfg.warnings:  # an unknown option.* key that looks like a typo of a known one
            log.warning("model %s: %s", name, warning)
        # Workers of different models share the machine's cores: option.num_threads=auto divides the cores by
        # the models loaded at start too (more OpenMP threads than cores spin; benchmarks/HISTORY.md, Soak).
        env = {**self._env, CORE_SHARERS_ENV: str(max(1, len(self.startup_models or ())))}
        for_version = getattr(self._observer, "for_version", None)  # the metrics' version label
        observer = for_version(version) if for_version is not None else self._observer
        ep = ModelEndpoint(cfg, observer, env=env, log_format=self._server.log_format, live=self.live,
                           devices=devices, launcher=self.launcher)
        ep.version = version
        self.residency.manage(ep)
        return ep

    def _without_paths(self, message: str, name: str, model_dir: Path) -> str:
        """Clients see a model's files by model name, never by where they live on the server: the model folder is
        the name, the store ``<model_store>``, any other absolute path (the model cache, an absolute
        ``option.model_id``) only its last component (``serving.redact``)."""
        return scrub_paths(message, {str(model_dir.resolve()): name, str(model_dir): name,
                                     str(self._store): "<model_store>"})

    def _add(self, name: str, version: str, ep: Endpoint, folder: Path, overrides: Mapping[str, str]) -> None:
        self.versions.setdefault(name, ModelVersions(name)).add(version, ep, folder, overrides)
        self.route(name)

    async def _start(self, name: str, ep: Endpoint) -> None:
        if self.residency.defers(ep):  # registered: it loads on its first request
            mv = self.versions.get(name)
            if self.startup_models is not None and mv is not None and all(map(self.residency.defers,
                                                                               mv.entries.values())):
                self.startup_models.discard(name)  # readiness does not wait for a model nobody asked for yet
            log.info("model %s (version %s): registered; it loads on its first request", name, ep.version)
            return
        await ep.start()
        self.residency.loaded(ep)
        self.route(name)  # a version that became READY may now be the default

    async def _prepare(self, name: str, version: str, folder: Path, overrides: Mapping[str, str]) -> Endpoint:
        """Resolve the version's source and build its endpoint (FAILED on an error), registered, not started."""
        try:
            resolved = await self.resolve_source(name, folder, overrides)
        except SourceError as exc:
            log.error("model %s: %s", name, exc)
            ep: Endpoint = FailedEndpoint(name, self._without_paths(str(exc), name, folder))
        else:
            ep = self.build(name, folder, resolved, version)
        self._add(name, version, ep, folder, overrides)
        return ep

    async def add_from_store(self, name: str, folder: Path, versions: Mapping[str, Path] | None = None) -> None:
        """Register and start the versions of a model folder (all of them by default): the models loaded at start
        and the watched store's. An invalid version is a FAILED one; others load. No model API needed."""
        if name not in self.versions and len(self.endpoints) >= self._server.max_models:
            log.error("model %s: not loaded: %d models are registered, at most %d (max_models)", name,
                      len(self.endpoints), self._server.max_models)
            return
        found = versions_of(folder) if versions is None else versions
        eps = [await self._prepare(name, v, f, {}) for v, f in sorted(found.items(), key=lambda i: int(i[0]))]
        self.pin_from_store(name, folder)
        await asyncio.gather(*(self._start(name, ep) for ep in eps))

    async def remove(self, ref: str, drain_timeout_s: float) -> None:
        """Unregister ``NAME`` (every version) or ``NAME:VERSION``: new requests get 404 at once, those in
        flight finish within the drain. No model API check (``unregister`` is the API's)."""
        name, version = split_ref(ref)
        self.lookup(ref)  # ModelNotFound
        mv = self.versions[name]
        async with mv.lock:
            if version is None:
                gone = list(mv.entries.values())
                mv.entries.clear()
            else:
                gone = [mv.remove(version)] if version in mv.entries else []
            self.route(name)
        if name not in self.endpoints and self.startup_models is not None:
            self.startup_models.discard(name)
        await asyncio.gather(*(ep.drain(drain_timeout_s) for ep in gone))

    async def reload(self, ref: str) -> dict[str, Any]:
        """Rebuild a version (``NAME``: the default one) from its folder as it is now, without downtime
        (``serving.models.reload``). No model API check: it adds no model."""
        return await reload_version(self, ref, self._server.drain_timeout_s)

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
            await self.add_from_store(name, path)

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
        # followers of a multi-host group resolve the same source on their own hosts (handlers' cluster)
        return {**overrides, "option.model_id": str(local), "option.origin_model_id": cfg.model_id}

    async def stop_all(self, drain_timeout_s: float) -> None:
        eps = [ep for _, _, ep in self.all_endpoints()] + list(self.retiring)
        await self.residency.close()
        await asyncio.gather(*(ep.drain(drain_timeout_s) for ep in eps), return_exceptions=True)
        await self.launcher.close()

    def num_pending(self) -> int:
        """Requests queued or running on every version, those being retired by a reload included."""
        eps = [ep for _, _, ep in self.all_endpoints()] + list(self.retiring)
        return sum(ep.batcher.num_pending() for ep in eps if isinstance(ep, ModelEndpoint))
