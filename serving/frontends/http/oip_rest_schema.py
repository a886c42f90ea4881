"""The OpenAPI description of the OIP v2 REST routes (``oip_rest``), merged into ``/openapi.json`` by ``openapi``.

Design note: written by hand from what ``oip_rest_tensors`` accepts (tensor ``name``/``shape``/``datatype``/
``data``, request ``parameters`` holding LMI's sampling parameters plus ``binary_data_output``, generate's
``text_input``); errors are the server-wide ``Error`` body, whose ``error`` string is the OIP's error object.
"""

from __future__ import annotations

from typing import Any

INFERENCE_ERRORS = ("400", "401", "404", "409", "413", "424", "499", "500", "502", "503", "504")


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(description: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _path(name: str) -> dict[str, Any]:
    return {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}


def oip_components() -> dict[str, Any]:
    """Request and answer schemas of the OIP routes."""
    sampling = {"type": "object", "description": "the sampling parameters (LMI's `parameters`, vLLM's "
                "`max_tokens` too) and Triton's `binary_data_output`"}
    tensor = {"type": "object", "required": ["name", "shape", "datatype"], "properties": {
        "name": {"type": "string", "enum": ["text_input", "stream", "sampling_parameters",
                                            "exclude_input_in_output"]},
        "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}},
        "datatype": {"type": "string", "enum": ["BYTES", "BOOL"]},
        "parameters": {"type": "object", "properties": {"binary_data_size": {"type": "integer", "minimum": 0}}},
        "data": {"type": "array", "description": "row-major elements (nested lists allowed): strings for BYTES, "
                                                 "booleans for BOOL"}}}
    output = {"type": "object", "required": ["name", "datatype", "shape"], "properties": {
        "name": {"type": "string"}, "datatype": {"type": "string"},
        "shape": {"type": "array", "items": {"type": "integer"}}, "data": {"type": "array"},
        "parameters": {"type": "object"}}}
    return {
        "OipTensor": tensor,
        "OipInferRequest": {"type": "object", "required": ["inputs"], "properties": {
            "id": {"type": "string"}, "model_name": {"type": "string", "description": "the path's, if given"},
            "parameters": sampling, "inputs": {"type": "array", "minItems": 1, "items": _ref("OipTensor")},
            "outputs": {"type": "array", "items": {"type": "object", "required": ["name"], "properties": {
                "name": {"type": "string", "enum": ["text_output"]},
                "parameters": {"type": "object", "properties": {"binary_data": {"type": "boolean"}}}}}}}},
        "OipInferAnswer": {"type": "object", "required": ["model_name", "model_version", "id", "outputs"],
                           "properties": {"model_name": {"type": "string"}, "model_version": {"type": "string"},
                                          "id": {"type": "string"}, "outputs": {"type": "array", "items": output}}},
        "OipGenerateRequest": {"type": "object", "required": ["text_input"], "properties": {
            "text_input": {"type": "string"}, "parameters": {**sampling, "description": "the sampling parameters; "
                                                             "`stream` and `exclude_input_in_output` may be here"},
            "stream": {"type": "boolean"}, "exclude_input_in_output": {"type": "boolean"}}},
        "OipGenerateAnswer": {"type": "object", "required": ["model_name", "model_version", "text_output"],
                              "properties": {"model_name": {"type": "string"}, "model_version": {"type": "string"},
                                             "text_output": {"type": "string"}}},
        "OipModelMetadata": {"type": "object", "required": ["name", "versions", "platform", "inputs", "outputs"],
                             "properties": {"name": {"type": "string"},
                                            "versions": {"type": "array", "items": {"type": "string"}},
                                            "platform": {"type": "string"}, "inputs": {"type": "array"},
                                            "outputs": {"type": "array"}}},
    }


def oip_paths(errors: dict[str, str]) -> dict[str, Any]:
    """The OIP v2 REST paths; ``errors``: the descriptions of the status codes."""
    def answers(ok: dict[str, Any], codes: tuple[str, ...]) -> dict[str, Any]:
        return {"200": ok, **{c: _json(errors[c], _ref("Error")) for c in codes}}

    def post(summary: str, body: str, ok: dict[str, Any], params: list[dict[str, Any]]) -> dict[str, Any]:
        return {"post": {"summary": summary, "parameters": params, "requestBody": {
            "required": True, "content": {"application/json": {"schema": _ref(body)}}},
            "responses": answers(ok, INFERENCE_ERRORS)}}

    probe = {"application/json": {"schema": {"type": "object"}}}
    paths: dict[str, Any] = {
        "/v2": {"get": {"summary": "OIP server metadata (name, version, extensions)", "responses": answers(
            _json("server metadata", {"type": "object"}), ("401",))}},
        "/v2/health/live": {"get": {"summary": "OIP liveness; no token needed", "security": [], "responses": {
            "200": {"description": "live", "content": probe}}}},
        "/v2/health/ready": {"get": {"summary": "OIP readiness (ping_requires); no token needed", "security": [],
                                     "responses": {"200": {"description": "ready", "content": probe},
                                                   "503": {"description": "not ready", "content": probe}}}},
    }
    for base, params in (("/v2/models/{model_name}", [_path("model_name")]),
                         ("/v2/models/{model_name}/versions/{model_version}",
                          [_path("model_name"), _path("model_version")])):
        paths[base] = {"get": {"summary": "OIP model metadata (its tensors)", "parameters": params,
                               "responses": answers(_json("model metadata", _ref("OipModelMetadata")),
                                                    ("401", "404"))}}
        paths[f"{base}/ready"] = {"get": {"summary": "OIP model readiness: 200 READY, 503 otherwise (with the "
                                                     "reason)", "parameters": params,
                                          "responses": answers(_json("ready", {"type": "object"}),
                                                               ("401", "404", "503"))}}
        paths[f"{base}/infer"] = post("OIP inference: `text_input` (BYTES) -> `text_output`; Triton's binary "
                                      "tensor data (Inference-Header-Content-Length) too", "OipInferRequest",
                                      _json("the inference answer", _ref("OipInferAnswer")), params)
        paths[f"{base}/generate"] = post("Triton's generate extension", "OipGenerateRequest",
                                         _json("the answer", _ref("OipGenerateAnswer")), params)
        stream = {"description": "SSE: `data: {\"model_name\", \"model_version\", \"text_output\"}` per piece",
                  "content": {"text/event-stream": {"schema": {"type": "string"}}}}
        paths[f"{base}/generate_stream"] = post("Triton's generate extension, streamed (rolling-batch models)",
                                                "OipGenerateRequest", stream, params)
    return paths
