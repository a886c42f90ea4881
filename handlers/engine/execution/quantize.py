"""``option.quantize``: weight-only int8 / int4 linear layers on CPU workers.

Design note (why: a decode step at a small batch is bound by the bytes of weight it reads; int8 reads a quarter
of fp32's, int4 about a sixth with its scales): each ``nn.Linear`` (the decoder's and the LM head) becomes a
``QuantizedLinear`` whose weight is quantized once at load and packed for ``csrc/quant_linear.c``; activations
stay fp32, so every row is computed alike at any batch size (a request's tokens never depend on its
batch-mates, which PyTorch's dynamically quantized linear breaks: it quantizes activations per tensor).
  int8: symmetric, one scale per output channel (round(w / scale), scale = max|w| / 127).
  int4: asymmetric per group of ``group_size`` inputs (llama.cpp's Q4_1 form: q * scale + min, q in 0..15), so a
        Q4_1 GGUF file's blocks (32 inputs) come back on the same grid. The output projection stays int8.
PyTorch's own weight-only operators (``_weight_int8pack_mm``, ``_weight_int4pack_mm_for_cpu``) and
``torch._int_mm`` were measured many times slower than the fp32 GEMM on an AVX2 CPU (benchmarks/README.md,
"Quantized weights"), hence the C kernel. Tensor parallelism, GPUs, fused projections and oneDNN prepacking
are not combined with it (the engine refuses or skips them, naming why).
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import replace
from functools import lru_cache

import torch
from torch import nn

from handlers.engine.execution.kernels import shared_library
from handlers.engine.execution.prepack import replace_module
from handlers.engine.planning.config import EngineConfig
from rollcore.errors import ConfigError

logger = logging.getLogger(__name__)

QUANTIZE_MODES = ("int8", "int4")
BLOCK = 16  # output channels per packed block (the kernel's NB)
_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p


@lru_cache(maxsize=1)
def _kernel() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    lib = shared_library("quant_linear.c", "option.quantize is refused")
    if lib is None:
        return None
    fn = lib.rollserve_quant_linear
    fn.restype = ctypes.c_int
    fn.argtypes = [_PTR, _I64, _I64, _I64, _PTR, ctypes.c_int, _PTR, _PTR, _I64, _PTR, _PTR, _I64, _I64, ctypes.c_int]
    return fn


class QuantizedLinear(nn.Module):
    """``nn.Linear``'s forward over an int8 or int4 weight (fp32 in, fp32 out)."""

    def __init__(self, linear: nn.Linear, bits: int, group_size: int) -> None:
        super().__init__()
        weight = linear.weight.detach().float()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.bits, self.group_size = bits, group_size if bits == 4 else 0
        packed, scale, minimum = (_pack_int8(weight) if bits == 8 else _pack_int4(weight, group_size))
        self.register_buffer("qweight", packed)
        self.register_buffer("scale", scale)
        self.register_buffer("minimum", minimum)
        bias = None if linear.bias is None else linear.bias.detach().float().contiguous()
        self.register_buffer("bias", bias)
        self._fn = _kernel()
        # the buffers never move (CPU, never reassigned): their addresses once, not six module lookups a call
        self._layer = (self.qweight.data_ptr(), bits, scale.data_ptr(),
                       None if minimum is None else minimum.data_ptr(), self.group_size,
                       None if bias is None else bias.data_ptr())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise RuntimeError(f"input of {x.shape[-1]} features for a layer of {self.in_features}")
        if x.dim() != 2 or x.dtype != torch.float32 or not x.is_contiguous():  # the engine passes [T, in] rows
            rows = x.reshape(-1, self.in_features).float().contiguous()
            return self.forward(rows).view(*x.shape[:-1], self.out_features)
        m, k, n = x.shape[0], self.in_features, self.out_features
        out = torch.empty(m, n)
        if self._fn(x.data_ptr(), k, m, k, *self._layer, out.data_ptr(), n, n, torch.get_num_threads()) != 0:
            raise RuntimeError(f"the quantized linear kernel refused {m} rows of {k} inputs")
        return out

    def dequantized(self) -> torch.Tensor:
        """The weight this layer computes with, as fp32 [out, in] (for tests and quality checks)."""
        blocks = self.qweight.shape[0]
        if self.bits == 8:
            q = self.qweight.view(torch.int8).float()  # [blocks, in, 16]
            w = q * self.scale.view(blocks, 1, BLOCK)
        else:
            low, high = (self.qweight & 15).float(), (self.qweight >> 4).float()  # [blocks, in, 8] each
            q = torch.cat([low, high], dim=2)  # [blocks, in, 16]
            groups = self.in_features // self.group_size
            scale = self.scale.view(blocks, groups, 1, BLOCK).expand(blocks, groups, self.group_size, BLOCK)
            minimum = self.minimum.view(blocks, groups, 1, BLOCK).expand(blocks, groups, self.group_size, BLOCK)
            w = q * scale.reshape(blocks, self.in_features, BLOCK) + minimum.reshape(blocks, self.in_features, BLOCK)
        return w.transpose(1, 2).reshape(-1, self.in_features)[: self.out_features]

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.bits == 4 else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, int{self.bits}{group}"


def _padded(weight: torch.Tensor) -> torch.Tensor:
    rows = -(-weight.shape[0] // BLOCK) * BLOCK
    return torch.nn.functional.pad(weight, (0, 0, 0, rows - weight.shape[0]))


def _blocked(values: torch.Tensor) -> torch.Tensor:
    """[rows, cols] with rows a multiple of 16 -> [rows / 16, cols, 16], contiguous (k-major per block)."""
    return values.view(-1, BLOCK, values.shape[1]).transpose(1, 2).contiguous()


def _pack_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
    weight = _padded(weight)
    scale = weight.abs().amax(dim=1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(weight / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return _blocked(q).view(torch.uint8), scale.contiguous(), None


def _pack_int4(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    weight = _padded(weight)
    rows, cols = weight.shape
    grouped = weight.view(rows, cols // group, group)
    minimum, maximum = grouped.amin(dim=2), grouped.amax(dim=2)
    scale = (maximum - minimum) / 15.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((grouped - minimum[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.uint8).view(rows, cols)
    q = _blocked(q)  # [blocks, cols, 16]
    packed = (q[..., :8] | (q[..., 8:] << 4)).contiguous()
    return packed, _blocked(scale), _blocked(minimum)


def quantize_linears(model: nn.Module, mode: str, group_size: int = 32) -> int:
    """Replace ``model``'s ``nn.Linear`` layers in place by quantized ones; returns how many. Raises
    ``ConfigError`` naming what it does not take: a mode, a model off the CPU or not fp32, an input width
    int4's group size does not divide, or no C compiler for the kernel."""
    if mode not in QUANTIZE_MODES:
        raise ConfigError(f"option.quantize={mode} is not supported (supported: none, {', '.join(QUANTIZE_MODES)})")
    first = next(model.parameters())
    if first.device.type != "cpu":
        raise ConfigError(f"option.quantize={mode} runs on CPU workers only (this worker is on {first.device})")
    if first.dtype != torch.float32:
        raise ConfigError(f"option.quantize={mode} quantizes fp32 weights: set option.dtype=fp32")
    if _kernel() is None:
        raise ConfigError(f"option.quantize={mode} needs a C compiler to build its kernel (none worked here)")
    bits = 8 if mode == "int8" else 4
    targets = [(name, m) for name, m in model.named_modules() if type(m) is nn.Linear]
    # int4 keeps the output projection at int8, as llama.cpp's Q4 files do (its logits are the most sensitive:
    # int4 there cost SmolLM2 ~4% more perplexity, benchmarks/README.md "Quantized weights")
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if bits == 4:
        for name, m in targets:
            if m.in_features % group_size and m is not head:
                raise ConfigError(f"option.quantize_group_size={group_size} does not divide {name}'s "
                                 f"{m.in_features} inputs")
    for name, linear in targets:
        replace_module(model, name, QuantizedLinear(linear, 8 if linear is head else bits, group_size))
    return len(targets)


def check_layout(config: EngineConfig, device: torch.device) -> None:
    """Refuse, before anything loads, what ``option.quantize`` is not combined with."""
    if config.quantize == "none":
        return
    if config.tensor_parallel_degree > 1:
        raise ConfigError(f"option.quantize={config.quantize} is not combined with tensor parallelism "
                          f"(option.tensor_parallel_degree={config.tensor_parallel_degree})")
    if device.type != "cpu":
        raise ConfigError(f"option.quantize={config.quantize} runs on CPU workers only (this worker has {device})")


def quantize_model(model: nn.Module, config: EngineConfig) -> EngineConfig:
    """Quantize a loaded model's linear layers as ``config`` says; the config it then runs with (no oneDNN
    prepacking or fused projections: both apply to float linears only). Raises ``ConfigError`` naming why not."""
    n = quantize_linears(model, config.quantize, config.quantize_group_size)
    group = f", groups of {config.quantize_group_size} inputs" if config.quantize == "int4" else ""
    logger.info("option.quantize=%s: %d linear layers quantized (weight-only%s); prepacking and fused projections "
                "off", config.quantize, n, group)
    return replace(config, prepack_weights="false", fuse_projections=False)
