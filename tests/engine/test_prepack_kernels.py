"""Packed linear layers: padded row counts give the unpadded result, and a worker's memory does not grow with
the row counts traffic brings (oneDNN caches one JIT kernel of ~0.55 MiB per input shape; issue 11's soak)."""

from __future__ import annotations

import ctypes
import ctypes.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from handlers.engine.engine import LLMEngine
from handlers.engine.prepack import (
    HYBRID_MAX_PACKED_ROWS,
    HYBRID_MIN_PACKED_ROWS,
    KERNEL_BYTES,
    PackedLinear,
    can_prepack,
    packed_row_counts,
    packed_rows,
)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def heap_bytes_in_use() -> int:
    """glibc's count of allocated bytes (heap + mmapped), which RSS follows while no memory is returned."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return int(info.uordblks + info.hblkhd)


def test_row_buckets() -> None:
    assert [packed_rows(r) for r in (1, 17, 32, 33, 48, 49, 128, 129, 512, 513, 2048)] == \
        [1, 17, 32, 48, 48, 64, 128, 192, 512, 768, 2048]
    counts = packed_row_counts(HYBRID_MAX_PACKED_ROWS)
    assert counts == [*range(1, 33), 48, 64, 80, 96, 112, 128]
    for rows in range(1, 2049):  # never more than a third padding
        assert rows <= packed_rows(rows) <= max(rows, rows * 3 // 2)


@pytest.mark.parametrize("hybrid", [True, False])
def test_padded_rows_give_the_unpadded_result(hybrid: bool) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(48, 40)
    assert can_prepack(nn.Sequential(linear))
    packed = PackedLinear(linear, max_packed_rows=HYBRID_MAX_PACKED_ROWS if hybrid else None)
    for shape in ((33, 48), (1, 37, 48), (2, 50, 48), (300, 48)):
        x = torch.randn(*shape)
        torch.testing.assert_close(packed(x), F.linear(x, linear.weight, linear.bias), rtol=1e-5, atol=1e-5)


def test_hybrid_routes_single_rows_and_prefill_to_the_plain_weight() -> None:
    """Hybrid mode: one row (a matrix-vector product) and more than HYBRID_MAX_PACKED_ROWS rows run on the plain
    weight, 2..HYBRID_MAX_PACKED_ROWS on the packed one. The packed copy is zeroed here, so its path returns
    the bias alone and each route is visible in the output."""
    torch.manual_seed(0)
    linear = nn.Linear(48, 40)
    packed = PackedLinear(linear, max_packed_rows=HYBRID_MAX_PACKED_ROWS)
    zero = torch.ops.mkldnn._reorder_linear_weight(torch.zeros_like(linear.weight), 8)
    packed.register_buffer("packed_weight", zero, persistent=False)
    with torch.no_grad():
        for rows in (1, HYBRID_MIN_PACKED_ROWS, HYBRID_MAX_PACKED_ROWS, HYBRID_MAX_PACKED_ROWS + 1):
            x = torch.randn(rows, 48)
            plain = rows < HYBRID_MIN_PACKED_ROWS or rows > HYBRID_MAX_PACKED_ROWS
            expected = F.linear(x, linear.weight, linear.bias) if plain else linear.bias.expand(rows, 40)
            torch.testing.assert_close(packed(x), expected, rtol=1e-5, atol=1e-5, msg=f"{rows} rows")


def test_engine_memory_does_not_grow_with_new_row_counts(model_dirs: dict[str, Path]) -> None:
    """After the engine is built, every row count 1..128 through every packed layer builds no new kernel."""
    engine = LLMEngine.from_options(model_dirs["llama"], {"num_kv_blocks": "64", "prepack_weights": "hybrid"})
    layers = [m for m in engine.model.modules() if isinstance(m, PackedLinear)]
    assert layers, "the engine prepacked nothing: the test would prove nothing"
    before = heap_bytes_in_use()
    with torch.no_grad():
        for rows in range(1, HYBRID_MAX_PACKED_ROWS + 1):
            for layer in {m.shape_key(): m for m in layers}.values():
                layer(torch.zeros(rows, layer.in_features))
    grown = heap_bytes_in_use() - before
    # Unwarmed, this loop builds ~5 shapes x 128 kernels x 0.55 MiB = ~350 MiB; allow a few stray allocations.
    assert grown < 4 * KERNEL_BYTES, f"heap grew {grown / 2**20:.1f} MiB: kernels were built after load"
