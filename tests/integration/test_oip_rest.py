"""OIP v2 REST (``serving/frontends/http/oip_rest.py``) with the real clients: KServe's SDK REST client (in its own
process: its ``inference`` protos clash with rollserve's) and ``tritonclient.http``; Triton's generate extension with
httpx. Greedy answers equal the LMI route's for the same prompt and parameters."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from tests.integration.harness import ServerProcess, write_model

CLIENT = Path(__file__).with_name("oip_rest_kserve_client.py")
PROMPT = "Deep learning is"
N = 6
PARAMS = {"max_new_tokens": N, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The ``api_server`` fixture's tiny models, and ``empty``: a folder with nothing to load (FAILED); ready while
    any model is (``ping_requires=any``)."""
    workdir = tmp_path_factory.mktemp("oip-rest")
    write_model(workdir / "model_store", "empty", {"batch_size": "1"})
    srv = ServerProcess.start(workdir, models={
        "tiny": {"option.entryPoint": "huggingface", "batch_size": "4", "max_batch_delay": "10",
                 "option.strict_parameters": "true"},
        "tiny-rb": {"option.entryPoint": "huggingface", "option.rolling_batch": "auto",
                    "option.max_rolling_batch_size": "8"}}, config={"ping_requires": "any"}, wait_ready=False,
        timeout_s=240)
    try:
        deadline = time.monotonic() + 300
        while any(srv.describe(m).get("state") not in ("READY", "FAILED") for m in ("tiny", "tiny-rb", "empty")):
            assert time.monotonic() < deadline, srv.log()[-4000:]
            time.sleep(0.2)
        yield srv
    finally:
        srv.stop()


def lmi(server: ServerProcess, model: str, parameters: dict[str, Any] = PARAMS) -> httpx.Response:
    return httpx.post(f"{server.url}/predictions/{model}", json={"inputs": PROMPT, "parameters": parameters},
                      headers=server.inference_headers, timeout=120)


def post(server: ServerProcess, path: str, body: Any) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=server.inference_headers, timeout=120)


def triton_client(server: ServerProcess) -> triton.InferenceServerClient:
    return triton.InferenceServerClient(server.url.removeprefix("http://"), network_timeout=120.0,
                                        connection_timeout=120.0)


def test_kserve_rest_client(server: ServerProcess) -> None:
    env = {**os.environ, **({"ROLLSERVE_TOKEN": server.tokens["inference"]} if "inference" in server.tokens else {})}
    proc = subprocess.run([sys.executable, str(CLIENT), server.url, "tiny-rb", PROMPT, str(N)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    seen = json.loads(proc.stdout)
    expected = lmi(server, "tiny-rb").json()["generated_text"]
    assert (seen["live"], seen["ready"], seen["model_ready"], seen["unknown_model_ready"]) == (True, True, True, False)
    # no exclude_input_in_output: the whole answer starts with the prompt, as on gRPC
    assert seen["json"] == {"model_name": "tiny-rb", "id": "kserve-json", "text": [PROMPT + expected]}
    assert seen["binary"] == {"model_name": "tiny-rb", "id": "kserve-binary", "text": [expected]}
    lmi_invalid = lmi(server, "tiny-rb", {"top_p": 0})
    assert seen["invalid"] == {"status": 400, "error": lmi_invalid.json()["error"]}
    assert seen["unknown"] == {"status": 404, "error": "model 'no-such-model' is not registered"}


def test_tritonclient_http(server: ServerProcess) -> None:
    client = triton_client(server)
    headers = server.inference_headers
    assert client.is_server_live(headers=headers) and client.is_server_ready(headers=headers)
    assert client.is_model_ready("tiny-rb", headers=headers)
    assert not client.is_model_ready("no-such-model", headers=headers)
    assert not client.is_model_ready("empty", headers=headers)  # FAILED
    meta = client.get_server_metadata(headers=headers)
    assert meta["name"] == "rollserve" and meta["extensions"] == ["binary_tensor_data", "generate"]
    model = client.get_model_metadata("tiny-rb", model_version="1", headers=headers)
    assert (model["name"], model["versions"], model["platform"]) == ("tiny-rb", ["1"], "rollserve_rolling")
    assert [(t["name"], t["datatype"], t["shape"]) for t in model["inputs"]] == [
        ("text_input", "BYTES", [-1]), ("stream", "BOOL", [1]), ("sampling_parameters", "BYTES", [1]),
        ("exclude_input_in_output", "BOOL", [1])]
    assert model["outputs"] == [{"name": "text_output", "datatype": "BYTES", "shape": [-1]}]

    for name in ("tiny", "tiny-rb"):
        expected = lmi(server, name).json()["generated_text"]
        prompt = triton.InferInput("text_input", [1], "BYTES")
        prompt.set_data_from_numpy(np.array([PROMPT.encode()], dtype=np.object_))  # binary tensor data
        params = triton.InferInput("sampling_parameters", [1], "BYTES")
        params.set_data_from_numpy(np.array([json.dumps(PARAMS).encode()], dtype=np.object_), binary_data=False)
        result = client.infer(name, [prompt, params], request_id="triton-1", headers=headers)
        assert isinstance(result, triton.InferResult)
        assert result.as_numpy("text_output").tolist() == [(PROMPT + expected).encode()]
        assert result.get_response()["id"] == "triton-1" and result.get_response()["model_version"] == "1"
        # JSON answer (binary_data=False), a version named by the path, vLLM's max_tokens
        exclude = triton.InferInput("exclude_input_in_output", [1], "BOOL")
        exclude.set_data_from_numpy(np.array([True]), binary_data=False)
        vllm = triton.InferInput("sampling_parameters", [1], "BYTES")
        vllm.set_data_from_numpy(np.array([json.dumps({"max_tokens": N, "ignore_eos": True}).encode()],
                                          dtype=np.object_), binary_data=False)
        result = client.infer(name, [prompt, vllm, exclude], model_version="1", headers=headers,
                              outputs=[triton.InferRequestedOutput("text_output", binary_data=False)])
        assert result.as_numpy("text_output").tolist() == [expected]

    with pytest.raises(InferenceServerException) as err:
        client.infer("tiny-rb", [prompt, triton_params({"top_p": 0})], headers=headers)
    assert err.value.status() == "400"
    assert err.value.message() == lmi(server, "tiny-rb", {"top_p": 0}).json()["error"]
    with pytest.raises(InferenceServerException) as err:
        client.infer("no-such-model", [prompt], headers=headers)
    assert err.value.status() == "404"
    client.close()


def triton_params(params: dict[str, Any]) -> triton.InferInput:
    tensor = triton.InferInput("sampling_parameters", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([json.dumps(params).encode()], dtype=np.object_), binary_data=False)
    return tensor


def test_request_parameters_carry_sampling_parameters(server: ServerProcess) -> None:
    """The REST request's ``parameters`` take the sampling parameters the gRPC ``sampling_parameters`` tensor does."""
    expected = lmi(server, "tiny-rb").json()["generated_text"]
    body = {"id": "p-1", "inputs": [{"name": "text_input", "shape": [1, 1], "datatype": "BYTES", "data": [[PROMPT]]},
                                    {"name": "exclude_input_in_output", "shape": [1], "datatype": "BOOL",
                                     "data": [True]}],
            "parameters": PARAMS, "outputs": [{"name": "text_output"}]}
    r = post(server, "/v2/models/tiny-rb/infer", body)
    assert r.status_code == 200, r.text
    assert r.json() == {"model_name": "tiny-rb", "model_version": "1", "id": "p-1", "outputs": [
        {"name": "text_output", "datatype": "BYTES", "shape": [1, 1], "data": [expected]}]}


def test_generate_matches_lmi(server: ServerProcess) -> None:
    for name in ("tiny", "tiny-rb"):
        expected = lmi(server, name).json()["generated_text"]
        r = post(server, f"/v2/models/{name}/generate", {"text_input": PROMPT, "parameters": PARAMS})
        assert r.status_code == 200, r.text
        assert r.json() == {"model_name": name, "model_version": "1", "text_output": PROMPT + expected}
        r = post(server, f"/v2/models/{name}/versions/1/generate",
                 {"text_input": PROMPT, "parameters": {**PARAMS, "exclude_input_in_output": True}})
        assert r.json() == {"model_name": name, "model_version": "1", "text_output": expected}


def sse_events(r: httpx.Response) -> list[dict[str, Any]]:
    assert r.headers["content-type"].startswith("text/event-stream")
    return [json.loads(line[len("data: "):]) for line in r.text.splitlines() if line.startswith("data: ")]


def test_generate_stream_deltas_add_up_to_the_answer(server: ServerProcess) -> None:
    expected = lmi(server, "tiny-rb").json()["generated_text"]
    r = post(server, "/v2/models/tiny-rb/generate_stream", {"text_input": PROMPT, "parameters": PARAMS})
    assert r.status_code == 200, r.text
    events = sse_events(r)
    assert len(events) > 1 and all(set(e) == {"model_name", "model_version", "text_output"} for e in events)
    assert "".join(e["text_output"] for e in events) == expected  # streamed tokens leave the prompt out
    r = post(server, "/v2/models/tiny-rb/generate_stream",
             {"text_input": PROMPT, "exclude_input_in_output": False, "parameters": PARAMS})
    assert "".join(e["text_output"] for e in sse_events(r)) == PROMPT + expected
    r = post(server, "/v2/models/tiny/generate_stream", {"text_input": PROMPT, "parameters": PARAMS})
    assert r.status_code == 400 and "option.rolling_batch" in r.json()["error"]


TENSOR = {"name": "text_input", "shape": [1], "datatype": "BYTES", "data": [PROMPT]}


@pytest.mark.parametrize(("path", "body", "status", "error"), [
    ("/v2/models/tiny-rb/infer", {"inputs": "x"}, 400, "'inputs' must be a list of tensors, got a string"),
    ("/v2/models/tiny-rb/infer", {"inputs": []}, 400, "'inputs' must be a non-empty list of tensors"),
    ("/v2/models/tiny-rb/infer", {"inputs": [{**TENSOR, "data": [1]}]}, 400,
     "'inputs[0].data[0]' must be a string, got an integer"),
    ("/v2/models/tiny-rb/infer", {"inputs": [{**TENSOR, "shape": [2]}]}, 400,
     "input 'text_input' has shape [2] but 1 elements"),
    ("/v2/models/tiny-rb/infer", {"inputs": [{**TENSOR, "datatype": "INT32"}]}, 400,
     "input 'text_input' has datatype 'INT32'; expected BYTES"),
    ("/v2/models/tiny-rb/infer", {"inputs": [{**TENSOR, "name": "image"}]}, 400, "unknown input 'image'"),
    ("/v2/models/tiny-rb/infer", {"inputs": [TENSOR], "outputs": [{"name": "logits"}]}, 400,
     "unknown output 'logits'"),
    ("/v2/models/tiny-rb/infer", {"inputs": [TENSOR], "parameters": {"temperature": 5}}, 400,
     "parameter 'temperature' must be"),
    ("/v2/models/tiny-rb/infer", {"inputs": [TENSOR, {"name": "stream", "shape": [1], "datatype": "BOOL",
                                                      "data": [True]}]}, 400, "input 'stream' true needs"),
    ("/v2/models/tiny-rb/infer", {"inputs": [TENSOR], "parameters": {"max_new_tokens": 2},
                                  **{"model_name": "other"}}, 400, "'model_name' is 'other' but the path names"),
    ("/v2/models/tiny/infer", {"inputs": [TENSOR], "colour": 1}, 400, "unknown fields: 'colour'"),
    ("/v2/models/tiny-rb/generate", {"parameters": PARAMS}, 400, "missing field 'text_input'"),
    ("/v2/models/tiny-rb/generate", {"text_input": 3}, 400, "'text_input' must be a string, got an integer"),
    ("/v2/models/tiny-rb/generate", {"text_input": PROMPT, "stream": True}, 400, "'stream' true needs"),
    ("/v2/models/tiny-rb/generate", {"text_input": PROMPT, "parameters": {"stream": "yes"}}, 400,
     "'parameters.stream' must be a boolean"),
    ("/v2/models/nope/infer", {"inputs": [TENSOR]}, 404, "model 'nope' is not registered"),
    ("/v2/models/tiny-rb/versions/7/infer", {"inputs": [TENSOR]}, 404, "model 'tiny-rb' version 7 is not registered"),
    ("/v2/models/empty/infer", {"inputs": [TENSOR]}, 503, "model 'empty' is FAILED"),
    ("/v2/models/empty/generate", {"text_input": PROMPT}, 503, "model 'empty' is FAILED"),
])
def test_bad_requests_get_the_oip_error(server: ServerProcess, path: str, body: Any, status: int,
                                        error: str) -> None:
    r = post(server, path, body)
    assert r.status_code == status, r.text
    assert r.json()["error"].startswith(error), r.json()
    assert PROMPT in post(server, "/v2/models/tiny-rb/generate", {"text_input": PROMPT, "parameters": PARAMS}).text


def test_binary_body_errors_name_the_header(server: ServerProcess) -> None:
    head = json.dumps({"inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES",
                                   "parameters": {"binary_data_size": 40}}]}).encode()
    r = httpx.post(f"{server.url}/v2/models/tiny-rb/infer", content=head + b"\x03\x00\x00\x00abc",
                   headers={**server.inference_headers, "Inference-Header-Content-Length": str(len(head))})
    assert r.status_code == 400
    assert r.json()["error"] == "'inputs[0].parameters.binary_data_size' (40) overruns the binary data after the " \
                                "JSON (7 bytes left)"


def test_readiness_and_metadata_routes(server: ServerProcess) -> None:
    get = lambda path: httpx.get(f"{server.url}{path}", headers=server.inference_headers, timeout=10)  # noqa: E731
    assert get("/v2/health/live").json() == {"live": True}
    ready = get("/v2/health/ready")
    assert (ready.status_code, ready.json()) == (200, {"ready": True})
    r = get("/v2/models/empty/ready")
    assert r.status_code == 503 and r.json()["ready"] is False and r.json()["error"].startswith(
        "model 'empty' is FAILED")
    assert get("/v2/models/tiny/ready").json() == {"name": "tiny", "ready": True}
    assert get("/v2/models/nope/ready").status_code == 404
    assert get("/v2/models/nope").json()["error"] == "model 'nope' is not registered"
    assert get("/v2/models/empty").json()["name"] == "empty"  # metadata of a model that is not READY


def test_the_real_model_answers_alike_on_every_protocol(smollm2_server: ServerProcess) -> None:
    """SmolLM2-135M-Instruct, rolling (``smollm2``) and dynamic (``dyn``): tritonclient's infer and Triton's
    generate give the LMI route's greedy text."""
    client = triton_client(smollm2_server)
    for name in ("smollm2", "dyn"):
        expected = lmi(smollm2_server, name).json()["generated_text"]
        prompt = triton.InferInput("text_input", [1], "BYTES")
        prompt.set_data_from_numpy(np.array([PROMPT.encode()], dtype=np.object_))
        exclude = triton.InferInput("exclude_input_in_output", [1], "BOOL")
        exclude.set_data_from_numpy(np.array([True]))
        result = client.infer(name, [prompt, triton_params(PARAMS), exclude], headers=smollm2_server.inference_headers)
        assert result.as_numpy("text_output").tolist() == [expected.encode()]
        r = post(smollm2_server, f"/v2/models/{name}/generate", {"text_input": PROMPT, "parameters": PARAMS})
        assert r.json() == {"model_name": name, "model_version": "1", "text_output": PROMPT + expected}
    client.close()
