"""``/openapi.json`` describes every mounted route, and a bounded schemathesis run against it (on the
torch-free server) finds no 5xx."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.integration.harness import ServerProcess

INFERENCE_ROUTES = {"/ping", "/health/live", "/health/ready", "/health/generate", "/predictions/{model_name}",
                    "/models/{model_name}/invoke", "/models", "/models/{name}",
                    "/invocations", "/v1/models", "/v1/completions",
                    "/v1/chat/completions", "/v1/responses", "/v1/responses/{response_id}",
                    "/v1/responses/{response_id}/cancel", "/generate", "/generate_stream", "/", "/info",
                    "/openapi.json", "/tokenize", "/detokenize", "/tokenizer_info", "/v1/models/{model_id}",
                    "/v1/messages", "/v1/messages/count_tokens", "/v1/embeddings",
                    # OIP v2 REST (KServe, Triton)
                    "/v2", "/v2/health/live", "/v2/health/ready",
                    *(f"{base}{tail}" for base in ("/v2/models/{model_name}",
                                                   "/v2/models/{model_name}/versions/{model_version}")
                      for tail in ("", "/ready", "/infer", "/generate", "/generate_stream"))}
MANAGEMENT_ROUTES = {"/models", "/models/{name}", "/requests/{request_id}", "/ping", "/health/live",
                     "/health/ready", "/health/generate", "/metrics", "/openapi.json"}


def test_document_lists_every_route_with_errors(echo_server: ServerProcess) -> None:
    doc = httpx.get(f"{echo_server.url}/openapi.json", timeout=10).json()
    assert doc["openapi"].startswith("3.") and set(doc["paths"]) == INFERENCE_ROUTES
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            if method == "post" and "requestBody" in op:  # a body may be too large (cancel takes none)
                errors = {c for c in op["responses"] if c.startswith(("4", "5"))}
                assert {"404", "413"} <= errors, (path, errors)
                # the Responses API and the embeddings route answer in OpenAI's error shape, Messages in Anthropic's
                own_shape = {"/v1/responses": "/ResponsesError", "/v1/embeddings": "/EmbeddingError",
                             "/v1/messages": "/AnthropicError"}
                assert op["responses"]["413"]["content"]["application/json"]["schema"]["$ref"].endswith(
                    next((v for k, v in own_shape.items() if path.startswith(k)), "/Error"))
    mgmt = httpx.get(f"{echo_server.mgmt}/openapi.json", headers=echo_server.mgmt_headers, timeout=10).json()
    assert set(mgmt["paths"]) == MANAGEMENT_ROUTES


def test_schemathesis_finds_no_server_error(echo_server: ServerProcess, tmp_path: Path) -> None:
    st = shutil.which("st") or str(Path(sys.executable).parent / "st")
    if not Path(st).exists():
        pytest.skip("schemathesis is not installed")
    cmd = [st, "run", f"{echo_server.url}/openapi.json", "--checks", "not_a_server_error",
           "--max-examples", "12", "--seed", "1", "--request-timeout", "20", "--no-color",
           "--phases", "examples,fuzzing", "--workers", "2",
           "--report-dir", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    log = echo_server.log()
    assert "Traceback" not in log, log[-4000:]
