"""rollserve's typed gRPC services: ``rollserve.v1.Generation`` and ``rollserve.v1.Management``.

Design note: a translation only. Typed sampling fields that the client set (proto3 presence) go through
``build_sampling_params``, so a bad value gets the HTTP message. ``GenerateStream`` sends one message per
generated token (rolling-batch models); the last message carries the finish reason and the request's
timings. Management mirrors the HTTP management API over the same registry (``UpdateModel`` is
``PUT /models/{name}``: the knobs the client set, checked by ``serving.models.knobs``).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import grpc
from google.protobuf import json_format, struct_pb2

from rollcore.errors import InvalidRequest
from rollcore.types import FinishReason, GenerationRequest, RequestTimings, TokenInfo
from serving.batching.streams import ResultStream
from serving.frontends.grpc.calls import (
    FrontendContext,
    Registry,
    batching_of,
    check_serving,
    collect,
    deadline_of,
    guarded,
    guarded_stream,
    is_text_model,
    new_request_id,
    register_model,
    register_overrides,
    require_streaming,
)
from serving.frontends.proto.gen.rollserve.v1 import generate_pb2 as pb
from serving.frontends.proto.gen.rollserve.v1 import generate_pb2_grpc as pb_grpc
from serving.models import knobs
from serving.models.resident import ensure_resident
from serving.requests.params import build_sampling_params, check_text

FINISH_REASON = {FinishReason.LENGTH: pb.FINISH_REASON_LENGTH, FinishReason.EOS: pb.FINISH_REASON_EOS_TOKEN,
                 FinishReason.STOP: pb.FINISH_REASON_STOP_SEQUENCE, FinishReason.ABORT: pb.FINISH_REASON_ABORT,
                 FinishReason.ERROR: pb.FINISH_REASON_ERROR}
_OPTIONAL_PARAMS = ("max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "repetition_penalty", "seed",
                    "ignore_eos", "logprobs", "guided_json", "guided_regex", "guided_grammar", "presence_penalty",
                    "frequency_penalty", "min_p", "typical_p", "min_tokens", "include_stop_str_in_output",
                    "skip_special_tokens", "num_beams", "length_penalty", "early_stopping")


def sampling_values(params: Any) -> dict[str, Any]:
    """The fields the client set in ``SamplingParameters`` -> SamplingParams field values."""
    values = {name: getattr(params, name) for name in _OPTIONAL_PARAMS if params.HasField(name)}
    if params.stop:
        values["stop"] = list(params.stop)
    if params.stop_token_ids:
        values["stop_token_ids"] = list(params.stop_token_ids)
    if params.guided_choice:
        values["guided_choice"] = list(params.guided_choice)
    if params.logit_bias:
        values["logit_bias"] = {str(k): v for k, v in params.logit_bias.items()}
    if params.bad_words:
        values["bad_words"] = list(params.bad_words)
    return values


def timings_message(t: RequestTimings) -> pb.Timings:
    return pb.Timings(queue_s=t.queue_s, ttft_s=t.ttft_s, prefill_s=t.prefill_s, decode_s=t.decode_s,
                      e2e_s=t.e2e_s, prompt_tokens=t.prompt_tokens, generated_tokens=t.generated_tokens,
                      max_itl_s=t.max_itl_s)


def token_message(t: TokenInfo, text: str | None = None) -> pb.Token:
    token = pb.Token(id=t.id, text=t.text if text is None else text,
                     top_logprobs=[pb.TopLogprob(id=i, logprob=p) for i, p in t.top_logprobs])
    if t.logprob is not None:
        token.logprob = t.logprob
    return token


class GenerationServicer(pb_grpc.GenerationServicer):
    """``rollserve.v1.Generation``. Event-loop only."""

    def __init__(self, ctx: FrontendContext, registry: Registry) -> None:
        self.ctx = ctx
        self.registry = registry

    def _request(self, msg: Any, context: grpc.aio.ServicerContext, stream: bool) -> tuple[Any, GenerationRequest]:
        check_serving(self.ctx)
        if not msg.model:
            raise InvalidRequest("'model' is required")
        ep = self.registry.get(msg.model)
        limits = self.ctx.limits
        params = build_sampling_params(sampling_values(msg.parameters), limits)
        ids = tuple(msg.prompt_token_ids) or None
        if ids is not None:
            if msg.prompt:
                raise InvalidRequest("give 'prompt' or 'prompt_token_ids', not both")
            if any(i < 0 for i in ids):
                raise InvalidRequest("'prompt_token_ids' must be non-negative token ids")
            prompt = ""
        else:
            prompt = check_text("prompt", msg.prompt, max_chars=limits.max_prompt_chars)
        payload = None if is_text_model(ep) else {"inputs": prompt}
        return ep, GenerationRequest(request_id=new_request_id(msg.request_id), model=ep.name, prompt=prompt,
                                     params=params, prompt_token_ids=ids, stream=stream, payload=payload,
                                     deadline=deadline_of(context))

    @guarded
    async def Generate(self, msg: Any, context: grpc.aio.ServicerContext) -> pb.GenerateResponse:
        ep, req = self._request(msg, context, stream=False)
        await ensure_resident(ep)  # a model loaded on demand: its first request waits for the load
        result = await collect(ep.submit(req))
        text = result.text
        if not text and result.payload is not None:
            text = result.payload if isinstance(result.payload, str) else json.dumps(result.payload)
        if msg.return_full_text:
            text = req.prompt + text
        return pb.GenerateResponse(request_id=req.request_id, text=text,
                                   finish_reason=FINISH_REASON[result.finish_reason],
                                   tokens=[token_message(t) for t in result.tokens],
                                   timings=timings_message(result.timings))

    @guarded_stream
    async def GenerateStream(self, msg: Any, context: grpc.aio.ServicerContext
                             ) -> AsyncIterator[pb.GenerateStreamResponse]:
        ep, req = self._request(msg, context, stream=True)
        await ensure_resident(ep)  # a model loaded on demand: its first request waits for the load
        require_streaming(ep)
        stream: ResultStream = ep.submit(req)
        prefix = req.prompt if msg.return_full_text else ""
        try:
            async for delta in stream:
                last = delta.finish_reason is not None
                tokens = list(delta.tokens)
                if not tokens:
                    if last or delta.text:
                        yield self._message(req, stream, None, prefix + delta.text, last)
                        prefix = ""
                    continue
                for i, t in enumerate(tokens):
                    text = delta.text if len(tokens) == 1 else t.text
                    yield self._message(req, stream, t, prefix + text, last and i == len(tokens) - 1)
                    prefix = ""
        finally:
            if not stream.done:
                stream.cancel()  # client cancel or deadline: the engine frees the KV blocks

    @staticmethod
    def _message(req: GenerationRequest, stream: ResultStream, token: TokenInfo | None, text: str,
                 last: bool) -> pb.GenerateStreamResponse:
        msg = pb.GenerateStreamResponse(request_id=req.request_id, text=text)
        if token is not None:
            msg.token.CopyFrom(token_message(token, text))
        if last:
            msg.finish_reason = FINISH_REASON[stream.finish_reason or FinishReason.LENGTH]
            msg.timings.CopyFrom(timings_message(stream.timings()))
        return msg


class ManagementServicer(pb_grpc.ManagementServicer):
    """``rollserve.v1.Management``: the HTTP management operations. Event-loop only."""

    def __init__(self, ctx: FrontendContext, registry: Registry, drain_timeout_s: float) -> None:
        self.ctx = ctx
        self.registry = registry
        self.drain_timeout_s = drain_timeout_s

    @guarded
    async def ListModels(self, msg: Any, context: grpc.aio.ServicerContext) -> pb.ListModelsResponse:
        return pb.ListModelsResponse(models=[
            pb.ModelSummary(name=name, status=ep.state.value, batching=batching_of(ep))
            for name, ep in sorted(self.registry.endpoints.items())])

    @guarded
    async def DescribeModel(self, msg: Any, context: grpc.aio.ServicerContext) -> pb.DescribeModelResponse:
        ep = self.registry.get(msg.name)
        described = json.loads(json.dumps(ep.describe(), default=str))
        details = struct_pb2.Struct()
        json_format.ParseDict(described, details)
        return pb.DescribeModelResponse(name=ep.name, status=ep.state.value, reason=ep.reason or "",
                                        batching=batching_of(ep), num_workers=len(described.get("workers") or []),
                                        target_workers=int(described.get("target_workers") or 0), details=details)

    @guarded
    async def RegisterModel(self, msg: Any, context: grpc.aio.ServicerContext) -> pb.RegisterModelResponse:
        check_serving(self.ctx)
        options = {name: getattr(msg, name) for name in ("batch_size", "max_batch_delay_ms", "min_workers",
                                                         "max_workers", "job_queue_size") if msg.HasField(name)}
        ep = await register_model(self.registry, msg.model_name, msg.url, register_overrides(options),
                                  wait=not msg.asynchronous)
        return pb.RegisterModelResponse(name=ep.name, status=ep.state.value)

    @guarded
    async def ScaleWorkers(self, msg: Any, context: grpc.aio.ServicerContext) -> pb.ScaleWorkersResponse:
        ep = await self.registry.scale(msg.name, msg.num_workers)
        return pb.ScaleWorkersResponse(name=ep.name, num_workers=msg.num_workers)

    @guarded
    async def UpdateModel(self, msg: Any, context: grpc.aio.ServicerContext) -> pb.UpdateModelResponse:
        values = knobs.check_values({k.name: getattr(msg, k.name) for k in knobs.KNOBS if msg.HasField(k.name)})
        answer = await self.registry.update_model(msg.name, values)
        details = struct_pb2.Struct()
        json_format.ParseDict(json.loads(json.dumps(answer, default=str)), details)
        return pb.UpdateModelResponse(name=msg.name, details=details)

    @guarded
    async def UnregisterModel(self, msg: Any, context: grpc.aio.ServicerContext) -> pb.UnregisterModelResponse:
        self.registry.require_model_api("unregistering a model")
        self.registry.get(msg.name)
        await self.registry.unregister(msg.name, self.drain_timeout_s)
        return pb.UnregisterModelResponse(name=msg.name)
