"""Readiness under ``ping_requires`` and the live client-id table (409 on a duplicate), without sockets."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from rollcore.errors import Conflict
from rollcore.types import ModelState
from serving.models.live_requests import LiveRequests, counter_ids
from serving.models.residency import Residence
from serving.telemetry.deep_health import DeepCheck
from serving.telemetry.health import Health


@dataclass
class Ep:
    state: ModelState
    serving_workers: int = 1
    residence: Residence | None = None  # loaded at start unless given one
    residency: object | None = None

    @property
    def available(self) -> bool:
        return self.state is ModelState.READY and self.serving_workers > 0


@dataclass
class Registry:
    endpoints: dict[str, Ep]
    startup_models: set[str] | None


@dataclass
class State:
    draining: bool = False


def test_readiness_follows_ping_requires() -> None:
    reg = Registry({"a": Ep(ModelState.READY), "b": Ep(ModelState.FAILED), "late": Ep(ModelState.FAILED)},
                   {"a", "b"})
    state = State()
    assert not Health(reg, state, "all").ready()  # a startup model FAILED
    assert Health(reg, state, "any").ready()
    reg.endpoints["a"].serving_workers = 0  # its only worker restarts (e.g. a tensor-parallel host was lost)
    assert not Health(reg, state, "any").ready()
    reg.endpoints["a"].serving_workers = 1
    assert Health(reg, state, "none").ready()
    reg.startup_models = {"a"}  # b was unregistered; "late" (registered later) never counts
    assert Health(reg, state, "all").ready()
    assert Health(reg, state, "all").live()
    state.draining = True
    assert not any(Health(reg, state, p).ready() for p in ("all", "any", "none"))
    assert Health(reg, state, "all").live()


def test_any_counts_a_model_that_loads_on_its_first_request() -> None:
    """A store of models loaded on demand is ready before any of them loaded (``ping_requires=any``), but not when
    the only one cannot fit the memory budget."""
    residence = Residence(on_demand=True, pinned=False, idle_ttl_s=None, weights="w", predicted_bytes=1,
                          predicted_from="preflight")
    reg = Registry({"a": Ep(ModelState.PENDING, residence=residence, residency=object())}, set())
    assert Health(reg, State(), "any").ready()
    reg.endpoints["a"].state = ModelState.UNLOADED
    assert Health(reg, State(), "any").ready()
    residence.refusal = "it needs 2 GiB and the model memory budget is 1 GiB"
    assert not Health(reg, State(), "any").ready()
    assert not Health(Registry({"b": Ep(ModelState.PENDING)}, set()), State(), "any").ready()  # loads at start


def test_not_ready_before_the_startup_models_are_known_or_built() -> None:
    assert not Health(Registry({}, None), State(), "all").ready()
    assert not Health(Registry({}, {"a"}), State(), "all").ready()  # discovered, not yet built
    assert not Health(Registry({"a": Ep(ModelState.LOADING)}, {"a"}), State(), "all").ready()
    assert not Health(Registry({}, set()), State(), "all").ready()  # serving nothing is not ready
    assert Health(Registry({"a": Ep(ModelState.READY)}, set()), State(), "all").ready()  # only API-registered
    with pytest.raises(ValueError):
        Health(Registry({}, set()), State(), "most")


def test_client_ids_are_unique_among_live_requests() -> None:
    live = LiveRequests(counter_ids("x"))
    first = live.claim("abc", "ep1")
    assert first == "x-1"
    with pytest.raises(Conflict, match="'abc'"):
        live.claim("abc", "ep2")
    assert live.find("abc") == ("ep1", first)
    live.release("abc", "stale-id")  # a stale release must not free a newer claim
    assert live.find("abc") == ("ep1", first)
    live.release("abc", first)
    assert live.find("abc") is None and len(live) == 0
    assert live.claim("abc", "ep2") == "x-2"  # reusable once the request ended


def test_the_deep_check_answers_503_unprobed_while_loading_or_draining() -> None:
    class Unprobed(Ep):
        def submit(self, request: object) -> None:
            raise AssertionError("a server that is not ready is not probed")

    loading = Registry({"a": Unprobed(ModelState.LOADING)}, {"a"})
    healthy, body = asyncio.run(DeepCheck(Health(loading, State()), 5, 10).result())
    assert not healthy and body["models"] == {"a": "LOADING"} and "not ready" in body["reason"]
    ready = Registry({"a": Unprobed(ModelState.READY)}, {"a"})
    healthy, body = asyncio.run(DeepCheck(Health(ready, State(draining=True)), 5, 10).result())
    assert not healthy and body == {"status": "draining", "models": {"a": "READY"}}
