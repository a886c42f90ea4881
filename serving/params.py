"""Strict validation of generation parameters, shared by every frontend.

Design note: HTTP (LMI, TGI, OpenAI) and gRPC (OIP ``sampling_parameters``, typed service) all end up
here, so a bad value gets the same message whatever the protocol. Every check names the field; JSON's
``true`` is never accepted where a number is expected; NaN and infinities are refused; unknown fields are
listed (unless the model relaxes it). Limits are passed in, never read from globals.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from serving.errors import InvalidRequest
from serving.types import SamplingParams

MAX_TOKEN_ID = 2**31 - 1  # token ids and top_k: what every tokenizer and the wire can carry
_INT64_MIN, _UINT64_MAX = -(2**63), 2**64 - 1  # what msgpack (the worker channel) can carry
MAX_PAYLOAD_DEPTH = 64
MIN_TEMPERATURE = 0.01


@dataclass(frozen=True, slots=True)
class Limits:
    """Caps on what one request may ask for (the configurable ones come from config.properties)."""

    max_new_tokens: int = 4096
    max_stop_sequences: int = 16
    max_stop_length: int = 256
    max_stop_token_ids: int = 64
    max_sequences_per_request: int = 64  # prompts x n of one request
    max_n: int = 8
    max_logprobs: int = 20
    max_prompt_chars: int = 1_000_000


# LMI/TGI parameter name -> SamplingParams field (aliases of the same meaning map to one field).
LMI_FIELDS: dict[str, str] = {
    "max_new_tokens": "max_new_tokens", "do_sample": "do_sample", "temperature": "temperature",
    "top_k": "top_k", "top_p": "top_p", "repetition_penalty": "repetition_penalty", "seed": "seed",
    "stop": "stop", "stop_sequences": "stop", "stop_token_ids": "stop_token_ids", "ignore_eos": "ignore_eos",
    "ignore_eos_token": "ignore_eos", "details": "details", "return_full_text": "return_full_text",
    "logprobs": "logprobs", "top_n_tokens": "logprobs", "decoder_input_details": "_ignored",
    "truncate": "_ignored", "watermark": "_ignored", "typical_p": "_ignored", "best_of": "_ignored",
}


def _bool(name: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise InvalidRequest(f"parameter {name!r} must be a boolean, got {_kind(v)}")
    return v


def _int(name: str, v: Any, lo: int | None = None, hi: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer() and math.isfinite(v):
            v = int(v)
        else:
            raise InvalidRequest(f"parameter {name!r} must be an integer, got {_kind(v)}")
    if lo is not None and v < lo:
        raise InvalidRequest(f"parameter {name!r} must be >= {lo}, got {_show(v)}")
    if hi is not None and v > hi:
        raise InvalidRequest(f"parameter {name!r} must be <= {hi}, got {_show(v)}")
    return v


def _show(v: int) -> str:
    """An integer for a message: its digits, or its size when it is huge (never a 4300-digit string)."""
    return str(v) if v.bit_length() <= 64 else f"an integer of {v.bit_length()} bits"


def _float(name: str, v: Any, lo: float, hi: float, lo_open: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise InvalidRequest(f"parameter {name!r} must be a number, got {_kind(v)}")
    f = float(v)
    if not math.isfinite(f):
        raise InvalidRequest(f"parameter {name!r} must be finite, got {v!r}")
    if f < lo or (lo_open and f == lo) or f > hi:
        bound = f"> {lo:g}" if lo_open else f">= {lo:g}"
        raise InvalidRequest(f"parameter {name!r} must be {bound} and <= {hi:g}, got {v!r}")
    return f


def _kind(v: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
            dict: "an object", type(None): "null"}.get(type(v), type(v).__name__)


def check_text(name: str, v: Any, *, allow_empty: bool = False, max_chars: int = 1_000_000) -> str:
    """A client string: must be a str, valid Unicode (no lone surrogates), non-empty unless allowed."""
    if not isinstance(v, str):
        raise InvalidRequest(f"{name!r} must be a string, got {_kind(v)}")
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequest(f"{name!r} contains invalid Unicode (a lone surrogate)") from None
    if not allow_empty and not v:
        raise InvalidRequest(f"{name!r} must not be empty")
    if len(v) > max_chars:
        raise InvalidRequest(f"{name!r} is longer than {max_chars} characters")
    return v


def _stops(name: str, v: Any, limits: Limits) -> tuple[str, ...]:
    if v is None:
        return ()
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list):
        raise InvalidRequest(f"parameter {name!r} must be a string or a list of strings, got {_kind(v)}")
    if len(items) > limits.max_stop_sequences:
        raise InvalidRequest(f"parameter {name!r} has {len(items)} entries; at most {limits.max_stop_sequences}")
    out = []
    for s in items:
        check_text(name, s)
        if len(s) > limits.max_stop_length:
            raise InvalidRequest(f"parameter {name!r} entry is {len(s)} characters; at most {limits.max_stop_length}")
        out.append(s)
    return tuple(out)


def build_sampling_params(values: Mapping[str, Any], limits: Limits) -> SamplingParams:
    """``values`` keyed by SamplingParams field names (already de-aliased) -> validated SamplingParams."""
    kw: dict[str, Any] = {}
    for key, v in values.items():
        if v is None and key not in ("seed",):
            continue
        if key == "max_new_tokens":
            kw[key] = _int(key, v, 1, limits.max_new_tokens)
        elif key in ("do_sample", "ignore_eos", "details", "return_full_text"):
            kw[key] = _bool(key, v)
        elif key == "temperature":
            # As vLLM: a positive temperature below MIN_TEMPERATURE is raised to it (smaller ones overflow
            # the logits; 0 means greedy).
            t = _float(key, v, 0.0, 100.0)
            kw[key] = MIN_TEMPERATURE if 0.0 < t < MIN_TEMPERATURE else t
        elif key == "top_k":
            kw[key] = 0 if v == -1 and isinstance(v, int) and not isinstance(v, bool) else _int(key, v, 0,
                                                                                                 MAX_TOKEN_ID)
            # -1 (vLLM) and 0 (LMI) both mean "off"
        elif key == "top_p":
            kw[key] = _float(key, v, 0.0, 1.0, lo_open=True)
        elif key == "repetition_penalty":
            kw[key] = _float(key, v, 0.01, 100.0)
        elif key == "seed":
            kw[key] = None if v is None else _int(key, v, 0, 2**63 - 1)
        elif key == "stop":
            kw[key] = _stops(key, v, limits)
        elif key == "stop_token_ids":
            if not isinstance(v, list):
                raise InvalidRequest(f"parameter {key!r} must be a list of integers, got {_kind(v)}")
            if len(v) > limits.max_stop_token_ids:
                raise InvalidRequest(f"parameter {key!r} has {len(v)} entries; at most {limits.max_stop_token_ids}")
            kw[key] = tuple(_int(key, i, 0, MAX_TOKEN_ID) for i in v)
        elif key == "logprobs":
            kw[key] = _int(key, v, 0, limits.max_logprobs)
        else:
            raise InvalidRequest(f"unknown parameter {key!r}")
    return SamplingParams(**kw)


def parse_lmi_parameters(params: Any, limits: Limits, *, strict: bool = True) -> SamplingParams:
    """The LMI/TGI ``parameters`` object -> SamplingParams. Unknown names -> 400 listing them."""
    if params is None:
        return SamplingParams()
    if not isinstance(params, dict):
        raise InvalidRequest(f"'parameters' must be an object, got {_kind(params)}")
    unknown = sorted(k for k in params if k not in LMI_FIELDS)
    if unknown and strict:
        raise InvalidRequest(f"unknown parameters: {', '.join(unknown)}")
    values: dict[str, Any] = {}
    for k, v in params.items():
        f = LMI_FIELDS.get(k)
        if f is None or f == "_ignored":
            continue
        values[f] = v
    if "stop_sequences" in params and "stop" in params:
        values["stop"] = list(_stops("stop", params["stop"], limits)) + list(
            _stops("stop_sequences", params["stop_sequences"], limits))
    if "truncate" in params and params["truncate"] is not None:
        _int("truncate", params["truncate"], 1, MAX_TOKEN_ID)
    return build_sampling_params(values, limits)


def check_sequences(num: int, limits: Limits, what: str = "'inputs'") -> None:
    """One request may ask for at most ``max_sequences_per_request`` sequences (prompts x n)."""
    if num > limits.max_sequences_per_request:
        raise InvalidRequest(f"{what} asks for {num} sequences; at most {limits.max_sequences_per_request} per "
                             "request (max_sequences_per_request)")


def check_wire_value(name: str, value: Any) -> None:
    """A raw JSON value that travels to a worker as is (a custom handler's payload): integers must fit in 64
    bits, strings must be valid Unicode, nesting at most ``MAX_PAYLOAD_DEPTH``. Raises ``InvalidRequest``
    naming the path of the first bad value (``body.parameters.foo[2]``)."""
    stack: list[tuple[str, Any, int]] = [(name, value, 0)]
    while stack:
        path, v, depth = stack.pop()
        if depth > MAX_PAYLOAD_DEPTH:
            raise InvalidRequest(f"{path!r} is nested more than {MAX_PAYLOAD_DEPTH} levels deep")
        if isinstance(v, bool) or v is None or isinstance(v, float):
            continue
        if isinstance(v, int):
            if not _INT64_MIN <= v <= _UINT64_MAX:
                raise InvalidRequest(f"{path!r} is an integer of {v.bit_length()} bits; integers must fit in "
                                     "64 bits")
        elif isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise InvalidRequest(f"{path!r} contains invalid Unicode (a lone surrogate)") from None
        elif isinstance(v, list):
            stack.extend((f"{path}[{i}]", item, depth + 1) for i, item in enumerate(v))
        elif isinstance(v, dict):
            for k, item in v.items():
                check_text(f"{path} key", k, allow_empty=True, max_chars=1 << 20)
                stack.append((f"{path}.{k}", item, depth + 1))
        else:
            raise InvalidRequest(f"{path!r} has an unsupported type {_kind(v)}")
