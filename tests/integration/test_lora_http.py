"""LoRA adapters through the server, on the real SmolLM2-135M-Instruct with two adapters built by peft: LMI's
``adapters`` (one for all prompts or one each), OpenAI's ``model`` naming an adapter (vLLM's convention),
TGI's and KServe OIP's ``adapter_id``; every answer equals peft's merged model; ``/v1/models`` lists the adapters
with their parent; an unknown adapter is a 404 naming it; a model that cannot serve adapters says so. Adapters
registered at run time (DJL LMI's adapter API) answer at once, survive a worker restart, and unregister."""

from __future__ import annotations

import json
import os
import shutil
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from serving.bench.launch import wait_for
from serving.frontends.proto.gen.inference import grpc_service_pb2_grpc as oip_grpc
from tests.integration.harness import ServerProcess
from tests.integration.test_hostile_values import oip_request
from tests.lora_adapters import merged_greedy, model_with_adapters

PROMPTS = ["The capital of France is", "List three colours:", "Write a haiku about the sea."]
MAX_NEW = 12
ROLLING = {"option.rolling_batch": "auto", "option.max_model_len": "1024", "option.kv_cache_populate": "lazy"}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return model_with_adapters(tmp_path_factory.mktemp("lora"))


@pytest.fixture(scope="module")
def server(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = ServerProcess.start(tmp_path_factory.mktemp("lora-server"), models={
        "smollm2": {**ROLLING, "option.enable_lora": "true", "option.max_loras": "2"}, "plain": ROLLING,
        "dyn": {"option.max_model_len": "1024", "batch_size": "2"}},
        sources={"smollm2": folder, "plain": folder, "dyn": folder}, config={"enable_model_api": "true"},
        timeout_s=600)
    try:
        yield srv
    finally:
        srv.stop()


def token_ids(folder: Path, prompt: str) -> list[int]:
    from transformers import AutoTokenizer

    return list(AutoTokenizer.from_pretrained(folder)(prompt).input_ids)


def lmi(server: ServerProcess, body: dict[str, Any], model: str = "smollm2") -> httpx.Response:
    body = {**body, "parameters": {"max_new_tokens": MAX_NEW, "ignore_eos": True, "details": True,
                                   **body.get("parameters", {})}}
    return httpx.post(f"{server.url}/predictions/{model}", json=body, headers=server.inference_headers, timeout=300)


def ids_of(answer: dict[str, Any]) -> list[int]:
    return [t["id"] for t in answer["details"]["tokens"]]


def test_every_api_answers_with_the_adapter_asked_for(server: ServerProcess, folder: Path) -> None:
    def one(k: int) -> tuple[str | None, str, list[int]]:
        adapter = (None, "terse", "verbose")[k]
        prompt = PROMPTS[2]
        r = lmi(server, {"inputs": prompt, **({"adapters": adapter} if adapter else {})})
        assert r.status_code == 200, r.text
        return adapter, prompt, ids_of(r.json())

    with ThreadPoolExecutor(3) as pool:  # base and both adapters at once (one batch: tests/engine/test_lora.py)
        answers = list(pool.map(one, range(3)))
    for adapter, prompt, got in answers:
        assert got == merged_greedy(folder, adapter, token_ids(folder, prompt), MAX_NEW), (adapter, prompt)

    r = lmi(server, {"inputs": PROMPTS[:2], "adapters": ["verbose", "terse"]})
    assert r.status_code == 200, r.text
    assert [ids_of(a) for a in r.json()] == [merged_greedy(folder, a, token_ids(folder, p), MAX_NEW)
                                             for a, p in zip(("verbose", "terse"), PROMPTS[:2], strict=True)]

    tgi = httpx.post(f"{server.url}/generate?model_name=smollm2", headers=server.inference_headers, timeout=300,
                     json={"inputs": PROMPTS[0], "parameters": {"max_new_tokens": MAX_NEW, "adapter_id": "terse",
                                                                "details": True, "decoder_input_details": False}})
    assert tgi.status_code == 200, tgi.text
    assert ids_of(tgi.json()) == merged_greedy(folder, "terse", token_ids(folder, PROMPTS[0]), MAX_NEW)

    openai = httpx.post(f"{server.url}/v1/completions", headers=server.inference_headers, timeout=300, json={
        "model": "verbose", "prompt": PROMPTS[1], "max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True})
    assert openai.status_code == 200, openai.text
    assert openai.json()["model"] == "verbose"
    lmi_text = lmi(server, {"inputs": PROMPTS[1], "adapters": "verbose"}).json()["generated_text"]
    assert openai.json()["choices"][0]["text"] == lmi_text

    with grpc.insecure_channel(server.grpc_target) as channel:  # KServe's OIP: the adapter_id parameter
        reply = oip_grpc.GRPCInferenceServiceStub(channel).ModelInfer(
            oip_request("smollm2", PROMPTS[1], json.dumps({"max_new_tokens": MAX_NEW, "ignore_eos": True,
                                                            "adapter_id": "verbose"})),
            metadata=server.grpc_inference_metadata, timeout=300)
    assert reply.raw_output_contents[0][4:].decode() == PROMPTS[1] + lmi_text  # Triton's text_output: the whole text


def test_models_lists_the_adapters_and_unknown_ones_are_404(server: ServerProcess) -> None:
    listed = httpx.get(f"{server.url}/v1/models", headers=server.inference_headers, timeout=30).json()["data"]
    assert {(m["id"], m.get("parent")) for m in listed} == {
        ("smollm2", None), ("plain", None), ("dyn", None), ("terse", "smollm2"), ("verbose", "smollm2")}
    r = lmi(server, {"inputs": "x", "adapters": "nope"})
    assert r.status_code == 404 and "LoRA adapter 'nope' is not registered" in r.text, r.text
    r = httpx.post(f"{server.url}/v1/completions", headers=server.inference_headers, timeout=60,
                   json={"model": "nope", "prompt": "x", "max_tokens": 2})
    assert r.status_code == 404 and "nope" in r.text, r.text
    r = lmi(server, {"inputs": "x", "adapters": "terse"}, model="plain")
    assert r.status_code == 400 and "option.enable_lora is off" in r.text, r.text
    r = lmi(server, {"inputs": "x", "adapters": "terse"}, model="dyn")  # dynamic batching: no adapters
    assert r.status_code == 400 and "does not serve LoRA adapters" in r.text, r.text
    r = lmi(server, {"inputs": ["a", "b"], "adapters": ["terse"]})
    assert r.status_code == 400 and "'adapters' has 1 names for 2 prompts" in r.text, r.text


def test_adapters_registered_at_run_time(server: ServerProcess, folder: Path) -> None:
    shutil.copytree(folder / "adapters" / "verbose", server.workdir / "model_store" / "loud-adapter")
    api = f"{server.mgmt}/models/smollm2/adapters"
    bad = httpx.post(api, params={"name": "broken", "src": "plain"}, headers=server.mgmt_headers, timeout=60)
    assert bad.status_code == 400 and "adapter 'broken'" in bad.text and "adapter_config.json" in bad.text, bad.text
    r = httpx.post(api, params={"name": "loud", "src": "loud-adapter"}, headers=server.mgmt_headers, timeout=60)
    assert r.status_code == 200, r.text
    listed = httpx.get(api, headers=server.mgmt_headers, timeout=30).json()["adapters"]
    assert listed == [{"name": "loud", "src": "api"}, {"name": "terse", "src": "model folder"},
                      {"name": "verbose", "src": "model folder"}]
    want = merged_greedy(folder, "verbose", token_ids(folder, PROMPTS[0]), MAX_NEW)  # the same weights
    assert ids_of(lmi(server, {"inputs": PROMPTS[0], "adapters": "loud"}).json()) == want
    models = httpx.get(f"{server.url}/v1/models", headers=server.inference_headers, timeout=30).json()["data"]
    assert ("loud", "smollm2") in {(m["id"], m.get("parent")) for m in models}

    worker = int(server.describe("smollm2")["workers"][0]["pid"])
    os.kill(worker, signal.SIGKILL)  # its replacement gets the registered set before its first request
    def replaced() -> bool:  # one snapshot: between two reads the dead worker may be gone and none ready yet
        model = server.describe("smollm2")
        return model["state"] == "READY" and any(w["pid"] != worker and w["status"] == "READY"
                                                 for w in model["workers"])

    wait_for(replaced, "the worker's replacement", 300)
    assert ids_of(lmi(server, {"inputs": PROMPTS[0], "adapters": "loud"}).json()) == want

    r = httpx.delete(f"{api}/loud", headers=server.mgmt_headers, timeout=60)
    assert r.status_code == 200, r.text
    gone = lmi(server, {"inputs": PROMPTS[0], "adapters": "loud"})
    assert gone.status_code == 404 and "LoRA adapter 'loud' is not registered" in gone.text, gone.text
    again = httpx.delete(f"{api}/loud", headers=server.mgmt_headers, timeout=60)
    assert again.status_code == 404, again.text
