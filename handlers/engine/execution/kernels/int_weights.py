"""Integer weights as ``csrc/quant_linear.c`` reads them: one form for every source of quantized weights.

Design note (why one form: the kernel stays one kernel, and a file's blocks load without going through fp32):
a weight [out, in] is integers ``q`` and, per group of ``group`` inputs and per output channel, a scale and an
optional minimum: ``W = q * scale (+ minimum)``. ``option.quantize`` makes this form from float weights
(``quantize.py``); a GGUF file's blocks already are it (``gguf_blocks.py``: Q4_0 is ``(q - 8) * d``, Q4_K is
``d * sc * q - dmin * m``, Q6_K is ``d * sc * (q - 32)``, ...), so they repack exactly, one tensor at a time.
  4 bits: q in 0..15, always grouped, always a minimum.
  8 bits: q in -128..127; grouped (scale, minimum optional) or per channel (``group`` 0, one scale per row).
``pack`` lays it out for the kernel: output channels in blocks of 16 (padded with zero rows), each block k-major;
4-bit bytes hold channel j in the low nibble and j + 8 in the high one; scales and minimums [blocks, groups, 16].
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from handlers.engine.execution.kernels.native import shared_library

BLOCK = 16  # output channels per packed block (the kernel's NB)


@dataclass(frozen=True)
class IntWeight:
    """``q`` [out, in] (int8, or uint8 holding 0..15 for 4 bits), ``scale`` [out, in / group] fp32 ([out] when
    ``group`` is 0: int8 per channel), ``minimum`` like ``scale`` or None."""

    q: torch.Tensor
    bits: int
    scale: torch.Tensor
    minimum: torch.Tensor | None
    group: int

    def __post_init__(self) -> None:
        out, cols = self.q.shape
        if self.bits not in (4, 8) or (self.bits == 4 and (self.group <= 0 or self.minimum is None)):
            raise ValueError(f"{self.bits}-bit weights need a group and a minimum (group {self.group})")
        want = (out,) if self.group == 0 else (out, cols // self.group if cols % self.group == 0 else -1)
        for name, t in (("scale", self.scale), ("minimum", self.minimum)):
            if t is not None and tuple(t.shape) != want:
                raise ValueError(f"{name} of shape {tuple(t.shape)} for a weight of {out}x{cols} in groups of "
                                 f"{self.group or cols}")

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape[0], self.q.shape[1]

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight [out, in] this stands for."""
        q = self.q.float()
        if self.group == 0:
            return q * self.scale[:, None]
        w = q * self.scale.repeat_interleave(self.group, dim=1)
        if self.minimum is not None:
            w += self.minimum.repeat_interleave(self.group, dim=1)
        return w


@dataclass(frozen=True)
class Packed:
    """An ``IntWeight`` in the kernel's layout (see the module note)."""

    qweight: torch.Tensor  # uint8 [blocks, in, 16] (8 bits) or [blocks, in, 8] (4 bits)
    scale: torch.Tensor  # fp32 [blocks * 16] (per channel) or [blocks, groups, 16], fp16 where exact in it
    minimum: torch.Tensor | None
    bits: int
    group: int
    out_features: int
    in_features: int


def _pad_rows(t: torch.Tensor, rows: int, value: float = 0.0) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    pad = torch.full((rows - t.shape[0], *t.shape[1:]), value, dtype=t.dtype)
    return torch.cat([t, pad])


def _blocked(values: torch.Tensor) -> torch.Tensor:
    """[rows, cols] with rows a multiple of 16 -> [rows / 16, cols, 16], contiguous (k-major per block)."""
    if values.dtype in (torch.uint8, torch.int8):  # numpy's byte transpose: 20-40x torch's on this build
        arr = values.numpy().reshape(-1, BLOCK, values.shape[1]).transpose(0, 2, 1)
        return torch.from_numpy(np.ascontiguousarray(arr))
    return values.view(-1, BLOCK, values.shape[1]).transpose(1, 2).contiguous()


def pack(weight: IntWeight, half_scales: bool = False) -> Packed:
    """``weight`` in the kernel's layout (a copy; the caller may drop ``weight``). Grouped tables are fp16 where
    that holds them exactly, or always with ``half_scales`` (rounded: at most 2^-11 of a scale)."""
    out, cols = weight.shape
    rows = -(-out // BLOCK) * BLOCK
    q = _packed_bytes(_pad_rows(weight.q, rows).contiguous().view(torch.uint8), weight.bits)
    if weight.group == 0:
        scale, minimum = _pad_rows(weight.scale.float(), rows, 1.0).contiguous(), None
    else:
        scale = _blocked(_pad_rows(weight.scale.float(), rows, 1.0))
        minimum = None if weight.minimum is None else _blocked(_pad_rows(weight.minimum.float(), rows))
        # a file's own fp16 scales (Q4_0's d and -8d, Q4_1's d and m, Q8_0's d...) kept in fp16: exactly the same
        # values in half the bytes (at 32 inputs a group, fp32 scale and minimum cost 2 bits a weight); a K-quant's
        # (products of two scales) rounded when the caller asks
        if all(t is None or (_fits_half(t) if half_scales else _exact_in_half(t)) for t in (scale, minimum)):
            scale = scale.half()
            minimum = None if minimum is None else minimum.half()
    return Packed(q, scale, minimum, weight.bits, weight.group, out, cols)


def _packed_bytes(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Bytes [rows, cols] (rows a multiple of 16) in the kernel's blocks: [rows / 16, cols, 16] (8 bits) or
    [rows / 16, cols, 8], channel j's nibble low and j + 8's high (4 bits). ``csrc/pack_blocks.c`` where it builds;
    numpy otherwise (the same bytes, one at a time: most of a 7B file's load)."""
    fn = _pack_kernel()
    if fn is None:
        blocked = _blocked(q)
        if bits == 8:
            return blocked
        nibbles = blocked.numpy()  # numpy's byte operations: torch's uint8 ones are many times slower
        return torch.from_numpy(np.ascontiguousarray(nibbles[..., :8] | (nibbles[..., 8:] << 4)))
    rows, cols = q.shape
    out = torch.empty(rows // BLOCK, cols, BLOCK if bits == 8 else BLOCK // 2, dtype=torch.uint8)
    fn(q.data_ptr(), rows, cols, bits, out.data_ptr(), torch.get_num_threads())
    return out


@lru_cache(maxsize=1)
def _pack_kernel() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    lib = shared_library("pack_blocks.c", "weights are packed by numpy (slower loads)")
    if lib is None:
        return None
    fn = lib.rollserve_pack_blocks
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    return fn


def _fits_half(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t.half()).all())


def _exact_in_half(t: torch.Tensor) -> bool:
    half = t.half()
    return bool(torch.isfinite(half).all()) and torch.equal(half.float(), t)


def unpack_rows(packed: Packed, rows: torch.Tensor) -> torch.Tensor:
    """The fp32 weight rows (output channels) ``rows`` [n] -> [n, in], read from the packed layout: what an
    embedding table kept in this form looks up."""
    block, lane = rows // BLOCK, rows % BLOCK
    if packed.bits == 8:
        q = packed.qweight.view(torch.int8)[block, :, lane].float()  # [n, in]
    else:
        byte = packed.qweight[block, :, lane % 8]  # [n, in]
        q = torch.where((lane < 8)[:, None], byte & 15, byte >> 4).float()
    if packed.group == 0:
        return q * packed.scale[rows][:, None]
    w = q * packed.scale[block, :, lane].float().repeat_interleave(packed.group, dim=1)
    if packed.minimum is not None:
        w += packed.minimum[block, :, lane].float().repeat_interleave(packed.group, dim=1)
    return w


def quantize_int8(weight: torch.Tensor) -> IntWeight:
    """Symmetric int8, one scale per output channel (``scale = max|w| / 127``)."""
    scale = weight.abs().amax(dim=1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(weight / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return IntWeight(q, 8, scale.contiguous(), None, 0)


def quantize_int4(weight: torch.Tensor, group: int) -> IntWeight:
    """Asymmetric int4 per group of ``group`` inputs (llama.cpp's Q4_1 form: ``q * scale + min``, q in 0..15)."""
    rows, cols = weight.shape
    grouped = weight.view(rows, cols // group, group)
    minimum, maximum = grouped.amin(dim=2), grouped.amax(dim=2)
    scale = (maximum - minimum) / 15.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((grouped - minimum[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.uint8).view(rows, cols)
    return IntWeight(q, 4, scale, minimum, group)
