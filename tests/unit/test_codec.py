"""Golden-byte tests of the worker channel codec (``serving.ipc.codec``): exact frames, incremental
decoding of partial frames, every message type encoded and decoded with its typed values (``serving.ipc.wire``),
and rejection of anything that is not a message of the protocol."""

from __future__ import annotations

import struct

import msgpack
import pytest

from rollcore.errors import ErrorKind
from rollcore.types import BatchOutput, FinishReason, GenerationRequest, SamplingParams, TokenDelta, TokenInfo
from serving.ipc import codec
from serving.ipc.messages import (
    MESSAGE_TYPES,
    Abort,
    Add,
    Batch,
    BatchResult,
    Configure,
    Configured,
    Deltas,
    Init,
    LoadFailed,
    ProtocolError,
    Ready,
    Reject,
    Shutdown,
    message_from_dict,
    message_to_dict,
)

# Hand-assembled msgpack: 4-byte big-endian length, then a fixmap of the dataclass fields in declaration
# order followed by the type tag "t"; a typed value inside (a TokenDelta) is the array of its fields in order.
GOLDEN = [
    (Shutdown(),
     b"\x00\x00\x00\x0c" b"\x81" b"\xa1t" b"\xa8shutdown"),
    (Abort(request_ids=["r1"]),
     b"\x00\x00\x00\x19" b"\x82" b"\xabrequest_ids" b"\x91\xa2r1" b"\xa1t" b"\xa5abort"),
    (Deltas(step=1, deltas=[TokenDelta(request_id="r", tokens=(TokenInfo(5, "y", -0.5),),
                                       finish_reason=FinishReason.EOS)]),
     b"\x00\x00\x00\x59" b"\x86" b"\xa4step\x01"
     b"\xa6deltas" b"\x91\x99" b"\xa1r" b"\x91\x94\x05\xa1y\xcb\xbf\xe0\x00\x00\x00\x00\x00\x00\x90" b"\xa0"
     b"\xa9eos_token" b"\xc0\xc0\xc0\xc0\xc0"
     b"\xa5stats\x80" b"\xa6step_s\xcb\x00\x00\x00\x00\x00\x00\x00\x00" b"\xa6prefix\xc0" b"\xa1t" b"\xa6deltas"),
    (LoadFailed(reason="boom"),
     b"\x00\x00\x00\x26" b"\x83" b"\xa6reason" b"\xa4boom" b"\xa9permanent\xc2" b"\xa1t" b"\xabload_failed"),
]

ROUND_TRIP = [
    Init(model_name="m", model_dir="/models/m", entry_point="echo", properties={"batch_size": "2"},
         rolling=True, device_id=0, worker_id=3),
    Ready(pid=123, info={"max_model_len": 2048, "chat_template": None}),
    Ready(pid=124, info={}, live_options=["max_rolling_batch_size"]),
    LoadFailed(reason="ValueError: no weights"),
    LoadFailed(reason="ModuleNotFoundError: No module named 'x'", permanent=True),
    Batch(batch_id=1, requests=[GenerationRequest(request_id="a", model="m", prompt="héllo", payload={"x": [1, None]},
                                                  params=SamplingParams(stop=("\n",), logit_bias=((3, -1.5),)),
                                                  attributes={"custom_attributes": "k=v"})]),
    BatchResult(batch_id=1, outputs=[BatchOutput(request_id="a", text="x", tokens=(TokenInfo(1, "x", -0.5),),
                                                 prompt_logprobs=(TokenInfo(2, "p"),), payload={"echo": True}),
                                     BatchOutput.failure("b", "boom", ErrorKind.INVALID),
                                     BatchOutput(request_id="c", embedding=(0.25, -1.0))]),
    Add(requests=[GenerationRequest(request_id="b", model="m", prompt_token_ids=(1, 2, 3), stream=True,
                                    params=SamplingParams(do_sample=True, temperature=0.5, seed=7, adapter="x"))]),
    Abort(request_ids=["b", "c"]),
    Deltas(step=4, deltas=[TokenDelta(request_id="b", tokens=(TokenInfo(5, "y", None, ((6, -2.0),)),), text="y",
                                      finish_reason=FinishReason.EOS, prompt_tokens=3, cached_tokens=2)],
           stats={"running": 1}, step_s=0.25, prefix={"add": [1, 2], "del": [], "block_size": 16}),
    Reject(request_id="b", kind="invalid_request", message="prompt too long"),
    Configure(seq=2, options={"max_rolling_batch_size": 4}),
    Configured(seq=2, stats={"max_num_seqs": 4, "limits": {"first_step_admitted": None}}),
    Configured(seq=3, error="ValueError: no"),
    Shutdown(),
]


@pytest.mark.parametrize("msg,frame", GOLDEN, ids=[type(m).__name__ for m, _ in GOLDEN])
def test_encode_golden_bytes(msg: object, frame: bytes) -> None:
    assert codec.encode(msg) == frame  # type: ignore[arg-type]
    assert codec.FrameDecoder().feed(frame) == [msg]


@pytest.mark.parametrize("msg", ROUND_TRIP, ids=[type(m).__name__ for m in ROUND_TRIP])
def test_round_trip(msg: object) -> None:
    frame = codec.encode(msg)  # type: ignore[arg-type]
    assert struct.unpack(">I", frame[:4])[0] == len(frame) - 4
    assert codec.decode_body(frame[4:]) == msg


def test_partial_frames_byte_by_byte() -> None:
    stream = b"".join(codec.encode(m) for m in ROUND_TRIP)  # type: ignore[arg-type]
    decoder = codec.FrameDecoder()
    got = []
    for i in range(len(stream)):
        got.extend(decoder.feed(stream[i:i + 1]))
    assert got == ROUND_TRIP


def test_partial_header_and_several_frames_in_one_chunk() -> None:
    a, b = codec.encode(Abort(request_ids=["x"])), codec.encode(Shutdown())
    decoder = codec.FrameDecoder()
    assert decoder.feed(a[:2]) == []           # half a header
    assert decoder.feed(a[2:4]) == []          # header, no body
    assert decoder.feed(a[4:-1]) == []         # body minus one byte
    assert decoder.feed(a[-1:] + b + b[:3]) == [Abort(request_ids=["x"]), Shutdown()]
    assert decoder.feed(b[3:]) == [Shutdown()]


def _body(obj: object) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


@pytest.mark.parametrize("body,match", [
    (_body({"t": "exec", "code": "import os"}), "unknown message type"),
    (_body({"t": "abort", "request_ids": ["a"], "extra": 1}), "unexpected fields"),
    (_body({"t": "abort"}), "bad 'abort' message"),                  # missing field
    (_body({"request_ids": ["a"]}), "not a tagged map"),              # no tag
    (_body({"t": 5}), "not a tagged map"),                            # tag not a string
    (_body(["t", "abort"]), "not a tagged map"),                      # not a map
    (_body("shutdown"), "not a tagged map"),
    (_body({b"t": b"shutdown"}), "not a tagged map"),                 # bytes, not str
    (_body({1: 2}), "undecodable"),                                   # non-string map key
    (_body({"t": "shutdown"}) + b"\x00", "undecodable"),              # trailing bytes
    (b"\xc1", "undecodable"),                                         # never-used msgpack byte
    (b"\x82\xa1", "undecodable"),                                     # truncated body
    (b"", "undecodable"),
])
def test_rejects_non_messages(body: bytes, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        codec.decode_body(body)
    with pytest.raises(ProtocolError):
        codec.FrameDecoder().feed(struct.pack(">I", len(body)) + body)


def test_rejects_oversized_frame_header_before_buffering() -> None:
    with pytest.raises(ProtocolError, match="exceeds the limit"):
        codec.FrameDecoder().feed(struct.pack(">I", codec.MAX_FRAME_BYTES + 1))


def test_ext_types_are_not_decoded_into_objects() -> None:
    # msgpack hands back an inert ExtType tuple (nothing is constructed or executed from it), which is no list
    # of request ids: the frame is refused
    body = _body({"t": "abort", "request_ids": msgpack.ExtType(1, b"payload")})
    with pytest.raises(ProtocolError, match="field 'request_ids' is a ExtType"):
        codec.decode_body(body)


@pytest.mark.parametrize("frame,field", [
    ({"t": "abort", "request_ids": "r1"}, "request_ids"),                      # a string, not a list
    ({"t": "abort", "request_ids": ["r1", 2]}, "request_ids"),                 # an item of another type
    ({"t": "batch", "batch_id": "1", "requests": []}, "batch_id"),             # a number as text
    ({"t": "batch", "batch_id": True, "requests": []}, "batch_id"),            # a bool is no integer
    ({"t": "add", "requests": [["not", "a", "request"]]}, "requests"),
    ({"t": "batch", "batch_id": 1, "requests": [{"request_id": "a"}]}, "requests"),  # a map is no request
    ({"t": "configure", "seq": 1, "options": {"max_rolling_batch_size": "4"}}, "options"),
    ({"t": "init", "model_name": "m", "model_dir": "/m", "entry_point": "echo", "properties": {"a": 1}},
     "properties"),
    ({"t": "deltas", "step": 1, "deltas": [], "step_s": "0.1"}, "step_s"),
    ({"t": "configured", "seq": 1, "error": 5}, "error"),
])
def test_a_wrongly_typed_field_is_refused_by_name(frame: dict[str, object], field: str) -> None:
    with pytest.raises(ProtocolError, match=f"field '{field}'"):
        codec.decode_body(_body(frame))


def test_typed_fields_accept_what_senders_write() -> None:
    delta = ["r", [], "", None, None, None, None, None, None]
    assert codec.decode_body(_body({"t": "deltas", "step": 3, "deltas": [delta], "step_s": 1})) == \
        Deltas(step=3, deltas=[TokenDelta(request_id="r")], step_s=1.0)  # a whole number for a float field
    assert codec.decode_body(_body({"t": "configured", "seq": 2, "error": None})) == Configured(seq=2)


def test_every_message_type_round_trips() -> None:
    assert {m.TAG for m in ROUND_TRIP} == set(MESSAGE_TYPES)


def test_a_request_crosses_without_its_frontend_fields() -> None:
    """``GenerationRequest.LOCAL_FIELDS`` (deadline, client id, affinity) stay in the frontend."""
    sent = GenerationRequest(request_id="a", model="m", prompt="p", deadline=12.5, client_id="mine", affinity="s")
    got = codec.decode_body(codec.encode(Add(requests=[sent]))[4:])
    assert got == Add(requests=[GenerationRequest(request_id="a", model="m", prompt="p")])


def test_a_malformed_output_or_delta_fails_its_own_request_only() -> None:
    result = message_to_dict(BatchResult(batch_id=2, outputs=[BatchOutput("a", "x"), BatchOutput("b", "y")]))
    result["outputs"][0][3] = [["not-an-id", "x", None, []]]  # a's tokens
    outputs = message_from_dict(result).outputs
    assert outputs[1] == BatchOutput("b", "y")
    assert outputs[0].request_id == "a" and outputs[0].finish_reason is FinishReason.ERROR
    assert outputs[0].error is not None and ".tokens[0].id: is a str, not an integer" in outputs[0].error
    deltas = message_to_dict(Deltas(step=1, deltas=[TokenDelta("a"), TokenDelta("b", text="ok")]))
    deltas["deltas"][0][4] = "many"  # a's prompt_tokens
    got = message_from_dict(deltas).deltas
    assert got[1] == TokenDelta("b", text="ok") and got[0].request_id == "a" and got[0].error is not None
