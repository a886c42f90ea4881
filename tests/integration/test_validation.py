"""Strict validation before any work: every bad input gets its documented status and the uniform error
body ``{"error", "error_type", "request_id"}``, and the server logs no error while refusing them."""

from __future__ import annotations

import re
import socket
from typing import Any
from urllib.parse import urlparse

import httpx
import pytest

from tests.integration.harness import ServerProcess

LONG = "word " * 3000  # ~3000 tokens: longer than the 2048-token context
P = "/predictions/tiny"
C = "/v1/completions"
CH = "/v1/chat/completions"
G = "/generate?model_name=tiny"


def lmi(params: dict[str, Any] | None = None, inputs: Any = "Hello") -> dict[str, Any]:
    body: dict[str, Any] = {"inputs": inputs}
    if params is not None:
        body["parameters"] = params
    return body


def oai(**kw: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": "Hello", "max_tokens": 2, **kw}


# (id, path, json body or raw bytes, status, regex the error message must match)
CASES: list[tuple[str, str, Any, int, str]] = [
    ("lmi-wrong-type", P, lmi(inputs=5), 400, "inputs.*string"),
    ("lmi-true-for-int", P, lmi({"max_new_tokens": True}), 400, "max_new_tokens.*integer"),
    ("lmi-float-for-int", P, lmi({"top_k": 1.5}), 400, "top_k.*integer"),
    ("lmi-string-for-number", P, lmi({"temperature": "hot"}), 400, "temperature.*number"),
    ("lmi-nan", P, b'{"inputs": "x", "parameters": {"temperature": NaN}}', 400, "NaN"),
    ("lmi-infinity", P, b'{"inputs": "x", "parameters": {"top_p": Infinity}}', 400, "Infinity"),
    ("lmi-unknown-params", P, lmi({"foo": 1, "bar": 2, "max_new_tokens": 2}), 400, "unknown parameters: bar, foo"),
    ("lmi-unknown-fields", P, {**lmi(), "extra": 1}, 400, "unknown fields: extra"),
    ("lmi-empty-prompt", P, lmi(inputs=""), 400, "must not be empty"),
    ("lmi-prompt-too-long", P, lmi({"max_new_tokens": 2}, inputs=LONG), 400, r"\d{4} tokens.*2048"),
    ("lmi-max-new-tokens-zero", P, lmi({"max_new_tokens": 0}), 400, "max_new_tokens.*>= 1"),
    ("lmi-max-new-tokens-cap", P, lmi({"max_new_tokens": 5000}), 400, "max_new_tokens.*<= 4096"),
    ("lmi-too-many-stops", P, lmi({"stop_sequences": ["s"] * 17}), 400, "at most 16"),
    ("lmi-stop-too-long", P, lmi({"stop_sequences": ["s" * 300]}), 400, "at most 256"),
    ("lmi-not-utf8", P, b'{"inputs": "\xff\xfe"}', 400, "UTF-8"),
    ("lmi-lone-surrogate", P, b'{"inputs": "a\\ud800b"}', 400, "surrogate"),
    ("lmi-bad-json", P, b'{"inputs": ', 400, "not valid JSON"),
    ("lmi-empty-body", P, b"", 400, "empty"),
    ("lmi-not-object", P, [1, 2], 400, "JSON object"),
    ("lmi-unknown-model", "/predictions/nope", lmi(), 404, "nope"),
    ("oai-true-for-int", C, oai(max_tokens=True), 400, "max_tokens.*integer"),
    ("oai-n-cap", C, oai(n=100), 400, "'n' must be >= 1 and <= 8, got 100"),
    ("oai-n-type", C, oai(n="2"), 400, "'n' must be an integer"),
    ("oai-unknown-fields", C, oai(foo=1, bar=None), 400, "unknown fields: bar, foo"),
    ("oai-empty-prompt", C, oai(prompt=""), 400, "must not be empty"),
    ("oai-empty-prompt-list", C, oai(prompt=[]), 400, "prompt"),
    ("oai-prompt-too-long", C, oai(prompt=LONG), 400, r"prompt has \d{4} tokens.*2048 tokens"),
    ("oai-prompt-plus-max-tokens", C, oai(prompt="Hello", max_tokens=2047), 400,
     r"prompt has \d tokens and max_tokens is 2047"),
    ("oai-max-tokens-cap", C, oai(max_tokens=5000), 400, "max_tokens.*4096"),
    ("oai-max-tokens-zero", C, oai(max_tokens=0), 400, "max_tokens"),
    ("oai-temperature-range", C, oai(temperature=-1), 400, "temperature"),
    ("oai-stop-count", C, oai(stop=["x"] * 17), 400, "at most 16"),
    ("oai-logprobs-cap", C, oai(logprobs=50), 400, "logprobs"),
    ("oai-token-ids-bad", C, oai(prompt=[1, -5]), 400, r"'prompt\[1\]' must be >= 0 and <= 2147483647, got -5"),
    ("oai-penalty", C, oai(presence_penalty=2.5), 400, "'presence_penalty' must be >= -2 and <= 2, got 2.5"),
    ("oai-logit-bias-key", C, oai(logit_bias={"a5": 1}), 400, "'logit_bias' keys must be token ids"),
    ("oai-min-tokens", C, oai(max_tokens=4, min_tokens=9), 400, r"min_tokens must be in \[0, max_new_tokens=4\]"),
    ("oai-stream-options-no-stream", C, oai(stream_options={"include_usage": True}), 400, "stream_options"),
    ("oai-model-type", C, oai(model=5), 400, "'model' must be a string"),
    ("oai-unknown-model", C, oai(model="nope"), 404, "nope"),
    ("chat-no-messages", CH, {"model": "tiny", "messages": []}, 400, "messages"),
    ("chat-bad-role", CH, {"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}, 400, "role"),
    ("chat-surrogate", CH, b'{"model": "tiny", "messages": [{"role": "user", "content": "\\udc00"}]}', 400,
     "surrogate"),
    ("chat-no-template", CH, {"model": "echo", "messages": [{"role": "user", "content": "x"}]}, 400,
     "no chat template"),
    ("chat-tools", CH, {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "tools": [{}]}, 400,
     "missing field 'tools.0..function'"),
    ("chat-bad-schema", CH, {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}}, 400,
     "'response_format.json_schema.schema' cannot be used as a constraint: Invalid type: objec"),
    ("echo-constraint", C, {"model": "echo", "prompt": "x", "guided_regex": "a+"}, 400,
     "does not apply structured-output"),
    ("tgi-wrong-type", G, {"inputs": ["x"]}, 422, "inputs.*string"),
    ("tgi-unsupported", G, {"inputs": "x", "parameters": {"watermark": True}}, 422, "watermark"),
    ("tgi-prompt-too-long", G, {"inputs": LONG, "parameters": {"max_new_tokens": 2}}, 422, r"\d{4} tokens.*2048"),
]


@pytest.fixture(scope="module")
def log_start(api_server: ServerProcess) -> int:
    return len(api_server.log())


@pytest.mark.parametrize("name,path,body,status,pattern", CASES, ids=[c[0] for c in CASES])
def test_bad_input(api_server: ServerProcess, log_start: int, name: str, path: str, body: Any, status: int,
                   pattern: str) -> None:
    rid = f"val-{name}"
    headers = {"X-Request-Id": rid, "Content-Type": "application/json"}
    if isinstance(body, bytes):
        r = httpx.post(api_server.url + path, content=body, headers=headers, timeout=60)
    else:
        r = httpx.post(api_server.url + path, json=body, headers=headers, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()
    assert set(err) == {"error", "error_type", "request_id"}
    assert err["request_id"] == rid == r.headers["x-request-id"]
    assert re.search(pattern, err["error"]), err["error"]


@pytest.mark.parametrize(("path", "body", "names"), [
    ("/predictions/tiny-rb", lmi({"foo": 1, "bar": 2, "max_new_tokens": 2}), "parameters.bar, parameters.foo"),
    ("/predictions/tiny-rb", {**lmi({"max_new_tokens": 2}), "extra": 1}, "extra"),
    (C, {**oai(foo=1), "model": "tiny-rb"}, "foo"),
    (CH, {"model": "tiny-rb", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "colour": "red"},
     "colour"),
    ("/generate?model_name=tiny-rb", {"inputs": "Hello", "parameters": {"max_new_tokens": 2, "best_of_n": 3}},
     "parameters.best_of_n"),
])
def test_unknown_fields_are_ignored_and_named_by_default(api_server: ServerProcess, path: str, body: Any,
                                                         names: str) -> None:
    """As DJL and vLLM: an unknown field is dropped (a log line, X-Ignored-Parameters) unless the model sets
    option.strict_parameters=true (``tiny`` does: the cases above)."""
    r = httpx.post(api_server.url + path, json=body, headers={"X-Request-Id": "lenient-1"}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.headers["x-ignored-parameters"] == names
    assert f"request lenient-1 model tiny-rb: ignored unknown fields: {names}" in api_server.log()


def test_413_decided_from_content_length(api_server: ServerProcess) -> None:
    """A declared body above max_request_size is refused before a byte of it is sent."""
    u = urlparse(api_server.url)
    with socket.create_connection((u.hostname, u.port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"X-Request-Id: big-1\r\nContent-Length: 1000000000\r\n\r\n")
        raw = b""
        while b"\r\n\r\n" not in raw or not raw.rstrip().endswith(b"}"):  # headers and body may split
            chunk = s.recv(65536)
            if not chunk:
                break
            raw += chunk
        data = raw.decode("latin-1")
    assert data.startswith("HTTP/1.1 413"), data
    assert '"error_type":"payload_too_large"' in data.replace(" ", "") and "big-1" in data


def test_no_server_error_logged(api_server: ServerProcess, log_start: int) -> None:
    """Runs after the table: refusing bad input never logs an error or a traceback."""
    log = api_server.log()[log_start:]
    bad = [line for line in log.splitlines() if "Traceback" in line or " ERROR " in line or "status 500" in line]
    assert not bad, "\n".join(bad[:20])
