"""OpenAI's embeddings route: ``POST /v1/embeddings``, as vLLM serves it.

Design note: the body is validated by ``EmbeddingRequest`` (the same model ``/openapi.json`` documents); each input
(a string, a list of strings, a list of token ids or a list of such lists) becomes one ``GenerationRequest`` with
``params.embed``, submitted like any other request: the rolling engine runs its prompt as a prefill beside the
running generations (``handlers.engine.execution.forward.pooling``), a dynamic-batching model in its next batch
(``handlers.embedding``). The worker answers each with its pooled vector, L2-normalised as the model's task says
(``info["embedding"]``); ``dimensions`` keeps the first N values and normalises them again (Matryoshka
truncation), ``encoding_format=base64`` packs little-endian float32 (what the ``openai`` SDK asks for by
default and decodes), ``float`` the same float32 values as JSON numbers. A model that cannot embed, or an
embedding-only model asked to generate, is refused by name (``serving.models.endpoint``). Errors are OpenAI's
``{"error": {"message", "type", "param", "code"}}`` so that the SDK's exceptions carry ``param``; unknown fields
are treated as on the completions route (dropped and named in ``X-Ignored-Parameters``, a 400 with
``option.strict_parameters=true``).
"""

from __future__ import annotations

import base64
import math
import re
import struct
import time
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from rollcore.errors import ErrorKind, HandlerError, InvalidRequest, ServingError
from rollcore.types import GenerationRequest, SamplingParams
from serving.frontends.http.httpio import (
    REQUEST_ID_HEADER,
    STATUS,
    HttpContext,
    body_size,
    collect_or_cancel,
    ignored_headers,
    note_model,
    read_request,
    request_id,
    strict_parameters,
    submit_all,
)
from serving.frontends.http.prompts import off_loop
from serving.models.endpoint_protocol import Endpoint
from serving.models.model_text import ModelText
from serving.models.resident import ensure_resident
from serving.requests.bodies import MAX_TOKEN_ID, Prompt, Text, TokenIds
from serving.requests.schema import BY_SHAPE, INTEGER, TEXT, Cap, StrictModel, json_schemas
from serving.requests.validation import RequestSchema


class EmbeddingRequest(StrictModel):
    """``POST /v1/embeddings`` (OpenAI's fields and vLLM's ``truncate_prompt_tokens``)."""

    input: Annotated[Prompt | Annotated[list[Prompt], Field(min_length=1), Cap("max_sequences_per_request")]
                     | TokenIds | Annotated[list[TokenIds], Field(min_length=1), Cap("max_sequences_per_request")],
                     BY_SHAPE, Field(description="a text, a list of texts, a text of token ids (of the model's "
                                     "vocabulary) or a list of those; one embedding each, in order")]
    model: Text | None = Field(None, description="the model; may be left out when the server has one model")
    encoding_format: Literal["float", "base64"] | None = Field(
        None, description="float (default): JSON numbers; base64: the little-endian float32 bytes")
    dimensions: Annotated[int, Field(ge=1), INTEGER] | None = Field(
        None, description="keep the first N values of each vector, normalised again (Matryoshka truncation); at "
        "most the model's hidden size")
    user: Annotated[str, Field(max_length=256), TEXT] | None = Field(None, description="an end-user id (ignored)")
    truncate_prompt_tokens: Annotated[int, Field(ge=1, le=MAX_TOKEN_ID), INTEGER] | None = Field(
        None, description="vLLM's: embed only the last N tokens of each input")


EMBEDDINGS = RequestSchema(EmbeddingRequest)
ERROR_STATUSES = ("400", "401", "404", "409", "413", "424", "499", "500", "502", "503", "504")


def embedding_components(limits: Any) -> dict[str, Any]:
    """The route's schemas for ``/openapi.json``: its request model (what it validates with), answer and error."""
    vector = {"anyOf": [{"type": "array", "items": {"type": "number"}},
                        {"type": "string", "contentEncoding": "base64"}]}
    usage = {"type": "object", "properties": {"prompt_tokens": {"type": "integer"},
                                              "total_tokens": {"type": "integer"}}}
    return {
        **json_schemas((EmbeddingRequest,), limits),
        "EmbeddingAnswer": {"type": "object", "required": ["object", "data", "model", "usage"], "properties": {
            "id": {"type": "string"}, "object": {"const": "list"}, "created": {"type": "integer"},
            "model": {"type": "string"}, "usage": usage, "data": {"type": "array", "items": {
                "type": "object", "required": ["object", "index", "embedding"], "properties": {
                    "object": {"const": "embedding"}, "index": {"type": "integer"}, "embedding": vector}}}}},
        "EmbeddingError": {"type": "object", "required": ["error"], "properties": {"error": {
            "type": "object", "required": ["message", "type", "param", "code"], "properties": {
                "message": {"type": "string"}, "type": {"type": "string"}, "param": {"type": ["string", "null"]},
                "code": {"type": "string"}}}}},
    }


def embedding_paths(errors: dict[str, str]) -> dict[str, Any]:
    """``/v1/embeddings``; ``errors``: the descriptions of the status codes."""
    def ref(name: str) -> dict[str, Any]:
        return {"application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}}
    responses: dict[str, Any] = {"200": {"description": "one embedding per input, in order", "content":
                                         ref("EmbeddingAnswer")}}
    responses.update({code: {"description": errors[code], "content": ref("EmbeddingError")}
                      for code in ERROR_STATUSES})
    return {"/v1/embeddings": {"post": {
        "summary": "OpenAI embeddings: each input's pooled final hidden state (a decoder's last token, or the "
                   "model's option.pooling), L2-normalised; OpenAI's error body", "requestBody": {
            "required": True, "content": ref("EmbeddingRequest")}, "responses": responses}}}

# the project's validation messages start with the field they name: 'input[0]', missing field 'x', unknown fields: x
_FIELD = re.compile(r"^(?:missing field )?'([A-Za-z_]+)|^unknown fields: ([A-Za-z_]+)")
_TYPES = {ErrorKind.INVALID: "invalid_request_error", ErrorKind.TOO_LARGE: "invalid_request_error",
          ErrorKind.NOT_FOUND: "invalid_request_error", ErrorKind.CONFLICT: "invalid_request_error",
          ErrorKind.UNAUTHORIZED: "authentication_error", ErrorKind.FORBIDDEN: "permission_error",
          ErrorKind.OVERLOADED: "rate_limit_error", ErrorKind.CANCELLED: "invalid_request_error"}


class ParamError(InvalidRequest):
    """A 400 about one request field (OpenAI's ``param``)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def openai_error(exc: ServingError, rid: str, param: str | None = None) -> JSONResponse:
    """OpenAI's error body; ``param`` the field at fault (None: the request as a whole)."""
    status = STATUS.get(exc.kind, 500)
    if param is None and exc.kind is ErrorKind.INVALID:
        found = _FIELD.match(exc.message)
        param = next((g for g in found.groups() if g), None) if found else None
    headers = {REQUEST_ID_HEADER: rid}
    if exc.retry_after_s is not None and status in (429, 503):
        headers["Retry-After"] = str(exc.retry_after_s)
    body = {"message": exc.message, "type": _TYPES.get(exc.kind, "server_error"), "param": param,
            "code": exc.kind.value}
    return JSONResponse({"error": body}, status_code=status, headers=headers)


@dataclass(frozen=True, slots=True)
class Parsed:
    """A validated request: one core request per input, and how to shape the answer."""

    requests: list[GenerationRequest]
    base64: bool
    dimensions: int | None
    ignored: tuple[str, ...]


def parse(body: Any, ep: Endpoint, text: ModelText, rid: str, limits: Any) -> Parsed:
    """An embeddings body on model ``ep`` -> its requests. Raises ``InvalidRequest`` naming the field."""
    ignored: list[str] = []
    req = EMBEDDINGS.validate(body, limits, strict=strict_parameters(ep), ignored=ignored)
    info = dict(ep.info)
    check_embeds(ep.name, info)
    size = (info.get("embedding") or {}).get("size")
    if req.dimensions is not None and isinstance(size, int) and req.dimensions > size:
        raise ParamError("dimensions", f"'dimensions' must be <= {size}, the hidden size of model {ep.name!r}, "
                                       f"got {req.dimensions}")
    raw = req.input
    inputs: list[str | list[int]] = [raw] if isinstance(raw, str) else \
        [list(raw)] if isinstance(raw[0], int) else list(raw)  # type: ignore[list-item]
    vocab = info.get("vocab_size")
    single = isinstance(raw, str) or isinstance(raw[0], int)
    requests = []
    for k, item in enumerate(inputs):
        where = "input" if single else f"input[{k}]"
        ids = text.encode(item) if isinstance(item, str) else list(item)
        if isinstance(item, list) and isinstance(vocab, int):
            bad = next((t for t in item if t >= vocab), None)
            if bad is not None:
                raise ParamError("input", f"'{where}' holds token id {bad}, outside the vocabulary of model "
                                          f"{ep.name!r} (size {vocab})")
        cut = req.truncate_prompt_tokens
        if cut is not None:
            if ids is None:
                raise ParamError("truncate_prompt_tokens", f"'truncate_prompt_tokens' needs a tokenizer.json for "
                                                           f"model {ep.name!r}")
            if len(ids) > cut:
                ids = item = ids[-cut:]
        if ids is not None and text.max_model_len is not None and len(ids) > text.max_model_len:
            raise ParamError("input", f"'{where}' has {len(ids)} tokens but model {ep.name!r} embeds at most "
                                      f"{text.max_model_len} (max_model_len)")
        requests.append(GenerationRequest(
            request_id=rid if len(inputs) == 1 else f"{rid}-{k}", model=ep.name,
            prompt=item if isinstance(item, str) else "",
            prompt_token_ids=text.worker_ids(ids) if isinstance(item, str) else tuple(item),
            params=SamplingParams(max_new_tokens=0, embed=True)))
    return Parsed(requests, req.encoding_format == "base64", req.dimensions, tuple(ignored))


def check_embeds(name: str, info: dict[str, Any]) -> None:
    """Refuse a model that computes no embeddings, naming it and what it serves."""
    tasks = info.get("tasks")
    if "embedding" in (tasks or ()):
        return
    why = f"it serves the task {', '.join(map(repr, tasks))} (option.task)" if tasks else \
        "its handler is not one of the built-in model handlers"
    raise ParamError("model", f"model {name!r} does not compute embeddings: {why}")


def check_generates(ep: Endpoint) -> None:
    """Refuse a generation route on an embedding-only model before its body is parsed (an encoder has no chat
    template to fail on first); ``serving.models.endpoint`` refuses the same at submit for every other route."""
    if ep.info.get("tasks") == ["embedding"]:
        raise InvalidRequest(f"model {ep.name!r} serves the task 'embedding' (option.task=embedding): it generates "
                             "no text; use POST /v1/embeddings")


def shaped(vector: tuple[float, ...], dimensions: int | None, normalize: bool) -> bytes:
    """The answer's little-endian float32 bytes: the first ``dimensions`` values, normalised again when the model
    normalises (Matryoshka truncation)."""
    values = list(vector[:dimensions] if dimensions else vector)
    if dimensions and normalize:
        norm = math.sqrt(sum(v * v for v in values))
        values = [v / norm for v in values] if norm > 0 else values
    return struct.pack(f"<{len(values)}f", *values)


class EmbeddingRoutes:
    """``POST /v1/embeddings``."""

    def __init__(self, ctx: HttpContext) -> None:
        self.ctx = ctx

    def routes(self) -> list[Route]:
        return [Route("/v1/embeddings", self.embeddings, methods=["POST"])]

    async def embeddings(self, request: Request) -> Response:
        rid = request_id(request)
        try:
            body, model = await read_request(self.ctx, request)
            ep = self.ctx.registry.get(model) if model else self.ctx.registry.only()
            note_model(request, ep)  # the metrics labels: the model and its version
            await ensure_resident(ep)  # a model loaded on demand: its first request waits for the load
            parsed = await off_loop(self.ctx.tokenize_pool, body_size(request), parse, body, ep, ep.text,
                                    rid, self.ctx.limits)
            streams = submit_all(ep, parsed.requests)
            try:
                await collect_or_cancel(request, streams)
            except ConnectionAbortedError:
                return Response(status_code=499, headers={REQUEST_ID_HEADER: rid})  # logged; the client left
            except InvalidRequest as exc:  # the worker refused an input (token ids, length): the input's fault
                return openai_error(exc, rid, "input")
        except ParamError as exc:
            return openai_error(exc, rid, exc.param)
        except ServingError as exc:
            return openai_error(exc, rid)
        normalize = bool(((ep.info or {}).get("embedding") or {}).get("normalize", True))
        data, total = [], 0
        for k, stream in enumerate(streams):
            if stream.embedding is None:  # a custom handler answered without a vector
                return openai_error(HandlerError(f"model {ep.name!r} answered without an embedding"), rid)
            packed = shaped(stream.embedding, parsed.dimensions, normalize)
            vector: str | list[float] = base64.b64encode(packed).decode("ascii") if parsed.base64 else \
                list(struct.unpack(f"<{len(packed) // 4}f", packed))
            data.append({"object": "embedding", "index": k, "embedding": vector})
            total += stream.prompt_tokens
        answer = {"id": f"embd-{rid}", "object": "list", "created": int(time.time()), "model": ep.name, "data": data,
                  "usage": {"prompt_tokens": total, "total_tokens": total}}
        return JSONResponse(answer, headers={REQUEST_ID_HEADER: rid, **ignored_headers(parsed.ignored, rid, ep.name)})
