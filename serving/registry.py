"""ModelRegistry: the models of the model store and their endpoints.

Design note: every sub-folder of ``model_store`` is a model named after the folder. A name or URL from a
client is resolved inside the model store only: symlinks are resolved first, then the path must still lie
inside the store (no ``..``, no absolute paths). A model whose configuration is invalid is registered as
FAILED with the reason, and the others keep serving.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from pathlib import Path

from serving.batching.ports import BatchObserver
from serving.config import ModelConfig, ServerConfig, load_model_config, validate_model_name
from serving.endpoint import AnyEndpoint, FailedEndpoint, ModelEndpoint
from serving.errors import ConfigError, InvalidRequest, ModelNotFound

log = logging.getLogger(__name__)


class ModelRegistry:
    """Holds every endpoint by name. Event-loop only."""

    def __init__(self, server: ServerConfig, env: Mapping[str, str], observer: BatchObserver | None = None) -> None:
        self._server = server
        self._env = env
        self._observer = observer
        self._store = server.model_store.resolve()
        self.endpoints: dict[str, AnyEndpoint] = {}

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
                                                 server=self._server)
        except ConfigError as exc:
            log.error("model %s: invalid configuration: %s", name, exc)
            return FailedEndpoint(name, self._without_paths(str(exc), name, model_dir))
        return ModelEndpoint(cfg, self._observer, env=self._env, log_format=self._server.log_format)

    def _without_paths(self, message: str, name: str, model_dir: Path) -> str:
        """Clients see a model's files by model name, never by where they live on the server."""
        for prefix in {str(model_dir.resolve()), str(model_dir)}:
            message = message.replace(prefix, name)
        return message.replace(str(self._store), "<model_store>")

    async def register(self, name: str, model_dir: Path, overrides: Mapping[str, str] = {},
                       wait: bool = True) -> AnyEndpoint:
        """Add a model and start loading it (waits for the load when ``wait``)."""
        try:
            validate_model_name(name)
        except ConfigError as exc:  # a client-supplied name: 400, not an internal error
            raise InvalidRequest(str(exc)) from None
        if name in self.endpoints:
            raise InvalidRequest(f"model {name!r} is already registered")
        ep = self.build(name, model_dir, overrides)
        if isinstance(ep, FailedEndpoint):
            raise InvalidRequest(f"model {name!r} has an invalid configuration: {ep.reason}")
        self.endpoints[name] = ep
        task = asyncio.ensure_future(ep.start())
        if wait:
            await task
        return ep

    async def unregister(self, name: str, drain_timeout_s: float) -> None:
        ep = self.get(name)
        del self.endpoints[name]
        await ep.drain(drain_timeout_s)

    async def start_all(self, models: Mapping[str, Path]) -> None:
        for name, path in models.items():
            try:
                self.endpoints[name] = self.build(validate_model_name(name), path)
            except ConfigError as exc:
                log.error("model %s: %s", name, exc)
        await asyncio.gather(*(ep.start() for ep in self.endpoints.values()))

    async def stop_all(self, drain_timeout_s: float) -> None:
        await asyncio.gather(*(ep.drain(drain_timeout_s) for ep in self.endpoints.values()),
                             return_exceptions=True)

    def num_pending(self) -> int:
        total = 0
        for ep in self.endpoints.values():
            if isinstance(ep, ModelEndpoint):
                total += ep.batcher.num_pending()
        return total
