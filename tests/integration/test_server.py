"""The default model through a real server process and a real HTTP client: LMI/SageMaker routes, greedy
output equal to the model's own ``transformers`` ``generate`` (alone and inside a concurrent batch), the
JSON error shape, and a frontend process that never loads torch."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration.harness import REPO, ServerProcess, greedy_references

MODEL = "tiny-llama"
MAX_NEW_TOKENS = 8
MAX_REQUEST_SIZE = 4096
PROMPTS = [
    "Hello, my name is",
    "The capital of France",
    "1 2 3 4 5",
    "Once upon a time there was a very small model that",
    "a",
    "Why is the sky blue?",
    "def main():",
    "The quick brown fox jumps over the lazy dog and then",
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    s = ServerProcess.start(
        tmp_path_factory.mktemp("server"),
        models={MODEL: {"option.entryPoint": "huggingface", "option.dtype": "fp32", "batch_size": "8",
                        "max_batch_delay": "500"}},
        config={"max_request_size": str(MAX_REQUEST_SIZE)})
    yield s
    s.stop()


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    """Greedy token ids of every prompt from transformers' own generate, one prompt at a time, fp32."""
    return greedy_references(PROMPTS, MAX_NEW_TOKENS)


def token_ids(answer: dict[str, Any]) -> list[int]:
    return [t["id"] for t in answer["details"]["tokens"]]


def greedy_body(prompt: str | list[str]) -> dict[str, Any]:
    return {"inputs": prompt, "parameters": {"max_new_tokens": MAX_NEW_TOKENS, "do_sample": False, "details": True}}


def test_predictions_and_invocations(server: ServerProcess) -> None:
    r = httpx.post(f"{server.url}/predictions/{MODEL}", json={"inputs": "Hello", "parameters": {"max_new_tokens": 3}},
                   timeout=60)
    assert r.status_code == 200, r.text
    assert set(r.json()) == {"generated_text"} and isinstance(r.json()["generated_text"], str)
    assert r.headers["X-Request-Id"] and int(r.headers["X-Generated-Tokens"]) <= 3
    # SageMaker route: a single model needs no model_name; a list input gives a list answer
    r = httpx.post(f"{server.url}/invocations",
                   json={"inputs": ["Hello", "World"], "parameters": {"max_new_tokens": 2}},
                   timeout=60)
    assert r.status_code == 200, r.text
    answers = r.json()
    assert isinstance(answers, list) and len(answers) == 2 and all("generated_text" in a for a in answers)
    r = httpx.post(f"{server.url}/invocations?model_name={MODEL}",
                   json={"inputs": "Hi", "parameters": {"max_new_tokens": 1}},
                   timeout=60)
    assert r.status_code == 200 and "generated_text" in r.json()


def test_greedy_alone_equals_transformers_generate(server: ServerProcess, reference: dict[str, list[int]]) -> None:
    for prompt in PROMPTS[:2]:
        r = httpx.post(f"{server.url}/predictions/{MODEL}", json=greedy_body(prompt), timeout=60)
        assert r.status_code == 200, r.text
        answer = r.json()
        assert token_ids(answer) == reference[prompt], prompt
        assert answer["details"]["generated_tokens"] == len(reference[prompt])


def test_greedy_in_a_concurrent_batch_of_8_equals_transformers_generate(
        server: ServerProcess, reference: dict[str, list[int]]) -> None:
    before = server.describe(MODEL)["batcher"]["batches_total"]

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(client.post(f"{server.url}/predictions/{MODEL}", json=greedy_body(p))
                                          for p in PROMPTS))

    responses = asyncio.run(burst())
    for prompt, r in zip(PROMPTS, responses, strict=True):
        assert r.status_code == 200, r.text
        assert token_ids(r.json()) == reference[prompt], prompt
    # the 8 requests were batched (max_batch_delay=500 ms gives them ample time to meet)
    assert server.describe(MODEL)["batcher"]["batches_total"] - before <= 2


def test_list_input_is_batched_and_equals_generate(server: ServerProcess, reference: dict[str, list[int]]) -> None:
    r = httpx.post(f"{server.url}/invocations", json=greedy_body(PROMPTS[2:6]), timeout=120)
    assert r.status_code == 200, r.text
    assert [token_ids(a) for a in r.json()] == [reference[p] for p in PROMPTS[2:6]]


def assert_error(r: httpx.Response, status: int, error_type: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error", "error_type", "request_id"}, body
    assert body["error_type"] == error_type and body["error"] and body["request_id"]
    for leak in ("Traceback", 'File "', "/work", "/tmp", str(REPO), ".py"):
        assert leak not in r.text, f"{leak!r} leaked in {r.text}"
    return body


def test_errors_are_json_without_internals(server: ServerProcess) -> None:
    url = server.url
    assert_error(httpx.post(f"{url}/predictions/nope", json={"inputs": "x"}, timeout=10), 404, "not_found")
    assert_error(httpx.post(f"{url}/predictions/{MODEL}", content=b"{not json", timeout=10), 400, "invalid_request")
    assert_error(httpx.post(f"{url}/predictions/{MODEL}", content=b"\xff\xfe", timeout=10), 400, "invalid_request")
    assert_error(httpx.post(f"{url}/predictions/{MODEL}", json={"inputs": "x", "parameters": {"max_new_tokens": -1}},
                            timeout=10), 400, "invalid_request")
    assert_error(httpx.post(f"{url}/predictions/{MODEL}", json={"inputs": "x", "stream": "yes"}, timeout=10),
                 400, "invalid_request")
    assert_error(httpx.get(f"{url}/no/such/route", timeout=10), 404, "not_found")
    assert_error(httpx.get(f"{url}/predictions/{MODEL}", timeout=10), 405, "method_not_allowed")
    # the model API is off by default: 403 naming the key, before the model is even looked up
    forbidden = assert_error(httpx.delete(f"{server.mgmt}/models/nope", headers=server.mgmt_headers, timeout=10),
                             403, "forbidden")
    assert "enable_model_api" in forbidden["error"]
    big = {"inputs": "x" * (MAX_REQUEST_SIZE + 10)}
    assert_error(httpx.post(f"{url}/predictions/{MODEL}", json=big, timeout=10), 413, "payload_too_large")

    def chunked() -> Iterator[bytes]:  # no Content-Length: the limit holds while reading
        yield b'{"inputs": "'
        for _ in range(MAX_REQUEST_SIZE // 512 + 2):
            yield b"y" * 512
        yield b'"}'

    assert_error(httpx.post(f"{url}/predictions/{MODEL}", content=chunked(), timeout=10), 413, "payload_too_large")
    rid = "my-request-42"
    body = assert_error(httpx.post(f"{url}/predictions/nope", json={}, headers={"X-Request-Id": rid}, timeout=10),
                        404, "not_found")
    assert body["request_id"] == rid


def test_frontend_process_never_loads_torch(server: ServerProcess) -> None:
    maps = Path(f"/proc/{server.proc.pid}/maps").read_text()
    assert "libtorch" not in maps and "torch/lib" not in maps
    # ...while its worker does (the check above is meaningful)
    assert any("libtorch" in Path(f"/proc/{pid}/maps").read_text() for pid in server.worker_pids())
    code = ("import sys\n"
            "import serving.server, serving.cli, serving.models.registry, serving.models.endpoint\n"
            "import serving.config.model_config\n"
            "import serving.batching.dynamic, serving.batching.rolling, serving.worker.pool, serving.worker.handle\n"
            "import serving.frontends.http.lmi, serving.frontends.http.management, serving.frontends.http.apps\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'handlers'))\n"
            "assert not bad, bad\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
