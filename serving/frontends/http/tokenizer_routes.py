"""Routes clients assume of an OpenAI-compatible server: vLLM's ``POST /tokenize``, ``POST /detokenize`` and
``GET /tokenizer_info`` (what lm-evaluation-harness's remote tokenizer calls), and OpenAI's ``GET /v1/models/{id}``.

Design note: the frontend's own per-model text side (the endpoint's ``ModelText``: the model folder's ``tokenizer.json``
and chat template) answers, so ``/tokenize`` counts exactly what a generation route counts. ``/tokenize`` with
``messages`` builds its prompt with the chat route's own parser (``openai_schema.parse_chat``), tools included, so
its ``count`` is the chat answer's ``usage.prompt_tokens``. A request that names no ``model`` is answered for the one
model served, or when several are, for the tokenizer they all share (one fine-tuned model served twice, as
lm-evaluation-harness expects of a server); models of different tokenizers need ``model`` (400 naming it). Bodies
are validated by the models below (documented in ``/openapi.json``), unknown fields dropped and named in
``X-Ignored-Parameters`` or refused under ``option.strict_parameters``. ``/v1/models/{id}`` answers in OpenAI's error
shape (``{"error": {"message", "type", "param", "code"}}``) so that SDKs raise their ``NotFoundError``.
"""

from __future__ import annotations

import hashlib
import json
import weakref
from typing import Annotated, Any

from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from rollcore.errors import InvalidRequest, ModelNotFound, ServingError
from serving.frontends.http.chat import render_chat, template_messages
from serving.frontends.http.httpio import (
    REQUEST_ID_HEADER,
    HttpContext,
    body_size,
    error_response,
    ignored_headers,
    note_model,
    read_json,
    request_id,
    strict_parameters,
)
from serving.frontends.http.openai import adapters_of, model_objects
from serving.frontends.http.openai_schema import parse_chat
from serving.frontends.http.prompts import off_loop
from serving.models.endpoint_protocol import Endpoint
from serving.models.model_text import ModelText
from serving.requests.bodies import MAX_MESSAGES, MAX_TOOLS, ChatMessage, Tool
from serving.requests.params import TokenId
from serving.requests.schema import TEXT, Cap, StrictModel
from serving.requests.validation import RequestSchema, type_error

Model = Annotated[str, TEXT]
# tokenizer_config.json keys that name files of the server (no server path in an answer) or repeat the vocabulary
_PRIVATE_KEYS = frozenset({"name_or_path", "tokenizer_file", "vocab_file", "merges_file", "added_tokens_decoder",
                           "special_tokens_map_file", "is_local", "local_files_only"})


class TokenizeCompletionRequest(StrictModel):
    """``POST /tokenize`` of a prompt (vLLM's ``TokenizeCompletionRequest``)."""

    model: Model | None = Field(None, description="the model; may be left out when the served models share one "
                                "tokenizer")
    prompt: Annotated[str, Cap("max_prompt_chars"), TEXT] = Field(description="the text to tokenize")
    add_special_tokens: bool | None = Field(None, description="add the tokenizer's special tokens as the "
                                            "generation routes do (default true)")
    return_token_strs: bool | None = Field(None, description="also answer each token's piece (`token_strs`)")


class TokenizeChatRequest(StrictModel):
    """``POST /tokenize`` of a conversation (vLLM's ``TokenizeChatRequest``): the prompt the chat route builds."""

    model: Model | None = Field(None, description="the model; may be left out when the served models share one "
                                "tokenizer")
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    add_generation_prompt: bool | None = Field(None, description="end with the assistant's turn opening, as the chat "
                                               "route does (default true)")
    add_special_tokens: bool | None = Field(None, description="add the tokenizer's special tokens as the chat route "
                                            "does (default true)")
    return_token_strs: bool | None = Field(None, description="also answer each token's piece (`token_strs`)")
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = Field(
        None, description="functions, rendered into the prompt as the chat route renders them")


class DetokenizeRequest(StrictModel):
    """``POST /detokenize`` (vLLM's): token ids of the model's vocabulary -> text."""

    model: Model | None = Field(None, description="the model; may be left out when the served models share one "
                                "tokenizer")
    tokens: list[TokenId] = Field(description="token ids of the model's vocabulary")


TOKENIZE_COMPLETION = RequestSchema(TokenizeCompletionRequest)
TOKENIZE_CHAT = RequestSchema(TokenizeChatRequest)
DETOKENIZE = RequestSchema(DetokenizeRequest)
TOKENIZER_MODELS = (TokenizeCompletionRequest, TokenizeChatRequest, DetokenizeRequest)
"""The request models of these routes (``openapi`` documents them)."""


def openai_error(message: str, kind: str, param: str | None, code: int, rid: str) -> JSONResponse:
    """OpenAI's error body, which the ``openai`` SDK reads (``NotFoundError`` for 404)."""
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=code, headers={REQUEST_ID_HEADER: rid})


class TokenizerRoutes:
    """``/tokenize``, ``/detokenize``, ``/tokenizer_info`` and ``/v1/models/{model_id}`` bound to one HttpContext."""

    def __init__(self, ctx: HttpContext) -> None:
        self.ctx = ctx
        self._digests: weakref.WeakKeyDictionary[ModelText, str] = weakref.WeakKeyDictionary()

    def routes(self) -> list[Route]:
        return [Route("/tokenize", self.tokenize, methods=["POST"]),
                Route("/detokenize", self.detokenize, methods=["POST"]),
                Route("/tokenizer_info", self.tokenizer_info, methods=["GET"]),
                Route("/v1/models/{model_id}", self.model, methods=["GET"])]

    # --- routes ---
    async def tokenize(self, request: Request) -> Response:
        rid = request_id(request)
        try:
            body = await read_json(request, self.ctx.max_request_size)
            ep, text = self._pick(body)
            note_model(request, ep)  # the metrics labels
            ignored: list[str] = []
            answer = await off_loop(self.ctx.tokenize_pool, body_size(request), self._tokenize, body, ep, text, rid,
                                    ignored)
        except ServingError as exc:
            return error_response(exc, rid)
        return JSONResponse(answer, headers={REQUEST_ID_HEADER: rid, **ignored_headers(ignored, rid, ep.name)})

    async def detokenize(self, request: Request) -> Response:
        rid = request_id(request)
        try:
            body = await read_json(request, self.ctx.max_request_size)
            ep, text = self._pick(body)
            note_model(request, ep)
            ignored: list[str] = []
            req = DETOKENIZE.validate(body, self.ctx.limits, strict=strict_parameters(ep), ignored=ignored)
            tokenizer = _tokenizer_of(text)
            size = tokenizer.get_vocab_size(with_added_tokens=True)
            for i, token in enumerate(req.tokens):
                if token >= size:
                    raise InvalidRequest(f"'tokens[{i}]' is {token}, outside the vocabulary of model {ep.name!r} "
                                         f"(ids 0 to {size - 1})")
            # special tokens kept, as vLLM's /detokenize (and transformers' decode) answer them
            prompt = await off_loop(self.ctx.tokenize_pool, body_size(request), tokenizer.decode, req.tokens, False)
        except ServingError as exc:
            return error_response(exc, rid)
        return JSONResponse({"prompt": prompt}, headers={REQUEST_ID_HEADER: rid,
                                                         **ignored_headers(ignored, rid, ep.name)})

    async def tokenizer_info(self, request: Request) -> Response:
        """vLLM's ``/tokenizer_info``: the tokenizer's configuration (its special tokens, class, chat template)."""
        rid = request_id(request)
        try:
            model = request.query_params.get("model")
            ep, text = self._pick({"model": model} if model else {})
            _tokenizer_of(text)
            info = {k: _plain(v) for k, v in text.tokenizer_config.items() if k not in _PRIVATE_KEYS}
            info.update(text.special_tokens)  # as the model's worker reported them
            info["chat_template"] = text.chat_template
            if text.max_model_len is not None:
                info["model_max_length"] = text.max_model_len
        except ServingError as exc:
            return error_response(exc, rid)
        return JSONResponse(info, headers={REQUEST_ID_HEADER: rid})

    async def model(self, request: Request) -> Response:
        """OpenAI's ``GET /v1/models/{model}``: the entry ``/v1/models`` lists under that id (an adapter too)."""
        rid = request_id(request)
        model_id = request.path_params["model_id"]
        for entry in model_objects(self.ctx):
            if entry["id"] == model_id:
                return JSONResponse(entry, headers={REQUEST_ID_HEADER: rid})
        return openai_error(f"The model '{model_id[:200]}' does not exist.", "NotFoundError", "model", 404, rid)

    # --- work ---
    def _tokenize(self, body: dict[str, Any], ep: Endpoint, text: ModelText, rid: str, ignored: list[str]
                  ) -> dict[str, Any]:
        """The answer of ``/tokenize`` (on the tokenize pool for a large body)."""
        strict = strict_parameters(ep)
        tokenizer = _tokenizer_of(text)
        if "messages" in body:
            chat = TOKENIZE_CHAT.validate(body, self.ctx.limits, strict=strict, ignored=ignored)
            prompt = self._chat_prompt(body, chat, ep, text, rid)
            add_special, strs = chat.add_special_tokens, chat.return_token_strs
        else:
            plain = TOKENIZE_COMPLETION.validate(body, self.ctx.limits, strict=strict, ignored=ignored)
            prompt, add_special, strs = plain.prompt, plain.add_special_tokens, plain.return_token_strs
        ids = list(tokenizer.encode_batch([prompt], add_special_tokens=add_special is not False)[0].ids)
        answer: dict[str, Any] = {"count": len(ids), "max_model_len": text.max_model_len, "tokens": ids}
        if strs:
            answer["token_strs"] = [tokenizer.id_to_token(i) for i in ids]
        return answer

    def _chat_prompt(self, body: dict[str, Any], chat: TokenizeChatRequest, ep: Endpoint, text: ModelText, rid: str
                     ) -> str:
        """The prompt the chat route builds of these messages and tools (its own parser builds it); without the
        generation prompt when ``add_generation_prompt`` is false."""
        request: dict[str, Any] = {"messages": body["messages"]}
        options = ep.options
        if chat.tools:
            request["tools"] = body["tools"]
            if options.get("enable_auto_tool_choice", "false").lower() != "true":
                request["tool_choice"] = "required"  # the same prompt; auto needs the model's option
        parsed = parse_chat(request, ep.name, text, rid, self.ctx.limits, False, options)
        prompt = parsed.choices[0].request.prompt
        if chat.add_generation_prompt is not False:
            return prompt
        suffix = _generation_prompt(text, chat, ep.name)
        if suffix and not prompt.endswith(suffix):
            raise InvalidRequest(f"'add_generation_prompt' false: the chat template of model {ep.name!r} does not "
                                 "end its prompt with a separate assistant opening")
        return prompt[:len(prompt) - len(suffix)]

    # --- which model ---
    def _pick(self, body: Any) -> tuple[Endpoint, ModelText]:
        """The endpoint and text side a body names (``model``: a model or one of its adapters), else the one
        model served or the tokenizer every served model shares. Raises ``InvalidRequest`` naming ``model``."""
        if not isinstance(body, dict):
            raise InvalidRequest("request body must be a JSON object")
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise type_error("model", "a string", model)
        registry = self.ctx.registry
        if model:
            try:
                ep = registry.get(model)
            except ModelNotFound:
                ep = next((e for e in registry.endpoints.values() if model in adapters_of(e)), None)
                if ep is None:
                    raise
            return ep, ep.text
        served = sorted(registry.endpoints.items())
        if not served:
            raise ModelNotFound("no model is registered")
        texts = [(ep, ep.text) for _, ep in served]
        with_tokenizer = [(ep, t) for ep, t in texts if t.tokenizer is not None]
        if len(texts) == 1 or not with_tokenizer:
            return texts[0]
        keys = {self._identity(t) for _, t in with_tokenizer}
        if len(keys) > 1:
            raise InvalidRequest(f"'model' is needed: the served models do not share one tokenizer (one of "
                                 f"{[name for name, _ in served]})")
        return with_tokenizer[0]

    def _identity(self, text: ModelText) -> str:
        """What makes two models tokenize and render alike: their tokenizer, template and special tokens."""
        digest = self._digests.get(text)
        if digest is None:
            tokenizer = _tokenizer_of(text)
            parts = [tokenizer.to_str(), text.chat_template or "", json.dumps(text.special_tokens, sort_keys=True)]
            digest = hashlib.sha256("\0".join(parts).encode("utf-8")).hexdigest()
            self._digests[text] = digest
        return digest


def _tokenizer_of(text: ModelText) -> Any:
    if text.tokenizer is None:
        raise InvalidRequest(f"model {text.name!r} has no tokenizer.json for the frontend to tokenize with: name "
                             "another 'model'")
    return text.tokenizer


def _generation_prompt(text: ModelText, chat: TokenizeChatRequest, model: str) -> str:
    """The text the template adds for ``add_generation_prompt`` (the prompt with it minus the prompt without)."""
    messages = template_messages(chat.messages)
    opened = render_chat(text.chat_template, messages, model=model, special_tokens=text.special_tokens)
    closed = render_chat(text.chat_template, messages, model=model, special_tokens=text.special_tokens,
                         add_generation_prompt=False)
    return opened[len(closed):] if opened.startswith(closed) else ""


def _plain(value: Any) -> Any:
    """A special token written as transformers' ``AddedToken`` object -> its text; other values as they are."""
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return value
