"""Build the Starlette applications (inference, management) from route modules.

Unknown routes and wrong methods get the same JSON error shape as every other error; an unexpected
exception becomes a 500 with a request id and no traceback (the traceback goes to the log).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute

from serving.frontends.httpio import REQUEST_ID_HEADER, request_id

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


def build_app(routes: Sequence[BaseRoute]) -> Starlette:
    return Starlette(routes=list(routes), exception_handlers={HTTPException: _http_error, Exception: _internal_error})
