"""The shipped model store as a user gets it: `serving --model-store model_store` (here on ephemeral ports)
serves model_store/tiny-llama with its own serving.properties, streaming through the rolling engine, and the
model folder is reproduced byte for byte by the build script."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import httpx

from tests.integration.harness import REPO, ServerProcess


def test_shipped_model_store_serves_and_streams(tmp_path: Path) -> None:
    server = ServerProcess.start(tmp_path, config={"model_store": str(REPO / "model_store")})
    try:
        info = server.describe("tiny-llama")
        assert info["state"] == "READY" and info["batching"] == "rolling"
        with httpx.stream("POST", f"{server.url}/predictions/tiny-llama", timeout=60,
                          json={"inputs": "Hello", "parameters": {"max_new_tokens": 5}, "stream": True}) as r:
            assert r.status_code == 200
            events = [json.loads(line) for line in r.iter_lines() if line]
        assert len(events) == 5 and events[-1]["details"]["generated_tokens"] == 5
    finally:
        server.stop()


def test_build_script_reproduces_the_shipped_model(tmp_path: Path) -> None:
    from handlers.synthetic_model import build_model

    out = build_model(tmp_path / "m", "llama", "small")
    for name in ("model.safetensors", "tokenizer.json"):
        shipped = (REPO / "model_store" / "tiny-llama" / name).read_bytes()
        assert hashlib.sha256((out / name).read_bytes()).digest() == hashlib.sha256(shipped).digest(), name
    # config.json: the same model, whichever transformers release stamped it (its version is not the model's)
    built, shipped_config = (json.loads(p.read_text()) for p in (out / "config.json",
                                                                  REPO / "model_store" / "tiny-llama" / "config.json"))
    built.pop("transformers_version")
    shipped_config.pop("transformers_version")
    assert built == shipped_config


def test_without_a_model_store_the_server_warns_and_is_not_ready(tmp_path: Path) -> None:
    # `serving` run outside the repository root: ./model_store does not exist there
    server = ServerProcess.start(tmp_path, config={"model_store": str(tmp_path / "absent")}, wait_ready=False)
    try:
        ping = httpx.get(f"{server.url}/ping", timeout=10)
        assert ping.status_code == 503, ping.text
        assert ping.json() == {"status": "Unhealthy", "models": {}, "reason": "no model is registered"}
        assert "no model to serve: the model store" in server.log() and "does not exist" in server.log()
        assert httpx.get(f"{server.mgmt}/models", headers=server.mgmt_headers, timeout=10).json()["models"] == []
    finally:
        server.stop()
