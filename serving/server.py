"""Composition root and lifecycle of the rollserve frontend process.

Design note: this is the one place that builds everything (registry, frontends, metrics, token
authority, health) and passes it down; nothing else holds global state. Startup binds the listeners first
(``serving.listeners``: a taken address is one line and exit 2, nothing written), resolves the tokens and writes
the key file (``serving.auth``), serves (SageMaker wants connections accepted within 250 ms; ``/ping`` answers 503
while models load), then loads the models. Each HTTP API sits behind an
``ApiGuard`` (management: token, Origin and Host checks; inference: token when required); gRPC behind an
``AuthInterceptor``. ``management_address=off`` binds no management listener and turns the gRPC management
RPCs off. On SIGTERM or SIGINT the server drains: readiness and new requests get 503, in-flight requests
finish within ``drain_timeout_s``, workers are stopped, listeners close, the default key file is removed;
no worker process outlives the server. With ``model_store_watch=true`` a ``StoreWatcher`` follows the model store
(``serving.models.store_watch``) until shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import time
from collections.abc import Generator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import uvicorn
from prometheus_client import CollectorRegistry
from starlette.routing import Route

from serving.auth import Scope, build_authority
from serving.config.server_config import ServerConfig
from serving.frontends.grpc.grpc_server import GrpcFrontend
from serving.frontends.http import openapi, tgi
from serving.frontends.http.adapter_routes import AdapterRoutes
from serving.frontends.http.anthropic import GUARD_BODIES, MessagesRoutes
from serving.frontends.http.apps import ModelReads, build_app
from serving.frontends.http.embeddings import EmbeddingRoutes
from serving.frontends.http.http_guard import ApiGuard
from serving.frontends.http.httpio import HttpContext, ServerState
from serving.frontends.http.lmi import LmiRoutes
from serving.frontends.http.management import ManagementRoutes
from serving.frontends.http.model_versions import VersionRoutes
from serving.frontends.http.oip_rest import OipRestRoutes
from serving.frontends.http.openai import OpenAIRoutes
from serving.frontends.http.responses import GUARD_BODIES as RESPONSES_GUARD_BODIES
from serving.frontends.http.responses import ResponsesRoutes
from serving.frontends.http.sessions import SessionRoutes
from serving.frontends.http.tokenizer_routes import TokenizerRoutes
from serving.heap import trim_periodically
from serving.listeners import ListenError, bind_all, listen_error
from serving.models.registry import ModelRegistry
from serving.models.residency_metrics import ResidencyCollector
from serving.models.store_watch import StoreWatcher
from serving.requests.deadlines import DeadlineScope
from serving.requests.params import Limits
from serving.telemetry.deep_health import DeepCheck
from serving.telemetry.health import Health, HealthRoutes
from serving.telemetry.metrics import ServingMetrics

log = logging.getLogger("serving.server")
KEEP_ALIVE_S = 75  # idle keep-alive connections are closed after this (see _serve_http)


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handling: the composition root owns SIGTERM (graceful drain)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


class Server:
    """The whole frontend process: ``await Server(...).run()`` serves until SIGTERM/SIGINT."""

    def __init__(self, config: ServerConfig, env: Mapping[str, str], extra_models: Mapping[str, str] = {},
                 ports_file: Path | None = None) -> None:
        # Listeners first: a taken address ends startup before the key file exists (serving.listeners).
        self.listeners = bind_all(config)  # raises ListenError
        self.config = config
        self.env = env
        self.extra_models = dict(extra_models)
        self.ports_file = ports_file
        self.state = ServerState(started_at=time.time())
        self.metrics = ServingMetrics(CollectorRegistry(), models=lambda: self.registry.endpoints,
                                      versions=lambda: self.registry.all_endpoints())
        self.registry = ModelRegistry(config, env, self.metrics)
        self.metrics.registry.register(ResidencyCollector(self.registry.all_endpoints, self.registry.residency))
        self.limits = Limits(max_stop_sequences=config.max_stop_sequences, max_stop_length=config.max_stop_length,
                             max_stop_token_ids=config.max_stop_token_ids,
                             max_sequences_per_request=config.max_sequences_per_request)
        # Long prompts are tokenized here, one thread fewer than the CPUs: the event loop keeps a core.
        self.tokenize_pool = ThreadPoolExecutor(max_workers=max(1, (os.cpu_count() or 2) - 1),
                                                thread_name_prefix="tokenize")
        self.http = HttpContext(registry=self.registry, state=self.state, limits=self.limits,
                                max_request_size=config.max_request_size, metrics=self.metrics,
                                tokenize_pool=self.tokenize_pool)
        self.authority = build_authority(config, Path.cwd())  # raises ConfigError for a bad key file
        self.health = Health(self.registry, self.state, config.ping_requires)
        self.deep_check = DeepCheck(self.health, config.health_generate_interval_s, config.health_generate_timeout_s)
        self._servers: list[_Uvicorn] = []
        self._stop = asyncio.Event()
        self.ports: dict[str, int] = {}
        self.grpc: Any = None
        self.openai = OpenAIRoutes(self.http)
        # LMI bodies with `messages` (chat) or `prompt` (completions) are answered by the OpenAI routes
        self.lmi = LmiRoutes(self.http, self.openai.chat_for_lmi, self.openai.completion_for_lmi)
        self.versions = VersionRoutes(self.registry, config.drain_timeout_s, self.lmi.predictions)
        self.watcher: StoreWatcher | None = None

    def _inference_routes(self) -> list[Any]:
        return [*HealthRoutes(self.health, self.deep_check).routes(), *SessionRoutes(self.http, self.lmi).routes(),
                *self.lmi.routes(), *self.versions.inference_routes(),
                *self.openai.routes(), *EmbeddingRoutes(self.http).routes(), *TokenizerRoutes(self.http).routes(),
                *ResponsesRoutes(self.http, self.authority.required(Scope.INFERENCE)).routes(),
                *MessagesRoutes(self.http).routes(),
                *tgi.routes(self.http), *OipRestRoutes(self.http, self.health).routes(),
                openapi.route(lambda: openapi.inference_document(self.limits, sorted(self.registry.endpoints)))]

    def _management_app(self, metrics_route: Any, reads_only: bool = False) -> Any:
        """The management API's app; ``reads_only``: its model reads alone (served on the inference address)."""
        routes = ManagementRoutes(self.http, self.registry, self.config.drain_timeout_s, metrics_route)
        if reads_only:
            app = build_app(routes.read_routes())
        else:
            # adapters before versions: /models/{name}/adapters is not a version
            app = build_app(routes.routes() + AdapterRoutes(self.registry).routes()
                            + self.versions.management_routes() + HealthRoutes(self.health, self.deep_check).routes()
                            + [openapi.route(lambda: openapi.management_document(
                                self.limits, sorted(self.registry.endpoints)))])
        c = self.config
        return ApiGuard(app, self.authority, Scope.MANAGEMENT, browser_checks=True,
                        allowed_hosts=c.management_allowed_hosts, allowed_origins=c.management_allowed_origins)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        metrics_route = self.metrics.route
        # deadline headers read as a request arrives (the routes queue it with them: serving.requests.deadlines)
        inference: Any = ApiGuard(DeadlineScope(build_app(self._inference_routes())), self.authority, Scope.INFERENCE,
                                  error_bodies=(*GUARD_BODIES, *RESPONSES_GUARD_BODIES))  # the APIs' own shapes
        management_hp = self.config.management_host_port()
        if management_hp is not None:  # DJL serves both APIs on one port: its clients read models there
            inference = ModelReads(inference, self._management_app(metrics_route, reads_only=True))
        apps = {"inference": self.metrics.instrument(inference)}
        if management_hp is not None:
            apps["management"] = self._management_app(metrics_route)
        else:
            log.info("management API is off (management_address=off)")
        if self.config.metrics_host_port() is not None:
            apps["metrics"] = build_app([Route("/metrics", metrics_route)])
        serve_tasks = []
        for listener in self.listeners:
            self.ports[listener.name] = listener.port
            log.info("%s API listening on http://%s:%d", listener.name, listener.host, listener.port)
            serve_tasks.append(asyncio.create_task(self._serve_http(apps[listener.name], listener.sock)))
        try:
            await self._start_grpc()
        except ListenError:  # taken since bind_all probed it: undo the startup so far (key file included)
            for task in serve_tasks:
                task.cancel()
            await asyncio.gather(*serve_tasks, return_exceptions=True)
            for listener in self.listeners:
                listener.sock.close()
            self.authority.close()
            self.tokenize_pool.shutdown(wait=False, cancel_futures=True)
            raise
        self._write_ports()
        models = self.registry.discover(self.extra_models)
        load = asyncio.create_task(self.registry.start_all(models))
        self.registry.residency.start()
        if self.config.model_store_watch:
            self.watcher = StoreWatcher(self.registry, self.config.model_store_watch_quiet_ms / 1000.0,
                                        self.config.drain_timeout_s)
            self.watcher.start()
        trim = asyncio.create_task(trim_periodically())
        await self._stop.wait()
        trim.cancel()
        if self.watcher is not None:
            await self.watcher.stop()
        log.info("shutting down: draining in-flight requests (up to %.0fs)", self.config.drain_timeout_s)
        self.state.draining = True
        await self._drain()
        load.cancel()
        await self.registry.stop_all(0.0)
        if self.grpc is not None:
            await self.grpc.stop(grace=1.0)
        for s in self._servers:
            s.should_exit = True
        await asyncio.gather(*serve_tasks, return_exceptions=True)
        self.authority.close()
        self.tokenize_pool.shutdown(wait=False, cancel_futures=True)
        log.info("stopped")

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.config.drain_timeout_s
        while self.registry.num_pending() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.1)  # let the last responses flush

    async def _serve_http(self, app: Any, sock: socket.socket) -> None:
        # h11 on purpose: its incomplete-event limit bounds a request's head (httptools, uvicorn's "auto" pick
        # when installed, accepted a 4 MB header here); the default asyncio loop (grpc.aio shares it).
        # keep-alive longer than client pools keep idle connections (httpx and the openai SDK 5 s, aiohttp 15 s) and
        # than load balancers' idle timeouts (60 s): the client closes an idle connection first, so it never sends a
        # request on one the server is closing (uvicorn's 5 s default races httpx's 5 s: "Server disconnected").
        cfg = uvicorn.Config(app, http="h11", lifespan="off", log_config=None, access_log=False,
                             timeout_graceful_shutdown=5, h11_max_incomplete_event_size=64 * 1024,
                             timeout_keep_alive=KEEP_ALIVE_S)
        server = _Uvicorn(cfg)
        self._servers.append(server)
        await server.serve(sockets=[sock])

    async def _start_grpc(self) -> None:
        hp = self.config.grpc_host_port()
        if hp is None:
            return
        self.grpc = GrpcFrontend(self.http, self.registry, self.config.drain_timeout_s, authority=self.authority,
                                 health=self.health, config=self.config)
        try:
            self.ports["grpc"] = await self.grpc.start(*hp)
        except (OSError, RuntimeError) as exc:  # grpc.aio raises RuntimeError for an address it cannot bind
            raise listen_error(self.config, "grpc", *hp, exc) from None
        log.info("gRPC API listening on %s:%d", hp[0], self.ports["grpc"])

    def _write_ports(self) -> None:
        if self.ports_file is not None:
            tmp = self.ports_file.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.ports))
            tmp.replace(self.ports_file)
