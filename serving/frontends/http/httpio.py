"""HTTP plumbing shared by every HTTP route module: errors, bodies, request ids, timings, disconnects.

Design note: the one table mapping core ``ErrorKind`` to HTTP status lives here (``STATUS``). Bodies are
read with the size limit decided from ``Content-Length`` before reading (413), decoded as strict UTF-8
JSON (no NaN/Infinity). A whole-answer request is raced against the client's disconnect so a client
that leaves aborts its request (queue removal or KV blocks freed) instead of wasting a slot.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor
from contextvars import ContextVar
from dataclasses import dataclass, replace
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import JSONResponse

from rollcore.errors import ErrorKind, InvalidRequest, ModelNotFound, PayloadTooLarge, ServingError, Unavailable
from rollcore.types import GenerationRequest, GenerationResult, RequestTimings
from serving.batching.streams import ResultStream
from serving.models.endpoint_protocol import Endpoint
from serving.requests.deadlines import with_headers
from serving.requests.params import Limits
from serving.requests.validation import type_error

log = logging.getLogger("serving.http")

STATUS: dict[ErrorKind, int] = {
    ErrorKind.INVALID: 400,
    ErrorKind.TOO_LARGE: 413,
    ErrorKind.NOT_FOUND: 404,
    ErrorKind.METHOD: 405,
    ErrorKind.UNAUTHORIZED: 401,
    ErrorKind.FORBIDDEN: 403,
    ErrorKind.CONFLICT: 409,
    ErrorKind.OVERLOADED: 503,
    ErrorKind.UNAVAILABLE: 503,
    ErrorKind.TIMEOUT: 504,
    ErrorKind.CANCELLED: 499,
    ErrorKind.WORKER_FAILED: 502,
    ErrorKind.HANDLER: 424,
    ErrorKind.INTERNAL: 500,
}
REQUEST_ID_HEADER = "X-Request-Id"
IGNORED_HEADER = "X-Ignored-Parameters"  # unknown request fields dropped (option.strict_parameters=false)


def strict_parameters(ep: Endpoint) -> bool:
    """Whether unknown request fields are a 400 on ``ep`` (``option.strict_parameters``; default: ignored, as
    DJL and vLLM do)."""
    return str(ep.options.get("strict_parameters", "false")).lower() == "true"


def ignored_headers(names: Sequence[str], rid: str, model: str) -> dict[str, str]:
    """The ``X-Ignored-Parameters`` header of a request whose unknown fields were dropped (logged once)."""
    if not names:
        return {}
    log.warning("request %s model %s: ignored unknown fields: %s", rid, model, ", ".join(names),
                extra={"request_id": rid, "model": model})
    value = "".join(c if c.isascii() and c.isprintable() else "?" for c in ", ".join(names))
    return {IGNORED_HEADER: value[:1024]}


class Lookup(Protocol):
    """What HTTP routes need from the model registry."""

    @property
    def endpoints(self) -> Mapping[str, Endpoint]: ...
    def get(self, name: str) -> Endpoint: ...
    def only(self) -> Endpoint: ...


@dataclass
class ServerState:
    """Mutable server-wide flags shared by the frontends (owned by the composition root)."""

    draining: bool = False
    started_at: float = 0.0


@dataclass(frozen=True)
class HttpContext:
    """Everything an HTTP route module needs, built once by the composition root."""

    registry: Lookup
    state: ServerState
    limits: Limits
    max_request_size: int
    metrics: Any = None  # serving.telemetry.metrics.ServingMetrics, when present
    tokenize_pool: Executor | None = None  # where long prompts are parsed and tokenized (None: asyncio's default)


def note_model(request: Request, ep: Endpoint) -> None:
    """The request's metrics labels, once its route resolved the model: its name and the version that answers
    (``serving.telemetry.metrics``' request wrapper reads them when the answer is sent)."""
    request.state.model = ep.name
    request.state.model_version = ep.version


def request_id(request: Request) -> str:
    rid = request.headers.get(REQUEST_ID_HEADER, "")
    if rid and len(rid) <= 128 and rid.isascii() and rid.isprintable():
        return rid
    return uuid.uuid4().hex


def error_response(exc: ServingError, rid: str, status: int | None = None) -> JSONResponse:
    code = status or STATUS.get(exc.kind, 500)
    headers = {REQUEST_ID_HEADER: rid}
    if exc.retry_after_s is not None and code in (429, 503):
        headers["Retry-After"] = str(exc.retry_after_s)
    return JSONResponse({"error": exc.message, "error_type": exc.kind.value, "request_id": rid},
                        status_code=code, headers=headers)


def _reject_constant(name: str) -> Any:
    raise InvalidRequest(f"invalid JSON number {name}: NaN and Infinity are not allowed")


async def read_bytes(request: Request, max_bytes: int) -> bytes:
    """The request body, or PayloadTooLarge (decided from Content-Length before reading, else while reading) /
    InvalidRequest for a malformed Content-Length."""
    length = request.headers.get("content-length")
    if length is not None:
        if not (length.isascii() and length.isdigit()):
            raise InvalidRequest("invalid Content-Length header")
        if int(length) > max_bytes:
            raise PayloadTooLarge(f"request body of {int(length)} bytes exceeds max_request_size={max_bytes}")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise PayloadTooLarge(f"request body exceeds max_request_size={max_bytes}")
        chunks.append(chunk)
    request.state.body_bytes = size  # how much work parsing it may be (see prompts.off_loop)
    return b"".join(chunks)


async def read_json(request: Request, max_bytes: int) -> Any:
    """The request body as JSON, or InvalidRequest/PayloadTooLarge. Size is checked before reading."""
    raw = await read_bytes(request, max_bytes)
    if not raw.strip():
        raise InvalidRequest("request body is empty: expected a JSON object")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequest(f"request body is not valid UTF-8 (byte {exc.start})") from None
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") \
            from None
    except RecursionError:
        raise InvalidRequest("request body JSON is nested too deeply") from None
    except ValueError as exc:  # e.g. an integer of more than 4300 digits
        raise InvalidRequest(f"request body is not acceptable JSON: {str(exc)[:200]}") from None


def body_size(request: Request) -> int:
    """Bytes of the body ``read_json`` read (0 before)."""
    return int(getattr(request.state, "body_bytes", 0))


WORKER_HEADER = "X-Worker-Id"  # the worker that answered (SageMaker sessions stick to one: frontends/http/sessions.py)


def timing_headers(t: RequestTimings) -> dict[str, str]:
    """Per-request timings for the client (milliseconds, three decimals), and the worker that answered."""
    worker = {WORKER_HEADER: str(t.worker_id)} if t.worker_id is not None else {}
    return {
        **worker,
        "X-Queue-Time-Ms": f"{t.queue_s * 1000:.3f}",
        "X-TTFT-Ms": f"{t.ttft_s * 1000:.3f}",
        "X-Prefill-Time-Ms": f"{t.prefill_s * 1000:.3f}",
        "X-Decode-Time-Ms": f"{t.decode_s * 1000:.3f}",
        "X-E2E-Ms": f"{t.e2e_s * 1000:.3f}",
        "X-Max-ITL-Ms": f"{t.max_itl_s * 1000:.3f}",
        "X-Prompt-Tokens": str(t.prompt_tokens),
        "X-Generated-Tokens": str(t.generated_tokens),
    }


def timings_json(t: RequestTimings) -> dict[str, float | int]:
    return {"queue_ms": round(t.queue_s * 1000, 3), "ttft_ms": round(t.ttft_s * 1000, 3),
            "prefill_ms": round(t.prefill_s * 1000, 3), "decode_ms": round(t.decode_s * 1000, 3),
            "e2e_ms": round(t.e2e_s * 1000, 3), "max_itl_ms": round(t.max_itl_s * 1000, 3),
            "prompt_tokens": t.prompt_tokens, "generated_tokens": t.generated_tokens}


async def collect_or_cancel(request: Request, streams: list[ResultStream]) -> list[GenerationResult]:
    """Await whole answers; if the client disconnects first, cancel every stream (frees their slots)."""
    gather: asyncio.Future[Any] = asyncio.ensure_future(asyncio.gather(*(s.collect() for s in streams)))
    watch: asyncio.Future[Any] = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait([gather, watch], return_when=asyncio.FIRST_COMPLETED)
        if gather in done:
            if gather.exception() is not None:
                for s in streams:
                    s.cancel()
            return gather.result()
        for s in streams:
            s.cancel()
        gather.cancel()
        await asyncio.gather(gather, return_exceptions=True)
        raise ConnectionAbortedError("client disconnected")
    finally:
        watch.cancel()
        if not gather.done():
            gather.cancel()
            for s in streams:
                s.cancel()


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


# The affinity key of the request being served (a SageMaker session: ``sessions`` sets it around the handler that
# serves the session's request), given to every request that ``submit_all`` queues on its behalf.
AFFINITY: ContextVar[str | None] = ContextVar("affinity", default=None)


def submit_all(ep: Endpoint, reqs: Sequence[GenerationRequest]) -> list[ResultStream]:
    """Submit every request, or none: a refusal cancels those already queued. Each carries the HTTP request's
    deadline headers (``serving.requests.deadlines``; a bad value: InvalidRequest naming the header)."""
    streams: list[ResultStream] = []
    key = AFFINITY.get()
    reqs = [replace(r, deadline=with_headers(r.deadline)) for r in reqs]
    try:
        for r in reqs:
            streams.append(ep.submit(r if key is None else replace(r, affinity=key)))
    except ServingError:
        for s in streams:
            s.cancel()
        raise
    return streams


def candidates(req: GenerationRequest, best_of: int) -> list[GenerationRequest]:
    """``best_of`` sampled candidates of ``req`` (ranked by their tokens' log-probabilities, so computed; a seed
    gives candidate j seed + j), or ``req`` alone."""
    if best_of == 1:
        return [req]
    p = replace(req.params, details=True)
    return [replace(req, request_id=f"{req.request_id}-{j}",
                    params=p if p.seed is None else replace(p, seed=p.seed + j)) for j in range(best_of)]


def likeliest_first(results: Sequence[GenerationResult]) -> list[int]:
    """Indices of ``results`` by cumulative log-probability, highest first."""
    return sorted(range(len(results)), key=lambda k: -sum(t.logprob or 0.0 for t in results[k].tokens))


async def read_request(ctx: HttpContext, request: Request) -> tuple[Any, str | None]:
    """A JSON route's body and the model it names (None when it names none), refused while the server drains;
    ``model`` is checked before the rest of the body, since it picks who validates the rest."""
    if ctx.state.draining:
        raise Unavailable("server is shutting down", retry_after_s=5)
    body = await read_json(request, ctx.max_request_size)
    model = body.get("model") if isinstance(body, dict) else None
    if model is not None and not isinstance(model, str):
        raise type_error("model", "a string", model)
    return body, model


def resolve_model(registry: Lookup, model: str) -> tuple[Endpoint, str | None]:
    """``model`` -> (endpoint, LoRA adapter): a model's name, or one of its adapters' (vLLM's convention, which every
    OpenAI-style route follows). Raises ``ModelNotFound``."""
    try:
        return registry.get(model), None
    except ModelNotFound:
        for ep in registry.endpoints.values():
            if model in ep.info.get("adapters", ()):
                return ep, model
        raise
