"""A lean forward for Llama-structured decoders: the same modules and weights, a fraction of the Python.

Design note (why: on a small model or a small batch a step is mostly per-operation overhead, not arithmetic):
transformers' forward of a Llama-family model runs ~15 module calls and ~60 tensor operations per layer, plus
a mask builder, output-capturing decorators and keyword plumbing per step. ``LeanDecoder`` walks the same
decoder on flat [T, hidden] tensors: it calls the model's own projection modules (so prepacked, fused and
tensor-parallel linears work unchanged), the norms as transformers computes them (``F.rms_norm`` in fp32, bitwise
the same; transformers' own formula in half precision), the rotary tables of the model's own rotary module
(computed once per step), and the engine's paged attention. Every operation is the one transformers
runs, on the same values in the same order, so the logits are bitwise the same. ``unsupported``
names any structure it does not reproduce (it accepts Llama, and Mistral/Qwen2 without sliding windows); the runner
also compares its logits with transformers' on a probe step at load and keeps transformers' forward when
they differ by a single bit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from handlers.engine.execution.kernels.native import ElementwiseKernels, RotaryKernel, load_rotary

# Families whose decoder layer is Llama's: pre-norm RMSNorm, q/k/v/o projections, rotate-half rotary, gated
# SiLU MLP, residual adds. (Qwen2 adds a bias to q/k/v, which the projection modules carry.)
_FAMILIES = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"}
_NORMS = {"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm"}
_ACTS = {"SiLU", "SiLUActivation"}


@dataclass(frozen=True, slots=True)
class _Layer:
    attn: nn.Module
    in_norm: tuple[torch.Tensor, float]
    post_norm: tuple[torch.Tensor, float]
    q: nn.Module
    k: nn.Module
    v: nn.Module
    o: nn.Module
    gate: nn.Module
    up: nn.Module
    down: nn.Module
    scaling: float


# attention(module, query [1, H, T, D], key [1, Hkv, T, D], value, None, scaling=) -> ([1, T, H, D], None)
Attention = Callable[..., tuple[torch.Tensor, Any]]


def _whole(x: torch.Tensor) -> torch.Tensor:
    """A projection's output on an unsharded model: already the sum."""
    return x


def _rms_norm_fp32(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, x.shape[-1:], weight, eps)


def _rms_norm_upcast(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Llama RMSNorm for half-precision inputs: fp32 statistics, the weight applied after the cast
    back (``F.rms_norm`` keeps fp32 until after the weight, so its bf16 results differ)."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' ``apply_rotary_pos_emb`` for one tensor [T, heads, D] with cos/sin [T, 1, D]."""
    half = x.shape[-1] // 2
    return (x * cos) + (torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin)


def _rotate_in_c(kernel: RotaryKernel) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """``_rotate`` through the C kernel (one pass instead of five, bitwise the same), torch's where it declines."""
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        out = kernel.apply(x, cos, sin)
        return out if out is not None else _rotate(x, cos, sin)
    return rotate


class LeanDecoder:
    """``forward(input_ids [T], positions [T], keep [K])`` -> logits [K, vocab], as the model would give."""

    def __init__(self, model: nn.Module, attention: Attention) -> None:
        inner: Any = model.model
        self.embed = inner.embed_tokens
        self.rotary = inner.rotary_emb
        self.norm = (inner.norm.weight, float(inner.norm.variance_epsilon))
        self.lm_head = model.lm_head
        self.head_dim = int(inner.layers[0].self_attn.head_dim)
        self.attention = attention
        # the final norm's weight tells the activations' dtype and device (the embedding may be kept quantized)
        dtype = inner.norm.weight.dtype
        # F.rms_norm is bitwise transformers' fp32 norm on CPU only; elsewhere (and in half precision) transformers'
        # own formula is used, so the lean forward matches on every device
        on_cpu = inner.norm.weight.device.type == "cpu"
        self.rms_norm = _rms_norm_fp32 if dtype == torch.float32 and on_cpu else _rms_norm_upcast
        kernel = load_rotary() if dtype == torch.float32 and on_cpu else None
        self.rotate = _rotate if kernel is None else _rotate_in_c(kernel)
        self.fuses = dtype == torch.float32 and on_cpu  # where ``fused`` may be set
        self.fused: ElementwiseKernels | None = None  # set by the runner once the exact forward is checked
        # a tensor-parallel shard: the row-parallel projections' partial outputs summed over the ranks, where the
        # blocks' hooks sum them in transformers' forward (``handlers.engine.execution.parallel.sharding``)
        self.reduce: Callable[[torch.Tensor], torch.Tensor] = getattr(model, "rollserve_tp_reduce", _whole)
        self.layers = [
            _Layer(layer.self_attn, (layer.input_layernorm.weight, float(layer.input_layernorm.variance_epsilon)),
                   (layer.post_attention_layernorm.weight, float(layer.post_attention_layernorm.variance_epsilon)),
                   layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
                   layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj, float(layer.self_attn.scaling))
            for layer in inner.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)  # [T, hidden]
        cos, sin = self.rotary(x, positions[None])  # [1, T, D] each
        cos, sin = cos[0, :, None], sin[0, :, None]  # [T, 1, D]: broadcast over heads
        if self.fused is not None and self.fused.takes(x):
            return self._forward_fused(self.fused, x.contiguous(), cos, sin, keep)
        t = x.shape[0]
        for layer in self.layers:
            residual = x
            h = self.rms_norm(x, *layer.in_norm)
            x = residual + self.reduce(layer.o(self._attend(layer, h, cos, sin).reshape(t, -1)))
            residual = x
            h = self.rms_norm(x, *layer.post_norm)
            x = residual + self.reduce(layer.down(F.silu(layer.gate(h)) * layer.up(h)))
        x = self.rms_norm(x[keep], *self.norm)
        return self.lm_head(x)  # type: ignore[no-any-return,operator]

    def _attend(self, layer: _Layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The layer's attention of the normed input ``h`` [T, hidden]: [1, T, H, D]."""
        t, d = h.shape[0], self.head_dim
        q = self.rotate(layer.q(h).view(t, -1, d), cos, sin)
        k = self.rotate(layer.k(h).view(t, -1, d), cos, sin)
        v = layer.v(h).view(t, -1, d)
        out, _ = self.attention(layer.attn, q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                v.transpose(0, 1)[None], None, scaling=layer.scaling)
        return out

    def _forward_fused(self, ew: ElementwiseKernels, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       keep: torch.Tensor) -> torch.Tensor:
        """``forward`` with the element-wise steps in C: each residual add fused with the norm after it, and
        silu(gate) * up in one pass. ``x`` [T, hidden] fp32 contiguous (the residual stream, updated in place)."""
        t = x.shape[0]
        last = len(self.layers) - 1
        h = ew.rms_norm(x, *self.layers[0].in_norm)
        for i, layer in enumerate(self.layers):
            h = ew.add_rms_norm(self.reduce(layer.o(self._attend(layer, h, cos, sin).reshape(t, -1))), x,
                                *layer.post_norm)
            mlp = self.reduce(layer.down(ew.silu_mul(layer.gate(h), layer.up(h))))
            if i < last:
                h = ew.add_rms_norm(mlp, x, *self.layers[i + 1].in_norm)
            else:
                x += mlp
        return self.lm_head(ew.rms_norm(x[keep], *self.norm))  # type: ignore[no-any-return,operator]


def unsupported(model: nn.Module) -> str | None:
    """Why ``LeanDecoder`` cannot reproduce ``model``'s forward, or None when it can."""
    name = type(model).__name__
    if name not in _FAMILIES:
        return f"{name} is not a Llama-structured family"
    config: Any = getattr(model, "config", None)
    if getattr(config, "sliding_window", None) and (
            name == "MistralForCausalLM" or getattr(config, "use_sliding_window", False)):
        return "sliding-window attention"
    if any(t != "full_attention" for t in (getattr(config, "layer_types", None) or ())):
        return "layers other than full attention"
    inner: Any = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if inner is None or not layers or getattr(model, "lm_head", None) is None:
        return "no model.layers / lm_head"
    if type(inner.norm).__name__ not in _NORMS or getattr(config, "final_logit_softcapping", None):
        return "a final norm or logit processing of its own"
    for layer in layers:
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if any(type(n).__name__ not in _NORMS for n in norms):
            return f"norm {type(norms[0]).__name__}"
        attn, mlp = layer.self_attn, layer.mlp
        if any(hasattr(attn, a) for a in ("q_norm", "k_norm")):
            return "query/key norms"
        if type(getattr(mlp, "act_fn", None)).__name__ not in _ACTS:
            return f"activation {type(getattr(mlp, 'act_fn', None)).__name__}"
        if not all(hasattr(mlp, a) for a in ("gate_proj", "up_proj", "down_proj")):
            return "an MLP other than gate/up/down"
    return None
