"""SageMaker stateful sessions on ``POST /invocations``.

Design note: as AWS describes the feature, the model server owns the sessions. A body ``{"requestType":
"NEW_SESSION"}`` creates one and answers ``X-Amzn-SageMaker-New-Session-Id: <id>; Expires=<ISO 8601 UTC time>``;
a request carrying ``X-Amzn-SageMaker-Session-Id: <id>`` runs in it, and ``{"requestType": "CLOSE"}`` with that
header closes it, answering ``X-Amzn-SageMaker-Closed-Session-Id: <id>``. An unknown, closed or expired id is a 400
naming the header. A session belongs to the model it was opened on (``?model_name=``, or the one model served).

The session's requests are ordinary ``/invocations`` requests (LMI, OpenAI chat or completions bodies) served by
``lmi.LmiRoutes``; what the session adds is where they run: their requests carry the session id as their affinity key
(``httpio.AFFINITY``), so the rolling batcher sends them to one worker, whose prefix cache still holds the earlier
turns (a dead worker's sessions move to another one). Answers name the worker in ``X-Worker-Id``.

Sessions are bounded: at most ``max_sessions`` open at once (another NEW_SESSION is a 503 until one closes or
expires) and each lives ``ttl_s`` seconds from its creation, the time its ``Expires`` announces (defaults: 1000
sessions, 20 minutes; ``SessionStore``'s constructor arguments). The store lives in this frontend process, one per
server, on the event loop.
"""

from __future__ import annotations

import collections
import datetime
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from rollcore.errors import InvalidRequest, Overloaded, ServingError
from serving.frontends.http.httpio import (
    AFFINITY,
    REQUEST_ID_HEADER,
    HttpContext,
    error_response,
    note_model,
    read_json,
    request_id,
)
from serving.frontends.http.lmi import LmiRoutes

SESSION_HEADER = "X-Amzn-SageMaker-Session-Id"
NEW_SESSION_HEADER = "X-Amzn-SageMaker-New-Session-Id"
CLOSED_SESSION_HEADER = "X-Amzn-SageMaker-Closed-Session-Id"
NEW_SESSION = "NEW_SESSION"
CLOSE = ("CLOSE", "CLOSE_SESSION")  # AWS's example container's word, and the longer one some clients send
DEFAULT_MAX_SESSIONS = 1000
DEFAULT_TTL_S = 20 * 60.0


@dataclass(frozen=True, slots=True)
class Session:
    id: str
    model: str  # the model it was opened on
    expires_at: float  # wall-clock time (seconds since the epoch)

    @property
    def expires(self) -> str:
        """``Expires`` as the header writes it: ISO 8601, UTC, whole seconds."""
        moment = datetime.datetime.fromtimestamp(self.expires_at, tz=datetime.timezone.utc)
        return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


class SessionStore:
    """Open sessions, oldest first: at most ``max_sessions``, each for ``ttl_s`` seconds after its creation."""

    def __init__(self, max_sessions: int = DEFAULT_MAX_SESSIONS, ttl_s: float = DEFAULT_TTL_S,
                 clock: Callable[[], float] = time.time,
                 on_end: Callable[[Session], None] | None = None) -> None:
        if max_sessions < 1 or ttl_s <= 0:
            raise ValueError("max_sessions must be >= 1 and ttl_s > 0")
        self.max_sessions = max_sessions
        self.ttl_s = ttl_s
        self._clock = clock
        self._on_end = on_end  # a session closed or expired (its worker is forgotten)
        self._open: collections.OrderedDict[str, Session] = collections.OrderedDict()

    def __len__(self) -> int:
        self._expire()
        return len(self._open)

    def open(self, model: str) -> Session:
        """A new session on ``model``; ``Overloaded`` (503) when ``max_sessions`` are open."""
        self._expire()
        if len(self._open) >= self.max_sessions:
            oldest = next(iter(self._open.values()))
            raise Overloaded(f"{self.max_sessions} sessions are open (the most this server keeps): close one with "
                             "{\"requestType\": \"CLOSE\"}", retry_after_s=max(1, int(oldest.expires_at -
                                                                                     self._clock()) + 1))
        session = Session(uuid.uuid4().hex, model, self._clock() + self.ttl_s)
        self._open[session.id] = session
        return session

    def get(self, session_id: str, model: str) -> Session:
        """The open session ``session_id`` of ``model``; ``InvalidRequest`` naming the header otherwise."""
        self._expire()
        session = self._open.get(session_id)
        if session is None:
            raise InvalidRequest(f"{SESSION_HEADER} names no open session: {session_id[:64]!r} is unknown, closed or "
                                 f"expired (sessions last {self.ttl_s:g}s); open one with "
                                 "{\"requestType\": \"NEW_SESSION\"}")
        if session.model != model:
            raise InvalidRequest(f"{SESSION_HEADER} names a session of model {session.model!r}, not of {model!r}")
        return session

    def close(self, session_id: str, model: str) -> Session:
        session = self.get(session_id, model)
        del self._open[session_id]
        self._ended(session)
        return session

    def _expire(self) -> None:
        now = self._clock()
        while self._open:
            session = next(iter(self._open.values()))  # every session lives ttl_s: the oldest expires first
            if session.expires_at > now:
                return
            del self._open[session.id]
            self._ended(session)

    def _ended(self, session: Session) -> None:
        if self._on_end is not None:
            self._on_end(session)


class SessionRoutes:
    """``POST /invocations`` with SageMaker's session requests; every other request goes to ``lmi`` as it is."""

    def __init__(self, ctx: HttpContext, lmi: LmiRoutes, store: SessionStore | None = None) -> None:
        self.ctx = ctx
        self.lmi = lmi
        self.store = store if store is not None else SessionStore(on_end=self._forget)

    def routes(self) -> list[Route]:
        """Mounted before the LMI routes: this ``/invocations`` wins and hands plain requests on."""
        return [Route("/invocations", self.invocations, methods=["POST"])]

    async def invocations(self, request: Request) -> Response:
        rid = request_id(request)
        try:
            header = _session_header(request)
            body = await read_json(request, self.ctx.max_request_size)
            kind = body.get("requestType") if isinstance(body, dict) else None
            if kind is None and header is None:
                return await self.lmi.invocations_of(request, body)
            model = self._model(request)
            if kind == NEW_SESSION:
                session = self.store.open(model)
                return JSONResponse({"session_id": session.id, "expires": session.expires, "model": model},
                                    headers={REQUEST_ID_HEADER: rid,
                                             NEW_SESSION_HEADER: f"{session.id}; Expires={session.expires}"})
            if kind in CLOSE:
                if header is None:
                    raise InvalidRequest(f"{{\"requestType\": {kind!r}}} needs the header {SESSION_HEADER} naming "
                                         "the session to close")
                session = self.store.close(header, model)
                return JSONResponse({"session_id": session.id, "closed": True},
                                    headers={REQUEST_ID_HEADER: rid, CLOSED_SESSION_HEADER: session.id})
            if kind is not None:
                raise InvalidRequest(f"'requestType' must be {NEW_SESSION!r} or 'CLOSE', got {str(kind)[:64]!r}")
            assert header is not None
            session = self.store.get(header, model)
        except ServingError as exc:
            return error_response(exc, rid)
        token = AFFINITY.set(session.id)  # every request the handler queues runs on the session's worker
        try:
            return await self.lmi.invocations_of(request, body)
        finally:
            AFFINITY.reset(token)

    def _model(self, request: Request) -> str:
        """The name of the model the request is for (as ``/invocations`` resolves it)."""
        name = request.query_params.get("model_name")
        ep = self.ctx.registry.get(name) if name else self.ctx.registry.only()
        note_model(request, ep)  # the metrics labels: the model and its version
        return str(ep.name)

    def _forget(self, session: Session) -> None:
        ep = self.ctx.registry.endpoints.get(session.model)
        if ep is not None:
            ep.forget_affinity(session.id)


def _session_header(request: Request) -> str | None:
    value = request.headers.get(SESSION_HEADER)
    if value is None:
        return None
    if not value or len(value) > 256 or not value.isascii() or not value.isprintable():
        raise InvalidRequest(f"{SESSION_HEADER} must be a session id (1 to 256 printable ASCII characters)")
    return value
