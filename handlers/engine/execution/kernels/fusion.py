"""Fused projections: Q/K/V, and gate/up, each as one matmul over the same input.

Design note (the idea: fewer, wider matmuls are faster for skinny batches on CPU): transformers'
Llama-family blocks call ``q_proj(x)``, ``k_proj(x)``, ``v_proj(x)`` (and ``gate_proj(x)``, ``up_proj(x)``) one
after another on the same tensor. Each group's weights are concatenated into one ``nn.Linear``; the first
member computes the wide product and every member returns its slice (a view), so the model's code runs
unchanged. Members after the first check that they receive the very same input object, and recompute
otherwise, so a caller that deviates from that order still gets correct results, only slower.
Apply after tensor-parallel sharding and before prepacking (the fused ``nn.Linear`` is then prepacked too).
"""

from __future__ import annotations

import torch
from torch import nn

_GROUPS = ((("q_proj", "k_proj", "v_proj"), "qkv_proj"), (("gate_proj", "up_proj"), "gate_up_proj"))


class FusedProjection(nn.Module):
    """One matmul for several projections of the same input; ``project(i, x)`` returns member i's slice."""

    def __init__(self, linears: list[nn.Linear]) -> None:
        super().__init__()
        first = linears[0]
        weight = torch.cat([m.weight.detach() for m in linears])
        has_bias = any(m.bias is not None for m in linears)
        self.linear = nn.Linear(first.in_features, weight.shape[0], bias=has_bias, dtype=weight.dtype,
                                device=weight.device)
        with torch.no_grad():
            self.linear.weight.copy_(weight)
            if has_bias:
                self.linear.bias.copy_(torch.cat([
                    m.bias.detach() if m.bias is not None else weight.new_zeros(m.out_features)
                    for m in linears]))
        self.linear.requires_grad_(False)
        self.sizes = [m.out_features for m in linears]
        self._input: torch.Tensor | None = None
        self._parts: tuple[torch.Tensor, ...] = ()

    def project(self, index: int, x: torch.Tensor) -> torch.Tensor:
        if index == 0 or x is not self._input:
            self._parts = torch.split(self.linear(x), self.sizes, dim=-1)
            self._input = x
        part = self._parts[index]
        if index == len(self.sizes) - 1:  # the group is done with this input: drop the references
            self._input, self._parts = None, ()
        return part


class ProjectionSlice(nn.Module):
    """Stands where one of the fused ``nn.Linear`` modules was; forwards to its group."""

    def __init__(self, group: FusedProjection, index: int) -> None:
        super().__init__()
        self._group = [group]  # a list, so the group is registered once (on the parent), not per member
        self.index = index
        self.out_features = group.sizes[index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._group[0].project(self.index, x)


def fuse_projections(model: nn.Module) -> int:
    """Fuse Q/K/V and gate/up in every block that has them as plain ``nn.Linear``; returns groups fused."""
    count = 0
    for module in list(model.modules()):
        for names, fused_name in _GROUPS:
            members = [getattr(module, n, None) for n in names]
            if not all(type(m) is nn.Linear for m in members):
                continue
            linears = [m for m in members if isinstance(m, nn.Linear)]
            if len({m.in_features for m in linears}) != 1:
                continue
            group = FusedProjection(linears)
            setattr(module, fused_name, group)
            for i, n in enumerate(names):
                setattr(module, n, ProjectionSlice(group, i))
            count += 1
    return count
