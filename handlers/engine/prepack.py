"""oneDNN-prepacked linear layers: faster skinny matmuls on CPU (+19-55% per decode step at B >= 8 here;
benchmarks/README.md, run 3).

Design note: each ``nn.Linear`` weight is reordered once into oneDNN's blocked layout with the stock
``torch.ops.mkldnn._reorder_linear_weight`` and run with ``torch.ops.mkldnn._linear_pointwise`` (the
ops inductor emits with freezing). Numerics differ from ``F.linear`` only by summation order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Where hybrid mode switches to the plain weight. Measured on AVX2-only CPUs, inside the engine (a 110M Llama,
# weights streamed from memory every step, not a cache-resident microbenchmark): a decode step of 32 sequences
# took 16% less CPU with the packed weight than with the plain one on one thread (median of 3 alternating runs,
# 177 vs 211 ms), 35% less on two (99-109 vs 132-174 ms); a 2048-row prefill 7% more (5367 vs 4985 ms); 256
# rows equal. 128 keeps decode batches and small chunks packed, prefill chunks plain. (An earlier threshold of
# 16 rows, from a microbenchmark, sent batched decode to the slower plain weight.)
HYBRID_MAX_PACKED_ROWS = 128


class PackedLinear(nn.Module):
    """Inference-only drop-in for ``nn.Linear`` holding a oneDNN-packed weight.

    With ``max_packed_rows`` set (hybrid mode) it also keeps the plain weight and uses the packed one only
    for inputs of at most that many rows (decode steps), the plain one for larger inputs (prefill): twice
    the weight memory, the faster kernel for both shapes.
    """

    def __init__(self, linear: nn.Linear, batch_size_hint: int = 8, max_packed_rows: int | None = None) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), batch_size_hint)
        self.register_buffer("packed_weight", packed, persistent=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        self.max_packed_rows = max_packed_rows
        self.weight = None if max_packed_rows is None else nn.Parameter(linear.weight.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is not None and self.max_packed_rows is not None and \
                x.numel() > self.max_packed_rows * self.in_features:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


def can_prepack(model: nn.Module) -> bool:
    """True when oneDNN is usable and the model is on CPU in fp32, or in bf16 where oneDNN runs bf16."""
    p = next(model.parameters())
    if not torch.backends.mkldnn.is_available() or p.device.type != "cpu":
        return False
    return p.dtype == torch.float32 or (p.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def prepack_linear_layers(model: nn.Module, hybrid: bool = True) -> int:
    """Replace every ``nn.Linear`` of ``model`` with a ``PackedLinear`` in place; returns how many.
    ``hybrid`` keeps the plain weights too, for prefill-sized inputs (see ``PackedLinear``)."""
    if not can_prepack(model):
        return 0
    targets = [(name, m) for name, m in model.named_modules() if type(m) is nn.Linear]
    for name, linear in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, PackedLinear(linear, max_packed_rows=HYBRID_MAX_PACKED_ROWS if hybrid else None))
    return len(targets)
