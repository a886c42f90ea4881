"""DJL LMI's adapter API on the management listener: LoRA adapters of a live model, registered at run time.

    POST   /models/{model}/adapters?name=NAME&src=SRC      register (SRC: a folder inside the model store,
                                                           s3://bucket/prefix or a hub id org/name[@revision])
    GET    /models/{model}/adapters                        the model's adapters (its own and registered)
    GET    /models/{model}/adapters/{name}                 one of them
    DELETE /models/{model}/adapters/{name}                 unregister (requests running on it finish)

Registering reads files from the server's disk or fetches them (``serving.models.adapter_source``), so it needs
``enable_model_api`` like registering a model; listing needs only the management token.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from rollcore.errors import InvalidRequest, ModelNotFound, ServingError
from serving.frontends.http.httpio import REQUEST_ID_HEADER, error_response, request_id
from serving.models.adapter_source import FORMS
from serving.models.adapters import ApiAdapters
from serving.models.endpoint_protocol import Endpoint


class AdapterRoutes:
    def __init__(self, registry: Any) -> None:
        self.registry = registry

    def routes(self) -> list[Route]:
        return [Route("/models/{model}/adapters", self.register, methods=["POST"]),
                Route("/models/{model}/adapters", self.list, methods=["GET"]),
                Route("/models/{model}/adapters/{name}", self.describe, methods=["GET"]),
                Route("/models/{model}/adapters/{name}", self.unregister, methods=["DELETE"])]

    async def _guard(self, request: Request, fn: Callable[[], Awaitable[dict[str, Any]]]) -> Response:
        rid = request_id(request)
        try:
            return JSONResponse(await fn(), headers={REQUEST_ID_HEADER: rid})
        except ServingError as exc:
            return error_response(exc, rid)

    def _endpoint(self, request: Request) -> tuple[Endpoint, ApiAdapters]:
        ep = self.registry.get(request.path_params["model"])
        api = ep.adapters
        if api is None or "adapters" not in ep.info:
            raise InvalidRequest(f"model {ep.name!r} does not serve LoRA adapters: they run on the rolling engine "
                                 "(option.rolling_batch with option.enable_lora)")
        return ep, api

    def _entries(self, ep: Endpoint, api: ApiAdapters) -> list[dict[str, str]]:
        registered = api.registered
        return [{"name": n, "src": "api" if n in registered else "model folder"} for n in ep.info["adapters"]]

    async def register(self, request: Request) -> Response:
        async def run() -> dict[str, Any]:
            self.registry.require_model_api("registering a LoRA adapter")
            ep, api = self._endpoint(request)
            name, src = request.query_params.get("name"), request.query_params.get("src")
            if not name or not src:
                raise InvalidRequest(f"query parameters 'name' and 'src' are required (src: {FORMS})")
            if name in self.registry.endpoints:
                raise InvalidRequest(f"adapter name {name!r} is a model's name (OpenAI's 'model' could not pick it)")
            builtin = [n for n in ep.info["adapters"] if n not in api.registered]
            api.check_name(name, builtin)  # before anything is fetched
            folder = await self.registry.adapter_folder(ep.name, name, src)
            await api.register(name, str(folder), builtin)
            return {"status": f"adapter {name!r} registered for model {ep.name!r}", "adapters": self._entries(ep, api)}
        return await self._guard(request, run)

    async def list(self, request: Request) -> Response:
        async def run() -> dict[str, Any]:
            ep, api = self._endpoint(request)
            return {"model": ep.name, "adapters": self._entries(ep, api)}
        return await self._guard(request, run)

    async def describe(self, request: Request) -> Response:
        async def run() -> dict[str, Any]:
            ep, api = self._endpoint(request)
            name = request.path_params["name"]
            for entry in self._entries(ep, api):
                if entry["name"] == name:
                    return {"model": ep.name, **entry}
            raise ModelNotFound(f"LoRA adapter {name!r} is not registered for model {ep.name!r}")
        return await self._guard(request, run)

    async def unregister(self, request: Request) -> Response:
        async def run() -> dict[str, Any]:
            self.registry.require_model_api("unregistering a LoRA adapter")
            ep, api = self._endpoint(request)
            await api.unregister(request.path_params["name"])
            return {"status": f"adapter {request.path_params['name']!r} unregistered from model {ep.name!r}"}
        return await self._guard(request, run)
