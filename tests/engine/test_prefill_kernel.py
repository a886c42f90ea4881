"""The native prefill attention kernel equals causal attention in float64, and the engine's attention uses it for
prompt chunks (fresh, after cached tokens, gathered from scattered blocks, windowed) with the same result as SDPA."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from handlers.engine.execution.forward.paged_attention import (
    CONTEXT_ATTR,
    KVPool,
    SeqSpan,
    StepContext,
    StepMetadata,
    paged_attention_forward,
)
from handlers.engine.execution.kernels.native import PagedKernels, load_kernels
from handlers.engine.planning.cpu import cpu_flags

# the kernel's vector width in floats: one AVX-512 register, else two AVX2 halves of 8
LANES = 16 if "avx512f" in cpu_flags() else 8


def causal_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, scale: float) -> torch.Tensor:
    """q [n, H, D] at the last n of the L key positions of k/v [Hkv, L, D] -> [n, H, D], in float64."""
    n, heads, _ = q.shape
    length = k.shape[1]
    g = heads // k.shape[0]
    kd, vd = k.double().repeat_interleave(g, 0), v.double().repeat_interleave(g, 0)
    s = q.double().transpose(0, 1) @ kd.transpose(1, 2) * scale  # [H, n, L]
    q_pos = torch.arange(length - n, length)[:, None]
    k_pos = torch.arange(length)[None, :]
    visible = k_pos <= q_pos
    if window:
        visible &= k_pos > q_pos - window
    return (torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1) @ vd).transpose(0, 1)


def kernels() -> PagedKernels:
    found = load_kernels()
    assert found is not None and found._prefill is not None  # a C compiler is part of the supported setup
    return found


# Head layouts (GQA groups of 1-12) and head sizes: multiples of four vectors (64, 128), one with a remainder of
# single vectors (80), and 24, a multiple of 8 but not of 16 (AVX2 runs it, AVX-512 declines).
@pytest.mark.parametrize(("heads", "kv_heads", "d"), [(9, 3, 64), (4, 4, 128), (12, 1, 80), (8, 2, 24)])
@pytest.mark.parametrize(("n", "length", "window"), [
    (1, 1, 0), (5, 5, 0), (100, 100, 0), (70, 300, 0), (200, 200, 37), (64, 130, 100), (257, 257, 0), (3, 700, 16),
])
def test_prefill_kernel_equals_causal_attention(heads: int, kv_heads: int, d: int, n: int, length: int,
                                                window: int) -> None:
    torch.manual_seed(n * 1000 + length)
    q = torch.randn(n, heads, d) * 2
    k, v = torch.randn(kv_heads, length, d), torch.randn(kv_heads, length, d)
    out = torch.full((n, heads, d), float("nan"))
    done = kernels().prefill(q, k, v, out, window, d ** -0.5)
    assert done == (d % LANES == 0)
    if done:
        err = (out.double() - causal_reference(q, k, v, window, d ** -0.5)).abs().max().item()
        assert err < 2e-5, err


def test_prefill_kernel_reads_strided_layouts_and_declines_what_it_cannot_take() -> None:
    torch.manual_seed(1)
    heads, kv_heads, d, n = 6, 2, 64, 90
    q = torch.randn(heads, n, d).transpose(0, 1)  # [n, H, D] with rows d apart: the model's transposed query
    pool_k, pool_v = torch.randn(kv_heads, 500, d), torch.randn(kv_heads, 500, d)
    k, v = pool_k[:, 300:400], pool_v[:, 300:400]  # a view into the pool, rows 100 into a head of 500
    out = torch.empty(1, n, heads, d)[0]
    assert kernels().prefill(q, k, v, out, 0, 0.1)
    assert (out.double() - causal_reference(q, k, v, 0, 0.1)).abs().max().item() < 2e-5
    assert not kernels().prefill(q.to(torch.bfloat16), k, v, out, 0, 0.1)  # fp32 only
    assert not kernels().prefill(q[:, :, ::2], k[:, :, ::2], v[:, :, ::2], out[:, :, ::2], 0, 0.1)  # D strided
    assert not kernels().prefill(q, k[:, :50], v[:, :50], out, 0, 0.1)  # fewer keys than queries


class _Layer(nn.Module):
    def __init__(self, context: StepContext) -> None:
        super().__init__()
        self.layer_idx = 0
        setattr(self, CONTEXT_ATTR, context)


@pytest.mark.parametrize("window", [0, 24])
def test_engine_attention_sends_prompt_chunks_to_the_kernel_with_sdpas_result(window: int,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """One step of three sequences: a fresh 37-token prompt (contiguous blocks), a 30-token chunk after 20 cached
    tokens in scattered blocks (gathered), and a decode row; the kernel path against SDPA's (no kernels)."""
    torch.manual_seed(2)
    heads, kv_heads, d, bs = 9, 3, 64, 16
    pool = KVPool(1, 64 * bs, kv_heads, d)
    pool.keys[0].normal_()
    pool.values[0].normal_()
    spans = (SeqSpan(0, 0, 37, (0, 1, 2)), SeqSpan(37, 20, 30, (10, 4, 30, 31)), SeqSpan(67, 25, 1, (50, 51)))
    slots = [s.block_table[p // bs] * bs + p % bs for s in spans for p in range(s.start, s.start + s.num_new)]
    q, key, value = torch.randn(1, heads, 68, d), torch.randn(1, kv_heads, 68, d), torch.randn(1, kv_heads, 68, d)
    impl = kernels()
    calls: list[int] = []
    kernel_prefill = impl.prefill

    def spy(*args: object) -> bool:
        done = kernel_prefill(*args)  # type: ignore[arg-type]
        calls.append(int(done))
        return done

    monkeypatch.setattr(impl, "prefill", spy)
    results = []
    for native in (impl, None):
        context = StepContext(StepMetadata(pool, torch.tensor(slots), spans, bs, native))
        out, _ = paged_attention_forward(_Layer(context), q, key, value, None, scaling=d ** -0.5,
                                         sliding_window=window or None)
        results.append(out)
    assert calls == [1, 1]  # both prompt chunks, in the kernel
    assert results[0].shape == results[1].shape == (1, 68, heads, d)
    assert (results[0] - results[1]).abs().max().item() < 2e-5
