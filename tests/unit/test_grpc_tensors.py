"""OIP tensors <-> text-generation inputs: BYTES framing, raw and typed contents, validation messages."""

from __future__ import annotations

import json
from typing import Any

import pytest

from rollcore.errors import InvalidRequest
from serving.frontends.grpc.oip_tensors import decode_inputs, frame_bytes, parse_parameters, split_bytes, text_response
from serving.frontends.proto.gen.inference import grpc_service_pb2 as pb


def raw_request(*tensors: tuple[str, str, list[int], bytes], outputs: tuple[str, ...] = ()) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="m", id="r1")
    for name, dtype, shape, data in tensors:
        request.inputs.add(name=name, datatype=dtype, shape=shape)
        request.raw_input_contents.append(data)
    for name in outputs:
        request.outputs.add(name=name)
    return request


def test_bytes_framing_golden() -> None:
    assert frame_bytes([b"ab", b""]) == b"\x02\x00\x00\x00ab\x00\x00\x00\x00"
    assert split_bytes(b"\x02\x00\x00\x00ab\x00\x00\x00\x00", "x") == [b"ab", b""]
    assert split_bytes(b"", "x") == []


@pytest.mark.parametrize("data, message", [
    (b"\x02\x00", "truncated BYTES element length"),
    (b"\x05\x00\x00\x00abc", "overruns the tensor data"),
])
def test_bad_framing_names_the_input(data: bytes, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        split_bytes(data, "text_input")


def test_raw_inputs_decode() -> None:
    params = json.dumps({"max_tokens": 5, "temperature": 0.5}).encode()
    request = raw_request(("text_input", "BYTES", [1, 1], frame_bytes(["héllo".encode()])),
                          ("stream", "BOOL", [1], b"\x01"),
                          ("sampling_parameters", "BYTES", [1], frame_bytes([params])),
                          ("exclude_input_in_output", "BOOL", [1], b"\x00"), outputs=("text_output",))
    inputs = decode_inputs(request)
    assert inputs.prompts == ("héllo",) and inputs.shape == (1, 1)
    assert inputs.stream is True and inputs.exclude_input is False
    assert inputs.parameters == {"max_new_tokens": 5, "temperature": 0.5}  # vLLM's max_tokens renamed


def test_typed_contents_decode() -> None:
    request = pb.ModelInferRequest(model_name="m")
    text = request.inputs.add(name="text_input", datatype="BYTES", shape=[2])
    text.contents.bytes_contents.extend([b"a", b"b"])
    flag = request.inputs.add(name="stream", datatype="BOOL", shape=[1])
    flag.contents.bool_contents.append(False)
    inputs = decode_inputs(request)
    assert inputs.prompts == ("a", "b") and inputs.shape == (2,) and inputs.stream is False
    assert inputs.parameters is None and inputs.exclude_input is None


@pytest.mark.parametrize("tensors, outputs, message", [
    ([], (), "missing input 'text_input'"),
    ([("prompt", "BYTES", [1], frame_bytes([b"x"]))], (), "unknown input 'prompt'"),
    ([("text_input", "FP32", [1], b"\x00\x00\x00\x00")], (), "datatype 'FP32'; expected BYTES"),
    ([("text_input", "BYTES", [2], frame_bytes([b"x"]))], (), "shape \\[2\\] but 1 elements"),
    ([("text_input", "BYTES", [1], frame_bytes([b"\xff"]))], (), "not valid UTF-8"),
    ([("text_input", "BYTES", [1], frame_bytes([b"x"])), ("stream", "BYTES", [1], frame_bytes([b"1"]))], (),
     "'stream' has datatype 'BYTES'; expected 'BOOL'"),
    ([("text_input", "BYTES", [1], frame_bytes([b"x"])), ("stream", "BOOL", [1], b"\x07")], (),
     "BOOL elements must be bytes 0 or 1"),
    ([("text_input", "BYTES", [1], frame_bytes([b"x"]))], ("logits",), "unknown output 'logits'"),
    ([("text_input", "BYTES", [1], frame_bytes([b"x"])), ("text_input", "BYTES", [1], frame_bytes([b"y"]))], (),
     "given twice"),
])
def test_invalid_inputs(tensors: list[Any], outputs: tuple[str, ...], message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        decode_inputs(raw_request(*tensors, outputs=outputs))


def test_raw_contents_count_must_match_inputs() -> None:
    request = raw_request(("text_input", "BYTES", [1], frame_bytes([b"x"])))
    request.raw_input_contents.append(b"extra")
    with pytest.raises(InvalidRequest, match="2 entries for 1 inputs"):
        decode_inputs(request)


@pytest.mark.parametrize("text, message", [
    ("[1]", "must be a JSON object"),
    ("{", "not valid JSON"),
    ('{"temperature": NaN}', "NaN and Infinity are not allowed"),
    ('{"max_tokens": 1, "max_new_tokens": 2}', "not both"),
])
def test_invalid_sampling_parameters(text: str, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        parse_parameters(text)


def test_text_response_is_framed_bytes() -> None:
    request = pb.ModelInferRequest(model_name="m", model_version="1", id="r9")
    response = text_response(request, ["hi", "yo"], [2], {"triton_final_response": True})
    assert (response.model_name, response.model_version, response.id) == ("m", "1", "r9")
    out = response.outputs[0]
    assert (out.name, out.datatype, list(out.shape)) == ("text_output", "BYTES", [2])
    assert split_bytes(response.raw_output_contents[0], "text_output") == [b"hi", b"yo"]
    assert response.parameters["triton_final_response"].bool_param is True
