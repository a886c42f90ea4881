"""Open Inference Protocol v2 REST bodies <-> the gRPC messages ``grpc_tensors`` translates (so both agree).

Design note: pure functions, no I/O. A REST inference request (``inputs`` of ``name``/``shape``/``datatype``/``data``,
request ``parameters``, requested ``outputs``) becomes a ``ModelInferRequest`` whose inputs are all
``raw_input_contents`` (BYTES elements length-framed, BOOL one byte each), then ``grpc_tensors.decode_inputs`` reads
it exactly as it reads a gRPC request. Triton's binary tensor extension is honoured both ways: an input whose
``parameters.binary_data_size`` is set takes its bytes from after the JSON (``Inference-Header-Content-Length``),
and ``binary_data_output`` / an output's ``binary_data`` answers the output's bytes after the JSON. The request's
``parameters`` carry the sampling parameters (as the gRPC ``sampling_parameters`` tensor does; not both), besides
the protocol's ``binary_data_output``. Triton's generate extension (``text_input`` + ``parameters``) is mapped onto
the same tensors. Errors name the field by its path (``'inputs[0].data[1]' must be a string``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rollcore.errors import InvalidRequest
from serving.frontends.grpc.oip_tensors import OUTPUT_NAME, frame_bytes
from serving.frontends.proto.gen.inference import grpc_service_pb2 as pb
from serving.requests.deadlines import TRITON_TIMEOUT, rest_timeout
from serving.requests.validation import type_error

REQUEST_FIELDS = ("id", "model_name", "model_version", "parameters", "inputs", "outputs")
PROTOCOL_PARAMETERS = ("binary_data_output", TRITON_TIMEOUT)  # request parameters the protocol's, not sampling's
GENERATE_FLAGS = ("stream", "exclude_input_in_output")  # BOOL inputs the generate body may give (or its parameters)


@dataclass
class RestInfer:
    """A REST inference request, translated."""

    request: Any  # pb.ModelInferRequest
    binary_output: bool = False
    ignored: list[str] = field(default_factory=list)  # unknown top-level fields (dropped unless strict)


def _strs(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise type_error(where, "a string", value)
    return value


def _flatten(data: Any, where: str) -> list[Any]:
    """A tensor's ``data`` (a list, nested row-major or flat) -> its elements."""
    if not isinstance(data, list):
        raise type_error(where, "a list", data)
    out: list[Any] = []
    stack: list[tuple[list[Any], int]] = [(data, 0)]
    while stack:
        items, i = stack.pop()
        if i < len(items):
            stack.append((items, i + 1))
            if isinstance(items[i], list):
                stack.append((items[i], 0))
            else:
                out.append(items[i])
    return out


def _shape(value: Any, where: str) -> list[int]:
    if not isinstance(value, list):
        raise type_error(where, "a list of integers", value)
    for i, d in enumerate(value):
        if isinstance(d, bool) or not isinstance(d, int) or d < 0:
            raise InvalidRequest(f"'{where}[{i}]' must be an integer >= 0, got {json.dumps(d)[:40]}")
    return list(value)


def _raw(datatype: str, elements: list[Any], where: str) -> bytes:
    """JSON elements -> the tensor's raw bytes (the framing ``grpc_tensors`` reads)."""
    if datatype == "BYTES":
        for i, e in enumerate(elements):
            if not isinstance(e, str):
                raise type_error(f"{where}[{i}]", "a string", e)
        return frame_bytes([e.encode("utf-8") for e in elements])
    if datatype == "BOOL":
        for i, e in enumerate(elements):
            if not isinstance(e, bool):
                raise type_error(f"{where}[{i}]", "a boolean", e)
        return bytes(1 if e else 0 for e in elements)
    return b""  # any other datatype: decode_inputs refuses it, naming the input and the datatype it expects


def _binary_size(params: Any, where: str) -> int | None:
    if params is None:
        return None
    if not isinstance(params, dict):
        raise type_error(where, "an object", params)
    size = params.get("binary_data_size")
    if size is None:
        return None
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise InvalidRequest(f"'{where}.binary_data_size' must be an integer >= 0, got {json.dumps(size)[:40]}")
    return size


def _flag(params: dict[str, Any], key: str, where: str) -> bool:
    value = params.get(key, False)
    if not isinstance(value, bool):
        raise type_error(f"{where}.{key}", "a boolean", value)
    return value


def infer_request(body: Any, tail: bytes, model_name: str, model_version: str) -> RestInfer:
    """An OIP REST inference request (JSON ``body``, binary ``tail``) -> ``RestInfer``, or InvalidRequest."""
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object (an OIP inference request)")
    ignored = sorted(k for k in body if k not in REQUEST_FIELDS)
    rid = body.get("id")
    rid = "" if rid is None else _strs(rid, "id")
    if body.get("model_name") is not None and _strs(body["model_name"], "model_name") != model_name:
        raise InvalidRequest(f"'model_name' is {body['model_name'][:100]!r} but the path names {model_name!r}")
    request = pb.ModelInferRequest(model_name=model_name, model_version=model_version, id=rid)
    params = body.get("parameters")
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise type_error("parameters", "an object", params)
    binary_output = _flag(params, "binary_data_output", "parameters")
    if params.get(TRITON_TIMEOUT) is not None:  # Triton's schedule policy: the request's deadline, as on gRPC
        request.parameters[TRITON_TIMEOUT].int64_param = rest_timeout(params[TRITON_TIMEOUT])
    sampling = {k: v for k, v in params.items() if k not in PROTOCOL_PARAMETERS}
    inputs = body.get("inputs")
    if not isinstance(inputs, list):
        raise type_error("inputs", "a list of tensors", inputs)
    if not inputs:
        raise InvalidRequest("'inputs' must be a non-empty list of tensors, got an empty list")
    offset = 0
    for i, tensor in enumerate(inputs):
        where = f"inputs[{i}]"
        if not isinstance(tensor, dict):
            raise type_error(where, "an object", tensor)
        name = _strs(tensor.get("name"), f"{where}.name")
        datatype = _strs(tensor.get("datatype"), f"{where}.datatype")
        shape = _shape(tensor.get("shape"), f"{where}.shape")
        size = _binary_size(tensor.get("parameters"), f"{where}.parameters")
        if size is not None:
            if tensor.get("data") is not None:
                raise InvalidRequest(f"'{where}' has both 'data' and parameters.binary_data_size: give one")
            if offset + size > len(tail):
                raise InvalidRequest(f"'{where}.parameters.binary_data_size' ({size}) overruns the binary data "
                                     f"after the JSON ({len(tail) - offset} bytes left)")
            raw = tail[offset:offset + size]
            offset += size
        else:
            raw = _raw(datatype, _flatten(tensor.get("data"), f"{where}.data"), f"{where}.data")
        request.inputs.add(name=name, datatype=datatype, shape=shape)
        request.raw_input_contents.append(raw)
    if offset != len(tail):
        raise InvalidRequest(f"{len(tail) - offset} bytes after the JSON belong to no input (binary_data_size)")
    if sampling:
        if any(t.name == "sampling_parameters" for t in request.inputs):
            raise InvalidRequest("give the sampling parameters in 'parameters' or in the input "
                                 "'sampling_parameters', not both")
        request.inputs.add(name="sampling_parameters", datatype="BYTES", shape=[1])
        request.raw_input_contents.append(frame_bytes([json.dumps(sampling).encode("utf-8")]))
    outputs = body.get("outputs")
    if outputs is not None:
        if not isinstance(outputs, list):
            raise type_error("outputs", "a list", outputs)
        for i, out in enumerate(outputs):
            if not isinstance(out, dict):
                raise type_error(f"outputs[{i}]", "an object", out)
            request.outputs.add(name=_strs(out.get("name"), f"outputs[{i}].name"))
            out_params = out.get("parameters")
            if out_params is not None:
                if not isinstance(out_params, dict):
                    raise type_error(f"outputs[{i}].parameters", "an object", out_params)
                binary_output = binary_output or _flag(out_params, "binary_data", f"outputs[{i}].parameters")
    return RestInfer(request=request, binary_output=binary_output, ignored=ignored)


def generate_request(body: Any, model_name: str, model_version: str, rid: str) -> RestInfer:
    """Triton's generate body (``text_input``, ``parameters``; ``stream`` and ``exclude_input_in_output`` at the top
    or among the parameters, as Triton's vLLM backend reads them) -> the same tensors as ``infer_request``."""
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object with 'text_input'")
    known = ("text_input", "parameters", *GENERATE_FLAGS)
    ignored = sorted(k for k in body if k not in known)
    if "text_input" not in body or body["text_input"] is None:
        raise InvalidRequest("missing field 'text_input' (the prompt, a string)")
    text = _strs(body["text_input"], "text_input")
    params = body.get("parameters")
    params = {} if params is None else dict(params) if isinstance(params, dict) else None
    if params is None:
        raise type_error("parameters", "an object", body["parameters"])
    tensors: list[dict[str, Any]] = [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": [text]}]
    for flag in GENERATE_FLAGS:
        top, inner = body.get(flag), params.pop(flag, None)
        if top is not None and inner is not None:
            raise InvalidRequest(f"give {flag!r} at the top or in 'parameters', not both")
        value = top if top is not None else inner
        if value is not None:
            if not isinstance(value, bool):
                raise type_error(flag if top is not None else f"parameters.{flag}", "a boolean", value)
            tensors.append({"name": flag, "datatype": "BOOL", "shape": [1], "data": [value]})
    rest = {"id": rid, "inputs": tensors, "parameters": params}
    translated = infer_request(rest, b"", model_name, model_version)
    translated.ignored = ignored
    return translated


def text_outputs(texts: Sequence[str], shape: Sequence[int], binary: bool) -> tuple[list[dict[str, Any]], bytes]:
    """The ``text_output`` tensor of an answer: JSON ``data``, or its framed bytes to append after the JSON."""
    out: dict[str, Any] = {"name": OUTPUT_NAME, "datatype": "BYTES", "shape": list(shape)}
    if not binary:
        out["data"] = list(texts)
        return [out], b""
    raw = frame_bytes([t.encode("utf-8") for t in texts])
    out["parameters"] = {"binary_data_size": len(raw)}
    return [out], raw
