"""The small test model (examples/models/tiny-llama) is reproduced byte for byte by its build script, and a server
started where there is no model store says so. (The shipped model store itself, model_store/smollm2, is served
end to end by test_gguf_model.py.)"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import httpx

from tests.integration.harness import REPO, ServerProcess

TINY = REPO / "examples" / "models" / "tiny-llama"


def test_build_script_reproduces_the_shipped_model(tmp_path: Path) -> None:
    from handlers.synthetic_model import build_model

    out = build_model(tmp_path / "m", "llama", "small")
    for name in ("model.safetensors", "tokenizer.json"):
        shipped = (TINY / name).read_bytes()
        assert hashlib.sha256((out / name).read_bytes()).digest() == hashlib.sha256(shipped).digest(), name
    # config.json: the same model, whichever transformers release stamped it (its version is not the model's)
    built, shipped_config = (json.loads(p.read_text()) for p in (out / "config.json", TINY / "config.json"))
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
