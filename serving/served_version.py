"""Which version of a model answered a request: the label the metrics give it.

Design note: a client names ``NAME`` (the default version) or ``NAME:VERSION``; only the registry's lookup knows
which version that was. ``RESOLVED`` carries the answer back without the metrics importing the registry: the
request's ASGI wrapper (``serving.metrics``) sets a dict, the lookup writes the endpoint's version into it
(``note_resolved``). ``DEFAULT_VERSION`` is the version of a model folder that names none.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

DEFAULT_VERSION = "1"
RESOLVED: ContextVar[dict[str, str] | None] = ContextVar("rollserve_resolved_version", default=None)


def note_resolved(ep: Any) -> None:
    """Tell the request's metrics wrapper (if any) which version answers it."""
    seen = RESOLVED.get()
    if seen is not None:
        seen["version"] = str(getattr(ep, "version", DEFAULT_VERSION))
