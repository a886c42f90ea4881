"""Liveness and readiness of the server, for HTTP (``/health/live``, ``/health/ready``, ``/ping``) and gRPC; the
deep check (``/health/generate``, a token through every worker) is ``serving.telemetry.deep_health``.

Design note (Triton's split): *liveness* means the process answers (its event loop runs); an orchestrator
restarts a server that is not live, so a FAILED model never makes it so. *Readiness* follows
``ping_requires``: ``all`` (default) -- every model of ``load_models`` (the startup set, minus those
unregistered since) is READY with a worker serving (a model whose workers are all restarting is not ready);
``any`` -- at least one registered model is; ``none`` -- readiness is
liveness. Models registered later over the API never change readiness: ask ``/models/{name}`` or the
per-model health for them. Draining (SIGTERM) makes the server not ready at once. Event loop only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from serving.models.endpoint_protocol import Endpoint
from serving.models.resident import loads_on_request

PING_REQUIRES = ("all", "any", "none")


class Models(Protocol):
    """What health needs from the registry."""

    @property
    def endpoints(self) -> Mapping[str, Endpoint]: ...
    startup_models: set[str] | None  # None until the startup models are known


class Draining(Protocol):
    draining: bool


class Health:
    """Answers live/ready from the registry's current state."""

    def __init__(self, registry: Models, state: Draining, ping_requires: str = "all") -> None:
        if ping_requires not in PING_REQUIRES:
            raise ValueError(f"ping_requires must be one of {PING_REQUIRES}, got {ping_requires!r}")
        self.registry = registry
        self.state = state
        self.ping_requires = ping_requires

    def live(self) -> bool:
        """The process serves (always true while this runs, draining included)."""
        return True

    def ready(self) -> bool:
        """Readiness under ``ping_requires`` (see the module note)."""
        if self.state.draining:
            return False
        endpoints = self.registry.endpoints
        if self.ping_requires == "none":
            return True
        if not endpoints:  # e.g. started outside the repository root: serving nothing is not "ready"
            return False
        if self.ping_requires == "any":
            # a model that loads on its first request serves too: a store of such models is ready unloaded
            return any(ep.available or loads_on_request(ep) for ep in endpoints.values())
        startup = self.registry.startup_models
        if startup is None:
            return False
        return all(name in endpoints and endpoints[name].available for name in startup)

    def models(self) -> dict[str, str]:
        return {name: ep.state.value for name, ep in sorted(self.registry.endpoints.items())}


class DeepCheck(Protocol):
    async def result(self) -> tuple[bool, dict[str, Any]]: ...


class HealthRoutes:
    """``GET /ping`` (readiness, SageMaker's contract), ``/health/ready``, ``/health/live`` and, given a deep
    check, ``/health/generate``."""

    def __init__(self, health: Health, deep: DeepCheck | None = None) -> None:
        self.health = health
        self.deep = deep

    def routes(self) -> list[Route]:
        routes = [Route("/ping", self.ping, methods=["GET"]),
                  Route("/health/ready", self.ping, methods=["GET"]),
                  Route("/health/live", self.live, methods=["GET"])]
        if self.deep is not None:
            routes.append(Route("/health/generate", self.generate, methods=["GET"]))
        return routes

    async def generate(self, request: Request) -> Response:
        assert self.deep is not None
        healthy, body = await self.deep.result()
        return JSONResponse(body, status_code=200 if healthy else 503)

    async def ping(self, request: Request) -> Response:
        if self.health.state.draining:
            return JSONResponse({"status": "draining", "models": self.health.models()}, status_code=503)
        ready = self.health.ready()
        if not ready and not self.health.registry.endpoints:
            return JSONResponse({"status": "Unhealthy", "models": {}, "reason": "no model is registered"},
                                status_code=503)
        return JSONResponse({"status": "Healthy" if ready else "Unhealthy", "models": self.health.models(),
                             "ping_requires": self.health.ping_requires}, status_code=200 if ready else 503)

    async def live(self, request: Request) -> Response:
        return JSONResponse({"status": "draining" if self.health.state.draining else "live"})
