"""The fused element-wise kernels (``csrc/elementwise.c``) equal the torch operations they replace within float32
rounding, on strided rows, odd widths and extreme values."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from handlers.engine.execution.kernels.native import ElementwiseKernels, load_elementwise


def kernels() -> ElementwiseKernels:
    found = load_elementwise()
    assert found is not None  # a C compiler is part of the supported setup
    return found


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Within a few float32 roundings of the float64 result."""
    return bool(((got.double() - want).abs() <= 2e-6 * want.abs() + 1e-6).all())


def torch_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Llama RMSNorm in float64."""
    h = x.double()
    return weight.double() * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps))


# widths: a multiple of the vector width, one with a tail (37), the real model's 576; rows below and above the
# size where the kernels start a second thread
@pytest.mark.parametrize(("rows", "cols"), [(1, 64), (5, 37), (512, 576), (3, 1536)])
@pytest.mark.parametrize("threads", [1, 2])
def test_norms_and_residual_add(rows: int, cols: int, threads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    torch.manual_seed(rows + cols)
    wide = torch.randn(rows, cols + 9) * 3
    x = wide[:, 5:5 + cols]  # rows that are slices of a wider tensor
    weight = torch.rand(cols) + 0.5
    got = kernels().rms_norm(x, weight, 1e-5)
    assert got.is_contiguous()
    assert close(got, torch_norm(x, weight, 1e-5))

    residual = torch.randn(rows, cols)
    before = residual.clone()
    a = torch.randn(rows, cols + 3)[:, :cols]
    normed = kernels().add_rms_norm(a, residual, weight, 1e-5)
    assert torch.equal(residual, before + a)  # the add is torch's, bit for bit, in place
    assert close(normed, torch_norm(residual, weight, 1e-5))


@pytest.mark.parametrize(("rows", "cols"), [(1, 16), (4, 37), (64, 1536)])
def test_silu_times_up(rows: int, cols: int) -> None:
    torch.manual_seed(cols)
    both = torch.randn(rows, 2 * cols) * 4  # gate and up as the two halves of one projection's output
    both[0, :8] = torch.tensor([-1e4, -100.0, -88.5, -20.0, 0.0, 20.0, 100.0, 1e4])
    gate, up = both[:, :cols], both[:, cols:]
    got = kernels().silu_mul(gate, up)
    want = F.silu(gate.double()) * up.double()
    assert got.shape == (rows, cols)
    assert ((got.double() - want).abs() <= 1e-6 * want.abs() + 1e-30).all()


def test_layouts_it_does_not_read_get_torchs_operations() -> None:
    """A projection of another kind may hand over bf16, a 3-D or a transposed tensor: torch computes those."""
    ew = kernels()
    assert ew.takes(torch.zeros(3, 4), torch.zeros(4))
    assert not ew.takes(torch.zeros(3, 4, dtype=torch.bfloat16))
    assert not ew.takes(torch.zeros(4, 3).t())  # columns not contiguous
    torch.manual_seed(0)
    weight = torch.rand(8) + 0.5
    for x in (torch.randn(5, 8, dtype=torch.bfloat16), torch.randn(8, 5).t(), torch.randn(2, 5, 8)):
        assert torch.equal(ew.rms_norm(x, weight.to(x.dtype), 1e-5), F.rms_norm(x, (8,), weight.to(x.dtype), 1e-5))
        residual, a = torch.randn(x.shape).to(x.dtype), x
        want = residual + a
        assert torch.equal(ew.add_rms_norm(a, residual, weight.to(x.dtype), 1e-5),
                           F.rms_norm(want, (8,), weight.to(x.dtype), 1e-5))
        assert torch.equal(residual, want)
        assert torch.equal(ew.silu_mul(x, x), F.silu(x) * x)
