"""KServe's Python SDK REST client (``InferenceRESTClient``, protocol v2) against a rollserve server; prints JSON.

Run in its own process by ``test_oip_rest.py``: ``import kserve`` loads KServe's ``inference`` protos, whose names
clash with rollserve's in one process. Usage: ``oip_rest_kserve_client.py URL MODEL PROMPT MAX_NEW_TOKENS``; the
inference token, when the server wants one, in ``ROLLSERVE_TOKEN``.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Any

import httpx
import numpy as np
from kserve import InferenceRESTClient, InferInput, InferRequest, InferResponse, RESTConfig
from kserve.protocol.infer_type import RequestedOutput


def prompt_input(prompt: str, binary: bool) -> InferInput:
    tensor = InferInput(name="text_input", shape=[1], datatype="BYTES")
    tensor.set_data_from_numpy(np.array([prompt.encode("utf-8")], dtype=np.object_), binary_data=binary)
    return tensor


def texts(response: InferResponse) -> list[str]:
    out = response.outputs[0]
    assert isinstance(response, InferResponse) and out.name == "text_output" and out.datatype == "BYTES"
    return [t.decode("utf-8") if isinstance(t, bytes) else t for t in out.data]


def httpx_auth(token: str) -> httpx.Auth:
    """The bearer token on every request the SDK sends."""
    class Bearer(httpx.Auth):
        def auth_flow(self, request: httpx.Request) -> Any:
            request.headers["Authorization"] = f"Bearer {token}"
            yield request
    return Bearer()


async def main(url: str, model: str, prompt: str, max_new_tokens: int) -> dict[str, Any]:
    token = os.environ.get("ROLLSERVE_TOKEN")
    client = InferenceRESTClient(RESTConfig(protocol="v2", timeout=180,
                                            auth=httpx_auth(token) if token else None))
    params = {"max_new_tokens": max_new_tokens, "ignore_eos": True}
    seen: dict[str, Any] = {
        "live": await client.is_server_live(url), "ready": await client.is_server_ready(url),
        "model_ready": await client.is_model_ready(url, model),
        "unknown_model_ready": await client.is_model_ready(url, "no-such-model")}
    request = InferRequest(model_name=model, infer_inputs=[prompt_input(prompt, binary=False)],
                           request_id="kserve-json", parameters=params)
    response = await client.infer(url, request, model_name=model)
    seen["json"] = {"model_name": response.model_name, "id": response.id, "text": texts(response)}
    # Triton's binary tensor extension: the prompt's bytes after the JSON, the answer's too
    exclude = InferInput(name="exclude_input_in_output", shape=[1], datatype="BOOL", data=[True])
    request = InferRequest(model_name=model, infer_inputs=[prompt_input(prompt, binary=True), exclude],
                           request_id="kserve-binary", parameters=params,
                           request_outputs=[RequestedOutput("text_output", {"binary_data": True})])
    response = await client.infer(url, request, model_name=model)
    seen["binary"] = {"model_name": response.model_name, "id": response.id, "text": texts(response)}
    bad = InferRequest(model_name=model, infer_inputs=[prompt_input(prompt, binary=False)], request_id="kserve-bad",
                       parameters={"top_p": 0})
    try:
        await client.infer(url, bad, model_name=model)
        seen["invalid"] = None
    except httpx.HTTPStatusError as exc:
        seen["invalid"] = {"status": exc.response.status_code, "error": exc.response.json()["error"]}
    try:
        await client.infer(url, request, model_name="no-such-model")
        seen["unknown"] = None
    except httpx.HTTPStatusError as exc:
        seen["unknown"] = {"status": exc.response.status_code, "error": exc.response.json()["error"]}
    await client.close()
    return seen


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])))))
