"""The ServingError hierarchy.

Design note: the core raises typed errors carrying a protocol-neutral ``ErrorKind``; each frontend maps
kinds to its own status codes through exactly one table (HTTP status, gRPC code). Messages are meant for
the client: they name the field or value at fault and never contain a traceback or a file-system path.
"""

from __future__ import annotations

import enum


class ErrorKind(str, enum.Enum):
    INVALID = "invalid_request"
    TOO_LARGE = "payload_too_large"
    NOT_FOUND = "not_found"
    METHOD = "method_not_allowed"
    UNAUTHORIZED = "unauthorized"
    FORBIDDEN = "forbidden"
    CONFLICT = "conflict"
    OVERLOADED = "overloaded"
    UNAVAILABLE = "unavailable"
    TIMEOUT = "timeout"
    CANCELLED = "cancelled"
    WORKER_FAILED = "worker_failed"
    HANDLER = "handler_error"
    INTERNAL = "internal_error"


class ServingError(Exception):
    """Base of all errors a client may see. ``kind`` decides the status code in every frontend."""

    kind: ErrorKind = ErrorKind.INTERNAL

    def __init__(self, message: str, *, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s


class InvalidRequest(ServingError):
    kind = ErrorKind.INVALID


class PayloadTooLarge(ServingError):
    kind = ErrorKind.TOO_LARGE


class ModelNotFound(ServingError):
    kind = ErrorKind.NOT_FOUND


class Unauthorized(ServingError):
    """A missing or wrong token (HTTP 401 with ``WWW-Authenticate``, gRPC UNAUTHENTICATED)."""

    kind = ErrorKind.UNAUTHORIZED


class Forbidden(ServingError):
    """An operation switched off by configuration (e.g. the model API), or a refused Origin/Host."""

    kind = ErrorKind.FORBIDDEN


class Conflict(ServingError):
    """A client-chosen request id already names a live request (409)."""

    kind = ErrorKind.CONFLICT


class Overloaded(ServingError):
    """Queue full: the client should retry later (503 + Retry-After)."""

    kind = ErrorKind.OVERLOADED


class Unavailable(ServingError):
    """Model not ready, failed, or the server is draining."""

    kind = ErrorKind.UNAVAILABLE


class RequestTimeout(ServingError):
    kind = ErrorKind.TIMEOUT


class Cancelled(ServingError):
    kind = ErrorKind.CANCELLED


class WorkerFailed(ServingError):
    """The worker process serving the request died after output had started."""

    kind = ErrorKind.WORKER_FAILED


class HandlerError(ServingError):
    """The model's handler raised for this request (DJL answers 424)."""

    kind = ErrorKind.HANDLER


class ConfigError(ValueError):
    """A configuration value is invalid; the message names file, line, key and value."""


ERROR_KINDS: dict[str, type[ServingError]] = {
    cls.kind.value: cls
    for cls in (InvalidRequest, PayloadTooLarge, ModelNotFound, Unauthorized, Forbidden, Conflict, Overloaded,
                Unavailable, RequestTimeout, Cancelled, WorkerFailed, HandlerError)
}


def error_from_kind(kind: str, message: str) -> ServingError:
    """Rebuild a typed error from its wire form (kind string + message)."""
    cls = ERROR_KINDS.get(kind, ServingError)
    return cls(message)
