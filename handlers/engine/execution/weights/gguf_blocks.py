"""GGML's quantized blocks read as integers and scales (``int_weights.IntWeight``), never as fp32 weights.

Design note (why: a 7B Q4_K_M file is 4 GB; dequantized it is 27 GB): every block type llama.cpp's common files
use is, per group of 16 or 32 inputs, ``q * scale + minimum`` with small integers ``q``, so the kernel's integer
form holds it exactly (the scales are the products the reference dequantization computes, in fp32):
  Q4_0 (q - 8) * d            -> 4 bits, group 32        Q4_1 q * d + m             -> 4 bits, group 32
  Q5_0 (q - 16) * d           -> 8 bits, group 32        Q5_1 q * d + m             -> 8 bits, group 32
  Q8_0 q * d                  -> 8 bits, group 32        Q2_K d*sc * q - dmin*m     -> 4 bits, group 16
  Q3_K d*sc * (q - 4)         -> 4 bits, group 16        Q4_K d*sc * q - dmin*m     -> 4 bits, group 32
  Q5_K d*sc * q - dmin*m      -> 8 bits, group 32        Q6_K d*sc * (q - 32)       -> 8 bits, group 16
The bit layouts follow ggml's ``block_*`` structs (gguf's own ``dequantize`` is the reference the tests compare
with). Each function takes a tensor's blocks as bytes [n_blocks, type size] and returns integers [n_blocks,
elements], scales and minimums [n_blocks, groups] (numpy; the caller reshapes to rows).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from handlers.engine.planning.gguf_plan import GGML_TYPES

QK_K = 256  # elements per K-quant super-block


class Blocks(NamedTuple):
    q: np.ndarray  # [n_blocks, elements] int8 (8 bits) or uint8 0..15 (4 bits)
    scale: np.ndarray  # [n_blocks, groups] fp32
    minimum: np.ndarray | None
    bits: int
    group: int


def _f16(raw: np.ndarray) -> np.ndarray:
    """Little-endian fp16 bytes [n, 2] -> fp32 [n, 1]."""
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, width: int) -> np.ndarray:
    """Bytes [n, width] -> [n, 2 * width]: the low nibbles of each run of ``width`` bytes, then the high ones."""
    n = qs.shape[0]
    runs = qs.reshape(n, -1, width)
    out = np.empty((n, runs.shape[1], 2, width), dtype=np.uint8)  # written in place: no shifted temporaries
    np.bitwise_and(runs, np.uint8(15), out=out[:, :, 0])
    np.right_shift(runs, np.uint8(4), out=out[:, :, 1])
    return out.reshape(n, -1)


def _high_bits(qh: np.ndarray, count: int) -> np.ndarray:
    """Bit i of the little-endian bytes ``qh`` [n, count / 8] for i < count -> [n, count] of 0/1."""
    return np.unpackbits(np.ascontiguousarray(qh), axis=1, bitorder="little")[:, :count]


def q4_0(b: np.ndarray) -> Blocks:
    d = _f16(b[:, :2])
    return Blocks(_nibbles(b[:, 2:18], 16), d, -8.0 * d, 4, 32)


def q4_1(b: np.ndarray) -> Blocks:
    return Blocks(_nibbles(b[:, 4:20], 16), _f16(b[:, :2]), _f16(b[:, 2:4]), 4, 32)


def q5_0(b: np.ndarray) -> Blocks:
    q = _nibbles(b[:, 6:22], 16) | (_high_bits(b[:, 2:6], 32) << np.uint8(4))
    return Blocks(q.astype(np.int8) - np.int8(16), _f16(b[:, :2]), None, 8, 32)


def q5_1(b: np.ndarray) -> Blocks:
    q = _nibbles(b[:, 8:24], 16) | (_high_bits(b[:, 4:8], 32) << np.uint8(4))
    return Blocks(q.astype(np.int8), _f16(b[:, :2]), _f16(b[:, 2:4]), 8, 32)


def q8_0(b: np.ndarray) -> Blocks:
    return Blocks(np.ascontiguousarray(b[:, 2:34]).view(np.int8), _f16(b[:, :2]), None, 8, 32)


def q2_k(b: np.ndarray) -> Blocks:
    n = b.shape[0]
    scales, qs = b[:, :16], b[:, 16:80]
    d, dmin = _f16(b[:, 80:82]), _f16(b[:, 82:84])
    q = (qs.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & np.uint8(3)
    return Blocks(q.reshape(n, QK_K), d * (scales & 15).astype(np.float32),
                  -(dmin * (scales >> 4).astype(np.float32)), 4, 16)


def q3_k(b: np.ndarray) -> Blocks:
    n = b.shape[0]
    hmask, qs, packed, d = b[:, :32], b[:, 32:96], b[:, 96:108], _f16(b[:, 108:110])
    low = (packed[:, :8].reshape(n, 1, 8) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)).reshape(n, 16)
    high = (packed[:, 8:].reshape(n, 1, 4) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 4, 1)).reshape(n, 16)
    sc = ((low & 15) | ((high & 3) << 4)).astype(np.int8) - np.int8(32)
    ql = (qs.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & np.uint8(3)
    hb = (hmask.reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & np.uint8(1)
    # the stored value is ql - 4 where the high bit is clear: q' = ql + 4 * bit holds it plus 4, in 0..7
    q = ql.reshape(n, QK_K) + (hb.reshape(n, QK_K) << np.uint8(2))
    scale = d * sc.astype(np.float32)
    return Blocks(q, scale, -4.0 * scale, 4, 16)


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's twelve bytes of 6-bit scales and minimums -> ([n, 8], [n, 8])."""
    n = packed.shape[0]
    s = packed.reshape(n, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 63, (md & 15) | ((d >> 2) & 48)], axis=1)
    mn = np.concatenate([m & 63, (md >> 4) | ((m >> 2) & 48)], axis=1)
    return sc.astype(np.float32), mn.astype(np.float32)


def q4_k(b: np.ndarray) -> Blocks:
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _k_scales(b[:, 4:16])
    return Blocks(_nibbles(b[:, 16:144], 32), d * sc, -(dmin * mn), 4, 32)


def q5_k(b: np.ndarray) -> Blocks:
    n = b.shape[0]
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _k_scales(b[:, 4:16])
    qh, qs = b[:, 16:48], b[:, 48:176]
    hb = (qh.reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & np.uint8(1)
    q = _nibbles(qs, 32) | (hb.reshape(n, QK_K) << np.uint8(4))
    return Blocks(q.astype(np.int8), d * sc, -(dmin * mn), 8, 32)


def q6_k(b: np.ndarray) -> Blocks:
    n = b.shape[0]
    ql, qh, scales, d = b[:, :128], b[:, 128:192], b[:, 192:208], _f16(b[:, 208:210])
    low = _nibbles(ql, 64).reshape(n, 2, 4, 32)  # per half of 128: four runs of 32
    high = ((qh.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & np.uint8(3))
    q = (low | (high << np.uint8(4))).reshape(n, QK_K).astype(np.int8) - np.int8(32)
    return Blocks(q, d * np.ascontiguousarray(scales).view(np.int8).astype(np.float32), None, 8, 16)


# GGMLQuantizationType value -> reader (names and block sizes: gguf_plan.GGML_TYPES)
READERS: dict[int, Callable[[np.ndarray], Blocks]] = {
    2: q4_0, 3: q4_1, 6: q5_0, 7: q5_1, 8: q8_0, 10: q2_k, 11: q3_k, 12: q4_k, 13: q5_k, 14: q6_k,
}


def read_blocks(type_id: int, raw: np.ndarray, rows: int, cols: int) -> Blocks:
    """A tensor's bytes (as stored: [rows, row bytes] or flat) -> its integers [rows, cols], scales and
    minimums [rows, cols / group]. Raises ValueError for a type it does not read or bytes of the wrong size."""
    if type_id not in READERS:
        raise ValueError(f"quantization type {type_id} is not read here")
    name, per_block, size, *_ = GGML_TYPES[type_id]
    reader = READERS[type_id]
    if cols % per_block:
        raise ValueError(f"{name} rows of {cols} elements are not whole blocks of {per_block}")
    n_blocks = rows * cols // per_block
    flat = np.ascontiguousarray(raw).reshape(-1)
    if flat.size != n_blocks * size:
        raise ValueError(f"{name} tensor of {rows}x{cols} needs {n_blocks * size} bytes, the file holds {flat.size}")
    blocks = reader(flat.view(np.uint8).reshape(n_blocks, size))
    groups = cols // blocks.group
    minimum = None if blocks.minimum is None else blocks.minimum.reshape(rows, groups)
    return Blocks(blocks.q.reshape(rows, cols), blocks.scale.reshape(rows, groups), minimum, blocks.bits, blocks.group)
