"""The GPU decode kernel (``handlers.engine.execution.gpu.gpu_attention``), run by Triton's interpreter on CPU tensors:
the same arguments as the C kernel's test, the same float64 reference."""

from __future__ import annotations

import os

import pytest
import torch

from handlers.engine.execution.forward.paged_attention import KVPool, SeqSpan, StepMetadata
from handlers.engine.execution.gpu.gpu_attention import TritonPagedKernels
from tests.engine.test_kernels import reference


@pytest.fixture(autouse=True)
def _interpreted(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton")  # a test dependency (setup.cfg); CI=true fails a skip
    assert os.environ.get("TRITON_INTERPRET") == "1"  # tests/conftest.py: the kernel runs on CPU tensors
    from triton.runtime import interpreter

    # The interpreter holds a scalar as a one-element array and turns it into a loop bound with int(), which
    # NumPy 2 refuses for arrays of one dimension; .item() is what it means (compiled kernels are unaffected).
    original = interpreter._patch_lang_tensor

    def patch(tensor: object, scope: interpreter._LangPatchScope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", patch)


@pytest.mark.parametrize("matrix_units", [True, False], ids=["dot", "plain"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "window", "softcap", "with_sinks", "head_dim"), [
    (4, 4, 0, None, False, 16), (8, 2, 0, None, False, 16), (4, 1, 0, None, False, 16), (4, 2, 5, None, False, 16),
    (4, 2, 0, 3.0, False, 16), (4, 2, 7, None, True, 16), (6, 3, 0, 2.0, True, 16), (6, 2, 0, None, False, 24),
])
def test_triton_decode_equals_reference(dtype: torch.dtype, heads: int, kv_heads: int, window: int,
                                        softcap: float | None, with_sinks: bool, head_dim: int,
                                        matrix_units: bool) -> None:
    torch.manual_seed(0)
    d, bs = head_dim, 4
    pool = KVPool(1, 64 * bs, kv_heads, d, dtype)
    pool.keys[0].normal_()
    pool.values[0].normal_()
    # Three sequences with scattered blocks, one decode row each (contexts 1, 13 and 30), rows out of order.
    tables = [(7,), (3, 9, 1, 20), (40, 2, 33, 5, 6, 11, 12, 60)]
    lengths = [1, 13, 30]
    order = [2, 0, 1]  # query row of each sequence
    spans = tuple(SeqSpan(order[i], n - 1, 1, t) for i, (n, t) in enumerate(zip(lengths, tables, strict=True)))
    kernels = TritonPagedKernels(matrix_units)
    meta = StepMetadata(pool, torch.zeros(3, dtype=torch.long), spans, bs, kernels)  # type: ignore[arg-type]
    q = torch.randn(1, 3, heads, d).to(dtype).transpose(1, 2)  # [1, H, T, D], as transformers passes it
    sinks = torch.randn(heads) if with_sinks else None
    plan = meta.decode_plan(window)
    assert plan is not None and plan.rest == ()
    out = torch.full((1, 3, heads, d), float("nan"), dtype=dtype)
    assert kernels.decode(q, pool.keys[0], pool.values[0], out, plan.meta, plan.tables, bs, d ** -0.5, softcap, sinks)
    assert kernels.matrix_units == matrix_units  # the chosen kernel ran (no fallback)
    for i, (n, table) in enumerate(zip(lengths, tables, strict=True)):
        lo = max(0, n - window) if window else 0
        slots = [table[p // bs] * bs + p % bs for p in range(lo, n)]
        want = reference(q[0, :, order[i]].float(), pool.keys[0][:, slots].float(), pool.values[0][:, slots].float(),
                         softcap, sinks)
        tol = {"atol": 2e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
        torch.testing.assert_close(out[0, order[i]].double(), want, **tol)


def test_triton_decode_declines_a_block_size_it_cannot_tile() -> None:
    pool = KVPool(1, 24, 2, 16)
    meta = torch.zeros(1, 4, dtype=torch.int64)
    out = torch.empty(1, 1, 2, 16)
    assert not TritonPagedKernels().decode(torch.zeros(1, 2, 1, 16), pool.keys[0], pool.values[0], out, meta,
                                           torch.zeros(1, dtype=torch.int32), 3, 0.25, None, None)
