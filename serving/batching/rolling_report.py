"""What ``GET /models/{name}`` shows of a rolling model's batcher: queue and running counts, limits, the predicted
wait, the watchdog's and retries' counts, the LoRA adapters in use (the gateway protocol's
``vllm:lora_requests_info``), the routing counters and each engine's latest stats."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from serving.batching.deadline_admission import as_ms

if TYPE_CHECKING:
    from serving.batching.rolling import RollingBatcher, _Admitted


def describe(b: RollingBatcher) -> dict[str, Any]:
    return {"mode": "rolling", "waiting": len(b._waiting), "running": len(b._running),
            "max_rolling_batch_size": b.max_rolling_batch_size, "job_queue_size": b.job_queue_size,
            "steps_total": b.num_steps,
            "predicted_wait_ms": as_ms(b._predicted_wait_s()),  # for a request submitted now
            "watchdog_restarts": b.num_watchdog_kills, "last_watchdog": b.last_watchdog,
            "retries_total": b._retries.num_retried,
            "running_adapters": _adapters(b._running.values()),
            "waiting_adapters": _adapters(b._waiting.values()),
            "routing": b.router.describe(),
            "engines": {str(k): _by_client_id(b, v) for k, v in b.engine_stats.items()}}


def _by_client_id(b: RollingBatcher, stats: dict[str, Any]) -> dict[str, Any]:
    """Engine stats with ``blocks_held`` keyed by the ids clients know (the engine keys by the server's)."""
    held = stats.get("blocks_held")
    if not isinstance(held, dict):
        return stats
    names = {rid: e.request.client_id or rid for rid, e in b._running.items()}
    return {**stats, "blocks_held": {names.get(rid, rid): n for rid, n in held.items()}}


def _adapters(entries: Iterable[_Admitted]) -> list[str]:
    """The LoRA adapters ``entries`` ask for, each once, sorted."""
    return sorted({e.request.params.adapter for e in entries if e.request.params.adapter is not None})
