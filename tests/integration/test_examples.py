"""Every example under examples/ runs: each model folder is served as the README says (``serving -m
NAME=PATH``) and answers, and each client script runs against a real server and prints what it should.
(The observability example -- prometheus.yml and the Grafana dashboard -- runs in test_prometheus.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from tests.integration.harness import DEFAULT_MODEL, REPO, ServerProcess

EXAMPLES = REPO / "examples"
MODELS = {"tiny-llama": DEFAULT_MODEL, "custom": EXAMPLES / "models" / "custom-handler",
          "echo": EXAMPLES / "models" / "echo", "rolling-llama": EXAMPLES / "models" / "rolling-llama"}


def test_every_example_is_covered() -> None:
    found = {p.relative_to(EXAMPLES).as_posix() for p in EXAMPLES.rglob("*") if p.is_file()}
    covered = {"clients/curl.sh", "clients/grpc_client.py", "clients/http_stream.py", "clients/openai_client.py",
               "models/custom-handler/model.py", "models/custom-handler/serving.properties",
               "models/echo/serving.properties", "models/rolling-llama/serving.properties",
               *(f"models/tiny-llama/{name}" for name in (  # the small model tests and benchmarks serve
                   "serving.properties", "config.json", "generation_config.json", "model.safetensors",
                   "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")),
               "observability/README.md", "observability/prometheus.yml", "observability/grafana-dashboard.json"}
    assert found == covered, "a new example needs a test here"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    args = [arg for name, path in MODELS.items() for arg in ("-m", f"{name}={path}")]
    s = ServerProcess.start(tmp_path_factory.mktemp("examples"), extra_args=args, timeout_s=240)
    yield s
    s.stop()


def run_client(*args: str, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(list(args), cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_example_model_folders_load_and_answer(server: ServerProcess) -> None:
    assert {m: server.describe(m)["state"] for m in MODELS} == dict.fromkeys(MODELS, "READY")
    r = httpx.post(f"{server.url}/predictions/custom", json={"inputs": "Hello", "shout": True}, timeout=60)
    assert (r.status_code, r.json()) == (200, {"reply": "HI THERE, HELLO", "length": 15})
    r = httpx.post(f"{server.url}/predictions/echo", json={"inputs": "echo me"}, timeout=60)
    assert (r.status_code, r.json()) == (200, {"generated_text": "echo me"})
    assert server.describe("rolling-llama")["batching"] == "rolling"
    body = {"inputs": "Deep learning is", "stream": True, "parameters": {"max_new_tokens": 6, "ignore_eos": True}}
    with httpx.stream("POST", f"{server.url}/predictions/rolling-llama", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = [json.loads(line) for line in r.iter_lines() if line.strip()]
    assert len(events) == 6 and events[-1]["details"]["generated_tokens"] == 6
    same = httpx.post(f"{server.url}/predictions/tiny-llama", json={**body, "stream": False}, timeout=60)
    assert events[-1]["generated_text"] == same.json()["generated_text"]  # the default model's weights


def test_curl_script(server: ServerProcess) -> None:
    out = run_client("bash", str(EXAMPLES / "clients" / "curl.sh"),
                     env={"H": server.url, "M": server.mgmt, "MODEL": "tiny-llama",
                          "KEY_FILE": str(server.workdir / "key_file.json")})
    assert '"status":"Healthy"' in out and '"generated_text"' in out and '"chat.completion"' in out
    assert '"finish_reason":"length"' in out and "rollserve_requests_total{" in out
    assert '"changed":{"max_rolling_batch_size":32}' in out


def test_http_stream_client(server: ServerProcess) -> None:
    out = run_client(sys.executable, str(EXAMPLES / "clients" / "http_stream.py"), "--url", server.url,
                     "--model", "tiny-llama", "--max-new-tokens", "8", "Hello")
    assert "\n---\nfinish: length timings: {" in out and "'ttft_ms'" in out


def test_grpc_client(server: ServerProcess) -> None:
    out = run_client(sys.executable, str(EXAMPLES / "clients" / "grpc_client.py"), "--target", server.grpc_target,
                     "--model", "tiny-llama", "--max-new-tokens", "8", "Hello")
    assert "[FINISH_REASON_LENGTH] ttft " in out and ", 8 tokens" in out
    out = run_client(sys.executable, str(EXAMPLES / "clients" / "grpc_client.py"), "--target", server.grpc_target,
                     "--model", "echo", "Hello there")  # a dynamic-batching model: the whole answer instead
    assert out.startswith("Hello there\n")


def test_openai_client(server: ServerProcess) -> None:
    out = run_client(sys.executable, str(EXAMPLES / "clients" / "openai_client.py"), "--base-url",
                     f"{server.url}/v1", "--model", "tiny-llama")
    assert out.startswith("chat: ") and "CompletionUsage(" in out and out.count("\n") == 2
