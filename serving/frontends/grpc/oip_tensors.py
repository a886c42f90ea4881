"""Open Inference Protocol tensors <-> the text-generation inputs (Triton vLLM-backend tensor names).

Design note: pure functions over the generated messages, no I/O. Inputs: ``text_input`` (BYTES, one
element per prompt), optional ``stream`` (BOOL), ``sampling_parameters`` (BYTES holding one JSON object
of the HTTP/LMI parameters; vLLM's ``max_tokens`` is accepted for ``max_new_tokens``) and
``exclude_input_in_output`` (BOOL). Output: ``text_output`` (BYTES, same shape as ``text_input``).
Tensors come either as ``raw_input_contents`` (one entry per input; BYTES elements framed as a 4-byte
little-endian length + bytes, BOOL as one byte each) or as typed ``contents``; both are accepted.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rollcore.errors import InvalidRequest
from serving.frontends.proto.gen.inference import grpc_service_pb2 as pb

INPUT_NAMES = ("text_input", "stream", "sampling_parameters", "exclude_input_in_output")
OUTPUT_NAME = "text_output"
VLLM_ALIASES = {"max_tokens": "max_new_tokens"}


@dataclass(frozen=True, slots=True)
class TextInputs:
    """What one ModelInferRequest asks for."""

    prompts: tuple[str, ...]
    shape: tuple[int, ...]
    stream: bool = False
    parameters: dict[str, Any] | None = None
    exclude_input: bool | None = None  # None: not given (whole answers include the prompt, streams do not)


def split_bytes(raw: bytes, name: str) -> list[bytes]:
    """BYTES tensor data -> its elements (4-byte little-endian length framing)."""
    out: list[bytes] = []
    i = 0
    while i < len(raw):
        if i + 4 > len(raw):
            raise InvalidRequest(f"input {name!r}: truncated BYTES element length at byte {i}")
        n = int.from_bytes(raw[i:i + 4], "little")
        i += 4
        if i + n > len(raw):
            raise InvalidRequest(f"input {name!r}: a BYTES element of {n} bytes overruns the tensor data")
        out.append(raw[i:i + n])
        i += n
    return out


def frame_bytes(items: Sequence[bytes]) -> bytes:
    """BYTES elements -> tensor data (4-byte little-endian length before each)."""
    return b"".join(len(b).to_bytes(4, "little") + b for b in items)


def _elements(tensor: Any, raw: bytes | None) -> list[Any]:
    name, dtype = tensor.name, tensor.datatype
    if dtype == "BYTES":
        items: list[Any] = split_bytes(raw, name) if raw is not None else list(tensor.contents.bytes_contents)
    elif dtype == "BOOL":
        if raw is not None:
            if any(b > 1 for b in raw):
                raise InvalidRequest(f"input {name!r}: BOOL elements must be bytes 0 or 1")
            items = [b == 1 for b in raw]
        else:
            items = list(tensor.contents.bool_contents)
    else:
        raise InvalidRequest(f"input {name!r} has datatype {dtype!r}; expected "
                             f"{'BOOL' if name in ('stream', 'exclude_input_in_output') else 'BYTES'}")
    expected = math.prod(tensor.shape) if tensor.shape else len(items)
    if expected != len(items):
        raise InvalidRequest(f"input {name!r} has shape {list(tensor.shape)} but {len(items)} elements")
    return items


def _expect(name: str, tensor: Any, dtype: str) -> None:
    if tensor.datatype != dtype:
        raise InvalidRequest(f"input {name!r} has datatype {tensor.datatype!r}; expected {dtype!r}")


def _scalar(name: str, items: list[Any]) -> Any:
    if len(items) != 1:
        raise InvalidRequest(f"input {name!r} must have exactly one element, got {len(items)}")
    return items[0]


def _utf8(name: str, b: bytes) -> str:
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequest(f"input {name!r} is not valid UTF-8 (byte {exc.start})") from None


def _reject_constant(value: str) -> Any:
    raise InvalidRequest(f"invalid JSON number {value}: NaN and Infinity are not allowed")


def parse_parameters(text: str) -> dict[str, Any]:
    """The ``sampling_parameters`` JSON -> an LMI ``parameters`` dict (vLLM aliases renamed)."""
    try:
        value = json.loads(text, parse_constant=_reject_constant) if text.strip() else {}
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"input 'sampling_parameters' is not valid JSON: {exc.msg} at column {exc.colno}") \
            from None
    except RecursionError:
        raise InvalidRequest("input 'sampling_parameters' is nested too deeply") from None
    except ValueError as exc:  # e.g. an integer of more than 4300 digits
        raise InvalidRequest(f"input 'sampling_parameters' is not acceptable JSON: {str(exc)[:200]}") from None
    if not isinstance(value, dict):
        raise InvalidRequest("input 'sampling_parameters' must be a JSON object")
    for alias, name in VLLM_ALIASES.items():
        if alias in value:
            if name in value:
                raise InvalidRequest(f"give {alias!r} or {name!r} in 'sampling_parameters', not both")
            value[name] = value.pop(alias)
    return value


def decode_inputs(request: Any) -> TextInputs:
    """A ModelInferRequest -> TextInputs, or InvalidRequest naming the tensor at fault."""
    raw = list(request.raw_input_contents)
    if raw and len(raw) != len(request.inputs):
        raise InvalidRequest(f"raw_input_contents has {len(raw)} entries for {len(request.inputs)} inputs")
    found: dict[str, Any] = {}
    prompts: tuple[str, ...] = ()
    shape: tuple[int, ...] = ()
    for i, tensor in enumerate(request.inputs):
        name = tensor.name
        if name not in INPUT_NAMES:
            raise InvalidRequest(f"unknown input {name!r}; expected one of {', '.join(INPUT_NAMES)}")
        if name in found:
            raise InvalidRequest(f"input {name!r} is given twice")
        items = _elements(tensor, raw[i] if raw else None)
        if name == "text_input":
            _expect(name, tensor, "BYTES")
            if not items:
                raise InvalidRequest("input 'text_input' has no elements")
            prompts = tuple(_utf8(name, b) for b in items)
            shape = tuple(tensor.shape) or (len(items),)
            found[name] = prompts
        elif name == "sampling_parameters":
            _expect(name, tensor, "BYTES")
            found[name] = parse_parameters(_utf8(name, _scalar(name, items)))
        else:
            _expect(name, tensor, "BOOL")
            found[name] = bool(_scalar(name, items))
    if "text_input" not in found:
        raise InvalidRequest("missing input 'text_input' (BYTES)")
    for out in request.outputs:
        if out.name != OUTPUT_NAME:
            raise InvalidRequest(f"unknown output {out.name!r}; this model produces {OUTPUT_NAME!r}")
    return TextInputs(prompts=prompts, shape=shape, stream=found.get("stream", False),
                      parameters=found.get("sampling_parameters"),
                      exclude_input=found.get("exclude_input_in_output"))


def text_response(request: Any, texts: Sequence[str], shape: Sequence[int],
                  parameters: dict[str, bool] | None = None, version: str | None = None) -> pb.ModelInferResponse:
    """A ModelInferResponse carrying ``text_output`` (BYTES, raw framing) for ``request``; ``version``: the model
    version that answered (default: the request's)."""
    response = pb.ModelInferResponse(model_name=request.model_name, model_version=version or request.model_version,
                                     id=request.id)
    response.outputs.add(name=OUTPUT_NAME, datatype="BYTES", shape=list(shape))
    response.raw_output_contents.append(frame_bytes([t.encode("utf-8") for t in texts]))
    for key, flag in (parameters or {}).items():
        response.parameters[key].bool_param = flag
    return response
