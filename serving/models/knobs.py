"""The knobs a live model changes without a reload: ``PUT /models/{name}`` and gRPC ``UpdateModel``.

Design note: one table (``KNOBS``) names every changeable knob with its ``serving.properties`` key, its
minimum and the batching it applies to; frontends parse their input with ``parse_query`` or
``check_values`` and hand a ``{name: int}`` mapping to ``ModelRegistry.update_model``. A request is checked
whole before anything changes, so a bad field fails the request alone and changes nothing: an unknown
name, a key that needs a reload (``option.dtype``, ``tensor_parallel_degree``, the KV cache's size: any
other ``serving.properties`` key or handler option) and a bad value are each a 400 naming the field.
``source_kind`` turns a ``ModelConfig.sources`` entry into where a value came from: ``file``, ``env``,
``API`` or ``default``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from rollcore.errors import InvalidRequest
from rollcore.options import OPTIONS
from serving.config.model_config import model_config_keys

MAX_VALUE = 999_999_999  # 9 ASCII digits, as every integer of the management API
API_SOURCE = "API"  # ModelConfig.sources value of a knob set by PUT /models/{name}


@dataclass(frozen=True, slots=True)
class Knob:
    """A changeable knob: its API name, its ``serving.properties`` key, its minimum, and the batching it
    applies to (``dynamic``, ``rolling`` or ``any``)."""

    name: str
    key: str
    minimum: int
    applies: str
    meaning: str


KNOBS: tuple[Knob, ...] = (
    Knob("batch_size", "batch_size", 1, "dynamic", "requests per dynamic batch, from the next batch on"),
    Knob("max_batch_delay", "max_batch_delay", 0, "dynamic",
         "milliseconds a dynamic batch waits for batch-mates, from the batch being gathered on"),
    Knob("max_rolling_batch_size", "option.max_rolling_batch_size", 1, "rolling",
         "requests running at once per worker, from the engine's next step on (never preempts to comply)"),
    Knob("max_rolling_batch_prefill_tokens", "option.max_rolling_batch_prefill_tokens", 1, "rolling",
         "tokens one engine step may compute, from the next step on"),
    Knob("max_itl_ms", "option.max_itl_ms", 0, "rolling",
         "the inter-token latency target of the engine's steps in ms (0: off), from the next step on"),
    Knob("job_queue_size", "job_queue_size", 1, "any", "requests that may wait for a worker (queued ones stay)"),
    Knob("min_worker", "minWorkers", 1, "any", "workers kept running (needs enable_model_api)"),
    Knob("max_worker", "maxWorkers", 1, "any", "workers the model may grow to (needs enable_model_api)"),
)
BY_NAME: dict[str, Knob] = {k.name: k for k in KNOBS}
WORKER_KNOBS = ("min_worker", "max_worker")
# Every other option the built-in handlers and the frontend read is read once, at load: the option schema.
RELOAD_OPTIONS = frozenset(OPTIONS)


def _norm(key: str) -> str:
    key = key.strip()
    if key.lower().startswith("option."):
        key = key[len("option."):]
    return re.sub(r"[._]", "", key.lower())


def _reload_keys() -> dict[str, str]:
    """Normalised name -> the ``serving.properties`` spelling of every key that needs a reload."""
    knob_keys = {_norm(k.key) for k in KNOBS}
    out = {_norm(k): k for k in model_config_keys() if _norm(k) not in knob_keys}
    out.update({_norm(o): f"option.{o}" for o in RELOAD_OPTIONS if _norm(o) not in knob_keys})
    return out


_RELOAD = _reload_keys()
# Another spelling of a knob (its serving.properties key, another case): named in the error with the API's.
_SPELLED_OTHERWISE = {**{_norm(k.key): k.name for k in KNOBS}, **{_norm(k.name): k.name for k in KNOBS}}


def names() -> str:
    return ", ".join(k.name for k in KNOBS)


def check_names(given: Iterable[str]) -> None:
    """Raise ``InvalidRequest`` naming every key that is not a knob: unknown ones, and those that need a
    reload (with their ``serving.properties`` spelling)."""
    reload: list[str] = []
    unknown: list[str] = []
    for key in given:
        if key in BY_NAME:
            continue
        norm = _norm(key)
        if norm in _SPELLED_OTHERWISE:
            unknown.append(f"{key!r} (this API calls it {_SPELLED_OTHERWISE[norm]})")
        elif norm in _RELOAD:
            reload.append(f"{key!r}" + (f" ({_RELOAD[norm]})" if _RELOAD[norm] != key else ""))
        elif key.lower().startswith("option."):
            reload.append(f"{key!r} (a handler option)")
        else:
            unknown.append(repr(key))
    parts = []
    if reload:
        they = "it needs" if len(reload) == 1 else "they need"
        parts.append(f"{', '.join(reload)} cannot change on a live model: {they} a reload (unregister and "
                     "register the model, or restart the server)")
    if unknown:
        parts.append(f"unknown parameter{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}")
    if parts:
        raise InvalidRequest("; ".join(parts) + f"; a live model changes: {names()}")


def parse_query(items: Iterable[tuple[str, str]]) -> dict[str, int]:
    """Knob values from query parameters (``multi_items()``). Raises ``InvalidRequest`` naming every bad key
    or value; a knob given twice is refused."""
    pairs = list(items)
    check_names(key for key, _ in pairs)
    seen: dict[str, str] = {}
    for key, value in pairs:
        if key in seen:
            raise InvalidRequest(f"query parameter {key!r} is given more than once")
        seen[key] = value
    bad = []
    values: dict[str, int] = {}
    for key, text in seen.items():
        knob = BY_NAME[key]
        if not (text.isascii() and text.isdigit()) or len(text) > 9 or int(text) < knob.minimum:
            bad.append(f"{key} must be an integer >= {knob.minimum} (ASCII digits, at most 9), got {text!r}")
        else:
            values[key] = int(text)
    if bad:
        raise InvalidRequest("; ".join(bad))
    return require_some(values)


def check_values(values: Mapping[str, int]) -> dict[str, int]:
    """Knob values from a typed API (gRPC): names and ranges checked as ``parse_query`` does."""
    check_names(values)
    bad = [f"{key} must be an integer between {BY_NAME[key].minimum} and {MAX_VALUE}, got {value!r}"
           for key, value in values.items()
           if isinstance(value, bool) or not isinstance(value, int) or not BY_NAME[key].minimum <= value <= MAX_VALUE]
    if bad:
        raise InvalidRequest("; ".join(bad))
    return require_some(dict(values))


def require_some(values: dict[str, int]) -> dict[str, int]:
    if not values:
        raise InvalidRequest(f"give at least one knob to change: {names()}")
    return values


def source_kind(source: str) -> str:
    """``file``, ``env``, ``API`` or ``default``: where a ``ModelConfig.sources`` entry came from. A value
    inherited from the server's config (``server config (<its source>)``) is classified by that source."""
    if source.startswith("server config"):
        inner = source[len("server config"):].strip(" ()")
        return source_kind(inner) if inner else "file"
    if source.startswith("env "):
        return "env"
    if source in (API_SOURCE, "override"):  # "override": a registration parameter (POST /models)
        return "API"
    if source == "default":
        return "default"
    return "file"
