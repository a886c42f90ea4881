"""``option.rolling_batch=auto`` through a real server: an architecture the rolling engine refuses (a tiny
random-weight BLOOM, ALiBi) is served by dynamic batching with the reason in ``GET /models/{name}`` and the
log; ``scheduler`` (and DJL's ``vllm``) on it is FAILED with the engine's message; a Llama folder with
``auto`` gets the rolling engine. ``serving config`` prints the same decision."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from handlers.synthetic_model import build_model
from tests.integration.harness import DEFAULT_MODEL, REPO, ServerProcess, write_model

ALIBI = "ALiBi position bias (the engine implements rotary and learned positions only)"
FALLBACK = ("option.rolling_batch=auto: dynamic batching (HF generate); the rolling engine cannot serve this "
            f"model: BloomForCausalLM (model_type=bloom): {ALIBI}")


def refusal(requested: str) -> str:
    return (f"serving.properties:1: option.rolling_batch = {requested!r}: the rolling engine cannot serve this "
            f"model: BloomForCausalLM (model_type=bloom): {ALIBI}; set option.rolling_batch=auto (falls back to "
            "dynamic batching) or disable")


@pytest.fixture(scope="module")
def bloom_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("bloom") / "bloom", "bloom", "tiny")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, bloom_dir: Path) -> Iterator[ServerProcess]:
    s = ServerProcess.start(tmp_path_factory.mktemp("auto"), models={
        "bloom-auto": {"option.rolling_batch": "auto", "batch_size": "2", "max_batch_delay": "10"},
        "bloom-scheduler": {"option.rolling_batch": "scheduler"},
        "bloom-vllm": {"option.rolling_batch": "vllm"},
        "llama-auto": {"option.rolling_batch": "auto", "option.num_kv_blocks": "64"},
    }, sources={"bloom-auto": bloom_dir, "bloom-scheduler": bloom_dir, "bloom-vllm": bloom_dir,
                "llama-auto": DEFAULT_MODEL}, wait_ready=False, timeout_s=240)
    deadline = time.monotonic() + 240
    while any(s.describe(m).get("state") != "READY" for m in ("bloom-auto", "llama-auto")):
        assert s.proc.poll() is None and time.monotonic() < deadline, s.log()
        time.sleep(0.2)
    yield s
    s.stop()


def test_auto_on_an_unsupported_architecture_serves_with_dynamic_batching(server: ServerProcess,
                                                                         bloom_dir: Path) -> None:
    info = server.describe("bloom-auto")
    assert info["state"] == "READY" and info["batching"] == "dynamic"
    assert info["rolling_batch"] == {"requested": "auto", "effective": "disable", "reason": FALLBACK}
    r = httpx.post(f"{server.url}/predictions/bloom-auto",
                   json={"inputs": "hello world", "parameters": {"max_new_tokens": 5, "do_sample": False,
                                                                 "ignore_eos": True, "details": True}}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["details"]["generated_tokens"] == 5 and isinstance(r.json()["generated_text"], str)
    # dynamic batching has no tokens to stream: as DJL, it answers whole
    r = httpx.post(f"{server.url}/predictions/bloom-auto", json={"inputs": "x", "stream": True}, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    assert isinstance(r.json()["generated_text"], str)
    assert f"model bloom-auto: option.rolling_batch=auto falls back to dynamic batching: {FALLBACK}" in server.log()


@pytest.mark.parametrize("model,requested", [("bloom-scheduler", "scheduler"), ("bloom-vllm", "vllm")])
def test_explicit_rolling_engine_on_an_unsupported_architecture_is_failed(server: ServerProcess, model: str,
                                                                         requested: str) -> None:
    info = server.describe(model)
    assert info["state"] == "FAILED"
    assert info["reason"] == f"{model}/{refusal(requested)}"  # the folder by model name, not by server path
    assert f"model {model}: invalid configuration: " in server.log() and refusal(requested) in server.log()
    r = httpx.post(f"{server.url}/predictions/{model}", json={"inputs": "x"}, timeout=10)
    assert r.status_code == 503 and refusal(requested) in r.json()["error"]


def test_auto_on_a_supported_architecture_is_rolling(server: ServerProcess) -> None:
    info = server.describe("llama-auto")
    assert info["state"] == "READY" and info["batching"] == "rolling"
    assert info["rolling_batch"] == {
        "requested": "auto", "effective": "scheduler",
        "reason": "option.rolling_batch=auto: rolling engine; LlamaForCausalLM (model_type=llama) is supported"}
    r = httpx.post(f"{server.url}/predictions/llama-auto",
                   json={"inputs": "hello", "parameters": {"max_new_tokens": 3, "ignore_eos": True},
                         "stream": True}, timeout=60)
    assert r.status_code == 200 and len([ln for ln in r.text.splitlines() if ln.strip()]) == 3, r.text


def serving_config(model_dir: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "serving", "config", str(model_dir)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


def test_config_command_prints_the_effective_rolling_batch(tmp_path: Path, bloom_dir: Path) -> None:
    auto = write_model(tmp_path, "auto", {"option.rolling_batch": "auto"}, bloom_dir)
    proc = serving_config(auto)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    i = lines.index("effective rolling_batch = disable  (dynamic batching; requested auto)")
    assert lines[i + 1] == f"  reason: {FALLBACK}"
    scheduler = write_model(tmp_path, "scheduler", {"option.rolling_batch": "scheduler"}, bloom_dir)
    proc = serving_config(scheduler)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr == f"error: {scheduler}/{refusal('scheduler')}\n"
