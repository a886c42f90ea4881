"""OpenAI request bodies -> core ``GenerationRequest``s (strict validation, one table per route).

Design note: every field the route understands is listed here; an unknown field is a 400 naming it
(``option.strict_parameters=false`` on a model relaxes that). OpenAI fields we cannot honour are accepted
only at their neutral value (``presence_penalty: 0``, ``logit_bias: {}``, ``min_p: 0``, ...) and refused
with a message saying so otherwise: never silently ignored. Sampling values go through the shared
``serving.params`` checks, so OpenAI, LMI and TGI give the same message for the same bad value.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from serving.errors import InvalidRequest
from serving.frontends.chat import check_messages, render_chat
from serving.frontends.prompts import ModelText
from serving.params import MAX_TOKEN_ID, Limits, build_sampling_params, check_sequences, check_text
from serving.types import GenerationRequest, SamplingParams

COMMON_FIELDS = frozenset({
    "model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "user",
    "presence_penalty", "frequency_penalty", "logit_bias", "ignore_eos", "top_k", "repetition_penalty", "min_p",
    "stop_token_ids"})
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "logprobs", "echo", "suffix", "best_of"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "response_format",
                               "tools", "tool_choice", "parallel_tool_calls"}
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's documented default for /v1/completions
MAX_PROMPTS = 256

# field -> its only accepted value(s) besides null, and why
_NEUTRAL: dict[str, tuple[tuple[Any, ...], str]] = {
    "presence_penalty": ((0, 0.0), "presence_penalty is not supported (use repetition_penalty)"),
    "frequency_penalty": ((0, 0.0), "frequency_penalty is not supported (use repetition_penalty)"),
    "min_p": ((0, 0.0), "min_p is not supported by this server's samplers"),
    "suffix": (("",), "suffix (insertion) is not supported"),
    "parallel_tool_calls": ((True, False), "parallel_tool_calls must be a boolean"),
}


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


def _kind(v: Any) -> str:
    return type(v).__name__ if v is not None else "null"


def check_fields(body: Any, allowed: frozenset[str], strict: bool) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise InvalidRequest(f"request body must be a JSON object, got {_kind(body)}")
    unknown = sorted(set(body) - allowed)
    if unknown and strict:
        raise InvalidRequest(f"unknown fields: {', '.join(unknown)}")
    for name, (ok, why) in _NEUTRAL.items():
        v = body.get(name)
        if v is not None and (isinstance(v, bool) != isinstance(ok[0], bool) or v not in ok):
            raise InvalidRequest(f"{why}; got {name}={v!r}")
    if body.get("logit_bias") not in (None, {}):
        raise InvalidRequest("logit_bias is not supported; send null or {}")
    if "user" in body and body["user"] is not None:
        check_text("user", body["user"], allow_empty=True, max_chars=256)
    return body


def _flag(body: dict[str, Any], name: str) -> bool:
    v = body.get(name)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise InvalidRequest(f"{name!r} must be a boolean, got {_kind(v)}")
    return v


def _n(body: dict[str, Any], limits: Limits) -> int:
    n = body.get("n")
    if n is None:
        return 1
    if isinstance(n, bool) or not isinstance(n, int):
        raise InvalidRequest(f"'n' must be an integer, got {_kind(n)}")
    if not 1 <= n <= limits.max_n:
        raise InvalidRequest(f"'n' must be between 1 and {limits.max_n}, got {n}")
    return n


def _include_usage(body: dict[str, Any], stream: bool) -> bool:
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not isinstance(opts, dict):
        raise InvalidRequest(f"'stream_options' must be an object, got {_kind(opts)}")
    if not stream:
        raise InvalidRequest("'stream_options' is only allowed with 'stream': true")
    unknown = sorted(set(opts) - {"include_usage", "continuous_usage_stats"})
    if unknown:
        raise InvalidRequest(f"unknown fields in stream_options: {', '.join(unknown)}")
    return _flag(opts, "include_usage")


def sampling(body: dict[str, Any], max_new_tokens: int | None, logprobs: int | None, limits: Limits
             ) -> SamplingParams:
    """OpenAI sampling fields -> SamplingParams (temperature 0 = greedy; OpenAI's default is 1.0)."""
    temperature = body.get("temperature")
    values: dict[str, Any] = {
        "max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": body.get("top_p"),
        "seed": body.get("seed"), "stop": body.get("stop"), "ignore_eos": body.get("ignore_eos"),
        "top_k": body.get("top_k"), "repetition_penalty": body.get("repetition_penalty"),
        "stop_token_ids": body.get("stop_token_ids"),
    }
    params = build_sampling_params(values, limits)
    do_sample = params.temperature != 0.0
    params = replace(params, do_sample=do_sample)
    if logprobs is not None:
        params = replace(params, details=True, logprobs=logprobs)
    return params


def _max_tokens(body: dict[str, Any], names: tuple[str, ...], limits: Limits) -> tuple[int | None, str]:
    """The first given of ``names`` (validated later by build_sampling_params' range check)."""
    for name in names:
        v = body.get(name)
        if v is not None:
            if isinstance(v, bool) or not isinstance(v, int):
                raise InvalidRequest(f"{name!r} must be an integer, got {_kind(v)}")
            if not 1 <= v <= limits.max_new_tokens:
                raise InvalidRequest(f"{name!r} must be between 1 and {limits.max_new_tokens}, got {v}")
            return v, name
    return None, names[0]


def _prompts(prompt: Any, limits: Limits) -> list[str | list[int]]:
    """``prompt``: a string, a list of strings, a list of token ids, or a list of token-id lists."""
    if isinstance(prompt, str):
        return [check_text("prompt", prompt, max_chars=limits.max_prompt_chars)]
    if not isinstance(prompt, list) or not prompt:
        raise InvalidRequest("'prompt' must be a non-empty string, list of strings, or list of token ids")
    if len(prompt) > MAX_PROMPTS:
        raise InvalidRequest(f"'prompt' has {len(prompt)} entries; at most {MAX_PROMPTS}")
    if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        return [_token_ids(prompt)]
    if all(isinstance(p, str) for p in prompt):
        return [check_text("prompt", p, max_chars=limits.max_prompt_chars) for p in prompt]
    if all(isinstance(p, list) for p in prompt):
        return [_token_ids(p) for p in prompt]
    raise InvalidRequest("'prompt' must not mix strings, token ids and lists")


def _token_ids(ids: list[Any]) -> list[int]:
    if not ids:
        raise InvalidRequest("'prompt' token-id list must not be empty")
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i <= MAX_TOKEN_ID:
            shown = repr(i) if not isinstance(i, int) or i.bit_length() < 80 else f"an integer of {i.bit_length()} bits"
            raise InvalidRequest(f"'prompt' token ids must be integers between 0 and {MAX_TOKEN_ID}, got {shown}")
    return list(ids)


def parse_completion(body: Any, model: str, text: ModelText, rid: str, limits: Limits, strict: bool
                     ) -> ParsedRequest:
    """A ``/v1/completions`` body -> choices (prompt-major, ``n`` per prompt)."""
    body = check_fields(body, COMPLETION_FIELDS, strict)
    if "prompt" not in body:
        raise InvalidRequest("missing field 'prompt'")
    stream = _flag(body, "stream")
    n = _n(body, limits)
    best_of = body.get("best_of")
    if best_of is not None and (isinstance(best_of, bool) or best_of != n):
        raise InvalidRequest(f"best_of is only supported equal to n ({n}); got {best_of!r}")
    logprobs = body.get("logprobs")
    if logprobs is not None:
        if isinstance(logprobs, bool) or not isinstance(logprobs, int):
            raise InvalidRequest(f"'logprobs' must be an integer, got {_kind(logprobs)}")
        if not 0 <= logprobs <= limits.max_logprobs:
            raise InvalidRequest(f"'logprobs' must be between 0 and {limits.max_logprobs}, got {logprobs}")
    echo = _flag(body, "echo")
    max_tokens, field = _max_tokens(body, ("max_tokens",), limits)
    prompts = _prompts(body["prompt"], limits)
    check_sequences(len(prompts) * n, limits, "'prompt' x 'n'")
    base = sampling(body, max_tokens or COMPLETION_DEFAULT_MAX_TOKENS, logprobs, limits)
    choices: list[Choice] = []
    for p_index, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            ids = text.encode(prompt)
            prompt_text = prompt
        else:
            ids = prompt
            decoded = text.decode(prompt) if echo else ""
            if decoded is None:
                raise InvalidRequest(f"'echo' with token-id prompts needs a tokenizer.json for model {model!r}")
            prompt_text = decoded
        text.check_length(len(ids) if ids is not None else None, base.max_new_tokens, field)
        for j in range(n):
            index = p_index * n + j
            params = base if base.seed is None or n == 1 else replace(base, seed=base.seed + j)
            req_id = rid if len(prompts) * n == 1 else f"{rid}-{index}"
            request = GenerationRequest(
                request_id=req_id, model=model, prompt=prompt if isinstance(prompt, str) else "",
                prompt_token_ids=None if isinstance(prompt, str) else tuple(prompt), params=params,
                stream=stream)
            choices.append(Choice(index, p_index, prompt_text, request))
    return ParsedRequest(choices, stream, _include_usage(body, stream), logprobs, echo)


def _chat_logprobs(body: dict[str, Any], limits: Limits) -> int | None:
    want = _flag(body, "logprobs")
    top = body.get("top_logprobs")
    if top is not None:
        if isinstance(top, bool) or not isinstance(top, int):
            raise InvalidRequest(f"'top_logprobs' must be an integer, got {_kind(top)}")
        if not 0 <= top <= limits.max_logprobs:
            raise InvalidRequest(f"'top_logprobs' must be between 0 and {limits.max_logprobs}, got {top}")
        if not want:
            raise InvalidRequest("'top_logprobs' needs 'logprobs': true")
    return (top or 0) if want else None


def _check_tools(body: dict[str, Any]) -> None:
    if body.get("tools") not in (None, []):
        raise InvalidRequest("tools (function calling) are not supported")
    if body.get("tool_choice") not in (None, "none", "auto"):
        raise InvalidRequest("tool_choice must be 'none' or 'auto' (tools are not supported)")
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise InvalidRequest("response_format other than {'type': 'text'} is not supported")


def parse_chat(body: Any, model: str, text: ModelText, rid: str, limits: Limits, strict: bool) -> ParsedRequest:
    """A ``/v1/chat/completions`` body -> ``n`` choices over the chat-template-rendered prompt."""
    body = check_fields(body, CHAT_FIELDS, strict)
    if "messages" not in body:
        raise InvalidRequest("missing field 'messages'")
    stream = _flag(body, "stream")
    n = _n(body, limits)
    _check_tools(body)
    logprobs = _chat_logprobs(body, limits)
    messages = check_messages(body["messages"])
    max_tokens, field = _max_tokens(body, ("max_completion_tokens", "max_tokens"), limits)
    include_usage = _include_usage(body, stream)
    prompt = render_chat(text.chat_template, messages, model=model, special_tokens=text.special_tokens)
    ids = text.encode(prompt)
    num_prompt = len(ids) if ids is not None else None
    text.check_length(num_prompt, max_tokens, field)
    if max_tokens is None:  # vLLM's default: the rest of the context (capped)
        max_tokens = text.room(num_prompt, limits.max_new_tokens)
    base = sampling(body, max_tokens, logprobs, limits)
    choices = []
    for j in range(n):
        params = base if base.seed is None or n == 1 else replace(base, seed=base.seed + j)
        request = GenerationRequest(request_id=rid if n == 1 else f"{rid}-{j}", model=model, prompt=prompt,
                                    params=params, stream=stream)
        choices.append(Choice(j, 0, prompt, request))
    return ParsedRequest(choices, stream, include_usage, logprobs, False)
