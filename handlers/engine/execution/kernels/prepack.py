"""oneDNN-prepacked linear layers: faster skinny matmuls on CPU (+19-55% per decode step at B >= 8 here;
benchmarks/HISTORY.md, run 3).

Design note: each ``nn.Linear`` weight is reordered once into oneDNN's blocked layout with the stock
``torch.ops.mkldnn._reorder_linear_weight`` and run with ``torch.ops.mkldnn._linear_pointwise`` (the
ops inductor emits with freezing). Numerics differ from ``F.linear`` only by summation order.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

# Hybrid mode keeps decode batches and small chunks on the packed weight, prefill chunks on the plain one: on
# AVX2-only CPUs packed wins from 2 to 128 rows inside the engine (benchmarks/HISTORY.md, "Prepacked weights").
HYBRID_MAX_PACKED_ROWS = 128
# One row is a matrix-vector product, which the plain weight (MKL's sgemv) runs faster than oneDNN's GEMM.
HYBRID_MIN_PACKED_ROWS = 2
# oneDNN JIT-compiles and caches one kernel per input shape, so a worker meeting new row counts grows for
# minutes: the packed path runs on a few row counts only (``packed_rows``: exact up to 32, the decode batches;
# rounded up beyond, the input zero-padded) whose kernels the runner builds at load (``warm_packed_kernels``),
# so the memory is taken once, up front.
EXACT_PACKED_ROWS = 32
KERNEL_BYTES = 576 * 1024  # the heap one cached kernel takes, whatever the weight (benchmarks/HISTORY.md)
# Prefill-sized inputs (more than HYBRID_MAX_PACKED_ROWS rows) run packed too when their kernel was built at
# load (``large_rows``: the engine's token budget per step) and rounding them up to their bucket pads at most
# 1/LARGE_MAX_PADDING of them; else the plain weight (benchmarks/HISTORY.md, "Prefill and the GEMM libraries").
LARGE_MAX_PADDING = 16


def packed_rows(rows: int) -> int:
    """The row count the packed kernel runs for an input of ``rows`` rows: exact up to 32, then rounded up to
    a multiple of 16 (to 128), of 64 (to 512), of 256 beyond. At most a third of the rows are padding; 38
    row counts cover 1..128 (50 cover 1..2048)."""
    if rows <= EXACT_PACKED_ROWS:
        return rows
    step = 16 if rows <= 128 else 64 if rows <= 512 else 256
    return -(-rows // step) * step


def packed_row_counts(max_rows: int = HYBRID_MAX_PACKED_ROWS) -> list[int]:
    """Every row count the packed path runs for inputs of 1..``max_rows`` rows."""
    return sorted({packed_rows(rows) for rows in range(1, max_rows + 1)})


def large_row_counts(large_rows: int) -> list[int]:
    """The row counts the packed path runs for prefill-sized inputs of up to ``large_rows`` rows: the buckets
    above HYBRID_MAX_PACKED_ROWS that fit in ``large_rows`` (12 up to 2048)."""
    return [r for r in packed_row_counts(large_rows) if r > HYBRID_MAX_PACKED_ROWS]


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
        self.large_rows = 0  # set by warm_packed_kernels: prefill-sized inputs whose kernels were built
        self.weight = None if max_packed_rows is None else nn.Parameter(linear.weight.detach(), requires_grad=False)
        # hybrid only: which row counts run packed, as measured on this CPU (``linear_choice``); None: the fixed rule
        self.router: Callable[[int], bool] | None = None
        # the row counts another kernel takes before this layer sees them (``PanelLinear``): none built for them
        self.taken: Callable[[int], bool] | None = None

    def runs_packed(self, rows: int) -> bool:
        """Whether an input of ``rows`` rows runs on the packed weight (always, unless hybrid)."""
        if self.weight is None or self.max_packed_rows is None:
            return True
        if self.router is not None:
            if not self.router(rows):
                return False
        elif rows < HYBRID_MIN_PACKED_ROWS:
            return False
        if rows <= self.max_packed_rows:
            return True
        run_rows = packed_rows(rows)
        return run_rows <= self.large_rows and (run_rows - rows) * LARGE_MAX_PADDING <= rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if self.weight is not None and not self.runs_packed(rows):
            return F.linear(x, self.weight, self.bias)
        run_rows = packed_rows(rows)
        if run_rows == rows:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
        padded = x.new_zeros(run_rows, self.in_features)
        padded[:rows] = x.reshape(rows, self.in_features)
        out = torch.ops.mkldnn._linear_pointwise(padded, self.packed_weight, self.bias, "none", [], "")
        return out[:rows].reshape(*x.shape[:-1], self.out_features)

    def shape_key(self) -> tuple[int, int, bool, torch.dtype]:
        """What a oneDNN kernel is built for, besides the row count."""
        packed = self.get_buffer("packed_weight")
        return self.in_features, self.out_features, self.bias is not None, packed.dtype


def warm_packed_kernels(model: nn.Module, max_rows: int = HYBRID_MAX_PACKED_ROWS, large_rows: int = 0,
                        large_skip: tuple[nn.Module, ...] = ()) -> int:
    """Build oneDNN's kernel for every packed row count up to ``max_rows`` (``packed_row_counts``) and every
    distinct weight shape of ``model``, so the worker's memory does not grow with traffic; returns how many.
    Costs one matmul per kernel (about 0.4 s for a 110M model on one core). With ``large_rows`` (the token
    budget of a step), also the prefill-sized buckets up to it (``large_row_counts``) for every layer but
    ``large_skip`` (the lm_head, which sees the sampled rows only), and lets hybrid layers run them packed
    (about 2 s more for a 110M model and a 2048-token budget)."""
    shapes: dict[tuple[int, int, bool, torch.dtype, int], PackedLinear] = {}  # + the rows it leaves to another
    large: dict[tuple[int, int, bool, torch.dtype, bool, int], PackedLinear] = {}  # packed-only kept apart
    skip = {id(m) for m in large_skip}
    for module in model.modules():
        if isinstance(module, PackedLinear):
            shapes.setdefault((*module.shape_key(), id(module.taken)), module)
            if large_rows and id(module) not in skip:
                module.large_rows = large_rows  # its forward now routes these buckets to the packed weight
                large.setdefault((*module.shape_key(), module.max_packed_rows is None, id(module.taken)), module)
    built = 0
    with torch.no_grad():
        for module, counts in [*((m, packed_row_counts(min(max_rows, m.max_packed_rows or max_rows)))
                                   for m in shapes.values()),
                               *((m, large_row_counts(large_rows)) for m in large.values())]:
            for rows in counts:
                if module.taken is None or not module.taken(rows):
                    module(torch.zeros(rows, module.in_features, dtype=module.get_buffer("packed_weight").dtype))
                    built += module.runs_packed(rows)
    return built


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
        replace_module(model, name, PackedLinear(linear, max_packed_rows=HYBRID_MAX_PACKED_ROWS if hybrid else None))
    return len(targets)


def replace_module(model: nn.Module, name: str, module: nn.Module) -> None:
    """Put ``module`` where ``model.get_submodule(name)`` is."""
    parent_name, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, attr, module)
