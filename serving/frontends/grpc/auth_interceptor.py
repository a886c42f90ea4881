"""gRPC server interceptor: token authorization per RPC, and the management switch.

Design note: every RPC is classified by its full method name. Management RPCs (the ``rollserve.v1.Management``
service and the OIP repository extension) need the management token in the ``authorization`` metadata
(``Bearer <token>``), and are UNIMPLEMENTED when ``management_address=off``; inference RPCs need the
inference token when inference authorization is on; health, readiness/liveness and reflection are open
(probes cannot send tokens). A refusal replaces the method's handler by one of the same shape that aborts
with UNAUTHENTICATED, so the servicer never runs.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from serving.auth import Scope, TokenAuthority

OPEN_METHODS = frozenset({"/inference.GRPCInferenceService/ServerLive",
                          "/inference.GRPCInferenceService/ServerReady",
                          "/inference.GRPCInferenceService/ModelReady"})
OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/",
                 "/grpc.reflection.v1.ServerReflection/")
MANAGEMENT_PREFIXES = ("/rollserve.v1.Management/", "/inference.GRPCInferenceService/Repository")


def scope_of(method: str) -> Scope | None:
    """The token an RPC needs (None: open to all)."""
    if method in OPEN_METHODS or method.startswith(OPEN_SERVICES):
        return None
    if method.startswith(MANAGEMENT_PREFIXES):
        return Scope.MANAGEMENT
    return Scope.INFERENCE


def _metadata(details: grpc.HandlerCallDetails, key: str) -> str | None:
    for k, v in details.invocation_metadata or ():
        if k == key:
            return v if isinstance(v, str) else bytes(v).decode("latin-1")
    return None


def _refusing(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler of ``handler``'s shape that aborts every call with ``code``."""
    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, message)

    async def streaming(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await context.abort(code, message)
        yield None  # pragma: no cover - abort raises

    kw = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(streaming, **kw)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary, **kw)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(streaming, **kw)
    return grpc.unary_unary_rpc_method_handler(unary, **kw)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Checks each RPC's token before its servicer runs."""

    def __init__(self, authority: TokenAuthority, management_enabled: bool = True) -> None:
        self.authority = authority
        self.management_enabled = management_enabled

    async def intercept_service(
            self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
            details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        scope = scope_of(details.method)
        if handler is None or scope is None:
            return handler
        if scope is Scope.MANAGEMENT and not self.management_enabled:
            return _refusing(handler, grpc.StatusCode.UNIMPLEMENTED,
                             "the management API is off (management_address=off)")
        if not self.authority.allows(scope, _metadata(details, "authorization")):
            which = scope.value
            return _refusing(handler, grpc.StatusCode.UNAUTHENTICATED,
                             f"this RPC needs the {which} token: metadata 'authorization: Bearer <{which} token>'")
        return handler
