"""Length-prefixed msgpack framing for the worker channel.

A frame is a 4-byte big-endian payload length followed by one msgpack map (see ``messages``).
msgpack decodes only data (no object hooks, no ext types), so a frame cannot execute code.
"""

from __future__ import annotations

import struct

import msgpack

from serving.ipc.messages import Message, ProtocolError, message_from_dict, message_to_dict

HEADER = struct.Struct(">I")
MAX_FRAME_BYTES = 1 << 30


def encode(msg: Message) -> bytes:
    """Serialise one message into one frame."""
    body = msgpack.packb(message_to_dict(msg), use_bin_type=True)
    return HEADER.pack(len(body)) + body


def decode_body(body: bytes) -> Message:
    """Decode one frame body (without its length header)."""
    try:
        obj = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError) as exc:
        raise ProtocolError(f"undecodable frame: {exc}") from None
    return message_from_dict(obj)


class FrameDecoder:
    """Incremental decoder: ``feed`` bytes as they arrive, get back every complete message."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[Message]:
        self._buf += data
        out: list[Message] = []
        while len(self._buf) >= HEADER.size:
            (n,) = HEADER.unpack_from(self._buf)
            if n > MAX_FRAME_BYTES:
                raise ProtocolError(f"frame of {n} bytes exceeds the limit")
            if len(self._buf) < HEADER.size + n:
                break
            body = bytes(self._buf[HEADER.size:HEADER.size + n])
            del self._buf[:HEADER.size + n]
            out.append(decode_body(body))
        return out
