"""The Gateway API Inference Extension's model-server protocol on a real server's ``/metrics``: the metric names,
types and labels the protocol document lists are there, and their values follow a request that runs and one that
waits (the real SmolLM2-135M-Instruct with two LoRA adapters, one sequence at a time)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.harness import ServerProcess
from tests.lora_adapters import model_with_adapters

# The protocol, as kubernetes-sigs/gateway-api-inference-extension v1.6.0 states it
# (docs/proposals/003-model-server-protocol/README.md):
#   | TotalQueuedRequests  | Gauge | The current total number of requests in the queue. | `vllm:num_requests_waiting` |
#   | TotalRunningRequests | Gauge | ... actively being served on the model server.      | `vllm:num_requests_running` |
#   | KVCacheUtilization   | Gauge | The current KV cache utilization in percentage.    | `vllm:kv_cache_usage_perc`  |
#   | [Optional] BlockSize, NumGPUBlocks | Labeled/Gauge | name: `vllm:cache_config_info`, label name: `block_size`,
#     `num_gpu_blocks` |
#   LoRA: "Metric name implemented in vLLM: `vllm:lora_requests_info`", type Gauge, value "The last updated
#   timestamp", labels `max_lora`, `running_lora_adapters`, `waiting_lora_adapters`.
# The protocol's earlier revision named KVCacheUtilization `vllm:gpu_cache_usage_perc`; vLLM labels each series with
# `model_name`.
PROTOCOL: dict[str, set[str]] = {
    "vllm:num_requests_waiting": set(),
    "vllm:num_requests_running": set(),
    "vllm:kv_cache_usage_perc": set(),
    "vllm:gpu_cache_usage_perc": set(),
    "vllm:cache_config_info": {"block_size", "num_gpu_blocks"},
    "vllm:lora_requests_info": {"max_lora", "running_lora_adapters", "waiting_lora_adapters"},
}
MODEL = "smollm2"
LONG = 1500  # tokens: the running request outlives the checks (it is cancelled once they are done)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder: Path = model_with_adapters(tmp_path_factory.mktemp("gateway-lora"))
    srv = ServerProcess.start(tmp_path_factory.mktemp("gateway"), models={MODEL: {
        "option.rolling_batch": "auto", "option.max_rolling_batch_size": "1", "option.max_model_len": "2048",
        "option.kv_cache_populate": "lazy", "option.enable_lora": "true", "option.max_loras": "2",
        "minWorkers": "1", "maxWorkers": "1"}},  # one worker of one sequence: a second request waits
        sources={MODEL: folder}, timeout_s=600)
    try:
        yield srv
    finally:
        srv.stop()


def scrape(server: ServerProcess) -> dict[str, Any]:
    text = httpx.get(f"{server.mgmt}/metrics", headers=server.mgmt_headers, timeout=30).text
    return {f.name: f for f in text_string_to_metric_families(text)}


def sample(families: dict[str, Any], name: str) -> Any:
    (s,) = [s for s in families[name].samples if s.labels.get("model_name") == MODEL]
    return s


def completion(client: httpx.Client, server: ServerProcess, adapter: str) -> Any:
    """A long streamed completion on ``adapter`` (the gateway names the adapter in ``model``, as vLLM serves it)."""
    return client.stream("POST", f"{server.url}/v1/completions", headers=server.inference_headers, json={
        "model": adapter, "prompt": "Write a long story about the sea.", "max_tokens": LONG, "ignore_eos": True,
        "stream": True})


def first_token(response: httpx.Response) -> Iterator[str]:
    """Read up to the stream's first event; the caller keeps the returned lines (a dropped line iterator closes
    the response, which the server takes as the client leaving)."""
    assert response.status_code == 200
    lines = response.iter_lines()
    assert next(line for line in lines if line.startswith("data: ")).startswith("data: {")
    return lines


def test_the_protocols_metrics_are_exported(server: ServerProcess) -> None:
    families = scrape(server)
    for name, labels in PROTOCOL.items():
        assert name in families, f"{name} is missing from /metrics"
        assert families[name].type == "gauge", (name, families[name].type)
        s = sample(families, name)
        assert labels | {"model_name"} == set(s.labels), (name, s.labels)
    # idle: nothing waits or runs; no adapter in use; the model's LoRA capacity
    assert sample(families, "vllm:num_requests_waiting").value == 0
    assert sample(families, "vllm:num_requests_running").value == 0
    lora = sample(families, "vllm:lora_requests_info")
    assert (lora.labels["max_lora"], lora.labels["running_lora_adapters"], lora.labels["waiting_lora_adapters"]) == \
        ("2", "", "")
    assert lora.value > 1.7e9  # a Unix time: "the last updated timestamp"
    cache = sample(families, "vllm:cache_config_info")
    assert int(cache.labels["block_size"]) > 0 and int(cache.labels["num_gpu_blocks"]) > 0


def test_a_running_and_a_waiting_request_show_up(server: ServerProcess) -> None:
    with httpx.Client(timeout=300) as client:
        with completion(client, server, "terse") as running:
            held = first_token(running)  # "terse" is generating: it runs
            with completion(client, server, "verbose") as waiting:
                assert waiting.status_code == 200  # queued: one sequence at a time, and "terse" holds it
                families = scrape(server)
                assert sample(families, "vllm:num_requests_running").value == 1
                assert sample(families, "vllm:num_requests_waiting").value == 1
                usage = sample(families, "vllm:kv_cache_usage_perc").value
                assert 0 < usage < 1 and sample(families, "vllm:gpu_cache_usage_perc").value == usage
                # the same values as rollserve's own gauges (one bookkeeping)
                own = [s for s in families["rollserve_num_requests_waiting"].samples if s.labels["model"] == MODEL]
                assert [s.value for s in own] == [1]
                lora = sample(families, "vllm:lora_requests_info")
                assert (lora.labels["running_lora_adapters"], lora.labels["waiting_lora_adapters"]) == \
                    ("terse", "verbose")
                running.close()  # the client leaves: "terse" is cancelled and "verbose" gets the sequence
                held = first_token(waiting)
                families = scrape(server)
                assert sample(families, "vllm:num_requests_running").value == 1
                assert sample(families, "vllm:num_requests_waiting").value == 0
                lora = sample(families, "vllm:lora_requests_info")
                assert (lora.labels["running_lora_adapters"], lora.labels["waiting_lora_adapters"]) == \
                    ("verbose", "")
                del held
