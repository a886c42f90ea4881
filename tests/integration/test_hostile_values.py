"""Hostile values through a real server: a value the wire cannot carry, a token id
beyond the vocabulary or an amplifying request gets a 4xx naming the field, while a neighbour request on
the same model runs to its end, twelve requests afterwards succeed and no slot or KV block leaks."""

from __future__ import annotations

from typing import Any

import grpc
import httpx
import pytest

from serving.frontends.grpc.oip_tensors import frame_bytes
from serving.frontends.proto.gen.inference import grpc_service_pb2 as oip_pb
from serving.frontends.proto.gen.inference import grpc_service_pb2_grpc as oip_grpc
from serving.frontends.proto.gen.rollserve.v1 import generate_pb2 as pb
from serving.frontends.proto.gen.rollserve.v1 import generate_pb2_grpc as pb_grpc
from tests.integration.harness import ServerProcess
from tests.integration.hostile import (
    PROMPT,
    Neighbour,
    assert_no_leaks,
    error_of,
    lmi_body,
    post,
    twelve_afterwards,
)

BIG = 10**24  # needs 80 bits: msgpack (the worker channel) carries at most 64

# (model, path, body, status, words the error must name)
HOSTILE_VALUES: list[tuple[str, str, Any, int, tuple[str, ...]]] = [
    ("dyn", "/predictions/dyn", lmi_body(top_k=BIG), 400, ("top_k",)),
    ("dyn", "/predictions/dyn", lmi_body(stop_token_ids=[2, BIG]), 400, ("stop_token_ids",)),
    ("dyn", "/v1/chat/completions", {"model": "dyn", "messages": [{"role": "user", "content": "hi"}],
                                     "seed": 2**80, "max_tokens": 4}, 400, ("seed",)),
    ("dyn", "/predictions/dyn", {"inputs": PROMPT, "parameters": {"truncate": BIG}}, 400, ("truncate",)),
    ("roll", "/predictions/roll", lmi_body(top_k=BIG), 400, ("top_k",)),
    ("roll", "/v1/completions", {"model": "roll", "prompt": PROMPT, "stop_token_ids": [BIG]}, 400,
     ("stop_token_ids",)),
    ("roll", "/v1/completions", {"model": "roll", "prompt": [[1, 2, BIG]], "max_tokens": 4}, 400, ("prompt",)),
    ("roll", "/generate?model_name=roll", {"inputs": PROMPT, "parameters": {"top_k": BIG}}, 422, ("top_k",)),
    ("custom", "/predictions/custom", {"inputs": "x", "extra": {"n": [1, BIG]}}, 400, ("body.extra.n[1]", "64 bits")),
    ("custom", "/predictions/custom", {"inputs": "x", "label": "a\ud800"}, 400, ("body.label", "surrogate")),
]


@pytest.mark.parametrize(("model", "path", "body", "status", "names"), HOSTILE_VALUES,
                         ids=[f"{c[0]}-{'-'.join(c[4])}" for c in HOSTILE_VALUES])
def test_values_the_wire_cannot_carry(hostile_server: ServerProcess, model: str, path: str, body: Any, status: int,
                                      names: tuple[str, ...]) -> None:
    s = hostile_server
    with Neighbour(s, model, stream=model == "roll") as neighbour:
        error_of(post(s, path, body, timeout=60), status, *names)
    neighbour.check()
    twelve_afterwards(s, model)
    assert_no_leaks(s, model)


def test_an_integer_of_5000_digits_is_a_400(hostile_server: ServerProcess) -> None:
    r = httpx.post(f"{hostile_server.url}/predictions/dyn", timeout=30,
                   content=b'{"inputs": "x", "parameters": {"top_k": ' + b"9" * 5000 + b"}}")
    error_of(r, 400, "JSON")


def oip_request(model: str, prompt: str, params: str, rid: str = "") -> oip_pb.ModelInferRequest:
    request = oip_pb.ModelInferRequest(model_name=model, id=rid)
    for name, data in (("text_input", prompt.encode()), ("sampling_parameters", params.encode())):
        request.inputs.add(name=name, datatype="BYTES", shape=[1])
        request.raw_input_contents.append(frame_bytes([data]))
    return request


def test_grpc_values_the_wire_cannot_carry(hostile_server: ServerProcess) -> None:
    s = hostile_server
    with grpc.insecure_channel(s.grpc_target) as channel:
        oip = oip_grpc.GRPCInferenceServiceStub(channel)
        for model, params, name in (("dyn", f'{{"top_k": {BIG}}}', "top_k"),
                                    ("custom", f'{{"colour": {BIG}}}', "sampling_parameters.colour")):
            with pytest.raises(grpc.RpcError) as err:
                oip.ModelInfer(oip_request(model, PROMPT, params), timeout=60)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and name in err.value.details()
        ok = oip.ModelInfer(oip_request("dyn", PROMPT, '{"max_new_tokens": 2}'), timeout=60)
        assert ok.model_name == "dyn"
    twelve_afterwards(s, "dyn")
    assert_no_leaks(s, "dyn")


VOCAB = 1024  # the default model's embedding rows
BEYOND_VOCAB: list[tuple[str, Any, tuple[str, ...]]] = [
    ("/v1/completions", {"model": "roll", "prompt": [1, 2, VOCAB + 5], "max_tokens": 4}, ("prompt", "vocabulary")),
    ("/v1/completions", {"model": "roll", "prompt": PROMPT, "max_tokens": 4, "stop_token_ids": [VOCAB]},
     ("stop_token_ids", "vocabulary")),
    ("/v1/completions", {"model": "roll", "prompt": PROMPT, "max_tokens": 4, "logit_bias": {str(VOCAB + 1): 5}},
     ("logit_bias",)),
    ("/predictions/roll", lmi_body(stop_token_ids=[VOCAB * 4]), ("stop_token_ids", "vocabulary")),
]


@pytest.mark.parametrize(("path", "body", "names"), BEYOND_VOCAB, ids=[c[2][0] for c in BEYOND_VOCAB])
def test_token_ids_beyond_the_vocabulary_fail_alone(hostile_server: ServerProcess, path: str, body: Any,
                                                    names: tuple[str, ...]) -> None:
    s = hostile_server
    with Neighbour(s, "roll", stream=True) as neighbour:
        error_of(post(s, path, body, timeout=60), 400, *names)
    neighbour.check()
    twelve_afterwards(s, "roll")
    assert_no_leaks(s, "roll")


def test_grpc_prompt_token_ids_beyond_the_vocabulary(hostile_server: ServerProcess) -> None:
    s = hostile_server
    with Neighbour(s, "roll", stream=True) as neighbour, grpc.insecure_channel(s.grpc_target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.Generate(pb.GenerateRequest(model="roll", prompt_token_ids=[5, VOCAB + 7],
                                             parameters=pb.SamplingParameters(max_new_tokens=4)), timeout=60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "vocabulary" in err.value.details()
    neighbour.check()
    twelve_afterwards(s, "roll")
    assert_no_leaks(s, "roll")


# --- caps (item 5) -----------------------------------------------------------------------------------
CAPS: list[tuple[str, Any, tuple[str, ...]]] = [
    ("/predictions/roll", lmi_body(stop_token_ids=list(range(65))), ("stop_token_ids", "at most 64")),
    ("/predictions/roll", lmi_body(stop=["x"] * 17), ("stop", "at most 16")),
    ("/predictions/roll", lmi_body(stop=["x" * 257]), ("stop", "at most 256")),
    ("/v1/completions", {"model": "roll", "prompt": [PROMPT] * 9, "n": 8, "max_tokens": 2},
     ("72 sequences", "max_sequences_per_request")),
    # the schema's cap on the list (maxItems in /openapi.json), hence the schema's words
    ("/predictions/roll", {"inputs": [PROMPT] * 65},
     ("'inputs' has 65 entries; at most 64", "max_sequences_per_request")),
]


@pytest.mark.parametrize(("path", "body", "names"), CAPS, ids=[c[2][-1] for c in CAPS])
def test_amplifying_requests_are_capped(hostile_server: ServerProcess, path: str, body: Any,
                                        names: tuple[str, ...]) -> None:
    error_of(post(hostile_server, path, body, timeout=60), 400, *names)
    assert_no_leaks(hostile_server, "roll")


def test_registration_caps(hostile_server: ServerProcess) -> None:
    s, auth = hostile_server, hostile_server.mgmt_headers
    for query, names in (({"url": "slowecho", "model_name": "many", "min_worker": "300"},
                          ("min_worker", "max_workers_per_model")),
                         ({"url": "slowecho", "model_name": "many", "max_worker": "9"}, ("max_worker", "2")),
                         ({"url": "slowecho", "model_name": "many", "min_worker": "\u00b2"}, ("min_worker",)),
                         ({"url": "slowecho", "model_name": "many", "batch_size": "1" * 30}, ("batch_size",))):
        error_of(httpx.post(f"{s.mgmt}/models", params=query, headers=auth, timeout=30), 400, *names)
    error_of(httpx.put(f"{s.mgmt}/models/slowecho", params={"min_worker": "300"}, headers=auth, timeout=30), 400,
             "max_workers_per_model")
    assert len(s.describe("slowecho")["workers"]) == 1
    # max_models=7 with 6 at start: one more registers, the next is refused
    assert httpx.post(f"{s.mgmt}/models", params={"url": "slowecho", "model_name": "seventh"}, headers=auth,
                      timeout=60).status_code == 200
    error_of(httpx.post(f"{s.mgmt}/models", params={"url": "slowecho", "model_name": "eighth"}, headers=auth,
                        timeout=60), 503, "max_models")
    assert httpx.delete(f"{s.mgmt}/models/seventh", headers=auth, timeout=60).status_code == 200


# --- prefix-cache keys (item 8) ----------------------------------------------------------------------
def test_prefix_cache_hits_serve_the_right_kv(hostile_server: ServerProcess) -> None:
    """A shared prefix is served from the cache (hits grow) and the answers equal HF generate's."""
    s = hostile_server
    shared = "The history of the city begins with a small village on the river, " * 4
    prompts = [shared + "and then the king", shared + "but the queen said"]

    def hits() -> int:
        return sum(int(e.get("prefix_cache_hits_total", 0)) for e in s.describe("roll")["batcher"]["engines"]
                   .values())

    before = hits()
    rolled = [post(s, "/predictions/roll", lmi_body(p, max_new_tokens=12)).json()["generated_text"] for p in prompts]
    assert hits() > before  # the second prompt reused the first one's full blocks
    reference = [post(s, "/predictions/dyn", lmi_body(p, max_new_tokens=12)).json()["generated_text"]
                 for p in prompts]
    assert rolled == reference
    assert_no_leaks(s, "roll")
