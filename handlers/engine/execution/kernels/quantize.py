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
``torch._int_mm`` were measured many times slower than the fp32 GEMM on an AVX2 CPU (benchmarks/HISTORY.md,
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

from handlers.engine.execution.kernels.int_weights import (
    IntWeight,
    Packed,
    pack,
    quantize_int4,
    quantize_int8,
    unpack_rows,
)
from handlers.engine.execution.kernels.native import shared_library
from handlers.engine.execution.kernels.prepack import replace_module
from handlers.engine.planning.engine_config import EngineConfig
from rollcore.errors import ConfigError

logger = logging.getLogger(__name__)

QUANTIZE_MODES = ("int8", "int4")
ACTIVATION_PARTS = {"fp32": 0, "int8": 1, "int8x2": 2}  # int8 parts per input value (csrc/quant_dot.h)
_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p
# From this many weights in a model's quantized linear layers, a GGUF file's ``auto`` inputs are int8 (llama.cpp's
# own precision): there the integer work is most of every step, and int8x2's second part nearly halves batched
# throughput; below it, int8x2 keeps the answers those of the dequantized weights.
LARGE_MODEL_WEIGHTS = 1_000_000_000


def auto_activations(linear_weights: int) -> str:
    """What ``quantized_activations=auto`` means for a GGUF file whose quantized linear layers hold
    ``linear_weights`` weights."""
    return "int8" if linear_weights >= LARGE_MODEL_WEIGHTS else "int8x2"


@lru_cache(maxsize=1)
def _kernel() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    lib = shared_library("quant_linear.c", "option.quantize is refused")
    if lib is None:
        return None
    fn = lib.rollserve_quant_linear
    fn.restype = ctypes.c_int
    fn.argtypes = [_PTR, _I64, _I64, _I64, _PTR, ctypes.c_int, _PTR, _PTR, _I64, _PTR, _PTR, _I64, _I64, ctypes.c_int,
                   ctypes.c_int, ctypes.c_int]
    fn.int8_dot = lib.rollserve_quant_int8_dot
    fn.int8_dot.restype = ctypes.c_int
    fn.int8_dot.argtypes = [_I64, _I64]
    return fn


class QuantizedLinear(nn.Module):
    """``nn.Linear``'s forward over int8 or int4 weights (fp32 in, fp32 out), from an ``IntWeight``."""

    def __init__(self, weight: IntWeight, bias: torch.Tensor | None = None, activations: str = "fp32",
                 half_scales: bool = False) -> None:
        super().__init__()
        packed = pack(weight, half_scales)
        self.in_features, self.out_features = packed.in_features, packed.out_features
        self.bits, self.group_size = packed.bits, packed.group
        self.register_buffer("qweight", packed.qweight)
        self.register_buffer("scale", packed.scale)
        self.register_buffer("minimum", packed.minimum)
        bias = None if bias is None else bias.detach().float().contiguous()
        self.register_buffer("bias", bias)
        self._fn = _kernel()
        if self._fn is None:
            raise ConfigError("quantized weights need a C compiler to build their kernel (none worked here)")
        # the buffers never move (CPU, never reassigned): their addresses once, not six module lookups a call
        self._layer = (self.qweight.data_ptr(), self.bits, self.scale.data_ptr(),
                       None if self.minimum is None else self.minimum.data_ptr(), self.group_size,
                       None if bias is None else bias.data_ptr())
        self._half = int(self.scale.dtype == torch.float16)
        self.activations = "fp32"
        self.use_activations(activations)

    def use_activations(self, mode: str) -> str:
        """What the kernel multiplies (``csrc/quant_dot.h``): ``int8`` each input row quantized per 32 values (16
        where a weight group is 16) and integer dot products (llama.cpp's precision), ``int8x2`` the same with
        what int8 leaves quantized again
        (inputs to ~1e-5 of their largest value), ``fp32`` the inputs as they are times converted weights. The
        integer modes only where this CPU and layer allow them; returns the mode in effect."""
        if mode not in ACTIVATION_PARTS:
            raise ConfigError(f"quantized activations {mode!r}: one of {', '.join(ACTIVATION_PARTS)}")
        allowed = mode == "fp32" or self._fn.int8_dot(self.in_features, self.group_size)
        self.activations = mode if allowed else "fp32"
        self._parts = ACTIVATION_PARTS[self.activations]
        return self.activations

    @classmethod
    def from_linear(cls, linear: nn.Linear, bits: int, group_size: int) -> QuantizedLinear:
        """``linear`` quantized: int8 per output channel, or int4 in groups of ``group_size`` inputs."""
        weight = linear.weight.detach().float()
        return cls(quantize_int8(weight) if bits == 8 else quantize_int4(weight, group_size), linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise RuntimeError(f"input of {x.shape[-1]} features for a layer of {self.in_features}")
        if x.dim() != 2 or x.dtype != torch.float32 or not x.is_contiguous():  # the engine passes [T, in] rows
            rows = x.reshape(-1, self.in_features).float().contiguous()
            return self.forward(rows).view(*x.shape[:-1], self.out_features)
        m, k, n = x.shape[0], self.in_features, self.out_features
        out = torch.empty(m, n)
        if self._fn(x.data_ptr(), k, m, k, *self._layer, out.data_ptr(), n, n, torch.get_num_threads(),
                    self._parts, self._half) != 0:
            raise RuntimeError(f"the quantized linear kernel refused {m} rows of {k} inputs")
        return out

    def packed(self) -> Packed:
        return Packed(self.qweight, self.scale, self.minimum, self.bits, self.group_size, self.out_features,
                      self.in_features)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Weight rows ``ids`` as fp32 [len(ids), in]: an embedding table held in this layer's form."""
        return unpack_rows(self.packed(), ids.reshape(-1).long())

    def dequantized(self) -> torch.Tensor:
        """The weight this layer computes with, as fp32 [out, in] (for tests and quality checks)."""
        return self.rows(torch.arange(self.out_features))

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.group_size else ""
        x = f", {self.activations} activations" if self.activations != "fp32" else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, int{self.bits}{group}{x}"


class QuantizedEmbedding(nn.Module):
    """``nn.Embedding`` over a table kept quantized (a GGUF file's, or the tied output projection's): each lookup
    dequantizes only the rows asked for."""

    def __init__(self, table: QuantizedLinear) -> None:
        super().__init__()
        self.table = table
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table.rows(ids).view(*ids.shape, self.embedding_dim)


def quantize_linears(model: nn.Module, mode: str, group_size: int = 32, activations: str = "fp32") -> int:
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
        layer = QuantizedLinear.from_linear(linear, 8 if linear is head else bits, group_size)
        layer.use_activations(activations)
        replace_module(model, name, layer)
    return len(targets)


def check_layout(config: EngineConfig, device: torch.device) -> None:
    """Refuse, before anything loads, what ``option.quantize`` is not combined with."""
    if config.quantize not in QUANTIZE_MODES:
        return
    if config.tensor_parallel_degree > 1:
        raise ConfigError(f"option.quantize={config.quantize} is not combined with tensor parallelism "
                          f"(option.tensor_parallel_degree={config.tensor_parallel_degree})")
    if device.type != "cpu":
        raise ConfigError(f"option.quantize={config.quantize} runs on CPU workers only (this worker has {device})")


def quantize_model(model: nn.Module, config: EngineConfig) -> EngineConfig:
    """Quantize a loaded model's linear layers as ``config`` says; the config it then runs with (no oneDNN
    prepacking or fused projections: both apply to float linears only). Raises ``ConfigError`` naming why not."""
    n = quantize_linears(model, config.quantize, config.quantize_group_size,
                         float_checkpoint_activations(config.quantized_activations))
    group = f", groups of {config.quantize_group_size} inputs" if config.quantize == "int4" else ""
    logger.info("option.quantize=%s: %d linear layers quantized (weight-only%s); prepacking and fused projections "
                "off", config.quantize, n, group)
    return replace(config, prepack_weights="false", fuse_projections=False)


def float_checkpoint_activations(value: str) -> str:
    """``option.quantized_activations`` for ``option.quantize`` on a float checkpoint: ``auto`` keeps fp32 inputs
    (the layers compute exactly the dequantized model, as they always have)."""
    return "fp32" if value == "auto" else value
