"""HTTP routes of model versions and reloads (TorchServe's shapes), beside the LMI and management routes.

Inference: ``POST /predictions/{name}/{version}`` is LMI's ``/predictions/{name}`` on that version (the LMI route
serves it with the name ``NAME:VERSION``, which every frontend's ``model`` field accepts as well).
Management (its token): ``GET /models/{name}/all`` (every version, DJL's description each), ``GET
/models/{name}/{version}``, ``PUT /models/{name}/{version}/set-default``, ``PUT /models/{name}/reload`` and ``PUT
/models/{name}/{version}/reload`` (zero-downtime reload, ``serving.models.reload``: 200 once the new workers serve; 500
with the reason when they could not, the old ones still serving), ``DELETE /models/{name}/{version}`` (the model
API, as unregistering).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from rollcore.errors import ServingError
from serving.frontends.http.djl import describe_model
from serving.frontends.http.httpio import REQUEST_ID_HEADER, error_response, request_id
from serving.models.endpoint_protocol import Endpoint
from serving.models.reload import ReloadFailed
from serving.models.versions import check_version

RouteHandler = Callable[[Request], Awaitable[Response]]


class VersionRoutes:
    """``registry``: a ``serving.models.registry.ModelRegistry``; ``predictions``: LMI's
    ``/predictions/{model_name}``."""

    def __init__(self, registry: Any, drain_timeout_s: float, predictions: RouteHandler | None = None) -> None:
        self.registry = registry
        self.drain_timeout_s = drain_timeout_s
        self.predictions = predictions

    def inference_routes(self) -> list[Route]:
        return [Route("/predictions/{model_name}/{version}", self.predict, methods=["POST"])]

    def management_routes(self) -> list[Route]:
        return [Route("/models/{name}/all", self.all_versions, methods=["GET"]),
                Route("/models/{name}/reload", self.reload, methods=["PUT"]),
                Route("/models/{name}/{version}/reload", self.reload, methods=["PUT"]),
                Route("/models/{name}/{version}/set-default", self.set_default, methods=["PUT"]),
                Route("/models/{name}/{version}", self.describe_version, methods=["GET"]),
                Route("/models/{name}/{version}", self.unregister_version, methods=["DELETE"])]

    async def predict(self, request: Request) -> Response:
        assert self.predictions is not None
        params = request.path_params
        try:
            version = check_version(params["version"])
        except ServingError as exc:
            return error_response(exc, request_id(request))
        params["model_name"] = f"{params['model_name']}:{version}"
        return await self.predictions(request)

    async def _answer(self, request: Request, fn: Callable[[], Awaitable[tuple[Any, int]]]) -> Response:
        rid = request_id(request)
        try:
            body, status = await fn()
        except ReloadFailed as exc:
            body = {"error": exc.message, "error_type": "reload_failed", "modelName": exc.name,
                    "version": exc.version, "request_id": rid}
            return JSONResponse(body, status_code=500, headers={REQUEST_ID_HEADER: rid})
        except ServingError as exc:
            return error_response(exc, rid)
        return JSONResponse(body, status_code=status, headers={REQUEST_ID_HEADER: rid})

    def _ref(self, request: Request) -> str:
        name = request.path_params["name"]
        version = request.path_params.get("version")
        return name if version is None else f"{name}:{check_version(version)}"

    def _describe(self, ep: Endpoint) -> list[dict[str, Any]]:
        startup = ep.name in (self.registry.startup_models or ())
        return describe_model(ep, startup, self.registry.version_info(ep))

    async def all_versions(self, request: Request) -> Response:
        async def run() -> tuple[Any, int]:
            name = request.path_params["name"]
            self.registry.lookup(name)  # 404 for an unknown model
            eps = [ep for n, _, ep in self.registry.all_endpoints() if n == name]
            return [workflow for ep in eps for workflow in self._describe(ep)], 200
        return await self._answer(request, run)

    async def describe_version(self, request: Request) -> Response:
        async def run() -> tuple[Any, int]:
            return self._describe(self.registry.lookup(self._ref(request))), 200
        return await self._answer(request, run)

    async def set_default(self, request: Request) -> Response:
        async def run() -> tuple[Any, int]:
            return self.registry.set_default(request.path_params["name"], request.path_params["version"]), 200
        return await self._answer(request, run)

    async def reload(self, request: Request) -> Response:
        async def run() -> tuple[Any, int]:
            return await self.registry.reload(self._ref(request)), 200
        return await self._answer(request, run)

    async def unregister_version(self, request: Request) -> Response:
        async def run() -> tuple[Any, int]:
            ref = self._ref(request)
            await self.registry.unregister(ref, self.drain_timeout_s)
            return {"status": f"model {request.path_params['name']!r} version "
                              f"{ref.partition(':')[2]} unregistered"}, 200
        return await self._answer(request, run)
