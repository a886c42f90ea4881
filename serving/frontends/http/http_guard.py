"""ASGI guard in front of an HTTP API: token check, and (management) the browser and DNS-rebinding checks.

Design note: one middleware per listener, applied by the composition root. Health probes (``/ping``,
``/health/live``, ``/health/ready``, ``/health/generate``) pass without a token: orchestrators and SageMaker cannot
send one, and they reveal only model and worker states (the deep check's probes run at most once per
``health_generate_interval``). On the management API a request carrying an ``Origin`` header (a
browser page) is refused unless the origin is listed in ``management_allowed_origins`` (CSRF), and the
``Host`` header must be an IP literal, ``localhost`` or a name listed in ``management_allowed_hosts``
(DNS rebinding: a hostile page's own name resolving to 127.0.0.1), as Jupyter does. Refusals use the
server-wide error body: 401 + ``WWW-Authenticate: Bearer`` for a missing or wrong token, 403 otherwise; a route
whose API has its own error shape names a builder for it (``error_bodies``: path prefix -> body). On the inference
API the ``x-api-key`` header (Anthropic's clients) carries the token as well as ``Authorization: Bearer``.
"""

from __future__ import annotations

import ipaddress
import uuid
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any

from starlette.responses import JSONResponse

from serving.auth import Scope, TokenAuthority

# the OIP v2 probes too (KServe and Triton probe them: oip_rest)
HEALTH_PATHS = frozenset({"/ping", "/health/live", "/health/ready", "/health/generate", "/v2/health/live",
                          "/v2/health/ready"})

ErrorBody = Callable[[int, str, str], dict[str, Any]]  # (status, message, request id) -> the JSON body
ASGIApp = Callable[[MutableMapping[str, Any], Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]],
                   Awaitable[None]]


def host_allowed(host_header: str, allowed: tuple[str, ...]) -> bool:
    """True for an IP literal, ``localhost`` or a listed name (the port, if any, is ignored)."""
    host = host_header.strip().lower()
    if host.startswith("["):  # [::1]:8081
        host = host[1:host.find("]")] if "]" in host else host
    elif host.count(":") == 1:
        host = host.partition(":")[0]
    if host in ("localhost", *[a.lower() for a in allowed]):
        return True
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class ApiGuard:
    """Wraps an ASGI app; ``scope`` names the token it needs. ``browser_checks`` adds Origin/Host checks."""

    def __init__(self, app: ASGIApp, authority: TokenAuthority, scope: Scope, *, browser_checks: bool = False,
                 allowed_hosts: tuple[str, ...] = (), allowed_origins: tuple[str, ...] = (),
                 error_bodies: Sequence[tuple[str, ErrorBody]] = ()) -> None:
        self.app = app
        self.error_bodies = tuple(error_bodies)
        self.authority = authority
        self.scope = scope
        self.browser_checks = browser_checks
        self.allowed_hosts = allowed_hosts
        self.allowed_origins = frozenset(o.rstrip("/").lower() for o in allowed_origins)

    async def __call__(self, scope: MutableMapping[str, Any], receive: Callable[[], Awaitable[Any]],
                       send: Callable[[Any], Awaitable[None]]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
        refusal = self._refusal(scope.get("path", ""), headers)
        if refusal is None:
            await self.app(scope, receive, send)
            return
        status, error_type, message = refusal
        rid = headers.get("x-request-id", "")
        if not (rid and len(rid) <= 128 and rid.isascii() and rid.isprintable()):
            rid = uuid.uuid4().hex
        extra = {"WWW-Authenticate": f'Bearer realm="{self.scope.value}"'} if status == 401 else {}
        path = scope.get("path", "")
        own = next((build for prefix, build in self.error_bodies if path.startswith(prefix)), None)
        body = own(status, message, rid) if own is not None else {"error": message, "error_type": error_type,
                                                                   "request_id": rid}
        response = JSONResponse(body, status_code=status, headers={"X-Request-Id": rid, **extra})
        await response(scope, receive, send)

    def _refusal(self, path: str, headers: dict[str, str]) -> tuple[int, str, str] | None:
        if self.browser_checks:
            origin = headers.get("origin")
            if origin is not None and origin.rstrip("/").lower() not in self.allowed_origins:
                return 403, "forbidden", ("the management API refuses requests from browser pages (Origin "
                                          "header); list the origin in management_allowed_origins to allow it")
            host = headers.get("host", "")
            if host and not host_allowed(host, self.allowed_hosts):
                return 403, "forbidden", ("the management API answers only requests addressed to an IP address "
                                          "or localhost (DNS rebinding guard); list the host name in "
                                          "management_allowed_hosts to allow it")
        if path in HEALTH_PATHS or self.authority.allows(self.scope, headers.get("authorization")):
            return None
        api_key = headers.get("x-api-key") if self.scope is Scope.INFERENCE else None
        if api_key and self.authority.allows(self.scope, f"Bearer {api_key}"):
            return None
        which = "management" if self.scope is Scope.MANAGEMENT else "inference"
        given = "a wrong" if "authorization" in headers or api_key else "no"
        header = "'Authorization: Bearer <inference token>' or 'x-api-key: <inference token>'" \
            if self.scope is Scope.INFERENCE else f"'Authorization: Bearer <{which} token>'"
        return 401, "unauthorized", (f"the {which} API needs {header} ({given} token was given); the token is in "
                                     "the server's key file")
