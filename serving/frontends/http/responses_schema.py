"""OpenAI Responses API request bodies (``POST /v1/responses``) -> a chat request for ``parse_chat``.

Design note: the Responses body is validated by its own model (``ResponsesRequest``, the schema ``/openapi.json``
documents; unknown fields dropped and named in ``X-Ignored-Parameters``, or refused under
``option.strict_parameters``), then translated into a ``/v1/chat/completions`` body: ``instructions`` and the
input items become ``messages`` (a ``function_call`` item joins the assistant message before it as a
``tool_calls`` entry, a ``function_call_output`` item is a ``tool`` message, a reasoning item is dropped as chat
templates drop earlier thinking), flat function tools become chat tools, ``text.format`` becomes
``response_format``, ``max_output_tokens`` becomes ``max_completion_tokens``. ``parse_chat`` then applies the
chat route's rules (the chat template, the tool plan, sampling validation): there is one generation path. Its
messages name chat fields; ``responses_param`` renames them to this API's (``'max_completion_tokens'`` ->
``'max_output_tokens'``). Fields OpenAI has but this server cannot honour are accepted only at their neutral
value (``truncation: "disabled"``), as everywhere in rollserve.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import Field

from rollcore.errors import InvalidRequest
from serving.requests.bodies import MAX_MESSAGES, MAX_TOOLS, FunctionName, Prompt, Text
from serving.requests.params import MaxNewTokens, Seed, Temperature, TopP
from serving.requests.schema import BY_SHAPE, Only, StrictModel
from serving.requests.validation import RequestSchema

ItemType = Literal["message", "function_call", "function_call_output", "reasoning"]
INCLUDABLE = ("reasoning.encrypted_content",)  # accepted: reasoning is returned in the clear, nothing is encrypted


class ResponsesInputPart(StrictModel):
    """A part of an input message: text (``input_text``, ``output_text``: an earlier answer's, sent back with its
    ``annotations`` and ``logprobs``), an earlier answer's ``refusal``, or a reasoning item's ``reasoning_text``."""

    type: Annotated[str, Only(("input_text", "output_text", "refusal", "reasoning_text"),
                              "must be 'input_text', 'output_text', 'refusal' or 'reasoning_text' (only text parts "
                              "are supported)")]
    text: Text | None = Field(None, description="the text (every type but refusal)")
    refusal: Text | None = Field(None, description="a refusal part's text")
    annotations: list[Any] | None = Field(None, description="an earlier answer's (ignored)")
    logprobs: list[Any] | None = Field(None, description="an earlier answer's (ignored)")


PartsOrText = Annotated[Text | Annotated[list[ResponsesInputPart], Field(max_length=MAX_MESSAGES)], BY_SHAPE]


class ResponsesInputItem(StrictModel):
    """One input item: a message (``type`` message or absent), a ``function_call`` of an earlier answer, a
    ``function_call_output`` (a tool's result) or a ``reasoning`` item (dropped). An earlier answer's output items
    can be sent back as they are: their ``id``, ``status`` and reasoning fields are accepted and ignored."""

    type: ItemType | None = Field(None, description="message (the default), function_call, function_call_output "
                                  "or reasoning (dropped: chat templates drop earlier thinking)")
    role: Literal["user", "system", "developer", "assistant"] | None = Field(
        None, description="a message's role (developer is system)")
    content: PartsOrText | None = Field(None, description="a message's text, or its input_text/output_text parts")
    call_id: Text | None = Field(None, description="function_call and function_call_output: the call")
    name: FunctionName | None = Field(None, description="function_call: the function")
    arguments: Text | None = Field(None, description="function_call: the arguments as JSON text")
    output: PartsOrText | None = Field(None, description="function_call_output: the tool's result")
    id: Text | None = Field(None, description="an earlier answer's item id (ignored)")
    status: Literal["in_progress", "completed", "incomplete"] | None = Field(None, description="an earlier "
                                                                              "answer's (ignored)")
    summary: list[Any] | None = Field(None, description="a reasoning item's (ignored)")
    encrypted_content: Text | None = Field(None, description="a reasoning item's (ignored)")


Items = Annotated[list[ResponsesInputItem], Field(min_length=1, max_length=MAX_MESSAGES)]


class ResponsesFunctionTool(StrictModel):
    """Responses' flat function tool."""

    type: Literal["function"]
    name: FunctionName
    description: Text | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema of the arguments (an object)")
    strict: bool | None = Field(None, description="accepted: forced calls always follow the schema")


class ResponsesToolChoice(StrictModel):
    type: Literal["function"]
    name: FunctionName


class ResponsesTextFormat(StrictModel):
    """``{"type": "text"}``, ``{"type": "json_object"}`` or ``{"type": "json_schema", "name", "schema",
    "strict"}`` (the schema is always enforced)."""

    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, Field(max_length=64)] | None = None
    description: Text | None = None
    format_schema: dict[str, Any] | None = Field(None, alias="schema", description="with type json_schema: the "
                                                 "JSON schema the answer follows")
    strict: bool | None = Field(None, description="accepted: the schema is always enforced")


class ResponsesTextConfig(StrictModel):
    format: ResponsesTextFormat | None = None
    verbosity: Annotated[str, Only(("medium",), "is not a knob of these models: only 'medium' or null")] | None = None


class ResponsesReasoning(StrictModel):
    """Accepted: these models think (or not) as they were trained; a reasoning parser returns the thinking."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = Field(None, description="accepted: no summary is "
                                                                   "written, the reasoning text is returned")
    generate_summary: Literal["auto", "concise", "detailed"] | None = Field(None, description="the old name of "
                                                                            "summary")


Includable = Annotated[str, Only(INCLUDABLE, "must be 'reasoning.encrypted_content' (accepted: reasoning is "
                                             "returned in the clear)")]
MetadataKey = Annotated[str, Field(max_length=64)]
MetadataValue = Annotated[str, Field(max_length=512)]


class ResponsesRequest(StrictModel):
    """``POST /v1/responses``."""

    model: Text | None = Field(None, description="the model; may be left out when the server has one model")
    input: Annotated[Prompt | Items, BY_SHAPE] = Field(description="a user message's text, or a list of input items")
    instructions: Text | None = Field(None, description="a system message before the input (not carried over by "
                                      "previous_response_id)")
    previous_response_id: Text | None = Field(None, description="continue a stored response: its input and output "
                                              "come before this input")
    tools: Annotated[list[ResponsesFunctionTool], Field(max_length=MAX_TOOLS)] | None = Field(
        None, description="function tools (Responses' flat shape)")
    tool_choice: Annotated[Annotated[str, Only(("none", "auto", "required"), "must be 'none', 'auto', 'required' or "
                                               "{\"type\": \"function\", \"name\": ...}")]
                           | ResponsesToolChoice, BY_SHAPE] | None = Field(
        None, description="none, auto (needs option.enable_auto_tool_choice), required, or {\"type\": \"function\", "
        "\"name\": ...}; default auto with tools")
    parallel_tool_calls: bool | None = Field(None, description="false: at most one call (tool_choice required)")
    text: ResponsesTextConfig | None = Field(None, description="format: text, json_object or json_schema")
    reasoning: ResponsesReasoning | None = None
    max_output_tokens: MaxNewTokens | None = Field(None, description="the most tokens to generate; default: the "
                                                   "rest of the context")
    temperature: Temperature | None = None
    top_p: TopP | None = None
    seed: Seed | None = Field(None, description="reproducible sampling (rollserve's; as on the chat route)")
    stream: bool | None = Field(None, description="SSE events (response.created ... response.completed); needs a "
                                "rolling-batch model")
    store: bool | None = Field(None, description="keep the answer for GET and previous_response_id (default true)")
    background: bool | None = Field(None, description="answer at once with status queued; GET the result, cancel "
                                    "with POST /v1/responses/{id}/cancel (needs store, not with stream)")
    metadata: Annotated[dict[MetadataKey, MetadataValue], Field(max_length=16)] | None = Field(
        None, description="up to 16 string pairs, returned with the response")
    user: Annotated[str, Field(max_length=256)] | None = Field(
        None, description="an end-user id: without prompt_cache_key, the user's requests stick to one worker")
    prompt_cache_key: Annotated[str, Field(min_length=1, max_length=256)] | None = Field(
        None, description="requests with the same key stick to one worker (its prefix cache)")
    truncation: Annotated[str, Only(("disabled",), "must be 'disabled': a prompt longer than the context is a 400")
                          ] | None = None
    include: Annotated[list[Includable], Field(max_length=8)] | None = Field(
        None, description="only reasoning.encrypted_content (accepted; nothing is encrypted)")


RESPONSES = RequestSchema(ResponsesRequest)


# --- items -> chat messages -----------------------------------------------------------------------------------
def _text(value: str | list[ResponsesInputPart] | None) -> str:
    if value is None:
        return ""
    return value if isinstance(value, str) else "".join(p.text or p.refusal or "" for p in value)


def input_items(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's ``input`` as plain items (a string is one user message), checked per type."""
    if isinstance(req.input, str):
        return [{"type": "message", "role": "user", "content": req.input}]
    out = []
    for i, item in enumerate(req.input):
        kind = item.type or "message"
        where = f"input[{i}]"
        if kind == "message":
            if item.role is None:
                raise InvalidRequest(f"'{where}.role' is required for a message item")
            out.append({"type": "message", "role": item.role, "content": _text(item.content)})
        elif kind == "function_call":
            for name in ("call_id", "name", "arguments"):
                if getattr(item, name) is None:
                    raise InvalidRequest(f"'{where}.{name}' is required for a function_call item")
            out.append({"type": "function_call", "call_id": item.call_id, "name": item.name,
                        "arguments": item.arguments})
        elif kind == "function_call_output":
            for name in ("call_id", "output"):
                if getattr(item, name) is None:
                    raise InvalidRequest(f"'{where}.{name}' is required for a function_call_output item")
            out.append({"type": "function_call_output", "call_id": item.call_id, "output": _text(item.output)})
        # reasoning items are dropped: chat templates do not show earlier turns' thinking
    return out


def chat_messages(instructions: str | None, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Plain items (``input_items`` or stored output items) -> chat messages."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    names: dict[str, str] = {}
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            role = "system" if item["role"] == "developer" else item["role"]  # templates know system, not developer
            content = item["content"]
            text = content if isinstance(content, str) else "".join(p.get("text", "") for p in content)
            messages.append({"role": role, "content": text})
        elif kind == "function_call":
            names[item["call_id"]] = item["name"]
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # one assistant turn: its text, then its calls
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            tool: dict[str, Any] = {"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]}
            if item["call_id"] in names:
                tool["name"] = names[item["call_id"]]
            messages.append(tool)
    return messages


def chat_body(req: ResponsesRequest, model: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The ``/v1/chat/completions`` body that generates this response."""
    body: dict[str, Any] = {"model": model, "messages": messages}
    if req.tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                         for t in req.tools]
    if isinstance(req.tool_choice, ResponsesToolChoice):
        body["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.name}}
    elif req.tool_choice is not None:
        body["tool_choice"] = req.tool_choice
    fmt = req.text.format if req.text is not None else None
    forced = isinstance(req.tool_choice, ResponsesToolChoice) or (req.tool_choice == "required" and req.tools)
    if fmt is not None and fmt.type != "text" and not forced:  # a forced answer is a call: the format is for text
        if fmt.type == "json_schema":
            if fmt.format_schema is None:
                raise InvalidRequest("'text.format.schema' is required with type 'json_schema'")
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": fmt.name or "response",
                                                                              "schema": fmt.format_schema}}
        else:
            body["response_format"] = {"type": "json_object"}
    fields = {"parallel_tool_calls": req.parallel_tool_calls, "max_completion_tokens": req.max_output_tokens,
              "temperature": req.temperature, "top_p": req.top_p, "seed": req.seed, "stream": req.stream,
              "user": req.user, "prompt_cache_key": req.prompt_cache_key}
    body.update({k: v for k, v in fields.items() if v is not None})
    return body


# --- chat names in messages -> this API's names ---------------------------------------------------------------
_RENAMES = ((re.compile(r"'messages(\[\d+\])?[^']*'"), "'input'"),
            (re.compile(r"'max_completion_tokens'"), "'max_output_tokens'"),
            (re.compile(r"'response_format\.json_schema(\.schema)?"), "'text.format\\1"),
            (re.compile(r"'response_format"), "'text.format"),
            (re.compile(r"'tools(\[\d*\])\.function\."), "'tools\\1."))
_PARAM = re.compile(r"^(?:unknown fields(?: in '([^']+)')?: ([^,\s]+)|'([^']+)')")


def responses_message(message: str) -> str:
    """A chat-route message with its field names in this API's words."""
    for pattern, repl in _RENAMES:
        message = pattern.sub(repl, message)
    return message


def responses_param(message: str) -> str | None:
    """The field a message names first (OpenAI's error ``param``), or None."""
    m = _PARAM.match(message)
    if m is None:
        return None
    if m.group(2) is not None:
        return f"{m.group(1)}.{m.group(2)}" if m.group(1) else m.group(2)
    return m.group(3)


def item_text(parts: list[Mapping[str, Any]]) -> str:
    """The text of an output message's parts."""
    return "".join(str(p.get("text", "")) for p in parts)


RESPONSES_MODELS = (ResponsesRequest,)
"""The request models of ``/openapi.json``'s Responses routes (their parts come with them)."""
