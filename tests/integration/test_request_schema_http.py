"""One source for validation and schema, through a real server: the ``/openapi.json`` it serves
is read as the contract (``tests/schema_strategies.py``), and for each route (LMI ``/predictions`` and
``/invocations``, OpenAI completions and chat, TGI ``/generate``, ``/generate_stream`` and ``/``):

- the fields the route knows are exactly the documented ones: every name any route documents, plus names
  other APIs use, is sent with ``null`` (the default of every optional field); the route refuses exactly the
  undocumented ones as unknown (the LMI routes take OpenAI chat bodies too: ``messages`` picks that schema);
- every documented field, alone, with a valid value, is accepted (200);
- bodies valid per the document (hypothesis) are accepted and answered (200, no error event in a stream);
- a value out of its documented range (hypothesis) is a 400 (TGI: 422) whose message names the field.

Sizes are capped (prompts of 24 characters, 3 list entries, 4 new tokens): valid, and cheap on the tiny model.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serving.frontends.http.openapi import inference_document
from serving.requests.params import Limits
from tests.integration.harness import ServerProcess
from tests.schema_strategies import Caps, Document, put

MODEL = "tiny-rb"  # rolling batching: streams are valid too
VOCAB = 1024  # the default model's vocabulary
MSG = [{"role": "user", "content": "Hello"}]


@dataclass(frozen=True)
class Route:
    name: str
    url: str  # path and query on the server
    doc_path: str  # the path in the document
    schema: str  # the request schema the body follows
    status: int  # of a validation error
    base: dict[str, Any]  # a small valid body
    params: bool = False  # has LMI's parameters object


LMI_BASE = {"inputs": "Hello", "parameters": {"max_new_tokens": 1}}
ROUTES = [
    Route("predictions", f"/predictions/{MODEL}", "/predictions/{model_name}", "LmiRequest", 400, LMI_BASE, True),
    Route("predictions-chat", f"/predictions/{MODEL}", "/predictions/{model_name}", "ChatRequest", 400,
          {"messages": MSG, "max_tokens": 1}),
    Route("invocations", f"/invocations?model_name={MODEL}", "/invocations", "LmiRequest", 400, LMI_BASE, True),
    Route("invocations-chat", f"/invocations?model_name={MODEL}", "/invocations", "ChatRequest", 400,
          {"messages": MSG, "max_tokens": 1}),
    Route("completions", "/v1/completions", "/v1/completions", "CompletionRequest", 400,
          {"model": MODEL, "prompt": "Hello", "max_tokens": 1}),
    Route("chat", "/v1/chat/completions", "/v1/chat/completions", "ChatRequest", 400,
          {"model": MODEL, "messages": MSG, "max_tokens": 1}),
    Route("generate", f"/generate?model_name={MODEL}", "/generate", "TgiRequest", 422, LMI_BASE, True),
    Route("generate_stream", f"/generate_stream?model_name={MODEL}", "/generate_stream", "TgiRequest", 422, LMI_BASE,
          True),
    Route("tgi-compat", f"/?model_name={MODEL}", "/", "TgiRequest", 422, LMI_BASE, True),
]
IDS = [r.name for r in ROUTES]
# names other APIs (OpenAI, vLLM, TGI, transformers' generate) use that no route documents
FOREIGN = ("zzz_no_such_field", "functions", "function_call", "length_penalty", "num_beams", "min_tokens",
           "use_beam_search", "prompt_logprobs",
           "store", "metadata", "service_tier", "modalities", "prediction", "reasoning_effort", "max_time",
           "no_repeat_ngram_size", "num_return_sequences", "min_length", "max_length", "bad_words_ids", "options",
           "top_a", "tfs", "presence", "temp", "maxTokens")
TOKENS = st.integers(1, 4)
CAPS = Caps(vocab=VOCAB, by_name={"max_new_tokens": TOKENS, "max_tokens": TOKENS, "max_completion_tokens": TOKENS})


@pytest.fixture(scope="module")
def doc(api_server: ServerProcess) -> Document:
    return Document(httpx.get(f"{api_server.url}/openapi.json", timeout=30).json())


_CLIENT = httpx.Client(timeout=120)  # one connection pool: a client per request costs more than the request


def post(server: ServerProcess, route: Route, body: Any) -> httpx.Response:
    return _CLIENT.post(server.url + route.url, json=body)


def refused_as_unknown(r: httpx.Response, name: str) -> bool:
    """The route does not know ``name``: a 400 naming it (option.strict_parameters=true), or, by default, an
    answer whose X-Ignored-Parameters names it (at any level: ``parameters.name``, ``stream_options.name``)."""
    if r.status_code < 400:
        ignored = r.headers.get("x-ignored-parameters", "")
        return any(path.split(".")[-1] == name for path in ignored.split(", ") if path)
    head, _, names = str(r.json().get("error", "")).partition(": ")  # nested ones by their dotted paths
    return head.startswith("unknown ") and any(path.split(".")[-1] == name for path in names.split(", "))


def fields_of(doc: Document, node: Any) -> set[str]:
    return set(doc.properties(node))


CONSTRAINT_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                     "structured_outputs", "grammar", "tools", "tool_choice",
                     # token ids of the model's vocabulary; at most max_tokens (test_structured_http.py)
                     "logit_bias", "min_tokens",
                     # a LoRA adapter's name, of a model with adapters (tests/integration/test_lora_http.py)
                     "adapters", "adapter_id")


def cross_field_rules(route: Route, body: dict[str, Any]) -> dict[str, Any]:
    """The rules the document states in words (see serving/requests/bodies.py), and the model to use."""
    body = dict(body)
    if route.schema in ("CompletionRequest", "ChatRequest"):
        if not route.name.endswith("-chat"):
            body["model"] = MODEL  # "may be left out when the server has one model": this one has three
        if body.get("stream_options") is not None:
            body["stream"] = True  # "stream_options: only with stream: true"
        if body.get("best_of") is not None:
            body["best_of"] = body.get("n") or 1  # "best_of: at least n" (more: a test's worth of work)
        if body.get("top_logprobs") is not None:
            body["logprobs"] = True  # "top_logprobs: with logprobs: true"
        if body.get("max_tokens") == 0 and route.schema == "CompletionRequest":
            body["echo"] = True  # "0 only with echo"
    # a constraint's content is a schema, pattern or grammar, and tools depend on the model's options: their own
    # tests send them (tests/integration/test_structured_http.py)
    params = body.get("parameters")
    if isinstance(params, dict) and params.get("best_of") is not None:
        params["best_of"] = 1  # "needs sampling" (candidates: tests/integration/test_prompt_logprobs_http.py)
    if isinstance(params, dict) and params.get("num_beams") is not None:
        params["num_beams"] = 1  # "dynamic batching" (this model rolls; beams: tests/engine/test_sampling_set.py)
    for level in (body, params if isinstance(params, dict) else {}):
        for name in CONSTRAINT_FIELDS:
            level.pop(name, None)
    if route.schema == "LmiRequest" and body.get("stream") and isinstance(body.get("inputs"), list):
        body["inputs"] = body["inputs"][0]  # "stream: a token stream ... of a single prompt"
    return body


def cheap(route: Route, body: dict[str, Any]) -> dict[str, Any]:
    """At most 4 new tokens when the body leaves the count to its default (30 for LMI and TGI, 16 for
    completions, the rest of the context for chat): valid either way, but a test's worth of work."""
    body = dict(body)
    if route.params:
        params = body.get("parameters") if isinstance(body.get("parameters"), dict) else {}
        body["parameters"] = {**params, "max_new_tokens": params.get("max_new_tokens") or 4}
    elif body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = 4
    return body


def assert_answered(r: httpx.Response, body: Any) -> None:
    assert r.status_code == 200, (body, r.text[:2000])
    if r.headers.get("content-type", "").startswith(("text/event-stream", "application/jsonlines")):
        assert '"error_type"' not in r.text, (body, r.text[-2000:])


def test_the_served_document_is_the_models_document(api_server: ServerProcess, doc: Document) -> None:
    """What the server documents is what ``inference_document`` builds from the models for its Limits."""
    built = inference_document(Limits(), ["echo", "tiny", MODEL])  # the api_server's models, sorted
    assert doc.document["components"]["schemas"] == built["components"]["schemas"]
    for route in ROUTES:
        schema = doc.request_schema(route.doc_path)
        refs = [b["$ref"] for b in schema.get("oneOf", [schema])]
        assert f"#/components/schemas/{route.schema}" in refs, (route.name, refs)


@pytest.mark.parametrize("route", ROUTES, ids=IDS)
def test_the_fields_a_route_knows_are_the_documented_ones(api_server: ServerProcess, doc: Document,
                                                          route: Route) -> None:
    everywhere = set().union(*(fields_of(doc, s) for s in doc.components.values()))
    # (where the names go, the body they go into, the documented names there)
    levels = [((), route.base, fields_of(doc, doc.components[route.schema]))]
    if route.params:
        levels.append((("parameters",), route.base, fields_of(doc, doc.components["LmiParameters"])))
    if route.schema in ("CompletionRequest", "ChatRequest"):
        levels.append((("stream_options",), {**route.base, "stream": True, "stream_options": {}},
                       fields_of(doc, doc.components["StreamOptions"])))
    for where, base, documented in levels:
        # on an LMI route, "messages" makes the body an OpenAI chat request (the document's oneOf): the LMI
        # variant neither knows nor refuses it as a field; the -chat routes cover that variant
        probes = (everywhere | set(FOREIGN)) - ({"messages"} if route.schema == "LmiRequest" and not where else set())
        target = base
        for step in where:
            target = target[step]
        known = {name for name in probes if name in target}
        sent = sorted(probes - known)
        bodies = [put(base, (*where, name), None) for name in sent]
        with ThreadPoolExecutor(8) as pool:  # independent probes: the engine batches them
            answers = list(pool.map(lambda body: post(api_server, route, body), bodies))
        for name, r in zip(sent, answers, strict=True):
            if not refused_as_unknown(r, name):
                assert r.status_code == 200, (route.name, where, name, r.text)
                known.add(name)
        assert known == documented, (route.name, where, sorted(known ^ documented))


@pytest.mark.parametrize("route", [r for r in ROUTES if r.schema == "ChatRequest"],
                         ids=[r.name for r in ROUTES if r.schema == "ChatRequest"])
def test_messages_take_other_keys_as_documented(api_server: ServerProcess, doc: Document, route: Route) -> None:
    """OpenAI clients send back what an answer held (``refusal``, ``tool_calls``, ...): a message and a text part
    take other keys, and the document says so."""
    assert doc.plain(doc.components["ChatMessage"])["additionalProperties"] is True
    assert doc.plain(doc.components["TextPart"])["additionalProperties"] is True
    message = {"role": "assistant", "content": [{"type": "text", "text": "Hi", "cache_control": {}}],
               "refusal": None, "tool_calls": [], "zzz_other": 1}
    body = {**route.base, "messages": [*MSG, message]}
    assert_answered(post(api_server, route, body), body)


@pytest.mark.parametrize("route", ROUTES, ids=IDS)
def test_every_documented_field_alone_is_accepted(api_server: ServerProcess, doc: Document, route: Route) -> None:
    schema = doc.components[route.schema]
    levels = [((), doc.properties(schema))]
    if route.params:
        levels.append((("parameters",), doc.properties(doc.components["LmiParameters"])))
    for where, props in levels:
        for name, prop in props.items():
            body = cheap(route, cross_field_rules(route, put(route.base, (*where, name), doc.example(prop))))
            assert_answered(post(api_server, route, body), body)


@pytest.mark.parametrize("route", ROUTES, ids=IDS)
@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_documents_valid_per_the_schema_are_answered(api_server: ServerProcess, doc: Document, route: Route,
                                                      data: st.DataObject) -> None:
    body = cheap(route, cross_field_rules(route, data.draw(doc.valid(doc.components[route.schema], CAPS),
                                                           label="body")))
    assert_answered(post(api_server, route, body), body)


@pytest.mark.parametrize("route", ROUTES, ids=IDS)
@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_values_out_of_their_documented_range_get_the_error_status_naming_the_field(
        api_server: ServerProcess, doc: Document, route: Route, data: st.DataObject) -> None:
    targets = [(p, node) for p, node in doc.constrained(doc.components[route.schema])
               if p != ("model",)]  # documented as the registered names: another name is a 404, not a 400
    where, node = data.draw(st.sampled_from(targets), label="field")
    body = put(route.base, where, data.draw(doc.breaking(node), label="value"))
    r = post(api_server, route, body)
    assert r.status_code == route.status, (body, r.text)
    error = r.json()
    assert set(error) == {"error", "error_type", "request_id"}
    text = ""
    for part in where[1:] if where[0] == "parameters" else where:
        text += "[0]" if part == "[]" else (f".{part}" if text else part)
    name = f"parameter '{text}'" if where[0] == "parameters" else f"'{text}'"
    assert error["error"].startswith(name), (body, error["error"])
