"""What the frontends ask of residency for a model: to have it loaded before serving it, whether it serves though
not loaded, and its entry in a model listing (``serving.models.residency`` keeps the budget itself)."""

from __future__ import annotations

from typing import Any

from serving.models.endpoint_protocol import Endpoint
from serving.models.residency import NOT_RESIDENT


def loads_on_request(ep: Endpoint) -> bool:
    """Whether ``ep`` is not loaded but serves all the same: its next request loads it (readiness counts it)."""
    r = ep.residence
    return (r is not None and r.on_demand and r.refusal is None and ep.residency is not None
            and ep.state in NOT_RESIDENT)


async def ensure_resident(ep: Endpoint) -> None:
    """What a route awaits before it serves ``ep`` (or the version a reload replaced it with): the model loaded on
    demand, within ``model_load_wait``. Nothing for a model without a residence (a FAILED one)."""
    while ep.successor is not None:
        ep = ep.successor
    residency = ep.residency
    if residency is not None:
        await residency.ensure(ep)


def residency_entry(ep: Endpoint) -> dict[str, Any]:
    """``{"residency": ...}`` for a model listing (``GET /models``): its state under the budget, what it holds and
    when it was last used; {} for a model without a residence (a FAILED configuration)."""
    residency = ep.residency
    return {"residency": residency.describe(ep)} if residency is not None else {}
