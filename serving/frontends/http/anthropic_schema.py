"""Anthropic Messages request bodies -> the OpenAI chat body the chat pipeline (``openai_schema.parse_chat``) takes.

Design note: the bodies are validated by ``MessagesRequest`` / ``CountTokensRequest`` (``serving.requests.schema``
rules: strict types, caps from ``Limits``; unknown top-level fields dropped and named in ``X-Ignored-Parameters``, or
a 400 with ``option.strict_parameters=true``, as the chat route does; a message, block or tool may carry other
keys, such as ``cache_control``, accepted and ignored, since clients send back what an answer held). The same
models are the routes' schemas in ``/openapi.json`` (``openapi_components``). Messages name the field the
way Anthropic's API does (``'messages.1.content.0.type'``). A content block is one model whose fields depend
on its ``type``; what a type needs is checked here, in ``to_chat``, which then translates: ``system`` -> a system
message, text blocks -> text parts, ``tool_use`` -> an assistant's ``tool_calls`` (``input`` as JSON text),
``tool_result`` -> a ``tool`` message (``is_error``: its text begins with ``Error: ``, as templates have no
place for the flag), ``thinking``/``redacted_thinking`` -> left out of the prompt (Anthropic drops earlier
turns' thinking too), ``image``/``document`` -> a 400 (text-only models). ``tool_choice`` any is OpenAI's
``required``, tool is a named function, ``disable_parallel_tool_use`` is ``parallel_tool_calls: false``. A
conversation must end with a user turn: continuing an assistant turn (prefill) is refused, as the chat template
closes every turn.
"""

from __future__ import annotations

import json
import re
import typing
from typing import Annotated, Any, Literal

from pydantic import Field

from rollcore.errors import InvalidRequest
from serving.requests.bodies import MAX_MESSAGES, MAX_TOOLS, FunctionName, OpenModel, Text
from serving.requests.params import MaxNewTokens, StopText, TopK, TopP
from serving.requests.schema import BY_SHAPE, INTEGER, TEXT, Cap, StrictModel, json_schemas
from serving.requests.validation import RequestSchema

BlockType = Literal["text", "image", "document", "tool_use", "tool_result", "thinking", "redacted_thinking"]
BLOCK_TYPES: tuple[str, ...] = typing.get_args(BlockType)
UNSUPPORTED_MEDIA = ("image", "document")
ToolName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$"), TEXT]


class AnthropicSystemBlock(OpenModel):
    """A text block of ``system``."""

    type: Literal["text"]
    text: Text


class AnthropicResultPart(OpenModel):
    """A block of a ``tool_result``'s content: text (an image or document is refused: text-only models)."""

    type: Literal["text", "image", "document"]
    text: Text | None = Field(None, description="type text: required")


class AnthropicContentBlock(OpenModel):
    """A content block; which fields it needs depends on ``type`` (checked by the route)."""

    type: BlockType = Field(description="text, tool_use (assistant), tool_result (user), thinking and "
                            "redacted_thinking (assistant; left out of the prompt); image and document "
                            "are refused (text-only models)")
    text: Text | None = Field(None, description="type text: required")
    id: Text | None = Field(None, description="type tool_use: required")
    name: FunctionName | None = Field(None, description="type tool_use: required")
    input: dict[str, Any] | None = Field(None, description="type tool_use: required, the call's arguments")
    tool_use_id: Text | None = Field(None, description="type tool_result: required, the tool_use it answers")
    content: Annotated[Text | list[AnthropicResultPart], BY_SHAPE] | None = Field(
        None, description="type tool_result: the result, text or text blocks")
    is_error: bool | None = Field(None, description="type tool_result: the result is an error (its text is "
                                  "prefixed with 'Error: ')")
    thinking: Text | None = Field(None, description="type thinking (left out of the prompt)")
    signature: Text | None = Field(None, description="type thinking (ignored)")
    data: Text | None = Field(None, description="type redacted_thinking (ignored)")
    source: dict[str, Any] | None = Field(None, description="type image or document: refused")


class AnthropicMessage(OpenModel):
    role: Literal["user", "assistant"]
    content: Annotated[Text | list[AnthropicContentBlock], BY_SHAPE] = Field(
        description="text, or content blocks")


class AnthropicTool(OpenModel):
    """A client tool (Anthropic's server tools have other types and are refused)."""

    type: Literal["custom"] | None = Field(None, description="custom or absent")
    name: ToolName
    description: Text | None = None
    input_schema: dict[str, Any] = Field(description="a JSON schema of the tool's input (an object)")


class AnthropicToolChoice(StrictModel):
    type: Literal["auto", "any", "tool", "none"] = Field(description="auto (needs option.enable_auto_tool_choice), "
                                                         "any (some tool), tool (the one named), none")
    name: FunctionName | None = Field(None, description="type tool: required")
    disable_parallel_tool_use: bool | None = Field(None, description="true: at most one tool_use block")


class AnthropicThinking(StrictModel):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Annotated[int, Field(ge=1024), INTEGER] | None = Field(
        None, description="type enabled: required, less than max_tokens (accepted; the model thinks as its "
        "template lets it)")
    display: Literal["summarized", "omitted"] | None = Field(None, description="accepted and ignored")


class AnthropicMetadata(OpenModel):
    user_id: Annotated[str, Field(max_length=256), Text] | None = Field(None, description="ignored")


class CountTokensRequest(StrictModel):
    """``POST /v1/messages/count_tokens``: the prompt ``POST /v1/messages`` would build, counted."""

    model: Text = Field(description="the model (or one of its LoRA adapters)")
    messages: Annotated[list[AnthropicMessage], Field(min_length=1, max_length=MAX_MESSAGES)] = Field(
        description="the conversation, ending with a user turn")
    system: Annotated[Text | list[AnthropicSystemBlock], BY_SHAPE] | None = Field(
        None, description="the system prompt: text or text blocks")
    tools: Annotated[list[AnthropicTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: AnthropicToolChoice | None = Field(None, description="default auto with tools")
    thinking: AnthropicThinking | None = None


class MessagesRequest(CountTokensRequest):
    """``POST /v1/messages``: a chat request in Anthropic's shape, served by the chat pipeline."""

    max_tokens: MaxNewTokens = Field(description="the most tokens to generate (required)")
    stop_sequences: Annotated[list[StopText], Cap("max_stop_sequences")] | None = Field(
        None, description="the answer ends before the first one (stop_reason stop_sequence)")
    temperature: Annotated[float, Field(ge=0, le=1)] | None = Field(None, description="0 = greedy (default 1)")
    top_p: TopP | None = None
    top_k: TopK | None = None
    metadata: AnthropicMetadata | None = Field(None, description="accepted and ignored")
    stream: bool | None = Field(None, description="server-sent events; needs a rolling-batch model")


MESSAGES = RequestSchema(MessagesRequest)
COUNT_TOKENS = RequestSchema(CountTokensRequest)
MODELS = (MessagesRequest, CountTokensRequest)
_FIELDS = "|".join(MessagesRequest.model_fields)
_PATH = re.compile(rf"'((?:{_FIELDS})(?:\[\d+\]|\.\w+)*)'")


def dotted(message: str) -> str:
    """The project's field paths (``'messages[1].content[0]'``) as Anthropic writes them (``messages.1.content.0``)."""
    return _PATH.sub(lambda m: "'" + re.sub(r"\[(\d+)\]", r".\1", m.group(1)) + "'", message)


def validate(body: Any, limits: Any, strict: bool, ignored: list[str], count: bool = False) -> CountTokensRequest:
    """``body`` as a request (``count``: a count_tokens one), or ``InvalidRequest`` naming the field."""
    try:
        return (COUNT_TOKENS if count else MESSAGES).validate(body, limits, strict=strict, ignored=ignored)
    except InvalidRequest as exc:
        raise InvalidRequest(dotted(exc.message)) from None


# --- Anthropic -> OpenAI chat ------------------------------------------------------------------------------
def _missing(where: str, kind: str) -> InvalidRequest:
    return InvalidRequest(f"missing field '{where}' (a {kind} block needs it)")


def _media(where: str, kind: str) -> InvalidRequest:
    article = "an" if kind == "image" else "a"
    return InvalidRequest(f"'{where}' is {article} {kind} block: {kind}s are not supported by this model (text only)")


def _result_parts(block: AnthropicContentBlock, where: str) -> list[dict[str, str]]:
    """A tool_result's content as OpenAI text parts (``is_error``: a first part says so)."""
    content = block.content
    parts: list[dict[str, str]] = []
    if isinstance(content, str):
        parts.append({"type": "text", "text": content})
    for k, part in enumerate(content if isinstance(content, list) else ()):
        if part.type in UNSUPPORTED_MEDIA:
            raise _media(f"{where}.content.{k}", part.type)
        if part.text is None:
            raise _missing(f"{where}.content.{k}.text", "text")
        parts.append({"type": "text", "text": part.text})
    if block.is_error:
        parts.insert(0, {"type": "text", "text": "Error: "})
    return parts


def _user(i: int, blocks: list[AnthropicContentBlock]) -> list[dict[str, Any]]:
    """A user turn's blocks, in order: runs of text -> user messages, each tool_result -> a tool message."""
    out: list[dict[str, Any]] = []
    texts: list[dict[str, str]] = []
    for j, b in enumerate(blocks):
        where = f"messages.{i}.content.{j}"
        if b.type == "text":
            if b.text is None:
                raise _missing(f"{where}.text", "text")
            texts.append({"type": "text", "text": b.text})
            continue
        if b.type in UNSUPPORTED_MEDIA:
            raise _media(where, b.type)
        if b.type != "tool_result":
            raise InvalidRequest(f"'{where}.type' {b.type!r} is only allowed in assistant messages")
        if b.tool_use_id is None:
            raise _missing(f"{where}.tool_use_id", "tool_result")
        if texts:
            out.append({"role": "user", "content": texts})
            texts = []
        out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": _result_parts(b, where)})
    if texts or not out:
        out.append({"role": "user", "content": texts})
    return out


def _assistant(i: int, blocks: list[AnthropicContentBlock]) -> dict[str, Any]:
    """An assistant turn: its text and its calls; thinking is left out of the prompt."""
    texts: list[dict[str, str]] = []
    calls: list[dict[str, Any]] = []
    for j, b in enumerate(blocks):
        where = f"messages.{i}.content.{j}"
        if b.type == "text":
            if b.text is None:
                raise _missing(f"{where}.text", "text")
            texts.append({"type": "text", "text": b.text})
        elif b.type == "tool_use":
            for name in ("id", "name", "input"):
                if getattr(b, name) is None:
                    raise _missing(f"{where}.{name}", "tool_use")
            calls.append({"id": b.id, "type": "function",
                          "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}})
        elif b.type in UNSUPPORTED_MEDIA:
            raise _media(where, b.type)
        elif b.type == "tool_result":
            raise InvalidRequest(f"'{where}.type' 'tool_result' is only allowed in user messages")
        elif b.type == "thinking" and b.thinking is None:
            raise _missing(f"{where}.thinking", "thinking")
    message: dict[str, Any] = {"role": "assistant", "content": texts if texts or not calls else None}
    if calls:
        message["tool_calls"] = calls
    return message


def _tool_choice(req: CountTokensRequest) -> dict[str, Any]:
    """``tool_choice`` and ``parallel_tool_calls`` in OpenAI's words."""
    choice = req.tool_choice
    if choice is None:
        return {}
    if choice.type in ("any", "tool") and not req.tools:
        raise InvalidRequest(f"'tool_choice.type' {choice.type!r} needs 'tools'")
    out: dict[str, Any] = {}
    if choice.type == "tool":
        if choice.name is None:
            raise InvalidRequest("missing field 'tool_choice.name' (type tool needs it)")
        out["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    else:
        out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    if choice.disable_parallel_tool_use is not None:
        out["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    return out


def to_chat(req: CountTokensRequest) -> dict[str, Any]:
    """A validated request -> the OpenAI chat body of the same conversation and sampling."""
    messages: list[dict[str, Any]] = []
    if req.system is not None:
        system = req.system if isinstance(req.system, str) else [{"type": "text", "text": b.text} for b in req.system]
        messages.append({"role": "system", "content": system})
    for i, m in enumerate(req.messages):
        blocks = [AnthropicContentBlock(type="text", text=m.content)] if isinstance(m.content, str) else m.content
        messages.extend(_user(i, blocks) if m.role == "user" else [_assistant(i, blocks)])
    if req.messages[-1].role != "user":
        raise InvalidRequest(f"'messages.{len(req.messages) - 1}.role' must be 'user' (the last turn): continuing "
                             "an assistant turn (prefill) is not supported, the chat template closes every turn")
    body: dict[str, Any] = {"model": req.model, "messages": messages, **_tool_choice(req)}
    if req.tools:
        body["tools"] = [{"type": "function", "function": {
            "name": t.name, "parameters": t.input_schema,
            **({"description": t.description} if t.description is not None else {})}} for t in req.tools]
    thinking = req.thinking
    if thinking is not None and thinking.type == "enabled" and thinking.budget_tokens is None:
        raise InvalidRequest("missing field 'thinking.budget_tokens' (type enabled needs it)")
    if isinstance(req, MessagesRequest):
        if thinking is not None and thinking.budget_tokens is not None and thinking.budget_tokens >= req.max_tokens:
            raise InvalidRequest(f"'thinking.budget_tokens' must be less than 'max_tokens' ({req.max_tokens}), "
                                 f"got {thinking.budget_tokens}")
        body["max_tokens"] = req.max_tokens
        sampling = {"temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k, "stream": req.stream}
        body.update({k: v for k, v in sampling.items() if v is not None})
        if req.stop_sequences:  # the stop string stays in the text, so the answer can name it (then cut)
            body.update(stop=list(req.stop_sequences), include_stop_str_in_output=True)
    return body


# --- /openapi.json ----------------------------------------------------------------------------------------
def openapi_components(limits: Any) -> dict[str, Any]:
    """The request schemas (from the models above) and the answers' and errors' shapes."""
    usage = {"type": "object", "properties": {name: {"type": "integer"} for name in (
        "input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens", "output_tokens")}}
    return {**json_schemas(MODELS, limits),
            "AnthropicError": {"type": "object", "required": ["type", "error"], "properties": {
                "type": {"const": "error"}, "request_id": {"type": "string"},
                "error": {"type": "object", "required": ["type", "message"], "properties": {
                    "type": {"type": "string"}, "message": {"type": "string"}}}}},
            "AnthropicAnswer": {"type": "object", "properties": {
                "id": {"type": "string"}, "type": {"const": "message"}, "role": {"const": "assistant"},
                "content": {"type": "array"}, "model": {"type": "string"}, "stop_reason": {"type": "string"},
                "stop_sequence": {"type": ["string", "null"]}, "usage": usage}},
            "AnthropicTokenCount": {"type": "object", "properties": {"input_tokens": {"type": "integer"}}}}


ERROR_STATUSES = ("400", "401", "404", "409", "413", "499", "500", "502", "503", "504")


def openapi_paths(errors: dict[str, str]) -> dict[str, Any]:
    """``/v1/messages`` and ``/v1/messages/count_tokens``; ``errors``: the descriptions of the status codes."""
    def op(summary: str, body: str, answer: str, stream: bool) -> dict[str, Any]:
        ok: dict[str, Any] = {"application/json": {"schema": {"$ref": f"#/components/schemas/{answer}"}}}
        if stream:
            ok["text/event-stream"] = {"schema": {"type": "string"}}
        responses: dict[str, Any] = {"200": {"description": "the answer", "content": ok}}
        for code in ERROR_STATUSES:
            responses[code] = {"description": errors[code], "content": {"application/json": {
                "schema": {"$ref": "#/components/schemas/AnthropicError"}}}}
        return {"post": {"summary": summary, "requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{body}"}}}}, "responses": responses}}
    return {"/v1/messages": op("Anthropic Messages API (the chat pipeline; x-api-key is the inference token)",
                               "MessagesRequest", "AnthropicAnswer", True),
            "/v1/messages/count_tokens": op("the prompt's tokens as /v1/messages would build it", "CountTokensRequest",
                                            "AnthropicTokenCount", False)}
