"""Request bodies of the HTTP routes: one model per route, which validates the body and is the route's
schema in ``/openapi.json`` (see ``serving.requests.schema`` for the rules and the messages).

Design note: the routes' modules (``lmi``, ``tgi``, ``openai_schema``) validate with the ``RequestSchema``s at
the bottom and then apply the rules a JSON schema cannot say, each named in a field's description:
``stream_options`` only with ``stream: true``, ``best_of`` at least ``n`` (and not streamed), ``top_logprobs`` only with
``logprobs: true``, prompts x ``n`` at most ``max_sequences_per_request``, the prompt plus the new tokens
within the model's context, token ids within its vocabulary, and a chat template that accepts the messages.
"""

from __future__ import annotations

import typing
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field

from serving.requests.params import (
    MAX_TOKEN_ID,
    BadWords,
    LmiParameters,
    LogitBias,
    Logprobs,
    MaxNewTokens,
    MinP,
    MinTokens,
    Penalty,
    RepetitionPenalty,
    Seed,
    Stop,
    StopTokenIds,
    Temperature,
    TokenId,
    TopK,
    TopP,
)
from serving.requests.schema import BY_SHAPE, INTEGER, TEXT, Cap, Only, StrictModel
from serving.requests.validation import RequestSchema

MAX_PROMPTS = 256  # entries of a list of prompts (/v1/completions)
MAX_MESSAGES = 4096

Prompt = Annotated[str, Field(min_length=1), Cap("max_prompt_chars"), TEXT]
Text = Annotated[str, TEXT]


class OpenModel(StrictModel):
    """A part of a request that may carry other keys (OpenAI clients send back what an answer held): accepted, and
    named in ``X-Ignored-Parameters`` by their dotted paths as unknown fields anywhere are (refused under
    ``option.strict_parameters``: ``serving.requests.validation``)."""

    model_config = ConfigDict(extra="allow")


# --- LMI / SageMaker and TGI -------------------------------------------------------------------------
class LmiRequest(StrictModel):
    """``POST /predictions/{model_name}`` and ``POST /invocations`` on a text model (a custom handler gets its
    body as is: only ``parameters`` and ``stream`` are checked, unknown parameters are dropped). A body with
    ``messages`` on either route is an OpenAI chat request (``ChatRequest``)."""

    inputs: Annotated[Prompt | Annotated[list[Prompt], Field(min_length=1), Cap("max_sequences_per_request")],
                      BY_SHAPE, Field(description="the prompt, or a list of prompts (a list of answers)")]
    parameters: LmiParameters | None = None
    adapters: Annotated[Text | Annotated[list[Text], Field(min_length=1)], BY_SHAPE] | None = Field(
        None, description="DJL LMI's: the LoRA adapter of the answer, or one per prompt of a list (a model with "
        "option.enable_lora; null or absent: the base model)")
    stream: bool | None = Field(None, description="a token stream (jsonlines; SSE with option.output_formatter=sse)"
                                " of a single prompt on a rolling-batch model (always with "
                                "option.output_formatter=jsonlines); dynamic batching answers whole")
    model: Text | None = Field(None, description="ignored: the route decides the model")


class TgiRequest(StrictModel):
    """``POST /generate``, ``POST /generate_stream`` and ``POST /`` (TGI)."""

    inputs: Annotated[Prompt, Field(description="the prompt")]
    parameters: LmiParameters | None = None
    stream: bool | None = Field(None, description="POST / only: an SSE stream instead of a one-element list "
                                "(needs a rolling-batch model)")


# --- OpenAI ------------------------------------------------------------------------------------------
class StreamOptions(StrictModel):
    include_usage: bool | None = Field(None, description="a last chunk with the token usage")
    continuous_usage_stats: bool | None = Field(None, description="vLLM's; accepted (usage comes in the last "
                                                "chunk only)")


class JsonSchemaFormat(StrictModel):
    """OpenAI's ``response_format.json_schema``."""

    name: Text | None = Field(None, description="the schema's name (not used)")
    description: Text | None = Field(None, description="what the answer is for (not used)")
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="the JSON schema the answer follows")
    strict: bool | None = Field(None, description="accepted: the schema is always enforced")


class ResponseFormat(OpenModel):
    """OpenAI's ``{"type": "text" | "json_object" | "json_schema", "json_schema": {"name", "schema", "strict"}}``,
    llama.cpp's ``{"type": "json_object", "schema": {...}}``, or TGI's ``{"type": "json" | "regex", "value": ...}``."""

    type: Literal["text", "json_object", "json_schema", "json", "regex"]
    json_schema: JsonSchemaFormat | None = Field(None, description="with type json_schema: {\"name\", \"schema\", "
                                                 "\"strict\"}; the schema is always enforced")
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="llama.cpp's: with type json_object, "
                                           "the JSON schema the answer follows (any object without it)")
    value: Any = Field(None, description="TGI's shape: the schema (type json) or the pattern (type regex)")


class OpenAIRequest(StrictModel):
    """Fields both OpenAI routes take (OpenAI's and vLLM's names)."""

    model: Text | None = Field(None, description="the model; may be left out when the server has one model")
    stream: bool | None = Field(None, description="SSE chunks ending in `data: [DONE]`; needs a rolling-batch "
                                "model")
    stream_options: StreamOptions | None = Field(None, description="only with stream: true")
    max_tokens: MaxNewTokens | None = Field(None, description="the most tokens to generate per choice")
    temperature: Temperature | None = None
    top_p: TopP | None = None
    n: Annotated[int, Field(ge=1), Cap("max_n"), INTEGER] | None = Field(
        None, description="choices per prompt (default 1); prompts x n at most max_sequences_per_request")
    stop: Stop | None = None
    seed: Seed | None = Field(None, description="reproducible sampling; choice j of n uses seed + j")
    user: Annotated[str, Field(max_length=256), TEXT] | None = Field(
        None, description="an end-user id: without prompt_cache_key, the user's requests stick to one worker "
        "(its prefix cache holds their conversation)")
    prompt_cache_key: Annotated[str, Field(min_length=1, max_length=256), TEXT] | None = Field(
        None, description="OpenAI's: requests with the same key stick to one worker (its prefix cache)")
    cache_salt: Annotated[str, Field(min_length=1, max_length=256), TEXT] | None = Field(
        None, description="vLLM's: only requests with the same salt share prefix-cache blocks")
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: LogitBias | None = None
    ignore_eos: bool | None = Field(None, description="vLLM's: keep generating after the end-of-sequence token")
    top_k: TopK | None = None
    repetition_penalty: RepetitionPenalty | None = None
    min_p: MinP | None = None
    bad_words: BadWords | None = None
    min_tokens: MinTokens | None = Field(None, description="vLLM's: no end-of-sequence or stop token before this "
                                         "many tokens")
    include_stop_str_in_output: bool | None = Field(None, description="vLLM's: keep the stop string that ended the "
                                                    "answer")
    skip_special_tokens: bool | None = Field(None, description="vLLM's: false keeps special tokens' text")
    stop_token_ids: StopTokenIds | None = None
    response_format: ResponseFormat | None = Field(None, description="structured output: json_object, json_schema "
                                                   "(OpenAI) or TGI's json / regex")
    guided_json: dict[str, Any] | str | None = Field(None, description="vLLM's: the answer is JSON valid under this "
                                                     "schema")
    guided_regex: str | None = Field(None, description="vLLM's: the answer matches this regular expression")
    guided_choice: list[str] | None = Field(None, description="vLLM's: the answer is one of these strings")
    guided_grammar: str | None = Field(None, description="vLLM's: the answer follows this Lark or GBNF grammar")
    structured_outputs: dict[str, Any] | None = Field(None, description="vLLM's newer form of the guided fields: "
                                                      "one of json, regex, choice, grammar, json_object")
    guided_decoding_backend: Text | None = Field(None, description="vLLM's; accepted: constraints always run on "
                                                 "llguidance")
    prompt_logprobs: Logprobs | None = Field(None, description="vLLM's: each prompt token's log-probability given "
                                             "those before it, with the k most likely alternatives (0: none)")
    truncate_prompt_tokens: Annotated[int, Field(ge=1, le=MAX_TOKEN_ID), INTEGER] | None = Field(
        None, description="vLLM's: keep only the last N tokens of the prompt")


TokenIds = Annotated[list[TokenId], Field(min_length=1)]


class CompletionRequest(OpenAIRequest):
    """``POST /v1/completions``."""

    prompt: Annotated[Prompt | Annotated[list[Prompt], Field(min_length=1, max_length=MAX_PROMPTS)] | TokenIds
                      | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)], BY_SHAPE, Field(
                          description="a prompt, a list of prompts, a prompt of token ids (of the model's "
                          "vocabulary) or a list of those; n choices each")]
    max_tokens: Annotated[int, Field(ge=0), Cap("max_new_tokens"), INTEGER] | None = Field(
        None, description="the most tokens to generate per choice (default 16); 0 only with echo: the prompt alone, "
        "scored with logprobs")
    logprobs: Logprobs | None = Field(None, description="the log-probability of each token and of its k most "
                                      "likely alternatives; with echo, the prompt's tokens too (the first: null)")
    echo: bool | None = Field(None, description="prepend the prompt to each choice's text")
    suffix: Annotated[str, Only(("",), "(insertion) is not supported: only \"\" or null is accepted")] | None = (
        Field(None, description="not supported: only \"\" or null"))
    best_of: Annotated[int, Field(ge=1), Cap("max_n"), INTEGER] | None = Field(
        None, description="candidates per prompt, at least n; the n with the highest cumulative log-probability are "
        "answered (not with stream)")


Role = Literal["system", "developer", "user", "assistant", "tool", "function"]
ROLES: tuple[str, ...] = typing.get_args(Role)


class TextPart(OpenModel):
    type: Annotated[str, Only(("text",), "must be 'text' (only text parts are supported)")]
    text: Text


FunctionName = Annotated[str, Field(min_length=1, max_length=64, description="letters, digits, _ . - "
                                    "(checked with the tools)"), TEXT]


class FunctionCall(OpenModel):
    name: FunctionName
    arguments: Text = Field(description="the arguments as JSON text")


class ToolCall(OpenModel):
    """An assistant message's earlier call, passed to the chat template."""

    id: Text | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenModel):
    """One message; other keys (``refusal``, ...) are accepted and ignored."""

    role: Role
    content: Annotated[Text | list[TextPart], BY_SHAPE] | None = Field(
        None, description="text, or a list of text parts (joined); null or absent: empty")
    name: Text | None = Field(None, description="passed to the chat template")
    tool_calls: list[ToolCall] | None = Field(None, description="an assistant message's calls (passed to the chat "
                                              "template, arguments as an object)")
    tool_call_id: Text | None = Field(None, description="a tool message: the call it answers")


MAX_TOOLS = 128


class FunctionDef(OpenModel):
    name: FunctionName
    description: Text | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema of the arguments (an object)")
    strict: bool | None = Field(None, description="accepted: forced calls always follow the schema")


class Tool(StrictModel):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(StrictModel):
    name: FunctionName


class NamedToolChoice(StrictModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatRequest(OpenAIRequest):
    """``POST /v1/chat/completions`` (and ``/invocations`` with ``messages``): rendered with the model's chat
    template, which may refuse a conversation (400)."""

    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: MaxNewTokens | None = Field(
        None, description="OpenAI's newer name of max_tokens (wins over it); default: the rest of the context")
    logprobs: bool | None = Field(None, description="the log-probability of each token")
    top_logprobs: Logprobs | None = Field(None, description="with logprobs: true, the k most likely alternatives "
                                          "of each token")
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = Field(
        None, description="functions the model may call (OpenAI's shape)")
    tool_choice: Annotated[Annotated[str, Only(("none", "auto", "required"), "must be 'none', 'auto', 'required' or "
                                               "{\"type\": \"function\", \"function\": {\"name\": ...}}")]
                           | NamedToolChoice, BY_SHAPE] | None = Field(
        None, description="none, auto (needs option.enable_auto_tool_choice), required, or {\"type\": "
        "\"function\", \"function\": {\"name\": ...}}; default auto with tools, none without")
    parallel_tool_calls: bool | None = Field(None, description="false: at most one call (tool_choice required)")


LMI = RequestSchema(LmiRequest, params_at=("parameters",))
TGI = RequestSchema(TgiRequest, params_at=("parameters",))
COMPLETION = RequestSchema(CompletionRequest)
CHAT = RequestSchema(ChatRequest)
ROUTE_MODELS = (LmiRequest, TgiRequest, CompletionRequest, ChatRequest)
"""The request models of the OpenAPI document (their parts come with them)."""
