"""The panel kernel (``csrc/panel_linear.c`` through ``handlers.engine.execution.kernels.panel_linear``): fp32 linear
layers on a weight laid out in panels, against a float64 reference, at every row count around its tile sizes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from handlers.engine.execution.kernels.panel_linear import PanelLinear, load_panel_kernel


@pytest.fixture(scope="module")
def kernel():
    k = load_panel_kernel()
    assert k is not None, "the panel kernel did not build: a C compiler is part of the test environment"
    return k


def reference(x: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    bias = None if linear.bias is None else linear.bias.double()
    return F.linear(x.double(), linear.weight.double(), bias)


def close(got: torch.Tensor, want: torch.Tensor, k: int) -> None:
    # one fp32 chain of k FMAs against float64: a few ulps of the running sum's magnitude
    assert got.dtype == torch.float32 and got.shape == want.shape
    if want.numel():
        tol = 4e-7 * k ** 0.5 * max(1.0, want.abs().max().item())
        assert (got.double() - want).abs().max().item() <= tol


# widths around the panel (16 or 32 channels) and inputs of odd length
SHAPES = [(32, 64), (47, 33), (576, 192), (100, 7), (1, 5), (65, 129)]


@pytest.mark.parametrize("n_out,n_in", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_every_row_count_around_the_tiles_matches_the_reference(kernel, n_out: int, n_in: int, bias: bool) -> None:
    torch.manual_seed(n_out * 1000 + n_in)
    linear = nn.Linear(n_in, n_out, bias=bias)
    layer = PanelLinear(linear, kernel)
    with torch.no_grad():
        for rows in [0, 1, 2, 5, 6, 7, 11, 12, 13, 24, 25, 40]:
            x = torch.randn(rows, n_in)
            close(layer(x), reference(x, linear), n_in)


def test_leading_dimensions_strided_rows_and_single_rows_of_any_stride(kernel) -> None:
    torch.manual_seed(1)
    linear = nn.Linear(40, 70)
    layer = PanelLinear(linear, kernel)
    with torch.no_grad():
        x = torch.randn(3, 5, 40)
        out = layer(x)
        assert out.shape == (3, 5, 70)
        close(out.reshape(15, 70), reference(x.reshape(15, 40), linear), 40)
        wide = torch.randn(9, 100)
        rows = wide[:, 10:50]  # rows 100 floats apart
        close(layer(rows), reference(rows, linear), 40)
        columns = torch.randn(40, 9).t()  # columns not contiguous: copied first
        close(layer(columns), reference(columns, linear), 40)
        one = torch.randn(1, 40).as_strided((1, 40), (1, 1))  # one row whose stride says nothing
        close(layer(one), reference(one, linear), 40)


def test_a_rows_result_does_not_depend_on_its_batch_mates_or_the_threads(kernel) -> None:
    """Each output is one chain of FMAs over the input in order: the same bits at any batch and thread count."""
    torch.manual_seed(2)
    linear = nn.Linear(96, 80)
    layer = PanelLinear(linear, kernel)
    x = torch.randn(31, 96)
    threads = torch.get_num_threads()
    with torch.no_grad():
        alone = torch.cat([layer(x[i:i + 1]) for i in range(31)])
        try:
            for n in (1, 2):
                torch.set_num_threads(n)
                assert torch.equal(layer(x), alone)
                assert torch.equal(layer(x[:13]), alone[:13])
        finally:
            torch.set_num_threads(threads)


def test_routing_sends_the_other_rows_to_the_rest(kernel) -> None:
    torch.manual_seed(3)
    linear = nn.Linear(24, 48)
    seen: list[int] = []

    class Spy(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(x.shape[0])
            return linear(x)

    layer = PanelLinear(linear, kernel, rest=Spy(), router=lambda rows: rows <= 8)
    with torch.no_grad():
        for rows in (1, 8, 9, 30):
            x = torch.randn(rows, 24)
            close(layer(x), reference(x, linear), 24)
    assert seen == [9, 30]
    assert PanelLinear(linear, kernel).runs_panel(10_000)  # without a rest, every row count


def test_what_it_refuses(kernel) -> None:
    layer = PanelLinear(nn.Linear(8, 8), kernel)
    with pytest.raises(TypeError, match="float32"):
        layer(torch.randn(2, 8, dtype=torch.float64))
    x, panels = torch.randn(2, 8), layer.get_buffer("panels")
    y = torch.empty(2, 8)
    assert kernel._linear(x.data_ptr(), 4, 2, 8, panels.data_ptr(), None, y.data_ptr(), 8, 8, 1) == -1  # ldx < K
    assert kernel._linear(x.data_ptr(), 8, 2, 8, panels.data_ptr(), None, y.data_ptr(), 8, 0, 1) == -1  # N = 0


def test_the_layout_puts_each_channel_in_its_panel_and_pads_with_zeros(kernel) -> None:
    w = torch.arange(3 * 5, dtype=torch.float32).reshape(3, 5)
    panels = kernel.pack(w)
    assert panels.shape == (1, 5, kernel.width)
    assert torch.equal(panels[0, :, :3].t(), w) and not panels[0, :, 3:].any()
    assert torch.equal(kernel.pad_bias(torch.ones(3))[:4], torch.tensor([1.0, 1.0, 1.0, 0.0]))
