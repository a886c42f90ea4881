"""The handler API: what a model's code implements to be served by rollserve.

Design note: DJL-shaped (``initialize`` with the model's properties and directory, then ``handle`` with a
batch) but typed. A dynamic-batching handler gets a list of ``Input`` and returns one ``Output`` per input,
each with its own status, so one bad item never fails its batch-mates. A rolling handler is driven step by
step by the worker's engine loop. Handlers run in backend worker processes only; they never see sockets,
frames or HTTP.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from rollcore.types import BatchOutput, SamplingParams, TokenDelta
from rollcore.values import BOOL_WORDS


@dataclass(frozen=True, slots=True)
class Context:
    """What a handler knows about its model and place. ``properties`` are the model's effective
    properties: ``option.`` prefixes stripped (``option.model_id`` -> ``model_id``), values as strings."""

    model_name: str
    model_dir: Path
    properties: Mapping[str, str]
    device_id: int = -1  # -1 = CPU
    rank: int = 0
    world_size: int = 1

    def option(self, key: str, default: str | None = None) -> str | None:
        return self.properties.get(key, default)


@dataclass(frozen=True, slots=True)
class Input:
    """One request of a batch, as the handler sees it."""

    request_id: str
    prompt: str
    params: SamplingParams = field(default_factory=SamplingParams)
    prompt_token_ids: tuple[int, ...] | None = None
    payload: dict[str, Any] | None = None  # the raw JSON body, for custom handlers
    attributes: Mapping[str, str] = field(default_factory=dict)


# One answer of ``handle``: the core's type, which the worker sends back as it is
Output = BatchOutput


class Handler(abc.ABC):
    """A dynamic-batching handler: ``handle`` gets up to ``batch_size`` inputs at once."""

    def initialize(self, ctx: Context) -> None:  # noqa: B027 - optional hook
        """Load the model. Called once in the worker process before any ``handle``."""

    @abc.abstractmethod
    def handle(self, inputs: Sequence[Input]) -> list[Output]:
        """Return exactly one ``Output`` per input, in order."""

    def describe(self) -> dict[str, Any]:
        """Facts for the frontend (e.g. ``max_model_len``, ``eos_token_id``, ``chat_template``)."""
        return {}

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources before the worker exits (called once, on shutdown)."""


class RollingHandler(abc.ABC):
    """A continuous-batching handler, driven one step at a time by the worker's engine loop.

    All methods run on the worker's main thread. ``add`` raises ``rollcore.errors.InvalidRequest`` for a
    request that can never run (e.g. prompt longer than the context); ``step`` runs one forward pass over
    every running sequence and returns the deltas it produced. ``live_options`` names the options that
    ``configure`` can change on the running handler (``PUT /models/{name}``); any other needs a reload.
    """

    live_options: ClassVar[frozenset[str]] = frozenset()

    @abc.abstractmethod
    def initialize(self, ctx: Context) -> None:
        """Load model and tokenizer; preallocate the KV cache."""

    @abc.abstractmethod
    def add(self, request: Input) -> None:
        """Queue a request; it joins the running batch at a coming step."""

    @abc.abstractmethod
    def abort(self, request_id: str) -> None:
        """Drop a request (queued or running) and free its KV blocks before the next step."""

    @abc.abstractmethod
    def has_work(self) -> bool:
        """True while any request is waiting or running."""

    @abc.abstractmethod
    def step(self) -> list[TokenDelta]:
        """Run one engine iteration; return one delta per request that advanced or finished."""

    def stats(self) -> dict[str, Any]:
        """Engine gauges/counters (running, waiting, kv blocks, preemptions, prefix hits, ...)."""
        return {}

    def prefix_events(self) -> dict[str, Any] | None:
        """The prefix-cache block keys (``rollcore.prefix_keys.short_key``) registered (``add``) and evicted
        (``del``) since the last call, with the ``block_size`` they cover (``reset``: ``add`` is the whole set); the
        frontend routes a prompt to the worker holding its longest prefix. None: nothing changed (or no cache)."""
        return None

    def configure(self, options: Mapping[str, int]) -> None:
        """Apply new values of ``live_options`` (already checked by the frontend) from the next step on,
        between steps; called only with keys of ``live_options``."""
        if options:
            raise NotImplementedError(f"{type(self).__name__} cannot change {sorted(options)} while it runs")

    def healthy(self) -> bool:
        """False when the handler cannot serve any more (e.g. a tensor-parallel rank died): the worker exits
        and is restarted. Called before every step; keep it cheap."""
        return True

    def describe(self) -> dict[str, Any]:
        """Facts for the frontend (e.g. ``max_model_len``, ``chat_template``)."""
        return {}

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources (e.g. tensor-parallel ranks) before the worker exits."""


def option_bool(value: str | None, default: bool = False) -> bool:
    """A boolean option of a custom handler, leniently: the schema's boolean words (``rollcore.values``:
    true/1/yes/on, false/0/no/off, any case); None (absent) or another word gives ``default``."""
    if value is None:
        return default
    return BOOL_WORDS.get(value.strip().lower(), default)
