"""Golden-byte tests of the worker channel codec (``serving.ipc.codec``): exact frames, incremental
decoding of partial frames, and rejection of anything that is not a message of the protocol."""

from __future__ import annotations

import struct

import msgpack
import pytest

from serving.ipc import codec
from serving.ipc.messages import (
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
)

# Hand-assembled msgpack: 4-byte big-endian length, then a fixmap of the dataclass fields in declaration
# order followed by the type tag "t".
GOLDEN = [
    (Shutdown(),
     b"\x00\x00\x00\x0c" b"\x81" b"\xa1t" b"\xa8shutdown"),
    (Abort(request_ids=["r1"]),
     b"\x00\x00\x00\x19" b"\x82" b"\xabrequest_ids" b"\x91\xa2r1" b"\xa1t" b"\xa5abort"),
    (Batch(batch_id=7, requests=[{"a": 1}]),
     b"\x00\x00\x00\x21" b"\x83" b"\xa8batch_id\x07" b"\xa8requests" b"\x91\x81\xa1a\x01" b"\xa1t" b"\xa5batch"),
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
    Batch(batch_id=1, requests=[{"request_id": "a", "prompt": "héllo"}]),
    BatchResult(batch_id=1, outputs=[{"request_id": "a", "text": "x", "tokens": [[1, "x", -0.5]]}]),
    Add(requests=[{"request_id": "b"}]),
    Abort(request_ids=["b", "c"]),
    Deltas(step=4, deltas=[{"id": "b", "tk": [[5, "y", None, []]], "fr": "eos"}], stats={"running": 1},
           step_s=0.25),
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
    ({"t": "add", "requests": [["not", "a", "map"]]}, "requests"),
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
    assert codec.decode_body(_body({"t": "deltas", "step": 3, "deltas": [{"id": "r"}], "step_s": 1})) == \
        Deltas(step=3, deltas=[{"id": "r"}], step_s=1)  # a whole number for a float field
    assert codec.decode_body(_body({"t": "configured", "seq": 2, "error": None})) == Configured(seq=2)
