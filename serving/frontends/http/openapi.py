"""``GET /openapi.json``: an OpenAPI 3.1 description of every inference and management route.

Design note: the request bodies' schemas are generated from the models the routes validate with
(``schemas.ROUTE_MODELS``, their parameters from ``params.LmiParameters``), so the document and the
validation cannot drift; the paths, answers and error responses are written here. Tests check that every
mounted route appears, that every field a route accepts is documented and vice versa, that documents valid
per the schema are accepted, and a bounded schemathesis run fuzzes it. Every operation lists its error
responses, all with the server-wide error body ``{"error", "error_type", "request_id"}``. Caps in the schemas
come from the ``Limits`` in use.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from serving.frontends.http import anthropic_schema as messages_schema
from serving.frontends.http.embeddings import embedding_components, embedding_paths
from serving.frontends.http.oip_rest_schema import oip_components, oip_paths
from serving.frontends.http.responses_schema import RESPONSES_MODELS
from serving.frontends.http.tokenizer_routes import TOKENIZER_MODELS
from serving.models import knobs
from serving.requests.bodies import ROUTE_MODELS
from serving.requests.params import Limits
from serving.requests.schema import json_schemas

ERRORS = {
    "400": "invalid request (bad JSON, wrong types, unknown fields, prompt too long, streaming on a "
           "dynamic-batching model)",
    "401": "missing or wrong token (Authorization: Bearer <token>; WWW-Authenticate)",
    "403": "switched off by configuration (enable_model_api), or a refused Origin/Host",
    "404": "unknown model or route", "409": "X-Request-Id already names a request in progress",
    "413": "body larger than max_request_size (decided from Content-Length)",
    "422": "validation error (TGI routes)", "424": "the model's handler failed for this request",
    "429": "queue full (TGI routes)", "499": "the client disconnected before the answer",
    "500": "internal error", "502": "the worker serving the request died", "503": "queue full, model not "
    "ready or server draining (Retry-After)", "504": "the request exceeded its deadline or predict timeout",
}
_INFERENCE_ERRORS = ("400", "401", "404", "409", "413", "424", "499", "500", "502", "503", "504")
_TGI_ERRORS = ("401", "404", "409", "413", "422", "424", "429", "499", "500", "502", "503", "504")


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _responses(ok: dict[str, Any], codes: tuple[str, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {"200": ok}
    for code in codes:
        out[code] = {"description": ERRORS[code], "content": {"application/json": {"schema": _ref("Error")}}}
    return out


def _json_ok(description: str, schema: dict[str, Any], stream: bool = False) -> dict[str, Any]:
    content: dict[str, Any] = {"application/json": {"schema": schema}}
    if stream:
        content["text/event-stream"] = {"schema": {"type": "string"}}
        content["application/jsonlines"] = {"schema": {"type": "string"}}
    return {"description": description, "content": content}


def _post(summary: str, body: str | dict[str, Any], ok: dict[str, Any], codes: tuple[str, ...] = _INFERENCE_ERRORS,
          params: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    schema = _ref(body) if isinstance(body, str) else body
    op: dict[str, Any] = {"summary": summary, "requestBody": {
        "required": True, "content": {"application/json": {"schema": schema}}},
        "responses": _responses(ok, codes)}
    if params:
        op["parameters"] = params
    return {"post": op}


def _path_param(name: str) -> dict[str, Any]:
    return {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}


def _query(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": False, "schema": schema}


def _schemas(limits: Limits, models: Sequence[str]) -> dict[str, Any]:
    """Request schemas from the request models (``schemas.ROUTE_MODELS``: what the routes validate with),
    answers and errors by hand (the server writes those, it does not validate them)."""
    requests = json_schemas(ROUTE_MODELS + TOKENIZER_MODELS, limits)
    requests.update(json_schemas(RESPONSES_MODELS, limits))  # the Responses API's (responses_schema)
    if models:  # the registered names, for clients and fuzzers (an unknown name is a 404, not a 400)
        for name in ("CompletionRequest", "ChatRequest", "ResponsesRequest"):
            model = requests[name]["properties"]["model"]
            model["anyOf"] = [{**b, "enum": list(models)} if b.get("type") == "string" else b for b in model["anyOf"]]
    usage = {"type": "object", "properties": {
        **{k: {"type": "integer"} for k in ("prompt_tokens", "completion_tokens", "total_tokens")},
        # the prompt's tokens that the prefix cache served (docs/routing.md)
        "prompt_tokens_details": {"type": "object", "properties": {"cached_tokens": {"type": "integer"}}}}}
    return {
        **requests,
        **embedding_components(limits),  # /v1/embeddings (OpenAI's error body)
        **oip_components(),  # the OIP v2 REST routes (oip_rest)
        **messages_schema.openapi_components(limits),  # Anthropic's Messages API (its own names: no clash)
        "Error": {"type": "object", "required": ["error", "error_type", "request_id"], "properties": {
            "error": {"type": "string"}, "error_type": {"type": "string"}, "request_id": {"type": "string"}}},
        "LmiAnswer": {"type": "object", "properties": {"generated_text": {"type": "string"},
                                                       "details": {"type": "object"}}},
        "Completion": {"type": "object", "properties": {"id": {"type": "string"}, "object": {"type": "string"},
                                                        "choices": {"type": "array"}, "usage": usage}},
        "ModelList": {"type": "object", "properties": {"object": {"const": "list"}, "data": {"type": "array"}}},
        "TgiAnswer": {"type": "object", "properties": {"generated_text": {"type": "string"},
                                                       "details": {"type": "object"}}},
        "TokenizeAnswer": {"type": "object", "required": ["count", "max_model_len", "tokens"], "properties": {
            "count": {"type": "integer"}, "max_model_len": {"type": ["integer", "null"]},
            "tokens": {"type": "array", "items": {"type": "integer"}},
            "token_strs": {"type": "array", "items": {"type": "string"}}}},
        "Model": {"type": "object", "required": ["id", "object", "created", "owned_by"], "properties": {
            "id": {"type": "string"}, "object": {"const": "model"}, "created": {"type": "integer"},
            "owned_by": {"type": "string"}, "parent": {"type": "string"}, "max_model_len": {"type": "integer"}}},
        "OpenAIError": {"type": "object", "required": ["error"], "properties": {"error": {
            "type": "object", "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                                             "param": {"type": ["string", "null"]}, "code": {"type": "integer"}}}}},
        "ResponsesError": {"type": "object", "required": ["error"], "properties": {"error": {
            "type": "object", "required": ["message", "type", "param", "code"], "properties": {
                "message": {"type": "string"}, "type": {"type": "string"}, "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]}}}}},
        "Response": {"type": "object", "required": ["id", "object", "status", "output"], "properties": {
            "id": {"type": "string"}, "object": {"const": "response"}, "status": {"type": "string"},
            "output": {"type": "array"}, "usage": {"type": ["object", "null"]}}},
    }


def _model_schema(models: Sequence[str]) -> dict[str, Any]:
    return {"type": "string", "enum": list(models)} if models else {"type": "string"}


def inference_document(limits: Limits, models: Sequence[str] = ()) -> dict[str, Any]:
    """The inference API: LMI/SageMaker, OpenAI and TGI routes; ``models``: the registered model names."""
    model_q = [_query("model_name", _model_schema(models))]
    openai_ok = _json_ok("the whole answer, or SSE chunks ending in `data: [DONE]` with stream=true",
                         _ref("Completion"), stream=True)
    # the LMI routes take all three (lmi.py): LMI's body, OpenAI chat (`messages`) and completions (`prompt`)
    lmi_body = {"oneOf": [_ref("LmiRequest"), _ref("ChatRequest"), _ref("CompletionRequest")]}
    lmi_or_chat_ok = _json_ok("LMI answer (a list for a list input), or an OpenAI chat answer for a body with "
                              "`messages`, an OpenAI completions answer for one with `prompt`; a token stream with "
                              "stream=true",
                              {"anyOf": [_ref("LmiAnswer"), {"type": "array", "items": _ref("LmiAnswer")},
                                         _ref("Completion")]}, stream=True)
    tgi_ok = _json_ok("TGI answer", _ref("TgiAnswer"))
    tgi_stream = _json_ok("TGI token events (SSE)", {"type": "string"}, stream=True)
    paths: dict[str, Any] = {
        **health_paths(),
        "/predictions/{model_name}": {"post": {**_post("LMI generation on a named model (a body with `messages` is "
                                                       "an OpenAI chat request)", lmi_body, lmi_or_chat_ok)
                                               ["post"], "parameters": [
                                                   {**_path_param("model_name"), "schema": _model_schema(models)}]}},
        "/models/{model_name}/invoke": {"post": {**_post("DJL's name of /predictions/{model_name}", lmi_body,
                                                         lmi_or_chat_ok)["post"], "parameters": [
            {**_path_param("model_name"), "schema": _model_schema(models)}]}},
        "/models": {"get": {"summary": "the management API's model list (DJL serves both APIs on one port): "
                                       "needs the management token", "responses": _responses(
                                           _json_ok("ok", {"type": "object"}), ("401", "500"))}},
        "/models/{name}": {"get": {"summary": "the management API's description of a model (DJL's shape): needs "
                                              "the management token", "parameters": [_path_param("name")],
                                   "responses": _responses(_json_ok("ok", {"type": "array"}), ("401", "404", "500"))}},
        "/invocations": _post("SageMaker/LMI generation (a body with `messages` is an OpenAI chat request); "
                              "X-Amzn-SageMaker-Custom-Attributes reaches the handler", lmi_body, lmi_or_chat_ok,
                              params=model_q),
        "/v1/models": {"get": {"summary": "OpenAI model list", "responses": _responses(
            _json_ok("models", _ref("ModelList")), ("500",))}},
        "/v1/completions": _post("OpenAI completions", "CompletionRequest", openai_ok),
        "/v1/chat/completions": _post("OpenAI chat completions (the model's chat template)", "ChatRequest",
                                      openai_ok),
        **embedding_paths(ERRORS),
        **oip_paths(ERRORS),
        **responses_paths(),
        **tokenizer_paths(models),
        **messages_schema.openapi_paths(ERRORS),
        "/generate": _post("TGI generate", "TgiRequest", tgi_ok, _TGI_ERRORS, model_q),
        "/generate_stream": _post("TGI generate_stream (SSE)", "TgiRequest", tgi_stream, _TGI_ERRORS, model_q),
        "/": _post("TGI compat route: generate (a one-element list), or generate_stream with stream=true",
                   "TgiRequest", _json_ok("TGI answers", {"type": "array", "items": _ref("TgiAnswer")}, stream=True),
                   _TGI_ERRORS, model_q),
        "/info": {"get": {"summary": "TGI model info", "parameters": model_q, "responses": _responses(
            _json_ok("model info", {"type": "object"}), ("400", "404"))}},
        "/openapi.json": {"get": {"summary": "this document", "responses": {
            "200": {"description": "OpenAPI document", "content": {"application/json": {"schema": {"type":
                                                                                             "object"}}}}}}},
    }
    return _document("rollserve inference API", paths, limits, models)


def management_document(limits: Limits, models: Sequence[str] = ()) -> dict[str, Any]:
    """The management API (DJL/TorchServe shape)."""
    mgmt = ("400", "401", "403", "404", "500", "503")
    obj = _json_ok("ok", {"type": "object"})
    ints = {"type": "integer", "minimum": 0}
    paths: dict[str, Any] = {
        "/models": {"get": {"summary": "list models", "responses": _responses(obj, ("500",))},
                    "post": {"summary": "register a model folder of the model store", "parameters": [
                        _query("url", {"type": "string"}), _query("model_name", {"type": "string"}),
                        *[_query(k, ints) for k in ("batch_size", "max_batch_delay", "min_worker", "max_worker",
                                                    "job_queue_size")],
                        _query("synchronous", {"type": "string"})], "responses": _responses(obj, mgmt)}},
        "/models/{name}": {"get": {"summary": "describe a model (DJL's shape: a list of one workflow whose models[0] "
                                              "has workerGroups[].workers[] and rollserve's fields)",
                                   "parameters": [_path_param("name")],
                                   "responses": _responses(_json_ok("ok", {"type": "array"}), mgmt)},
                           "put": {"summary": "change knobs of the live model without a reload (min_worker and "
                                              "max_worker need enable_model_api)", "parameters": [
                               _path_param("name"),
                               *[_query(k.name, {"type": "integer", "minimum": k.minimum, "maximum": knobs.MAX_VALUE,
                                                 "description": k.meaning}) for k in knobs.KNOBS]],
                               "responses": _responses(obj, mgmt)},
                           "delete": {"summary": "unregister", "parameters": [_path_param("name")],
                                      "responses": _responses(obj, mgmt)}},
        "/requests/{request_id}": {"delete": {"summary": "cancel a queued or running request",
                                              "parameters": [_path_param("request_id")],
                                              "responses": _responses(obj, ("401", "404", "500"))}},
        **health_paths(),
        "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {"200": {"description": "metrics",
                     "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
        "/openapi.json": {"get": {"summary": "this document", "responses": {"200": obj}}},
    }
    return _document("rollserve management API", paths, limits, models)


def tokenizer_paths(models: Sequence[str]) -> dict[str, Any]:
    """vLLM's tokenizer routes and OpenAI's model lookup (``tokenizer_routes``)."""
    tokenize_body = {"oneOf": [_ref("TokenizeCompletionRequest"), _ref("TokenizeChatRequest")]}
    not_found = {"description": "no model of that id (OpenAI's error shape: the SDK raises NotFoundError)",
                 "content": {"application/json": {"schema": _ref("OpenAIError")}}}
    return {
        "/tokenize": _post("vLLM's tokenize: a prompt, or messages as the chat route renders them (its count is "
                           "the chat answer's usage.prompt_tokens)", tokenize_body,
                           _json_ok("the token ids", _ref("TokenizeAnswer"))),
        "/detokenize": _post("vLLM's detokenize: token ids of the model's vocabulary -> text", "DetokenizeRequest",
                             _json_ok("the text", {"type": "object", "required": ["prompt"], "properties": {
                                 "prompt": {"type": "string"}}})),
        "/tokenizer_info": {"get": {"summary": "vLLM's tokenizer_info: the tokenizer's configuration (special tokens, "
                                               "class, chat template), as lm-evaluation-harness's remote tokenizer "
                                               "reads it", "parameters": [_query("model", _model_schema(models))],
                                    "responses": _responses(_json_ok("tokenizer configuration", {"type": "object"}),
                                                            ("400", "401", "404"))}},
        "/v1/models/{model_id}": {"get": {"summary": "OpenAI's model lookup: the entry /v1/models lists under that id "
                                                     "(a LoRA adapter too)", "parameters": [_path_param("model_id")],
                                          "responses": {"200": _json_ok("the model", _ref("Model")),
                                                        "401": _responses({}, ("401",))["401"], "404": not_found}}},
    }


def responses_paths() -> dict[str, Any]:
    """OpenAI's Responses API (``serving.frontends.http.responses``): errors in OpenAI's shape (``ResponsesError``), the
    token check's 401 too (``responses.GUARD_BODIES``)."""
    def errors(*codes: str) -> dict[str, Any]:
        return {code: {"description": ERRORS[code], "content": {"application/json": {
            "schema": _ref("ResponsesError")}}} for code in codes}

    answer = {"description": "the Response object", "content": {"application/json": {"schema": _ref("Response")}}}
    created = {**answer, "description": "the Response object, or its SSE events (response.created ... "
                                        "response.completed) with stream=true",
               "content": {**answer["content"], "text/event-stream": {"schema": {"type": "string"}}}}
    by_id = [_path_param("response_id")]
    unknown = ("401", "404", "500")
    return {
        "/v1/responses": {"post": {"summary": "OpenAI Responses: create a response (the chat route's generation)",
                                   "requestBody": {"required": True, "content": {"application/json": {
                                       "schema": _ref("ResponsesRequest")}}},
                                   "responses": {"200": created, **errors(*_INFERENCE_ERRORS)}}},
        "/v1/responses/{response_id}": {
            "get": {"summary": "a stored response (store: true)", "parameters": by_id,
                    "responses": {"200": answer, **errors(*unknown)}},
            "delete": {"summary": "delete a stored response", "parameters": by_id, "responses": {
                "200": {"description": "deleted", "content": {"application/json": {"schema": {"type": "object"}}}},
                **errors(*unknown)}}},
        "/v1/responses/{response_id}/cancel": {"post": {
            "summary": "cancel a queued or in-progress response (400 when it is not in progress)", "parameters": by_id,
            "responses": {"200": answer, **errors("400", *unknown)}}},
    }


def health_paths() -> dict[str, Any]:
    """``/ping`` and ``/health/ready`` (readiness, ``ping_requires``), ``/health/live`` (liveness) and
    ``/health/generate`` (the deep check); no token."""
    body = {"application/json": {"schema": {"type": "object"}}}
    ready = {"get": {"summary": "readiness (ping_requires: all|any|none); no token needed", "security": [],
                     "responses": {"200": {"description": "ready", "content": body},
                                   "503": {"description": "not ready, or the server is draining", "content": body}}}}
    live = {"get": {"summary": "liveness: 200 while the process serves; no token needed", "security": [],
                    "responses": {"200": {"description": "live", "content": body}}}}
    deep = {"get": {"summary": "deep check: one token through every worker of every ready model (within "
                               "health_generate_timeout, reused for health_generate_interval); no token needed",
                    "security": [], "responses": {
                        "200": {"description": "every probe produced its token", "content": body},
                        "503": {"description": "not ready, draining, or a probe failed (the body names the models "
                                               "and workers)", "content": body}}}}
    return {"/ping": ready, "/health/ready": ready, "/health/live": live, "/health/generate": deep}


def _document(title: str, paths: dict[str, Any], limits: Limits, models: Sequence[str]) -> dict[str, Any]:
    return {"openapi": "3.1.0", "info": {"title": title, "version": "0.1.0"}, "paths": paths,
            "security": [{"bearer": []}],
            "components": {"schemas": _schemas(limits, models),
                           "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}}}


def route(document: Callable[[], dict[str, Any]]) -> Route:
    """``GET /openapi.json`` serving ``document()`` (built per request: model names change at runtime)."""
    async def openapi(request: Request) -> Response:
        return JSONResponse(document())
    return Route("/openapi.json", openapi, methods=["GET"])
