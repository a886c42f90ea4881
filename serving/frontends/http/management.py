"""Management API (DJL/TorchServe shape) on its own address.

``GET /models``, ``GET /models/{name}`` (DJL's shape: ``serving.frontends.http.djl``),
``POST /models?url=&model_name=&batch_size=&max_batch_delay=&
min_worker=&max_worker=&synchronous=``, ``PUT /models/{name}?batch_size=&max_batch_delay=&
max_rolling_batch_size=&max_rolling_batch_prefill_tokens=&job_queue_size=&min_worker=&max_worker=``,
``DELETE /models/{name}``, ``DELETE /requests/{request_id}``, ``GET /ping``. Registration only accepts a
folder inside the model store (the registry enforces it). Registering, scaling (``min_worker``/``max_worker``
of a PUT) and unregistering need ``enable_model_api=true`` (403 otherwise; the registry decides); the other
knobs of a PUT change a live model with the management token alone (``serving.models.knobs``). Query integers are
ASCII digits only. ``DELETE /requests/{id}`` cancels by the client's id (``X-Request-Id``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from rollcore.errors import InvalidRequest, ModelNotFound, ServingError
from serving.frontends.http.djl import describe_model
from serving.frontends.http.httpio import REQUEST_ID_HEADER, HttpContext, error_response, request_id
from serving.models import knobs
from serving.models.endpoint_protocol import Endpoint
from serving.models.resident import residency_entry


class Registry(Protocol):
    endpoints: dict[str, Any]
    live: Any  # serving.models.live_requests.LiveRequests
    startup_models: set[str] | None

    def get(self, name: str) -> Any: ...
    def versions_of(self, name: str) -> list[str]: ...
    def version_info(self, ep: Endpoint) -> dict[str, Any]: ...
    def resolve_url(self, url: str) -> Any: ...
    async def register(self, name: str, model_dir: Any, overrides: dict[str, str], wait: bool = True) -> Any: ...
    async def unregister(self, name: str, drain_timeout_s: float) -> None: ...
    async def update_model(self, name: str, values: dict[str, int]) -> dict[str, Any]: ...
    def require_model_api(self, what: str) -> None: ...


_REGISTER_OVERRIDES = {"batch_size": "batch_size", "max_batch_delay": "max_batch_delay",
                       "min_worker": "minWorkers", "max_worker": "maxWorkers", "job_queue_size": "job_queue_size"}


def _int_param(request: Request, name: str) -> int | None:
    v = request.query_params.get(name)
    if v is None:
        return None
    if not (v.isascii() and v.isdigit()) or len(v) > 9:
        raise InvalidRequest(f"query parameter {name!r} must be a non-negative integer (ASCII digits, at most "
                             f"9), got {v!r}")
    return int(v)


def _folder(ep: Endpoint) -> str:
    return str(ep.config.model_dir.name) if ep.config is not None else ep.name


class ManagementRoutes:
    def __init__(self, ctx: HttpContext, registry: Registry, drain_timeout_s: float,
                 metrics_route: Callable[[Request], Any] | None = None) -> None:
        self.ctx = ctx
        self.registry = registry
        self.drain_timeout_s = drain_timeout_s
        self.metrics_route = metrics_route

    def read_routes(self) -> list[Route]:
        return [Route("/models", self.list_models, methods=["GET"]),
                Route("/models/{name}", self.describe, methods=["GET"])]

    def routes(self) -> list[Route]:
        routes = [*self.read_routes(),
                  Route("/models", self.register, methods=["POST"]),
                  Route("/models/{name}", self.update, methods=["PUT"]),
                  Route("/models/{name}", self.unregister, methods=["DELETE"]),
                  Route("/requests/{request_id}", self.cancel_request, methods=["DELETE"])]
        if self.metrics_route is not None:
            routes.append(Route("/metrics", self.metrics_route, methods=["GET"]))
        return routes

    async def _guard(self, request: Request, fn: Callable[[], Any]) -> Response:
        rid = request_id(request)
        try:
            body, status = await fn()
        except ServingError as exc:
            return error_response(exc, rid)
        return JSONResponse(body, status_code=status, headers={REQUEST_ID_HEADER: rid})

    async def list_models(self, request: Request) -> Response:
        async def run() -> tuple[Any, int]:
            return {"models": [{"modelName": n, "modelUrl": _folder(ep), "status": ep.state.value,
                                "version": ep.version, "versions": self.registry.versions_of(n),
                                **residency_entry(ep)}
                               for n, ep in sorted(self.registry.endpoints.items())]}, 200
        return await self._guard(request, run)

    async def describe(self, request: Request) -> Response:
        async def run() -> tuple[Any, int]:
            ep = self.registry.get(request.path_params["name"])
            return describe_model(ep, ep.name in (self.registry.startup_models or ()),
                                  self.registry.version_info(ep)), 200
        return await self._guard(request, run)

    async def register(self, request: Request) -> Response:
        async def run() -> tuple[Any, int]:
            self.registry.require_model_api("registering a model")
            url = request.query_params.get("url")
            if not url:
                raise InvalidRequest("query parameter 'url' is required (a folder inside the model store)")
            model_dir = self.registry.resolve_url(url)
            name = request.query_params.get("model_name") or model_dir.name
            overrides = {}
            for q, key in _REGISTER_OVERRIDES.items():
                v = _int_param(request, q)
                if v is not None:
                    overrides[key] = str(v)
            sync = request.query_params.get("synchronous", "true").lower() != "false"
            ep = await self.registry.register(name, model_dir, overrides, wait=sync)
            status = ep.state.value
            if sync and status == "FAILED":
                return {"status": f"model {name!r} failed to load", "reason": ep.reason, "modelName": name}, 503
            return {"status": f"model {name!r} registered", "modelName": name, "state": status}, \
                200 if sync else 202
        return await self._guard(request, run)

    async def update(self, request: Request) -> Response:
        """Change knobs of a live model (``serving.models.knobs``): every one checked before any changes."""
        async def run() -> tuple[Any, int]:
            values = knobs.parse_query(request.query_params.multi_items())
            return await self.registry.update_model(request.path_params["name"], values), 200
        return await self._guard(request, run)

    async def unregister(self, request: Request) -> Response:
        async def run() -> tuple[Any, int]:
            name = request.path_params["name"]
            await self.registry.unregister(name, self.drain_timeout_s)
            return {"status": f"model {name!r} unregistered"}, 200
        return await self._guard(request, run)

    async def cancel_request(self, request: Request) -> Response:
        async def run() -> tuple[Any, int]:
            rid = request.path_params["request_id"]
            found = self.registry.live.find(rid)
            if found is not None and found[0].cancel(found[1]):
                return {"status": f"request {rid!r} cancelled"}, 200
            raise ModelNotFound(f"request {rid!r} is not queued or running")
        return await self._guard(request, run)

