"""``POST /v1/embeddings``'s body, in process: bodies valid per ``/openapi.json`` are accepted by the route's parser,
a value out of its documented range is refused naming the field (and the OpenAI error names it as ``param``), and
the answer's vectors are shaped as documented (Matryoshka truncation, little-endian float32)."""

from __future__ import annotations

import json
import math
import struct
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollcore.errors import InvalidRequest
from serving.frontends.http.embeddings import openai_error, parse, shaped
from serving.frontends.http.openapi import inference_document
from serving.requests.params import Limits
from tests.schema_strategies import Caps, Document, put

LIMITS = Limits()
DOC = Document(inference_document(LIMITS, ["m"]))
SCHEMA = DOC.request_schema("/v1/embeddings")
MODEL = SimpleNamespace(name="m", options={"strict_parameters": "true"}, successor=None, residency=None,
                        info={"tasks": ["generate", "embedding"], "vocab_size": 1000,
                              "embedding": {"size": 64, "pooling": "last", "normalize": True}})


class FakeText:
    """A model's text side without a tokenizer (no length checks)."""

    max_model_len = None

    def encode(self, text: str) -> None:
        return None

    def worker_ids(self, ids: list[int] | None) -> None:
        return None  # no tokenizer here: the worker tokenizes the text


def run(body: Any) -> Any:
    return parse(body, MODEL, FakeText(), "r", LIMITS)  # type: ignore[arg-type]


CAPS = Caps(vocab=1000, by_name={"dimensions": st.integers(1, 64),
                                 "truncate_prompt_tokens": st.none()})  # needs a tokenizer


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_bodies_valid_per_the_document_are_accepted(data: st.DataObject) -> None:
    body = data.draw(DOC.valid(SCHEMA, CAPS), label="body")
    parsed = run(body)
    assert parsed.requests and all(r.params.embed for r in parsed.requests)


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_values_out_of_their_documented_range_are_refused_naming_the_field(data: st.DataObject) -> None:
    targets = [(p, node) for p, node in DOC.constrained(SCHEMA) if p != ("model",)]
    where, node = data.draw(st.sampled_from(targets), label="field")
    body = put({"input": "hello"}, where, data.draw(DOC.breaking(node), label="value"))
    with pytest.raises(InvalidRequest) as err:
        run(body)
    assert err.value.message.startswith(f"'{where[0]}"), (body, err.value.message)
    param = json.loads(bytes(openai_error(err.value, "r").body))["error"]["param"]
    assert param == where[0]


def test_what_only_the_model_knows_is_refused_naming_the_field() -> None:
    for body, param, words in [
        ({"input": "hi", "dimensions": 65}, "dimensions", "'dimensions' must be <= 64, the hidden size of model 'm'"),
        ({"input": [[1], [5, 1000]]}, "input", "'input[1]' holds token id 1000, outside the vocabulary"),
        ({"input": "hi", "truncate_prompt_tokens": 2}, "truncate_prompt_tokens", "needs a tokenizer.json"),
        ({"input": "hi", "colour": 1}, "colour", "unknown fields: colour"),
    ]:
        with pytest.raises(InvalidRequest) as err:
            run(body)
        assert words in err.value.message
        error = json.loads(bytes(openai_error(err.value, "r").body))["error"]
        assert error == {"message": err.value.message, "type": "invalid_request_error", "param": param,
                         "code": "invalid_request"}


def test_vectors_are_truncated_normalised_and_packed_little_endian() -> None:
    vector = (0.6, 0.8, 0.0, 0.0)
    assert struct.unpack("<4f", shaped(vector, None, True)) == pytest.approx(vector)
    half = struct.unpack("<2f", shaped((0.3, 0.4, 0.5, 0.7), 2, True))
    assert half == pytest.approx((0.6, 0.8)) and math.isclose(math.hypot(*half), 1, rel_tol=1e-6)
    assert struct.unpack("<2f", shaped((0.3, 0.4, 0.5, 0.7), 2, False)) == pytest.approx((0.3, 0.4))
