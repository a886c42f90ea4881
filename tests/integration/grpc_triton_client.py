"""A tritonclient.grpc session against a rollserve server, run as its own process by the gRPC tests.

tritonclient registers its own ``inference.*`` protobuf symbols, which clash with rollserve's in one
process, so the tests run this script in a subprocess: ``python grpc_triton_client.py TARGET MODEL PROMPT
MAX_NEW_TOKENS [MANAGEMENT_TOKEN]`` prints one JSON object with what the client saw (the repository calls
send the management token).
"""

from __future__ import annotations

import json
import queue
import sys
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException


def text_inputs(prompt: str, params: dict[str, Any], stream: bool | None = None,
                exclude_input: bool | None = None) -> list[grpcclient.InferInput]:
    inputs = []
    text = grpcclient.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_))
    inputs.append(text)
    sampling = grpcclient.InferInput("sampling_parameters", [1], "BYTES")
    sampling.set_data_from_numpy(np.array([json.dumps(params).encode()], dtype=np.object_))
    inputs.append(sampling)
    for name, flag in (("stream", stream), ("exclude_input_in_output", exclude_input)):
        if flag is not None:
            t = grpcclient.InferInput(name, [1], "BOOL")
            t.set_data_from_numpy(np.array([flag], dtype=bool))
            inputs.append(t)
    return inputs


def decode(result: Any) -> list[str]:
    return [b.decode() for b in result.as_numpy("text_output").reshape(-1)]


def main(target: str, model: str, prompt: str, max_new_tokens: int, token: str = "") -> dict[str, Any]:
    client = grpcclient.InferenceServerClient(url=target)
    auth = {"authorization": f"Bearer {token}"} if token else None
    params = {"max_new_tokens": max_new_tokens, "ignore_eos": True}
    out: dict[str, Any] = {
        "live": client.is_server_live(), "ready": client.is_server_ready(),
        "model_ready": client.is_model_ready(model), "unknown_model_ready": client.is_model_ready("no-such-model"),
        "server_metadata": client.get_server_metadata(as_json=True),
        "model_metadata": client.get_model_metadata(model, as_json=True),
        "index": client.get_model_repository_index(headers=auth, as_json=True),
    }
    result = client.infer(model, text_inputs(prompt, params, exclude_input=True), request_id="infer-1",
                          outputs=[grpcclient.InferRequestedOutput("text_output")])
    out["infer_text"] = decode(result)
    out["infer_id"] = result.get_response().id
    # vLLM-backend spelling, and the prompt included by default in whole answers
    result = client.infer(model, text_inputs(prompt, {"max_tokens": max_new_tokens, "ignore_eos": True}))
    out["infer_full_text"] = decode(result)
    try:
        client.infer(model, text_inputs(prompt, {"top_p": 0}))
        out["invalid"] = None
    except InferenceServerException as exc:
        out["invalid"] = {"status": exc.status(), "message": exc.message()}

    responses: queue.Queue[Any] = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    client.async_stream_infer(model, text_inputs(prompt, params, stream=True), request_id="stream-1")
    pieces, finals, errors = [], [], []
    while True:
        result, error = responses.get(timeout=120)
        if error is not None:
            errors.append(str(error))
            break
        pieces.extend(decode(result))
        response = result.get_response()
        final = response.parameters["triton_final_response"].bool_param
        finals.append(final)
        if final:
            break
    client.async_stream_infer(model, text_inputs(prompt, {"nonsense": 1}, stream=True), request_id="stream-bad")
    result, error = responses.get(timeout=120)
    out["stream_error"] = str(error) if error is not None else None
    client.stop_stream()
    out.update(stream_pieces=pieces, stream_finals=finals, stream_errors=errors)

    client.unload_model("echo", headers=auth)  # the repository extension, on the torch-free model
    out["echo_after_unload"] = {m["name"]: m.get("state") for m in
                                client.get_model_repository_index(headers=auth, as_json=True)["models"]}.get("echo")
    client.load_model("echo", headers=auth)
    out["echo_ready_after_load"] = client.is_model_ready("echo")
    client.close()
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), *sys.argv[5:6])))
