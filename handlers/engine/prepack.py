"""oneDNN-prepacked linear layers: faster skinny matmuls on CPU (see ENGINE-NOTES: +19-55% at B >= 8).

Design note: each ``nn.Linear`` weight is reordered once into oneDNN's blocked layout with the stock
``torch.ops.mkldnn._reorder_linear_weight`` and run with ``torch.ops.mkldnn._linear_pointwise`` (the
ops inductor emits with freezing). Numerics differ from ``F.linear`` only by summation order.
"""

from __future__ import annotations

import torch
from torch import nn


class PackedLinear(nn.Module):
    """Inference-only drop-in for ``nn.Linear`` holding a oneDNN-packed weight."""

    def __init__(self, linear: nn.Linear, batch_size_hint: int = 8) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), batch_size_hint)
        self.register_buffer("packed_weight", packed, persistent=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


def can_prepack(model: nn.Module) -> bool:
    """True when oneDNN is usable and the model is fp32 on CPU."""
    p = next(model.parameters())
    return bool(torch.backends.mkldnn.is_available()) and p.dtype == torch.float32 and p.device.type == "cpu"


def prepack_linear_layers(model: nn.Module) -> int:
    """Replace every ``nn.Linear`` of ``model`` with a ``PackedLinear`` in place; returns how many."""
    if not can_prepack(model):
        return 0
    targets = [(name, m) for name, m in model.named_modules() if type(m) is nn.Linear]
    for name, linear in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, PackedLinear(linear))
    return len(targets)
