"""What the search needs from whatever measures configurations (``LiveEvaluator`` starts real servers; tests
simulate one): apply a configuration, measure it at a rung, and the record of what it observed, from which
the cost model (``serving.tune.costs``) predicts the next start and run."""

from __future__ import annotations

from typing import Protocol

from rollcore.step_cost import StepCost
from serving.tune.runs import Run
from serving.tune.space import Config, Group


class Evaluator(Protocol):
    ladder: list[float]  # the load ladder's rates, req/s
    stream: bool  # the server streams (ITL bounds are measurable)
    current: Config | None  # the live configuration (None: no server runs)
    deadline: float | None  # time.monotonic(): a run still going then is cut (``Run.cut``)
    cores: int
    n_requests: int  # requests a run sends
    started: list[tuple[Group, float]]  # each server start (with its warm-up): group, seconds
    stops: list[float]  # seconds each server stop took
    order: list[Run]  # every run measured, in order
    cut: list[Run]  # runs and starts stopped at the deadline
    warm_e2e: list[float]  # the warm-up requests' E2E seconds
    knob_changes: int  # live changes (PUT) made
    step_costs: dict[Group, StepCost]  # each rolling group's step cost, read from its server

    def apply(self, config: Config) -> None:
        """Make ``config`` live: a server start for another group, a knob change otherwise."""

    def measure(self, config: Config, rung: int, again: bool = False) -> Run:
        """``config`` at ``rung`` (cached per configuration and rung unless ``again``)."""

    def close(self) -> None:
        """Stop the server, if one runs."""
