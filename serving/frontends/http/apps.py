"""Build the Starlette applications (inference, management) from route modules.

Unknown routes and wrong methods get the same JSON error shape as every other error; an unexpected
exception becomes a 500 with a request id and no traceback (the traceback goes to the log). Every answer carries
``X-Request-Id`` (the client's when it sent a usable one). ``ModelReads`` puts the management API's model reads on
the inference address as well, as DJL serves both APIs on one port (behind the management token still).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute
from starlette.types import ASGIApp

from serving.frontends.http.httpio import REQUEST_ID_HEADER, request_id

log = logging.getLogger("serving.http")

_TYPES = {404: "not_found", 405: "method_not_allowed", 413: "payload_too_large"}


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    rid = request_id(request)
    message = "no such route" if exc.status_code == 404 else str(exc.detail)
    return JSONResponse({"error": message, "error_type": _TYPES.get(exc.status_code, "invalid_request"),
                         "request_id": rid}, status_code=exc.status_code, headers={REQUEST_ID_HEADER: rid})


async def _internal_error(request: Request, exc: Exception) -> Response:
    rid = request_id(request)
    model = str(request.scope.get("state", {}).get("model", "-"))
    log.exception("request %s model %s failed: %s", rid, model, type(exc).__name__, exc_info=exc,
                  extra={"request_id": rid, "model": model})
    return JSONResponse({"error": "internal server error", "error_type": "internal_error", "request_id": rid},
                        status_code=500, headers={REQUEST_ID_HEADER: rid})


Receive = Callable[[], Awaitable[Any]]
Send = Callable[[Any], Awaitable[None]]


def build_app(routes: Sequence[BaseRoute]) -> ASGIApp:
    app = Starlette(routes=list(routes), exception_handlers={HTTPException: _http_error, Exception: _internal_error})
    return RequestIds(app)


class RequestIds:
    """Adds ``X-Request-Id`` to an answer that lacks one (``/ping``, ``/metrics``, the OpenAPI document)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: MutableMapping[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        name = REQUEST_ID_HEADER.lower().encode()
        given = dict(scope.get("headers") or ()).get(name, b"").decode("latin-1")
        rid = given if given and len(given) <= 128 and given.isascii() and given.isprintable() else uuid.uuid4().hex

        async def send_with_id(message: Any) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers") or ())
                if not any(k.lower() == name for k, _ in headers):
                    message = {**message, "headers": [*headers, (name, rid.encode("latin-1"))]}
            await send(message)
        await self.app(scope, receive, send_with_id)


class ModelReads:
    """``GET /models``, ``GET /models/{name}``, ``/models/{name}/all`` and ``/models/{name}/{version}`` go to
    ``management`` (its own guard: the management token); everything else to ``inference``."""

    def __init__(self, inference: ASGIApp, management: ASGIApp) -> None:
        self.inference = inference
        self.management = management

    async def __call__(self, scope: MutableMapping[str, Any], receive: Receive, send: Send) -> None:
        path = str(scope.get("path", ""))
        name = path[len("/models/"):] if path.startswith("/models/") else None
        head, _, tail = (name or "").partition("/")
        read = scope["type"] == "http" and scope.get("method") in ("GET", "HEAD") and (
            path == "/models" or (name is not None and head != "" and (
                "/" not in name or ("/" not in tail and (tail == "all" or tail.isdigit())))))
        await (self.management if read else self.inference)(scope, receive, send)
