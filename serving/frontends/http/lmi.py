"""LMI / DJL routes: ``POST /predictions/{model}``, ``POST /invocations`` (``GET /ping``: ``serving.telemetry.health``).

Design note: a thin translation. The LMI body ``{"inputs", "parameters", "stream"}`` becomes one
``GenerationRequest`` per input string; answers are LMI's ``{"generated_text", "details"}`` (a list for a
list input), streams are jsonlines token objects (or SSE with ``option.output_formatter=sse``; TGI shapes
with ``option.tgi_compat``). As DJL: a rolling-batch model with ``option.output_formatter=jsonlines`` streams
without being asked, and a dynamic-batching model answers ``stream`` whole (it has no tokens to stream).
``POST /models/{model}/invoke`` is DJL's other name of ``/predictions/{model}``. A body with ``messages`` is an
OpenAI chat request and one with ``prompt`` (no ``inputs``) an OpenAI completions request, as LMI's vLLM handler
takes them: answered by the OpenAI routes' handlers, in their shapes.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from rollcore.errors import InvalidRequest, ServingError, Unavailable
from rollcore.types import GenerationRequest, GenerationResult, SamplingParams, TokenInfo
from serving.batching.streams import ResultStream
from serving.frontends.http.httpio import (
    REQUEST_ID_HEADER,
    HttpContext,
    body_size,
    candidates,
    collect_or_cancel,
    error_response,
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
from serving.frontends.http.tgi import whole_answer as tgi_answer
from serving.models.endpoint_protocol import Endpoint, is_text_model
from serving.models.model_text import ModelText
from serving.models.resident import ensure_resident
from serving.requests.bodies import LMI
from serving.requests.params import check_best_of, check_wire_value, lmi_sampling_params, parse_lmi_parameters
from serving.requests.validation import kind_of, type_error

SAGEMAKER_ATTRIBUTES = "x-amzn-sagemaker-custom-attributes"
_UNREAD: Any = object()  # _serve reads the body itself
# the OpenAI route's chat or completion handler, for an LMI body in its shape: (request, body, endpoint, request id)
OpenAIHandler = Callable[[Request, Any, Endpoint, str], Awaitable[Response]]


def model_option(ep: Endpoint, key: str, default: str = "") -> str:
    return str(ep.options.get(key, default))


def attributes_of(request: Request) -> dict[str, str]:
    value = request.headers.get(SAGEMAKER_ATTRIBUTES)
    if value is None:
        return {}
    if len(value) > 1024 or not value.isascii():
        raise InvalidRequest("X-Amzn-SageMaker-Custom-Attributes must be at most 1024 ASCII characters")
    return {"custom_attributes": value}


def build_requests(body: Any, ep: Endpoint, rid: str, attributes: dict[str, str], ctx: HttpContext,
                   ignored: list[str] | None = None) -> tuple[list[GenerationRequest], bool, bool, int]:
    """LMI body -> (requests, was_list, stream, best_of). A text model's body is a ``schemas.LmiRequest``; a custom
    handler's is its own (only ``parameters`` and ``stream`` are checked, and that it can cross to a worker).
    Unknown fields dropped (not ``option.strict_parameters``) are added to ``ignored``."""
    if not isinstance(body, dict):
        raise _not_an_object(body)
    if is_text_model(ep):
        req = LMI.validate(body, ctx.limits, strict=strict_parameters(ep), ignored=ignored)
        params = lmi_sampling_params(req.parameters, ctx.limits) if req.parameters else SamplingParams()
        best_of = (req.parameters.best_of if req.parameters else None) or 1
        was_list = isinstance(req.inputs, list)
        prompts = list(req.inputs) if isinstance(req.inputs, list) else [req.inputs]
        adapters = _adapters(req.adapters, len(prompts), params.adapter)
        stream = _streams(ep, bool(req.stream), was_list) and best_of == 1
        check_best_of(best_of, params, bool(req.stream))
        # every streamed token carries its log-probability (DJL's token objects always have one); tgi_compat
        # answers always carry TGI's details
        if stream or _tgi_compat(ep):
            params = replace(params, details=True)
        payload = None
    else:
        stream_value = body.get("stream")
        if stream_value is not None and not isinstance(stream_value, bool):
            raise type_error("stream", "a boolean", stream_value)
        stream = _streams(ep, bool(stream_value), False)
        params = parse_lmi_parameters(body.get("parameters"), ctx.limits, strict=False)
        check_wire_value("body", body)  # a custom handler's raw payload crosses to the worker as is
        inputs = body.get("inputs")
        prompts = [inputs if isinstance(inputs, str) else ""]
        was_list = False
        payload = body
        best_of = 1  # parse_lmi_parameters refuses more
        adapters = [params.adapter]
    reqs = [GenerationRequest(request_id=rid if len(prompts) == 1 else f"{rid}-{i}", model=ep.name, prompt=p,
                              params=replace(params, adapter=a), stream=stream, payload=payload, attributes=attributes)
            for i, (p, a) in enumerate(zip(prompts, adapters, strict=True))]
    return reqs, was_list, stream, best_of


def _adapters(value: str | list[str] | None, num_prompts: int, default: str | None) -> list[str | None]:
    """LMI's ``adapters``: one name for every prompt or one per prompt (TGI's ``adapter_id`` when absent)."""
    if value is None:
        return [default] * num_prompts
    if isinstance(value, str):
        return [value] * num_prompts
    if len(value) != num_prompts:
        raise InvalidRequest(f"'adapters' has {len(value)} names for {num_prompts} prompts: give one name, or one "
                             "per prompt")
    return list(value)


def _tgi_compat(ep: Endpoint) -> bool:
    return model_option(ep, "tgi_compat").lower() == "true"


def _streams(ep: Endpoint, asked: bool, was_list: bool) -> bool:
    """Whether the answer streams, as DJL decides: a rolling-batch model streams when asked, and always with
    ``option.output_formatter=jsonlines`` (for one prompt); dynamic batching answers whole even when asked."""
    if not ep.rolling:
        return False
    return asked or (not was_list and model_option(ep, "output_formatter") == "jsonlines")


def tokenize(text: ModelText, reqs: list[GenerationRequest]) -> list[GenerationRequest]:
    """Before any work: a text model's prompt that cannot fit its context is a 400 naming both counts. Returns the
    requests carrying the ids counted, when the worker takes them (``ModelText.worker_ids``)."""
    out = []
    for r in reqs:
        ids = text.encode(r.prompt)
        text.check_length(len(ids) if ids is not None else None, r.params.max_new_tokens, "max_new_tokens")
        out.append(replace(r, prompt_token_ids=text.worker_ids(ids)))
    return out


def _not_an_object(body: Any) -> InvalidRequest:
    return InvalidRequest(f"request body must be a JSON object, got {kind_of(body)}")



def lmi_answer(result: GenerationResult, params_details: bool, prompt: str, full_text: bool) -> dict[str, Any]:
    text = prompt + result.text if full_text else result.text
    out: dict[str, Any] = {"generated_text": text}
    if params_details:
        out["details"] = details_of(result.finish_reason.value, result.tokens, prompt, result.prompt_tokens,
                                    result.prompt_logprobs)
    return out


def details_of(finish_reason: str, tokens: tuple[TokenInfo, ...] | list[TokenInfo], prompt: str,
               prompt_tokens: int, prompt_logprobs: tuple[TokenInfo, ...] | None = None) -> dict[str, Any]:
    """LMI's details; ``prefill`` (the prompt's tokens, TGI's name) when prompt log-probabilities were asked."""
    details: dict[str, Any] = {"finish_reason": finish_reason, "generated_tokens": len(tokens), "inputs": prompt,
                               "prompt_tokens": prompt_tokens,
                               "tokens": [{"id": t.id, "text": t.text, "log_prob": t.logprob} for t in tokens]}
    if prompt_logprobs is not None:
        details["prefill"] = [{"id": t.id, "text": t.text, "log_prob": t.logprob} for t in prompt_logprobs]
    return details


class LmiRoutes:
    """The LMI inference routes bound to one HttpContext; a body with ``messages`` or ``prompt`` goes to the OpenAI
    routes' ``chat`` and ``completion`` handlers (LMI's vLLM handler takes both)."""

    def __init__(self, ctx: HttpContext, chat: OpenAIHandler, completion: OpenAIHandler) -> None:
        self.ctx = ctx
        self.chat = chat
        self.completion = completion

    def routes(self) -> list[Route]:
        return [Route("/predictions/{model_name}", self.predictions, methods=["POST"]),
                Route("/models/{model_name}/invoke", self.predictions, methods=["POST"]),  # DJL's other name
                Route("/invocations", self.invocations, methods=["POST"])]

    async def predictions(self, request: Request) -> Response:
        return await self._serve(request, request.path_params["model_name"])

    async def invocations(self, request: Request) -> Response:
        return await self._serve(request, request.query_params.get("model_name"))

    async def invocations_of(self, request: Request, body: Any) -> Response:
        """``/invocations`` with its body already read (SageMaker sessions read it first: ``sessions``)."""
        return await self._serve(request, request.query_params.get("model_name"), body)

    async def _serve(self, request: Request, model_name: str | None, body: Any = _UNREAD) -> Response:
        rid = request_id(request)
        try:
            if self.ctx.state.draining:
                raise Unavailable("server is shutting down", retry_after_s=5)
            ep = self.ctx.registry.get(model_name) if model_name else self.ctx.registry.only()
            note_model(request, ep)  # the metrics labels: the model and its version
            await ensure_resident(ep)  # a model loaded on demand: its first request waits for the load
            if body is _UNREAD:
                body = await read_json(request, self.ctx.max_request_size)
            if isinstance(body, dict) and "messages" in body:
                return await self.chat(request, body, ep, rid)  # LMI: a body with messages is OpenAI chat
            if isinstance(body, dict) and "prompt" in body and "inputs" not in body:
                return await self.completion(request, body, ep, rid)  # LMI's vLLM handler: OpenAI completions
            ignored: list[str] = []
            reqs, was_list, stream, best_of = build_requests(body, ep, rid, attributes_of(request), self.ctx,
                                                             ignored)
            extra = ignored_headers(ignored, rid, ep.name)
            if is_text_model(ep):
                # ep.text is read on the loop (its cache is not thread-safe), the prompts are tokenized off it
                reqs = await off_loop(self.ctx.tokenize_pool, body_size(request), tokenize, ep.text, reqs)
            if stream:
                if len(reqs) != 1:
                    raise InvalidRequest("'stream' takes a single string in 'inputs'")
                return self._stream(ep, reqs[0], submit_all(ep, reqs)[0], rid, extra)
            tries = [c for r in reqs for c in candidates(r, best_of)]
            results = await collect_or_cancel(request, submit_all(ep, tries))
        except ServingError as exc:
            return error_response(exc, rid)
        except ConnectionAbortedError:
            return Response(status_code=499, headers={REQUEST_ID_HEADER: rid})  # logged; the client left
        if best_of > 1:
            return self._best_of(ep, tries, results, best_of, was_list, rid, extra)
        return self._whole(ep, reqs, results, was_list, rid, extra)

    def _best_of(self, ep: Endpoint, tries: list[GenerationRequest], results: list[GenerationResult], best_of: int,
                 was_list: bool, rid: str, extra: dict[str, str]) -> Response:
        """DJL's best_of answer per prompt: the likeliest candidate, the others in details.best_of_sequences."""
        answers = []
        tgi = _tgi_compat(ep)
        text = ep.text
        for start in range(0, len(tries), best_of):
            group, outs = tries[start:start + best_of], results[start:start + best_of]
            order = likeliest_first(outs)
            shaped = [tgi_answer(group[k], outs[k], text) if tgi else
                      lmi_answer(outs[k], True, group[k].prompt, group[k].params.return_full_text) for k in order]
            best = shaped[0]
            best["details"]["best_of_sequences"] = [{"generated_text": a["generated_text"], **a["details"]}
                                                    for a in shaped[1:]]
            answers.append(best)
        headers = {REQUEST_ID_HEADER: rid, **timing_headers(results[0].timings), **extra}
        return JSONResponse(answers if was_list or tgi else answers[0], headers=headers)

    def _whole(self, ep: Endpoint, reqs: list[GenerationRequest], results: list[GenerationResult], was_list: bool,
               rid: str, extra: dict[str, str]) -> Response:
        headers = {REQUEST_ID_HEADER: rid, **timing_headers(results[0].timings), **extra}
        if not is_text_model(ep) and results[0].payload is not None:
            return JSONResponse(results[0].payload, headers=headers)
        if _tgi_compat(ep):  # TGI's answer shape (a list), details included, as DJL's tgi_compat
            text = ep.text
            return JSONResponse([tgi_answer(q, r, text) for q, r in zip(reqs, results, strict=True)],
                                headers=headers)
        answers = [lmi_answer(r, q.params.details, q.prompt, q.params.return_full_text)
                   for q, r in zip(reqs, results, strict=True)]
        return JSONResponse(answers if was_list else answers[0], headers=headers)

    def _stream(self, ep: Endpoint, req: GenerationRequest, stream: ResultStream, rid: str, extra: dict[str, str]
                ) -> Response:
        tgi = _tgi_compat(ep)
        sse = tgi or model_option(ep, "output_formatter") == "sse"
        media = "text/event-stream" if sse else "application/jsonlines"
        return StreamingResponse(lmi_events(req, stream, sse, tgi), media_type=media,
                                 headers={REQUEST_ID_HEADER: rid, **extra})


async def lmi_events(req: GenerationRequest, stream: ResultStream, sse: bool, tgi: bool = False
                     ) -> AsyncIterator[str]:
    """LMI token objects, one per token; the last also carries generated_text, details and timings.
    With ``tgi`` the token objects take TGI's stream-event shape (``logprob``, ``special``)."""
    def frame(obj: dict[str, Any]) -> str:
        token = obj.get("token")
        if tgi and token is not None:
            token["logprob"] = token.pop("log_prob")
            token["special"] = obj.get("details", {}).get("finish_reason") == "eos_token"
        data = json.dumps(obj, ensure_ascii=False)
        return f"data: {data}\n\n" if sse else data + "\n"

    tokens: list[TokenInfo] = []
    parts: list[str] = []
    try:
        async for delta in stream:
            parts.append(delta.text)
            new = list(delta.tokens)
            tokens.extend(new)
            last = delta.finish_reason is not None
            for i, t in enumerate(new):
                text = delta.text if len(new) == 1 else t.text
                obj: dict[str, Any] = {"token": {"id": t.id, "text": text, "log_prob": t.logprob},
                                       "generated_text": None}
                if last and i == len(new) - 1:
                    obj.update(_final(req, stream, parts, tokens))
                yield frame(obj)
            if last and not new:
                yield frame({"token": None, **_final(req, stream, parts, tokens)})
    except ServingError as exc:
        yield frame({"token": {"id": -1, "text": "", "log_prob": None}, "generated_text": None,
                     "details": {"finish_reason": "error", "generated_tokens": len(tokens)},
                     "error": exc.message, "error_type": exc.kind.value})
    finally:
        if not stream.done:
            stream.cancel()


def _final(req: GenerationRequest, stream: ResultStream, parts: list[str], tokens: list[TokenInfo]) -> dict[str, Any]:
    text = "".join(parts)
    if req.params.return_full_text:
        text = req.prompt + text
    fr = stream.finish_reason.value if stream.finish_reason else "length"
    return {"generated_text": text, "details": details_of(fr, tokens, req.prompt, stream.prompt_tokens,
                                                          stream.prompt_logprobs),
            "timings": timings_json(stream.timings())}
