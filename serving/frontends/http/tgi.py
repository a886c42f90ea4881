"""TGI routes: ``POST /generate``, ``POST /generate_stream``, ``POST /`` (TGI's compat route that the
``text-generation`` client calls), ``GET /info``.

Design note: a thin translation onto ``GenerationRequest``; the body is a ``schemas.TgiRequest``, whose
``parameters`` are LMI's (``params.LmiParameters``, TGI's names included). TGI clients
expect TGI's status codes and error types, so this module has its own mapping table: validation errors
are 422 ``"validation"``, a full queue is 429 ``"overloaded"``, model failures are ``"generation"``; the
body keeps the server-wide ``{"error", "error_type", "request_id"}`` shape (which is TGI's own shape plus
the request id). ``null`` parameters mean "default", as in TGI; ``grammar`` constrains the answer
(``serving.requests.structured``). Parameters TGI has but rollserve cannot honour (``adapter_id``, ``watermark``,
``watermark``) are refused at any non-neutral value; ``best_of`` > 1 samples that many candidates and answers the
likeliest (the others in ``details.best_of_sequences``). Streaming needs a rolling-batch model (422 naming
``option.rolling_batch``).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from rollcore.errors import ErrorKind, InvalidRequest, ServingError, Unavailable
from rollcore.types import GenerationRequest, GenerationResult, SamplingParams, TokenInfo
from serving.batching.streams import ResultStream
from serving.frontends.http.httpio import (
    REQUEST_ID_HEADER,
    STATUS,
    HttpContext,
    body_size,
    candidates,
    collect_or_cancel,
    ignored_headers,
    likeliest_first,
    note_model,
    read_json,
    request_id,
    strict_parameters,
    submit_all,
    timing_headers,
    timings_json,
)
from serving.frontends.http.prompts import off_loop
from serving.models.endpoint_protocol import Endpoint
from serving.models.model_text import ModelText
from serving.models.resident import ensure_resident
from serving.requests.bodies import TGI
from serving.requests.params import check_best_of, lmi_sampling_params

VERSION = "rollserve-0.1.0"
# core error kind -> (TGI status, TGI error_type); kinds not listed keep the server-wide status.
TGI_ERRORS: dict[ErrorKind, tuple[int, str]] = {
    ErrorKind.INVALID: (422, "validation"),
    ErrorKind.OVERLOADED: (429, "overloaded"),
    ErrorKind.HANDLER: (424, "generation"),
    ErrorKind.WORKER_FAILED: (502, "generation"),
    ErrorKind.INTERNAL: (500, "generation"),
}


def routes(ctx: HttpContext) -> list[Route]:
    """The TGI routes bound to ``ctx`` (called once by the composition root)."""
    return TgiRoutes(ctx).routes()


def tgi_error(exc: ServingError, rid: str) -> JSONResponse:
    status, error_type = TGI_ERRORS.get(exc.kind, (STATUS.get(exc.kind, 500), exc.kind.value))
    headers = {REQUEST_ID_HEADER: rid}
    if exc.retry_after_s is not None and status in (429, 503):
        headers["Retry-After"] = str(exc.retry_after_s)
    return JSONResponse({"error": exc.message, "error_type": error_type, "request_id": rid}, status_code=status,
                        headers=headers)


class TgiRoutes:
    """TGI's routes over the registry's models (``?model_name=`` picks one when several are served)."""

    def __init__(self, ctx: HttpContext) -> None:
        self.ctx = ctx

    def routes(self) -> list[Route]:
        return [Route("/generate", self.generate, methods=["POST"]),
                Route("/generate_stream", self.generate_stream, methods=["POST"]),
                Route("/", self.compat, methods=["POST"]),
                Route("/info", self.info, methods=["GET"])]

    def _endpoint(self, request: Request) -> Endpoint:
        name = request.query_params.get("model_name")
        ep = self.ctx.registry.get(name) if name else self.ctx.registry.only()
        note_model(request, ep)  # the metrics labels: the model and its version
        return ep

    async def info(self, request: Request) -> Response:
        rid = request_id(request)
        try:
            ep = self._endpoint(request)
        except ServingError as exc:
            return tgi_error(exc, rid)
        max_len = ep.info.get("max_model_len")
        config = ep.config
        limits = self.ctx.limits
        body = {"model_id": ep.name, "model_sha": None, "model_dtype": str(config.options.get("dtype", "fp32"))
                if config is not None else None, "model_device_type": _device_type(ep),
                "model_pipeline_tag": "text-generation",
                "max_concurrent_requests": config.batching.job_queue_size if config is not None else None,
                "max_best_of": limits.max_n,
                "max_stop_sequences": limits.max_stop_sequences, "max_input_tokens": (max_len - 1) if max_len else None,
                "max_input_length": (max_len - 1) if max_len else None, "max_total_tokens": max_len,
                "max_new_tokens": limits.max_new_tokens, "max_client_batch_size": 1,
                "rolling_batch": bool(ep.rolling), "router": "rollserve", "version": VERSION, "sha": None,
                "docker_label": None, "validation_workers": 1, "waiting_served_ratio": 0.0,
                "max_batch_total_tokens": None, "max_waiting_tokens": 0, "max_batch_size": None}
        return JSONResponse(body, headers={REQUEST_ID_HEADER: rid})

    async def generate(self, request: Request) -> Response:
        return await self._serve(request, stream=False)

    async def generate_stream(self, request: Request) -> Response:
        return await self._serve(request, stream=True)

    async def compat(self, request: Request) -> Response:
        return await self._serve(request, stream=None)

    async def _serve(self, request: Request, stream: bool | None) -> Response:
        rid = request_id(request)
        try:
            if self.ctx.state.draining:
                raise Unavailable("server is shutting down", retry_after_s=5)
            ep = self._endpoint(request)
            await ensure_resident(ep)  # a model loaded on demand: its first request waits for the load
            body = await read_json(request, self.ctx.max_request_size)
            text = ep.text
            ignored: list[str] = []
            req, want_stream, best_of = await off_loop(self.ctx.tokenize_pool, body_size(request), self._build,
                                                       body, ep, rid, text, stream, ignored)
            extra = ignored_headers(ignored, rid, ep.name)
            if want_stream and not ep.rolling:
                raise InvalidRequest("streaming needs a rolling-batch model (set option.rolling_batch=auto); "
                                     f"model {ep.name!r} uses dynamic batching")
            if want_stream:
                result_stream = submit_all(ep, [req])[0]  # with the HTTP request's deadline headers
                return StreamingResponse(tgi_events(req, result_stream, text), media_type="text/event-stream",
                                         headers={REQUEST_ID_HEADER: rid, "Cache-Control": "no-cache", **extra})
            tries = candidates(req, best_of)
            results = await collect_or_cancel(request, submit_all(ep, tries))
        except ServingError as exc:
            return tgi_error(exc, rid)
        except ConnectionAbortedError:
            return Response(status_code=499, headers={REQUEST_ID_HEADER: rid})  # logged; the client left
        order = likeliest_first(results)
        result = results[order[0]]
        answer = whole_answer(req, result, text)
        if best_of > 1 and req.params.details:  # TGI: the other candidates, best first
            answer["details"]["best_of_sequences"] = [
                {"generated_text": seq["generated_text"], **seq["details"]}
                for seq in (whole_answer(tries[k], results[k], text) for k in order[1:])]
        # TGI's compat route answers a one-element list (what the text-generation client reads)
        return JSONResponse([answer] if stream is None else answer,
                            headers={REQUEST_ID_HEADER: rid, **timing_headers(result.timings), **extra})

    def _build(self, body: Any, ep: Endpoint, rid: str, text: ModelText, stream: bool | None, ignored: list[str]
               ) -> tuple[GenerationRequest, bool, int]:
        req = TGI.validate(body, self.ctx.limits, strict=strict_parameters(ep), ignored=ignored)
        p = req.parameters
        params = lmi_sampling_params(p, self.ctx.limits) if p is not None else SamplingParams()
        # TGI samples whenever a sampling warper is set, even without do_sample
        sampling = params.do_sample or params.temperature != 1.0 or params.top_k > 0 or params.top_p < 1.0
        params = replace(params, do_sample=sampling and params.temperature != 0.0)
        ids = text.encode(req.inputs)
        token_ids: tuple[int, ...] | None = None
        truncate = p.truncate if p is not None else None
        if truncate is not None and ids is not None and len(ids) > truncate:
            token_ids = tuple(ids[-truncate:])
            ids = list(token_ids)
        text.check_length(len(ids) if ids is not None else None, params.max_new_tokens, "max_new_tokens")
        want = bool(req.stream) if stream is None else stream
        if want:  # every streamed token carries its log-probability, as TGI's own server sends it
            params = replace(params, details=True)
        best_of = (p.best_of if p is not None else None) or 1
        check_best_of(best_of, params, want)
        request = GenerationRequest(request_id=rid, model=ep.name, prompt=req.inputs, params=params,
                                    prompt_token_ids=token_ids or text.worker_ids(ids), stream=want)
        return request, want, best_of




def _token(t: TokenInfo, text: ModelText, piece: str | None = None) -> dict[str, Any]:
    return {"id": t.id, "text": t.text if piece is None else piece, "logprob": t.logprob,
            "special": text.is_special(t.id)}


def _top(t: TokenInfo, text: ModelText) -> list[dict[str, Any]]:
    return [{"id": i, "text": text.token_text(i), "logprob": lp, "special": text.is_special(i)}
            for i, lp in t.top_logprobs]


def whole_answer(req: GenerationRequest, result: GenerationResult, text: ModelText) -> dict[str, Any]:
    out_text = req.prompt + result.text if req.params.return_full_text else result.text
    answer: dict[str, Any] = {"generated_text": out_text}
    if req.params.details:
        prefill = [{"id": t.id, "text": t.text, "logprob": t.logprob} for t in result.prompt_logprobs or ()]
        answer["details"] = {
            "finish_reason": result.finish_reason.value, "generated_tokens": result.generated_tokens,
            "seed": req.params.seed if req.params.do_sample else None, "prefill": prefill,
            "tokens": [_token(t, text) for t in result.tokens],
            "top_tokens": [_top(t, text) for t in result.tokens] if req.params.logprobs else None}
    return answer


async def tgi_events(req: GenerationRequest, stream: ResultStream, text: ModelText) -> AsyncIterator[str]:
    """TGI's SSE token events; the last one carries ``generated_text``, ``details`` and ``timings``."""
    parts: list[str] = []
    count = 0
    try:
        async for delta in stream:
            parts.append(delta.text)
            tokens = list(delta.tokens)
            for i, t in enumerate(tokens):
                count += 1
                last = delta.finish_reason is not None and i == len(tokens) - 1
                event: dict[str, Any] = {"index": count, "token": _token(t, text, delta.text if len(tokens) == 1
                                                                         else None),
                                         "top_tokens": _top(t, text) if req.params.logprobs else None,
                                         "generated_text": None, "details": None}
                if last:
                    full = "".join(parts)
                    event["generated_text"] = req.prompt + full if req.params.return_full_text else full
                    event["details"] = {"finish_reason": delta.finish_reason.value if delta.finish_reason else
                                        "length", "generated_tokens": count,
                                        "seed": req.params.seed if req.params.do_sample else None}
                    event["timings"] = timings_json(stream.timings())
                yield f"data: {json.dumps(event, ensure_ascii=False)}\n\n"
    except ServingError as exc:
        status, error_type = TGI_ERRORS.get(exc.kind, (0, exc.kind.value))
        yield f"data: {json.dumps({'error': exc.message, 'error_type': error_type, 'request_id': req.request_id})}\n\n"
    finally:
        if not stream.done:
            stream.cancel()


def _device_type(ep: Endpoint) -> str:
    """``cuda`` when the model's workers run on GPUs (``serving.config.devices``), else ``cpu``."""
    return "cuda" if ep.pool is not None and ep.pool.devices.plan.on_gpu else "cpu"
