"""The Gateway API Inference Extension's model-server metrics, under vLLM's names, on rollserve's ``/metrics``.

Design note: an endpoint picker (the extension's EPP, llm-d, KServe's LLMInferenceService, GKE's inference gateway)
scrapes what the extension's "model server protocol" lists (kubernetes-sigs/gateway-api-inference-extension,
docs/proposals/003-model-server-protocol): ``vllm:num_requests_waiting`` (TotalQueuedRequests),
``vllm:num_requests_running`` (TotalRunningRequests), ``vllm:kv_cache_usage_perc`` (KVCacheUtilization; also under
the older ``vllm:gpu_cache_usage_perc``), and for LoRA ``vllm:lora_requests_info``. The first four are the
``StateCollector``'s own gauges (``rollserve_num_requests_*``, the KV blocks), renamed, summed over a model's
versions and labelled ``model_name`` as vLLM labels them: one bookkeeping, read at scrape time. KV usage is the
fraction 0..1 vLLM reports; a model without a paged KV cache (dynamic batching) reports 0. The optional
``vllm:cache_config_info`` (labels ``block_size``, ``num_gpu_blocks``; value 1) is given for rolling-batch models.
``vllm:lora_requests_info`` (models serving LoRA adapters) carries ``running_lora_adapters`` and
``waiting_lora_adapters`` (comma-separated names of the adapters running and waiting requests use) and ``max_lora``
as labels; its value is the scrape's time, the protocol's "last updated timestamp".
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from serving.models.endpoint_protocol import Endpoint
from serving.telemetry.metrics_state import StateCollector, VersionSource

RUNNING = "rollserve_num_requests_running"
WAITING = "rollserve_num_requests_waiting"
KV_TOTAL = "rollserve_kv_cache_blocks"
KV_USED = "rollserve_kv_cache_used_blocks"
# every family this module exports (the only ones on /metrics not named rollserve_*)
PROTOCOL_NAMES = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                  "vllm:gpu_cache_usage_perc", "vllm:cache_config_info", "vllm:lora_requests_info")


def _per_model(family: Metric | None) -> dict[str, float]:
    """A state family's samples summed over each model's versions."""
    out: dict[str, float] = {}
    for sample in family.samples if family is not None else ():
        out[sample.labels["model"]] = out.get(sample.labels["model"], 0.0) + sample.value
    return out


class GatewayCollector(Collector):
    """The protocol's vLLM-named gauges from ``state``'s families, and LoRA and cache info from the endpoints."""

    def __init__(self, state: StateCollector, versions: VersionSource, clock: Callable[[], float] = time.time) -> None:
        self._state = state
        self._versions = versions
        self._clock = clock

    def collect(self) -> Iterator[Metric]:
        families = {f.name: f for f in self._state.collect()}
        running, waiting = _per_model(families.get(RUNNING)), _per_model(families.get(WAITING))
        total, used = _per_model(families.get(KV_TOTAL)), _per_model(families.get(KV_USED))
        label = ["model_name"]
        out = {name: GaugeMetricFamily(name, doc, labels=label) for name, doc in (
            ("vllm:num_requests_waiting", "Requests waiting (gateway protocol: TotalQueuedRequests)"),
            ("vllm:num_requests_running", "Requests running (gateway protocol: TotalRunningRequests)"),
            ("vllm:kv_cache_usage_perc", "KV-cache usage, 1 = 100% (gateway protocol: KVCacheUtilization)"),
            ("vllm:gpu_cache_usage_perc", "KV-cache usage, 1 = 100% (vllm:kv_cache_usage_perc's older name)"))}
        for model in sorted(running):
            usage = used.get(model, 0.0) / total[model] if total.get(model) else 0.0
            out["vllm:num_requests_waiting"].add_metric([model], waiting.get(model, 0.0))
            out["vllm:num_requests_running"].add_metric([model], running[model])
            out["vllm:kv_cache_usage_perc"].add_metric([model], usage)
            out["vllm:gpu_cache_usage_perc"].add_metric([model], usage)
        yield from out.values()
        yield from self._info(set(running))

    def _info(self, served: set[str]) -> Iterator[Metric]:
        lora = GaugeMetricFamily("vllm:lora_requests_info", "LoRA adapters of running and waiting requests; the "
                                 "value is when it was read", labels=["model_name", "max_lora", "running_lora_adapters",
                                                                      "waiting_lora_adapters"])
        cache = GaugeMetricFamily("vllm:cache_config_info", "KV-cache layout", labels=["model_name", "block_size",
                                                                                     "num_gpu_blocks"])
        now = self._clock()
        models: dict[str, dict[str, Any]] = {}  # a model's rolling versions together, as the gauges above
        for name, _, ep in self._versions():
            batcher = ep.batcher
            info = _info_of(ep)
            if name not in served or batcher is None or not info:
                continue
            d = batcher.describe()
            if d.get("mode") != "rolling":
                continue
            m = models.setdefault(name, {"block_size": info.get("block_size"), "num_blocks": 0, "max_loras": 0,
                                         "running": set(), "waiting": set()})
            m["num_blocks"] += int(info.get("num_blocks") or 0)
            m["max_loras"] = max(m["max_loras"], int(info.get("max_loras") or 0))
            m["running"].update(d.get("running_adapters", ()))
            m["waiting"].update(d.get("waiting_adapters", ()))
        for name, m in sorted(models.items()):
            cache.add_metric([name, str(m["block_size"]), str(m["num_blocks"])], 1.0)
            if m["max_loras"]:  # the model serves LoRA adapters (option.enable_lora)
                lora.add_metric([name, str(m["max_loras"]), ",".join(sorted(m["running"])),
                                 ",".join(sorted(m["waiting"]))], now)
        yield cache
        yield lora


def _info_of(ep: Endpoint) -> Mapping[str, Any]:
    """The endpoint's handler description (empty before a worker is ready)."""
    try:
        return ep.info
    except Exception:  # noqa: BLE001 - a scrape never fails on a model that is going away
        return {}
