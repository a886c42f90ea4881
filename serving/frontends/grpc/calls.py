"""gRPC plumbing shared by the servicers: the one error table, guards, deadlines, request ids, models.

Design note: every servicer method runs on the server's asyncio loop (``grpc.aio``). Core errors are
translated to status codes only here (``GRPC_CODE``), with the same messages as HTTP. A request whose
RPC ends early (client cancel, client deadline, a broken connection) has its ``ResultStream`` cancelled
in a ``finally``: the batcher dequeues it or the engine frees its KV blocks before its next step. The
client's deadline also travels into ``GenerationRequest.deadline`` so the scheduler aborts it on time.
"""

from __future__ import annotations

import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn, Protocol, TypeVar

import grpc

from rollcore.errors import ErrorKind, InvalidRequest, ServingError, Unavailable
from rollcore.types import GenerationResult, ModelState
from serving.batching.streams import ResultStream
from serving.models.endpoint_protocol import Endpoint, is_text_model
from serving.requests.params import Limits

log = logging.getLogger("serving.grpc")

GRPC_CODE: dict[ErrorKind, grpc.StatusCode] = {
    ErrorKind.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorKind.TOO_LARGE: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorKind.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorKind.METHOD: grpc.StatusCode.UNIMPLEMENTED,
    ErrorKind.UNAUTHORIZED: grpc.StatusCode.UNAUTHENTICATED,
    ErrorKind.FORBIDDEN: grpc.StatusCode.PERMISSION_DENIED,
    ErrorKind.CONFLICT: grpc.StatusCode.ALREADY_EXISTS,
    ErrorKind.OVERLOADED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorKind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorKind.TIMEOUT: grpc.StatusCode.DEADLINE_EXCEEDED,
    ErrorKind.CANCELLED: grpc.StatusCode.CANCELLED,
    ErrorKind.WORKER_FAILED: grpc.StatusCode.UNAVAILABLE,  # the worker restarts: a retry may succeed
    ErrorKind.HANDLER: grpc.StatusCode.INTERNAL,
    ErrorKind.INTERNAL: grpc.StatusCode.INTERNAL,
}
MAX_OPTION_VALUE = 999_999_999  # registration options: what the HTTP API's 9 ASCII digits allow
# RegisterModel / RepositoryModelLoad option -> serving.properties key (same names as the HTTP API).
REGISTER_OVERRIDES = {"batch_size": "batch_size", "max_batch_delay": "max_batch_delay",
                      "max_batch_delay_ms": "max_batch_delay", "min_worker": "minWorkers",
                      "min_workers": "minWorkers", "max_worker": "maxWorkers", "max_workers": "maxWorkers",
                      "job_queue_size": "job_queue_size"}


class Registry(Protocol):
    """What the gRPC servicers need from the model registry."""

    @property
    def endpoints(self) -> Mapping[str, Endpoint]: ...
    @property
    def model_store(self) -> Path: ...
    def get(self, name: str) -> Endpoint: ...
    def versions_of(self, name: str) -> list[str]: ...
    def all_endpoints(self) -> Sequence[tuple[str, str, Endpoint]]: ...
    def resolve_url(self, url: str) -> Path: ...
    async def register(self, name: str, model_dir: Path, overrides: Mapping[str, str] = {},
                       wait: bool = True) -> Any: ...
    async def unregister(self, name: str, drain_timeout_s: float) -> None: ...
    async def scale(self, name: str, num_workers: int) -> Any: ...
    async def update_model(self, name: str, values: Mapping[str, int]) -> dict[str, Any]: ...
    def require_model_api(self, what: str) -> None: ...


class FrontendContext(Protocol):
    """The shared frontend context built by the composition root (``HttpContext`` satisfies it)."""

    @property
    def registry(self) -> Any: ...
    @property
    def state(self) -> Any: ...
    @property
    def limits(self) -> Limits: ...
    @property
    def max_request_size(self) -> int: ...


def code_of(exc: ServingError) -> grpc.StatusCode:
    return GRPC_CODE.get(exc.kind, grpc.StatusCode.INTERNAL)


async def abort(context: grpc.aio.ServicerContext, exc: ServingError) -> NoReturn:
    """End the RPC with the status of ``exc`` (``retry-after`` trailer when the error has one)."""
    if exc.retry_after_s is not None:
        context.set_trailing_metadata((("retry-after", str(exc.retry_after_s)),))
    await context.abort(code_of(exc), exc.message)
    raise AssertionError("unreachable")  # context.abort raises


R = TypeVar("R")
Handler = Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable[R]]


def guarded(fn: Handler[R]) -> Handler[R]:
    """A unary method whose ServingErrors become statuses; any other exception is logged -> INTERNAL."""
    @functools.wraps(fn)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> R:
        try:
            return await fn(self, request, context)
        except grpc.aio.AbortError:
            raise
        except ServingError as exc:
            await abort(context, exc)
        except Exception:  # noqa: BLE001 - one bad request fails one request
            log.exception("gRPC %s failed", fn.__name__)
            await context.abort(grpc.StatusCode.INTERNAL, "internal error")
        raise AssertionError("unreachable")
    return wrapper


StreamHandler = Callable[[Any, Any, grpc.aio.ServicerContext], AsyncIterator[R]]


def guarded_stream(fn: StreamHandler[R]) -> StreamHandler[R]:
    """``guarded`` for server-streaming methods (async generators)."""
    @functools.wraps(fn)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[R]:
        try:
            async for item in fn(self, request, context):
                yield item
        except grpc.aio.AbortError:
            raise
        except ServingError as exc:
            await abort(context, exc)
        except Exception:  # noqa: BLE001
            log.exception("gRPC %s failed", fn.__name__)
            await context.abort(grpc.StatusCode.INTERNAL, "internal error")
    return wrapper


def deadline_of(context: grpc.aio.ServicerContext, clock: Callable[[], float] = time.monotonic) -> float | None:
    """The client's deadline as an absolute ``time.monotonic()`` value, or None without one."""
    remaining = context.time_remaining()
    return None if remaining is None else clock() + max(0.0, remaining)


def new_request_id(candidate: str = "") -> str:
    """The client's id when it is short printable ASCII (as X-Request-Id on HTTP), else a fresh one."""
    if candidate and len(candidate) <= 128 and candidate.isascii() and candidate.isprintable():
        return candidate
    return uuid.uuid4().hex


def check_serving(ctx: FrontendContext) -> None:
    if ctx.state.draining:
        raise Unavailable("server is shutting down", retry_after_s=5)


def strict_parameters(ep: Endpoint) -> bool:
    """Unknown parameters are refused for text models with ``option.strict_parameters=true`` (else dropped)."""
    return is_text_model(ep) and str(ep.options.get("strict_parameters", "false")).lower() == "true"


def require_streaming(ep: Endpoint) -> None:
    if not ep.rolling:
        raise InvalidRequest("'stream' needs a rolling-batch model (set option.rolling_batch=auto); "
                             f"model {ep.name!r} uses dynamic batching")


async def collect(stream: ResultStream) -> GenerationResult:
    """The whole answer; an RPC that ends first (cancel, deadline) cancels the request."""
    try:
        return await stream.collect()
    finally:
        if not stream.done:
            stream.cancel()


def all_ready(registry: Any) -> bool:
    return all(ep.state is ModelState.READY for ep in registry.endpoints.values())


def batching_of(ep: Endpoint) -> str:
    """``rolling`` or ``dynamic``; empty for a model whose configuration failed."""
    if ep.config is None:
        return ""
    return "rolling" if ep.rolling else "dynamic"


def register_overrides(options: Mapping[str, int]) -> dict[str, str]:
    """Register options (non-negative integers) -> serving.properties overrides."""
    out: dict[str, str] = {}
    for name, value in options.items():
        key = REGISTER_OVERRIDES.get(name)
        if key is None:
            raise InvalidRequest(f"unknown parameter {name!r}; known: {', '.join(sorted(REGISTER_OVERRIDES))}")
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_OPTION_VALUE:
            raise InvalidRequest(f"parameter {name!r} must be an integer between 0 and {MAX_OPTION_VALUE}, "
                                 f"got {value!r}")
        out[key] = str(value)
    return out


async def register_model(registry: Registry, name: str, url: str, overrides: dict[str, str],
                         wait: bool) -> Any:
    """Register a model folder of the model store; a synchronous load that fails -> Unavailable."""
    registry.require_model_api("registering a model")
    if not url:
        raise InvalidRequest("'url' is required (a folder inside the model store)")
    model_dir = registry.resolve_url(url)
    name = name or model_dir.name
    ep = await registry.register(name, model_dir, overrides, wait=wait)
    if wait and ep.state is ModelState.FAILED:
        raise Unavailable(f"model {name!r} failed to load: {ep.reason}")
    return ep

