"""The int32-packed weights of compressed-tensors, GPTQ and AWQ checkpoints, unpacked into ``IntWeight``.

Design note (why straight into ``IntWeight``: the kernels already compute ``q * scale + minimum``; these formats
store ``(q - zero) * scale``, so ``minimum = -zero * scale`` holds them exactly, with no float weight ever made):
each reader takes one layer's tensors (read one at a time from the checkpoint by ``quant_ckpt_load``), checks their
shapes against the layer's, and returns its integers and fp32 tables. The three packings (little-endian words,
element i of a word at bits ``bits * i``):
  compressed-tensors  ``weight_packed`` [out, in * bits / 32], along the inputs, values stored + 2^(bits-1)
                      (signed integers made unsigned); ``weight_scale`` [out, groups]; ``weight_zero_point``
                      (asymmetric) signed, packed the same way along the OUTPUT channels [out * bits / 32, groups];
                      ``weight_shape`` the unpacked [out, in]. W = (q - zero) * scale.
  GPTQ                ``qweight`` [in / 8, out], along the inputs; ``qzeros`` [groups, out / 8] along the outputs,
                      stored minus one in the original format (``checkpoint_format`` gptq: read back by adding
                      0x11111111 to each word, as GPTQModel does); ``scales`` [groups, out];
                      ``g_idx`` [in] each input's group (checked to be in order: act-order is refused).
                      W = (q - zero) * scale.
  AWQ (GEMM)          ``qweight`` [in, out / 8] along the outputs, each word's eight in AWQ's order
                      (0, 2, 4, 6, 1, 3, 5, 7); ``qzeros`` [groups, out / 8] likewise; ``scales`` [groups, out].
                      W = (q - zero) * scale.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import numpy as np
import torch

from handlers.engine.execution.kernels.int_weights import IntWeight
from handlers.engine.planning.quant_config import CheckpointQuant, WeightScheme
from rollcore.errors import ConfigError

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the column each nibble of an AWQ word holds, nibble 0 first
_AWQ_UNDO = tuple(AWQ_ORDER.index(c) for c in range(8))  # the nibble that holds column c


class CheckpointTensorError(ConfigError):
    """A quantized checkpoint's tensor is missing or of a shape its layer does not have; names the file and tensor."""


# (tensor name) -> the tensor, or None when the checkpoint has no such tensor; ``where(name)``: its file's name
Fetch = Callable[[str], "torch.Tensor | None"]


class LayerTensors:
    """One layer's tensors, fetched on demand, with errors that name the file and the tensor."""

    def __init__(self, prefix: str, fetch: Fetch, where: Callable[[str], str]) -> None:
        self.prefix, self._fetch, self._where = prefix, fetch, where

    def get(self, suffix: str, required: bool = True) -> torch.Tensor | None:
        name = f"{self.prefix}.{suffix}"
        tensor = self._fetch(name)
        if tensor is None and required:
            raise CheckpointTensorError(f"{self._where(name)}: tensor {name} is missing (a quantized layer needs it)")
        return tensor

    def where(self, suffix: str) -> str:
        """The name of the file holding this layer's tensor ``suffix`` (or where it would be)."""
        return self._where(f"{self.prefix}.{suffix}")

    def need(self, suffix: str) -> torch.Tensor:
        tensor = self.get(suffix)
        assert tensor is not None
        return tensor

    def check(self, suffix: str, tensor: torch.Tensor, shape: tuple[int, ...], what: str,
              dtype: torch.dtype | None = None) -> None:
        if tuple(tensor.shape) != shape or (dtype is not None and tensor.dtype != dtype):
            name = f"{self.prefix}.{suffix}"
            want = f"{dtype} ".replace("torch.", "") if dtype is not None else ""
            raise CheckpointTensorError(
                f"{self._where(name)}: tensor {name} is {str(tensor.dtype).replace('torch.', '')} "
                f"{list(tensor.shape)}, where {what} needs {want}{list(shape)}")


def unpack_rows(words: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """int32 words [rows, w] packed along each row (element i at bits ``bits * i``, little-endian) -> uint8
    [rows, count]: the unsigned values, the first ``count`` of each row."""
    if sys.byteorder != "little":
        raise ConfigError("int32-packed checkpoints are read on little-endian hosts only")
    raw = words.contiguous().view(torch.uint8).numpy()  # [rows, 4w]: a word's bytes low first
    if bits == 8:
        return torch.from_numpy(np.ascontiguousarray(raw[:, :count]))
    # numpy, not torch: torch's uint8 bitwise operations are many times slower on CPU builds
    nibbles = np.empty((raw.shape[0], raw.shape[1] * 2), dtype=np.uint8)
    np.bitwise_and(raw, 15, out=nibbles[:, 0::2])
    np.right_shift(raw, 4, out=nibbles[:, 1::2])
    return torch.from_numpy(np.ascontiguousarray(nibbles[:, :count]))


def _from_zero_points(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, scheme: WeightScheme,
                      in_features: int) -> IntWeight:
    """``W = (q - zero) * scale`` with ``q`` unsigned [out, in] (4 bits: 0..15; 8 bits: 0..255) and ``zero`` in
    the same unsigned range [out, groups] (None: symmetric, the middle of the range), as an ``IntWeight``."""
    scale = scale.float()
    group = scheme.group or in_features
    if scheme.bits == 8 and zero is None:
        signed = (q.to(torch.int16) - 128).to(torch.int8)
        if scheme.group == 0:
            return IntWeight(signed, 8, scale.reshape(-1).contiguous(), None, 0)
        return IntWeight(signed, 8, scale.contiguous(), None, group)
    if scheme.bits == 8:
        signed = (q.to(torch.int16) - 128).to(torch.int8)  # W = (s - (zero - 128)) * scale
        minimum = -(zero.float() - 128) * scale  # type: ignore[union-attr]
        return IntWeight(signed, 8, scale.contiguous(), minimum.contiguous(), group)
    zeros = torch.full_like(scale, 8.0) if zero is None else zero.float()
    return IntWeight(q.contiguous(), 4, scale.contiguous(), (-zeros * scale).contiguous(), group)


def read_compressed_tensors(t: LayerTensors, scheme: WeightScheme, out_features: int, in_features: int) -> IntWeight:
    """A compressed-tensors ``pack-quantized`` layer (see the module note)."""
    bits = scheme.bits
    groups = 1 if scheme.group == 0 else in_features // scheme.group
    if scheme.group and in_features % scheme.group:
        raise CheckpointTensorError(f"{t.where('weight_packed')}: {t.prefix}: group_size {scheme.group} does not "
                                    f"divide its {in_features} inputs")
    shape = t.get("weight_shape", required=False)
    if shape is not None and [int(v) for v in shape.reshape(-1).tolist()] != [out_features, in_features]:
        raise CheckpointTensorError(f"{t.where('weight_shape')}: tensor {t.prefix}.weight_shape is "
                                    f"{shape.tolist()}, the layer is [{out_features}, {in_features}]")
    packed = t.need("weight_packed")
    t.check("weight_packed", packed, (out_features, -(-in_features * bits // 32)),
            f"a {out_features}x{in_features} layer of {bits}-bit weights", torch.int32)
    scale = t.need("weight_scale")
    t.check("weight_scale", scale, (out_features, groups), f"{groups} group(s) per output channel")
    zero = None
    if not scheme.symmetric:
        packed_zero = t.need("weight_zero_point")
        t.check("weight_zero_point", packed_zero, (-(-out_features * bits // 32), groups),
                f"{bits}-bit zero points packed along {out_features} output channels", torch.int32)
        zero = unpack_rows(packed_zero.T, bits, out_features).T  # unsigned: the signed zero + 2^(bits-1)
    return _from_zero_points(unpack_rows(packed, bits, in_features), scale, zero, scheme, in_features)


def read_gptq(t: LayerTensors, scheme: WeightScheme, out_features: int, in_features: int,
              zeros_offset: int) -> IntWeight:
    """A GPTQ layer (see the module note); ``zeros_offset`` 1 for the original format's zeros stored minus one."""
    group = scheme.group or in_features
    if in_features % group or in_features % 8 or out_features % 8:
        raise CheckpointTensorError(f"{t.where('qweight')}: {t.prefix}: {out_features}x{in_features} does not "
                                    f"pack in GPTQ's words of 8 with groups of {group}")
    groups = in_features // group
    qweight, qzeros, scales = t.need("qweight"), t.need("qzeros"), t.need("scales")
    t.check("qweight", qweight, (in_features // 8, out_features), f"a {out_features}x{in_features} layer",
            torch.int32)
    t.check("qzeros", qzeros, (groups, out_features // 8), f"{groups} group(s) of {group} inputs", torch.int32)
    t.check("scales", scales, (groups, out_features), f"{groups} group(s) of {group} inputs")
    g_idx = t.get("g_idx", required=False)
    if g_idx is not None:
        t.check("g_idx", g_idx, (in_features,), "one group per input")
        if not torch.equal(g_idx.long(), torch.arange(in_features) // group):
            raise CheckpointTensorError(f"{t.where('g_idx')}: tensor {t.prefix}.g_idx orders the inputs out of "
                                        "their groups (act-order), which is not loaded")
    q = unpack_rows(qweight.T, 4, in_features)  # [out, in]
    if zeros_offset:
        # the original format's zeros, stored minus one: one added to every nibble as GPTQModel converts them, on
        # the whole word (0x11111111, carries included), so a zero of 0 stored as a borrow reads back as 0
        qzeros = ((qzeros.to(torch.int64) + 0x11111111 * zeros_offset) & 0xFFFFFFFF)
        qzeros = torch.where(qzeros >= 1 << 31, qzeros - (1 << 32), qzeros).to(torch.int32)
    zero = unpack_rows(qzeros, 4, out_features).T  # [out, groups]
    return _from_zero_points(q, scales.T, zero, WeightScheme(4, group, False), in_features)


def read_awq(t: LayerTensors, scheme: WeightScheme, out_features: int, in_features: int) -> IntWeight:
    """An AWQ GEMM layer (see the module note)."""
    group = scheme.group
    if in_features % group or out_features % 8:
        raise CheckpointTensorError(f"{t.where('qweight')}: {t.prefix}: {out_features}x{in_features} does not "
                                    f"pack in AWQ's words of 8 with groups of {group}")
    groups = in_features // group
    qweight, qzeros, scales = t.need("qweight"), t.need("qzeros"), t.need("scales")
    t.check("qweight", qweight, (in_features, out_features // 8), f"a {out_features}x{in_features} layer",
            torch.int32)
    t.check("qzeros", qzeros, (groups, out_features // 8), f"{groups} group(s) of {group} inputs", torch.int32)
    t.check("scales", scales, (groups, out_features), f"{groups} group(s) of {group} inputs")
    undo = torch.tensor(_AWQ_UNDO)

    def columns(words: torch.Tensor) -> torch.Tensor:  # [rows, out / 8] words -> [rows, out] in column order
        nibbles = unpack_rows(words, 4, out_features).view(words.shape[0], -1, 8)
        return nibbles[:, :, undo].reshape(words.shape[0], out_features)

    return _from_zero_points(columns(qweight).T, scales.T, columns(qzeros).T, WeightScheme(4, group, False),
                             in_features)


def read_layer(quant: CheckpointQuant, scheme: WeightScheme, t: LayerTensors, out_features: int,
               in_features: int) -> IntWeight:
    """One quantized layer of a checkpoint in ``quant``'s format."""
    if quant.method == "compressed-tensors":
        return read_compressed_tensors(t, scheme, out_features, in_features)
    if quant.method == "gptq":
        return read_gptq(t, scheme, out_features, in_features, quant.zeros_offset)
    return read_awq(t, scheme, out_features, in_features)
