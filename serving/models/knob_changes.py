"""A live model's knobs changed over the API: the new configuration, what changed, and the engines' answers.

Design note: ``ModelEndpoint.update`` (``serving.models.endpoint``) checks and applies a change under its lock; the
decisions are made here, from the configuration alone: which knobs apply to the model's batching mode, which a
handler cannot change live (a worker that does not list the option among its ``live_options``), how a moved
bound drags the other one (``min_worker``/``max_worker``), and the configuration with the new values, each
recorded with the source ``API``. ``knob_table`` is what ``GET /models/{name}`` shows of them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import replace
from types import MappingProxyType
from typing import Any, Protocol

from rollcore.errors import HandlerError, InvalidRequest
from serving.config.model_config import ModelConfig
from serving.models import knobs


class LiveWorker(Protocol):
    live_options: frozenset[str]  # the options its handler changes live (WorkerHandle)


def itl_option(config: ModelConfig) -> int | str:
    """``option.max_itl_ms`` as configured: milliseconds, or ``auto`` (each engine's measured default, in its
    stats: ``itl_target.derived_ms``)."""
    raw = str(config.options.get("max_itl_ms", "auto")).strip()
    return int(raw) if raw.isdigit() else "auto"


def knob_values(config: ModelConfig) -> dict[str, int | str]:
    """Each live knob's effective value."""
    c, b = config, config.batching
    return {"batch_size": b.batch_size, "max_batch_delay": b.max_batch_delay_ms,
            "max_rolling_batch_size": b.max_rolling_batch_size,
            "max_rolling_batch_prefill_tokens": b.max_rolling_batch_prefill_tokens,
            "max_itl_ms": itl_option(c),
            "job_queue_size": b.job_queue_size, "min_worker": c.min_workers, "max_worker": c.max_workers}


def knob_table(config: ModelConfig, rolling: bool) -> dict[str, dict[str, Any]]:
    """Every live knob: its effective value, where it came from (``file``, ``env``, ``API``, ``default``),
    the exact source (``serving.properties:3``, ``env SERVING_BATCH_SIZE``, ...) and whether it applies to
    this model's batching."""
    mode = "rolling" if rolling else "dynamic"
    values = knob_values(config)
    out: dict[str, dict[str, Any]] = {}
    for knob in knobs.KNOBS:
        raw = config.sources.get(knob.key, "default")
        out[knob.name] = {"value": values[knob.name], "source": knobs.source_kind(raw), "from": raw,
                          "applies": knob.applies in ("any", mode)}
    return out


def updated_config(config: ModelConfig, values: Mapping[str, int], rolling: bool,
                   workers: Mapping[int, LiveWorker]) -> tuple[ModelConfig, dict[str, int]]:
    """The config with ``values`` applied, and every knob whose value changes (a bound moved by the other
    one included). Raises ``InvalidRequest`` for a knob of the other batching mode, one the handler of a
    running worker cannot change live, or ``min_worker`` > ``max_worker``."""
    c, b = config, config.batching
    mode = "rolling" if rolling else "dynamic"
    wrong = [n for n in values if knobs.BY_NAME[n].applies not in ("any", mode)]
    if wrong:
        own = ", ".join(k.name for k in knobs.KNOBS if k.applies in ("any", mode))
        raise InvalidRequest(f"{', '.join(wrong)} {'does' if len(wrong) == 1 else 'do'} not apply to model "
                             f"{c.name!r}: it uses {mode} batching (it changes {own})")
    for name in ("max_rolling_batch_prefill_tokens", "max_itl_ms"):
        fixed = [wid for wid, h in sorted(workers.items()) if name not in h.live_options]
        if name in values and fixed:
            raise InvalidRequest(f"{name} cannot change on a live model whose handler ({c.entry_point!r}) does "
                                 "not support it: it needs a reload")
    lo, hi = values.get("min_worker"), values.get("max_worker")
    if lo is not None and hi is not None and lo > hi:
        raise InvalidRequest(f"min_worker ({lo}) must be <= max_worker ({hi})")
    min_workers = lo if lo is not None else min(c.min_workers, hi) if hi is not None else c.min_workers
    max_workers = hi if hi is not None else max(c.max_workers, lo) if lo is not None else c.max_workers
    wanted = {"batch_size": values.get("batch_size", b.batch_size),
              "max_batch_delay": values.get("max_batch_delay", b.max_batch_delay_ms),
              "max_rolling_batch_size": values.get("max_rolling_batch_size", b.max_rolling_batch_size),
              "max_rolling_batch_prefill_tokens": values.get("max_rolling_batch_prefill_tokens",
                                                             b.max_rolling_batch_prefill_tokens),
              "job_queue_size": values.get("job_queue_size", b.job_queue_size),
              "min_worker": min_workers, "max_worker": max_workers}
    current = knob_values(c)
    changed = {k: v for k, v in wanted.items() if k in values or v != current[k]}
    if "max_itl_ms" in values:  # not a bound of any other knob: it changes only when given
        changed["max_itl_ms"] = values["max_itl_ms"]
    batching = replace(b, batch_size=wanted["batch_size"], max_batch_delay_ms=wanted["max_batch_delay"],
                       job_queue_size=wanted["job_queue_size"],
                       max_rolling_batch_size=wanted["max_rolling_batch_size"],
                       max_rolling_batch_prefill_tokens=wanted["max_rolling_batch_prefill_tokens"])
    options = dict(c.options)
    for name in ("max_rolling_batch_size", "max_rolling_batch_prefill_tokens"):
        options[name] = str(wanted[name])
    if "max_itl_ms" in changed:
        options["max_itl_ms"] = str(changed["max_itl_ms"])
    sources = dict(c.sources)
    for name in changed:
        sources[knobs.BY_NAME[name].key] = knobs.API_SOURCE
    return replace(c, batching=batching, min_workers=min_workers, max_workers=max_workers,
                   options=MappingProxyType(options), sources=MappingProxyType(sources)), changed


async def engine_answers(model: str, acks: Mapping[int, asyncio.Future[Any]], timeout_s: float) -> dict[str, Any]:
    """Each worker's engine limits right after it applied the change (``Configured``), by worker id. A
    worker that has not answered within ``timeout_s`` (the model's ``liveness_timeout``) is reported ``pending``
    (the change waits in its queue); one that went away is left out (its replacement loads with the new values)."""
    if not acks:
        return {}
    done, _ = await asyncio.wait(acks.values(), timeout=timeout_s)
    out: dict[str, Any] = {}
    refused = []
    for wid, future in sorted(acks.items()):
        if future not in done:
            out[str(wid)] = "pending"
            continue
        msg = future.result()
        if msg is None:
            continue
        if msg.error is not None:
            refused.append(msg.error)
            continue
        out[str(wid)] = {k: msg.stats[k] for k in ("max_num_seqs", "max_num_batched_tokens", "itl_target", "limits",
                                                   "num_running", "num_waiting", "num_steps_total")
                         if k in msg.stats}
    if refused:
        raise HandlerError(f"model {model!r}: a worker's engine refused the new options ({refused[0]}); the "
                           "frontend applies them, workers started later load with them")
    return out
