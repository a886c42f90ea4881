"""The gRPC frontend: one ``grpc.aio`` server on the frontend's event loop.

Design note: the server carries the Open Inference Protocol v2 service (``inference``, see
``grpc_oip``), rollserve's typed ``Generation`` and ``Management`` services (``grpc_typed``),
``grpc.health.v1.Health`` and server reflection. Message size is capped at ``max_request_size`` both
ways (larger -> RESOURCE_EXHAUSTED from gRPC itself), and concurrent RPCs at ``grpc_max_concurrent_rpcs``
(beyond: RESOURCE_EXHAUSTED). An ``AuthInterceptor`` checks tokens per RPC; without the management API
(``management_address=off``) the Management service is not registered. Health answers from the live
registry state: the whole server (service ``""``) follows readiness (``serving.telemetry.health``: ``ping_requires``),
a model name is SERVING when that model is READY, and everything is NOT_SERVING while the server drains.
Stubs come from ``proto/gen`` (generated).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from importlib import metadata
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from rollcore.types import ModelState
from serving.auth import TokenAuthority
from serving.config.server_config import ServerConfig
from serving.frontends.grpc.auth_interceptor import AuthInterceptor
from serving.frontends.grpc.calls import FrontendContext, Registry, all_ready
from serving.frontends.grpc.oip import OipServicer
from serving.frontends.grpc.rollserve_v1 import GenerationServicer, ManagementServicer
from serving.frontends.proto.gen.inference import grpc_service_pb2 as oip_pb
from serving.frontends.proto.gen.inference import grpc_service_pb2_grpc as oip_grpc
from serving.frontends.proto.gen.rollserve.v1 import generate_pb2 as typed_pb
from serving.frontends.proto.gen.rollserve.v1 import generate_pb2_grpc as typed_grpc
from serving.telemetry.health import Health

log = logging.getLogger("serving.grpc")

SERVICE_NAMES = (
    oip_pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name,
    typed_pb.DESCRIPTOR.services_by_name["Generation"].full_name,
    typed_pb.DESCRIPTOR.services_by_name["Management"].full_name,
    health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
)
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


class HealthServicer(health_pb2_grpc.HealthServicer):
    """``grpc.health.v1.Health`` computed from the registry on each call (``Watch`` polls for changes)."""

    def __init__(self, ctx: FrontendContext, registry: Registry, watch_interval_s: float = 0.25,
                 health: Health | None = None) -> None:
        self.ctx = ctx
        self.registry = registry
        self.watch_interval_s = watch_interval_s
        self.health = health

    def status_of(self, service: str) -> int | None:
        """The status of ``service`` ("" = the server, a service name, or a model name); None if unknown."""
        ep = self.registry.endpoints.get(service)
        if service and service not in SERVICE_NAMES and ep is None:
            return None
        if self.ctx.state.draining:
            return NOT_SERVING
        if ep is not None:
            return SERVING if ep.state is ModelState.READY else NOT_SERVING
        if not service:
            ready = self.health.ready() if self.health is not None else all_ready(self.registry)
            return SERVING if ready else NOT_SERVING
        return SERVING

    async def Check(self, request: Any, context: grpc.aio.ServicerContext) -> health_pb2.HealthCheckResponse:
        status = self.status_of(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service or model {request.service!r}")
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request: Any, context: grpc.aio.ServicerContext
                    ) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        last = None
        while True:
            status = self.status_of(request.service)
            status = SERVICE_UNKNOWN if status is None else status
            if status != last:
                yield health_pb2.HealthCheckResponse(status=status)
                last = status
            await asyncio.sleep(self.watch_interval_s)


class GrpcFrontend:
    """Builds, starts and stops the gRPC server. Event-loop only."""

    def __init__(self, ctx: FrontendContext, registry: Registry, drain_timeout_s: float = 30.0, *,
                 authority: TokenAuthority | None = None, health: Health | None = None,
                 config: ServerConfig | None = None) -> None:
        self.ctx = ctx
        self.registry = registry
        self.drain_timeout_s = drain_timeout_s
        self.authority = authority or TokenAuthority("", "", enabled=False)
        self.health = health
        self.config = config or ServerConfig()
        self.server: grpc.aio.Server | None = None

    def build(self) -> grpc.aio.Server:
        size = self.ctx.max_request_size
        c = self.config
        server = grpc.aio.server(
            options=[("grpc.max_receive_message_length", size), ("grpc.max_send_message_length", size),
                     ("grpc.so_reuseport", 0)],
            interceptors=[AuthInterceptor(self.authority, c.management_enabled)],
            maximum_concurrent_rpcs=c.grpc_max_concurrent_rpcs)
        oip_grpc.add_GRPCInferenceServiceServicer_to_server(
            OipServicer(self.ctx, self.registry, self.drain_timeout_s, _version(), health=self.health,
                        max_stream_requests=c.grpc_max_stream_requests), server)
        typed_grpc.add_GenerationServicer_to_server(GenerationServicer(self.ctx, self.registry), server)
        names = SERVICE_NAMES
        if c.management_enabled:
            typed_grpc.add_ManagementServicer_to_server(
                ManagementServicer(self.ctx, self.registry, self.drain_timeout_s), server)
        else:
            names = tuple(n for n in SERVICE_NAMES if not n.endswith(".Management"))
        health_pb2_grpc.add_HealthServicer_to_server(HealthServicer(self.ctx, self.registry, health=self.health),
                                                     server)
        reflection.enable_server_reflection((*names, reflection.SERVICE_NAME), server)
        return server

    async def start(self, host: str, port: int) -> int:
        """Bind ``host:port`` (0 = ephemeral) and start serving; returns the bound port."""
        self.server = self.build()
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        bound = self.server.add_insecure_port(address)
        if bound == 0:
            raise OSError(f"cannot bind the gRPC address {address}")
        await self.server.start()
        return bound

    async def stop(self, grace: float = 1.0) -> None:
        """Stop accepting RPCs; in-flight ones get ``grace`` seconds, then are cancelled."""
        if self.server is not None:
            await self.server.stop(grace)
            self.server = None


def _version() -> str:
    try:
        return metadata.version("rollserve")
    except metadata.PackageNotFoundError:
        return "0.0.0"
