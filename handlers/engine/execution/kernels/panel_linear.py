"""The panel kernel (``csrc/panel_linear.c``): fp32 linear layers for the few rows of a decode step, with the weight
laid out once at load so that a step streams it from memory in order.

Design note: oneDNN's packed weight and MKL's GEMM are built for large inputs; at 1-64 rows a step is bound by
reading the weight, and their blocking costs more than that read (benchmarks/HISTORY.md, "A linear kernel for
decode steps"). Which rows a layer runs here is measured with the other two kernels (``linear_choice``), so a CPU
where it loses never uses it. Each output is one chain of FMAs over the input in order, whatever the batch, so a
sequence's logits do not depend on its batch-mates on this path.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from functools import lru_cache

import torch
from torch import nn

from handlers.engine.execution.kernels.native import shared_library

_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p


class PanelKernel:
    """The C entry point and the panel width it was built for (output channels per panel)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.width = int(lib.rollserve_panel_width())
        self._linear = lib.rollserve_panel_linear
        self._linear.restype = ctypes.c_int
        self._linear.argtypes = [_PTR, _I64, _I64, _I64, _PTR, _PTR, _PTR, _I64, _I64, ctypes.c_int]

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` [N, K] as panels [ceil(N / width), K, width]: channel ``p * width + j`` at ``[p, :, j]``, the
        padding channels zero."""
        n, k = weight.shape
        padded = weight.new_zeros(-(-n // self.width) * self.width, k)
        padded[:n] = weight.detach()
        return padded.view(-1, self.width, k).transpose(1, 2).contiguous()

    def pad_bias(self, bias: torch.Tensor) -> torch.Tensor:
        """The bias padded with zeros to whole panels (the kernel reads a panel's bias as whole vectors)."""
        out = bias.new_zeros(-(-bias.numel() // self.width) * self.width)
        out[:bias.numel()] = bias.detach()
        return out

    def __call__(self, x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, out_features: int
                 ) -> torch.Tensor:
        """``x`` [M, K] (rows of contiguous columns) times the packed weight, plus the padded bias: [M, N]."""
        y = torch.empty(x.shape[0], out_features, dtype=x.dtype, device=x.device)
        ldx = x.stride(0) if x.shape[0] > 1 else x.shape[1]  # one row's stride is never read (and may be anything)
        status = self._linear(x.data_ptr(), ldx, x.shape[0], x.shape[1], panels.data_ptr(),
                              None if bias is None else bias.data_ptr(), y.data_ptr(), y.stride(0), out_features,
                              torch.get_num_threads())
        if status:
            raise RuntimeError(f"panel kernel refused a {tuple(x.shape)} input for {out_features} outputs")
        return y


@lru_cache(maxsize=1)
def load_panel_kernel() -> PanelKernel | None:
    """The panel kernel, built at first use; None where it cannot be built (the other kernels run every row)."""
    lib = shared_library("panel_linear.c", "the linear layers use oneDNN and MKL only")
    return None if lib is None else PanelKernel(lib)


def takes(linear: nn.Linear) -> bool:
    """Whether the panel kernel can run ``linear``: fp32 weights on the CPU."""
    return linear.weight.dtype == torch.float32 and linear.weight.device.type == "cpu"


class PanelLinear(nn.Module):
    """Inference-only drop-in for ``nn.Linear`` running the rows ``router`` picks (all, without ``rest``) on the
    panel kernel and the others on ``rest`` (the layer as it was: plain or oneDNN-packed)."""

    def __init__(self, linear: nn.Linear, kernel: PanelKernel, rest: nn.Module | None = None,
                 router: Callable[[int], bool] | None = None) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.kernel = kernel
        self.register_buffer("panels", kernel.pack(linear.weight), persistent=False)
        self.register_buffer("panel_bias", None if linear.bias is None else kernel.pad_bias(linear.bias),
                             persistent=False)
        self.rest = rest
        self.router = router

    def runs_panel(self, rows: int) -> bool:
        return self.rest is None or self.router is None or self.router(rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if not self.runs_panel(rows):
            assert self.rest is not None
            return self.rest(x)
        flat = x.reshape(rows, self.in_features)
        if x.dtype != torch.float32:
            raise TypeError(f"the panel kernel computes in float32, got a {x.dtype} input")
        if flat.stride(-1) != 1 or (rows > 1 and flat.stride(0) < self.in_features):
            flat = flat.contiguous()
        y = self.kernel(flat, self.panels, self.panel_bias, self.out_features)
        return y.reshape(*x.shape[:-1], self.out_features)
