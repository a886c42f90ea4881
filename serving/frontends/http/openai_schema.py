"""OpenAI request bodies -> core ``GenerationRequest``s.

Design note: the bodies are validated by the route's model (``schemas.CompletionRequest``,
``schemas.ChatRequest``), the same definition ``/openapi.json`` documents: every field the route understands
is there, an unknown field is dropped and named in ``X-Ignored-Parameters`` (a 400 naming it with
``option.strict_parameters=true``),
OpenAI fields we cannot honour are accepted only at their neutral value (``suffix: ""``)
and refused with a message saying so otherwise: never silently ignored. The sampling fields share their types
with LMI's parameters, so OpenAI, LMI and TGI give the same message for the same bad value. This module adds
what a schema cannot say (see ``schemas``' design note).
A constraint (``response_format``, vLLM's guided fields) becomes the request's grammar
(``serving.requests.structured``);
``tools`` and ``tool_choice`` become a ``ToolPlan`` (``serving.frontends.http.tools``) the answer is read with.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, cast

from rollcore.errors import InvalidRequest
from rollcore.types import GenerationRequest, SamplingParams
from serving.frontends.http import reasoning, tools
from serving.frontends.http.chat import render_chat, template_messages
from serving.frontends.http.tools import ToolPlan
from serving.models.model_text import ModelText
from serving.requests import structured
from serving.requests.bodies import CHAT, COMPLETION, ChatRequest, CompletionRequest, NamedToolChoice, OpenAIRequest
from serving.requests.params import Limits, check_sequences, sampling_params

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions


@dataclass(frozen=True, slots=True)
class Choice:
    """One generation of a request: which prompt it answers and the core request that produces it."""

    index: int
    prompt_index: int
    prompt_text: str  # for echo / details
    request: GenerationRequest


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """A validated OpenAI request: its choices plus what the answer needs to know."""

    choices: list[Choice]
    stream: bool
    include_usage: bool
    logprobs: int | None  # None = not asked; k = chosen token plus k alternatives
    echo: bool
    tools: ToolPlan | None = None  # chat with tools: how to read the answer (serving.frontends.http.tools)
    prompt_logprobs: int | None = None  # vLLM's field: the answer carries ``prompt_logprobs``
    echo_only: bool = False  # max_tokens 0 with echo: one token is generated (vLLM does the same) and left out
    ignored: tuple[str, ...] = ()  # unknown fields dropped (not option.strict_parameters)
    keep_best: int | None = None  # best_of > n: the answer keeps the n candidates of each prompt with the highest
    # cumulative log-probability (vLLM's best_of)
    # a thinking model's chat: None = it does not think; True = the prompt opened the reasoning, False = the
    # answer may open it (serving.frontends.http.reasoning)
    reasoning: bool | None = None


def _include_usage(body: OpenAIRequest, stream: bool) -> bool:
    if body.stream_options is None:
        return False
    if not stream:
        raise InvalidRequest("'stream_options' is only allowed with 'stream': true")
    return bool(body.stream_options.include_usage)


def sampling(body: OpenAIRequest, max_new_tokens: int | None, logprobs: int | None, limits: Limits,
             tool_grammar: str | None = None) -> SamplingParams:
    """OpenAI sampling fields -> SamplingParams (temperature 0 = greedy; OpenAI's default is 1.0)."""
    params = sampling_params({
        "max_new_tokens": max_new_tokens, "temperature": body.temperature, "top_p": body.top_p, "seed": body.seed,
        "stop": (body.stop,), "ignore_eos": body.ignore_eos, "top_k": body.top_k,
        "repetition_penalty": body.repetition_penalty, "stop_token_ids": body.stop_token_ids,
        "presence_penalty": body.presence_penalty, "frequency_penalty": body.frequency_penalty, "min_p": body.min_p,
        "min_tokens": body.min_tokens, "logit_bias": body.logit_bias,
        "bad_words": tuple(body.bad_words) if body.bad_words else None,
        "include_stop_str_in_output": body.include_stop_str_in_output, "skip_special_tokens": body.skip_special_tokens,
        "grammar": structured.one_of(("tool_choice", tool_grammar), ("response_format", constraint(body)))}, limits)
    params = replace(params, do_sample=params.temperature != 0.0, prompt_logprobs=body.prompt_logprobs,
                     cache_salt=body.cache_salt)
    if logprobs is not None:
        params = replace(params, details=True, logprobs=logprobs)
    return params


def affinity(body: OpenAIRequest) -> str | None:
    """The key whose requests stick to one worker (``rolling`` batcher): OpenAI's ``prompt_cache_key``, else the
    ``user``; prefixed so that neither can name the other's key or a SageMaker session."""
    if body.prompt_cache_key is not None:
        return "prompt_cache_key:" + body.prompt_cache_key
    return "user:" + body.user if body.user is not None else None


def constraint(body: OpenAIRequest) -> str | None:
    """The request's structured-output grammar, from whichever of OpenAI's and vLLM's fields carries it."""
    fmt = body.response_format
    return structured.one_of(
        ("response_format", structured.from_response_format(fmt.model_dump(by_alias=True)) if fmt is not None
         else None),
        ("guided_*", structured.from_guided({k: getattr(body, k) for k in structured.GUIDED_FIELDS})),
        ("structured_outputs", structured.from_structured_outputs(body.structured_outputs)
         if body.structured_outputs is not None else None))


def _prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """``prompt`` (validated: never empty) -> one entry per prompt: a string or a list of token ids."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt[0], int):
        return [cast("list[int]", prompt)]  # one prompt of token ids
    return list(cast("list[str | list[int]]", prompt))  # prompts: strings or lists of token ids


def _truncated(ids: list[int] | None, keep: int | None, model: str) -> list[int] | None:
    """vLLM's ``truncate_prompt_tokens``: the prompt's last ``keep`` tokens, or None when it is not cut."""
    if keep is None:
        return None
    if ids is None:
        raise InvalidRequest(f"'truncate_prompt_tokens' needs a tokenizer.json for model {model!r}")
    return list(ids[-keep:]) if len(ids) > keep else None


def parse_completion(body: Any, model: str, text: ModelText, rid: str, limits: Limits, strict: bool
                     ) -> ParsedRequest:
    """A ``/v1/completions`` body -> choices (prompt-major, ``n`` per prompt)."""
    ignored: list[str] = []
    req: CompletionRequest = COMPLETION.validate(body, limits, strict=strict, ignored=ignored)
    stream = bool(req.stream)
    n = req.n or 1
    best_of = req.best_of or n
    if best_of < n:
        raise InvalidRequest(f"'best_of' must be >= 'n' ({n}), got {best_of}")
    if best_of > n and stream:
        raise InvalidRequest("'best_of' > 'n' cannot stream: the best answers are known only at the end")
    include_usage = _include_usage(req, stream)
    logprobs = req.logprobs
    echo = bool(req.echo)
    echo_only = req.max_tokens == 0
    if echo_only and not echo:
        raise InvalidRequest("'max_tokens' may be 0 only with 'echo': true (the answer is then the prompt alone)")
    prompts = _prompts(req.prompt)
    check_sequences(len(prompts) * best_of, limits, "'prompt' x 'best_of'" if best_of > n else "'prompt' x 'n'")
    max_tokens = COMPLETION_DEFAULT_MAX_TOKENS if req.max_tokens is None else max(req.max_tokens, 1)
    base = sampling(req, max_tokens, logprobs, limits)
    if best_of > n:  # candidates are ranked by their tokens' log-probabilities
        base = replace(base, details=True)
    if echo and logprobs is not None:  # the echoed prompt's tokens are scored too (vLLM's behaviour)
        base = replace(base, prompt_logprobs=max(logprobs, base.prompt_logprobs or 0))
    choices: list[Choice] = []
    for p_index, prompt in enumerate(prompts):
        ids = text.encode(prompt) if isinstance(prompt, str) else prompt
        cut = _truncated(ids, req.truncate_prompt_tokens, model)
        if cut is not None:
            prompt = ids = cut
        if isinstance(prompt, str):
            prompt_text = prompt
        else:
            decoded = text.decode(prompt) if echo else ""
            if decoded is None:
                raise InvalidRequest(f"'echo' with token-id prompts needs a tokenizer.json for model {model!r}")
            prompt_text = decoded
        text.check_length(len(ids) if ids is not None else None, base.max_new_tokens, "max_tokens")
        for j in range(best_of):
            index = p_index * best_of + j  # with best_of > n, the answer renumbers the n it keeps
            params = base if base.seed is None or best_of == 1 else replace(base, seed=base.seed + j)
            req_id = rid if len(prompts) * best_of == 1 else f"{rid}-{index}"
            request = GenerationRequest(
                request_id=req_id, model=model, prompt=prompt if isinstance(prompt, str) else "",
                prompt_token_ids=text.worker_ids(ids) if isinstance(prompt, str) else tuple(prompt), params=params,
                stream=stream, affinity=affinity(req))
            choices.append(Choice(index, p_index, prompt_text, request))
    return ParsedRequest(choices, stream, include_usage, logprobs, echo, None, req.prompt_logprobs, echo_only,
                         tuple(ignored), n if best_of > n else None)


def parse_chat(body: Any, model: str, text: ModelText, rid: str, limits: Limits, strict: bool,
               options: Mapping[str, str] | None = None) -> ParsedRequest:
    """A ``/v1/chat/completions`` body -> ``n`` choices over the chat-template-rendered prompt; ``options`` are
    the model's (tool calling's)."""
    ignored: list[str] = []
    req: ChatRequest = CHAT.validate(body, limits, strict=strict, ignored=ignored)
    plan = tools.plan([t.model_dump() for t in req.tools or ()],
                      req.tool_choice.model_dump() if isinstance(req.tool_choice, NamedToolChoice) else req.tool_choice,
                      req.parallel_tool_calls, dict(options or {}), text.chat_template)
    stream = bool(req.stream)
    n = req.n or 1
    if req.top_logprobs is not None and not req.logprobs:
        raise InvalidRequest("'top_logprobs' needs 'logprobs': true")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens: int | None = req.max_tokens
    field = "max_tokens"
    if req.max_completion_tokens is not None:  # OpenAI's newer name wins
        max_tokens, field = req.max_completion_tokens, "max_completion_tokens"
    include_usage = _include_usage(req, stream)
    messages = template_messages(req.messages)
    template_tools = None
    if plan is not None:
        if text.chat_template and "tools" in text.chat_template:
            template_tools = plan.template_tools
        else:
            messages = tools.add_tools_prompt(messages, plan)
    prompt = render_chat(text.chat_template, messages, model=model, special_tokens=text.special_tokens,
                         tools=template_tools)
    ids = text.encode(prompt)
    cut = _truncated(ids, req.truncate_prompt_tokens, model)
    if cut is not None:
        ids = cut
    num_prompt = len(ids) if ids is not None else None
    text.check_length(num_prompt, max_tokens, field)
    if max_tokens is None:  # vLLM's default: the rest of the context (capped)
        max_tokens = text.room(num_prompt, limits.max_new_tokens)
    base = sampling(req, max_tokens, logprobs, limits, plan.grammar() if plan is not None else None)
    triggered = plan.triggered(text.special_by_text) if plan is not None and base.grammar is None else None
    if triggered is not None:  # auto: a call the model starts is kept valid from its marker on
        base = replace(base, grammar=triggered[0], grammar_trigger=triggered[1])
    opened = reasoning.opened_by(prompt) if reasoning.thinks(options or {}, text.chat_template) else None
    if opened is not None and base.grammar is not None and base.grammar_trigger is None:
        base = replace(base, grammar=reasoning.after_reasoning(base.grammar, opened))  # think first, then answer
    choices = []
    for j in range(n):
        params = base if base.seed is None or n == 1 else replace(base, seed=base.seed + j)
        request = GenerationRequest(request_id=rid if n == 1 else f"{rid}-{j}", model=model, prompt=prompt,
                                    params=params, stream=stream, affinity=affinity(req),
                                    prompt_token_ids=tuple(cut) if cut is not None else text.worker_ids(ids))
        choices.append(Choice(j, 0, prompt, request))
    return ParsedRequest(choices, stream, include_usage, logprobs, False, plan, req.prompt_logprobs,
                         ignored=tuple(ignored), reasoning=opened)
