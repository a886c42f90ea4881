"""The native paged decode kernel equals the PyTorch attention it replaces, and the engine works without it."""

from __future__ import annotations

import math
import os
from typing import Any

import pytest
import torch

from handlers.engine.execution.forward.paged_attention import KVPool, SeqSpan, StepMetadata, _attend
from handlers.engine.execution.kernels import native as kernels
from handlers.engine.execution.kernels.native import load_kernels


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softcap: float | None,
              sinks: torch.Tensor | None) -> torch.Tensor:
    """q [H, D], k/v [Hkv, L, D] -> [H, D], eager math in float64."""
    g = q.shape[0] // k.shape[0]
    k, v = k.double().repeat_interleave(g, 0), v.double().repeat_interleave(g, 0)
    s = torch.einsum("hd,hld->hl", q.double(), k) / math.sqrt(q.shape[1])
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    if sinks is not None:
        s = torch.cat([s, sinks.double()[:, None]], dim=1)
    p = torch.softmax(s, dim=1)[:, :k.shape[1]]
    return torch.einsum("hl,hld->hd", p, v)


def filled_pool(kv_heads: int, d: int, bs: int, dtype: torch.dtype, seed: int) -> tuple[kernels.PagedKernels, KVPool]:
    """The kernels and a 64-block pool of random keys and values."""
    torch.manual_seed(seed)
    k_impl = load_kernels()
    assert k_impl is not None
    pool = KVPool(1, 64 * bs, kv_heads, d, dtype)
    pool.keys[0].normal_()
    pool.values[0].normal_()
    return k_impl, pool


def test_kernel_builds_on_this_machine() -> None:
    assert load_kernels() is not None  # a C compiler is part of the supported setup (and CI's)


# Head sizes and block sizes that reach each of the kernel's paths: with AVX-512, keys 16 at a time in blocks of 4
# (partial), 16 and 32 (two per block), value rows with the accumulator in registers (64, 128), and the portable
# loops (a head size that is no multiple of 16).
@pytest.mark.parametrize(("d", "bs"), [(16, 4), (64, 16), (128, 32), (40, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "window", "softcap", "with_sinks"), [
    (4, 4, 0, None, False), (8, 2, 0, None, False), (4, 1, 0, None, False), (4, 2, 5, None, False),
    (4, 2, 0, 3.0, False), (4, 2, 7, None, True), (6, 3, 0, 2.0, True),
])
def test_decode_kernel_equals_reference(dtype: torch.dtype, heads: int, kv_heads: int, window: int,
                                        softcap: float | None, with_sinks: bool, d: int, bs: int) -> None:
    k_impl, pool = filled_pool(kv_heads, d, bs, dtype, seed=0)
    # Three sequences with scattered (non-contiguous) blocks, one decode row each, contexts 1, 13 and 30.
    tables = [(7,), (3, 9, 1, 20), (40, 2, 33, 5, 6, 11, 12, 60)]
    lengths = [1, 13, 30]
    spans = tuple(SeqSpan(i, n - 1, 1, t) for i, (n, t) in enumerate(zip(lengths, tables, strict=True)))
    meta = StepMetadata(pool, torch.zeros(3, dtype=torch.long), spans, bs, k_impl)
    q = torch.randn(1, 3, heads, d).to(dtype).transpose(1, 2)  # [1, H, T, D], as transformers passes it
    sinks = torch.randn(heads) if with_sinks else None
    plan = meta.decode_plan(window)
    assert plan is not None and plan.rest == ()
    out = torch.empty(1, 3, heads, d, dtype=dtype)
    assert k_impl.decode(q, pool.keys[0], pool.values[0], out, plan.meta, plan.tables, bs, d ** -0.5, softcap, sinks)
    for i, (n, table) in enumerate(zip(lengths, tables, strict=True)):
        lo = max(0, n - window) if window else 0
        slots = [table[p // bs] * bs + p % bs for p in range(lo, n)]
        want = reference(q[0, :, i].float(), pool.keys[0][:, slots].float(), pool.values[0][:, slots].float(), softcap,
                         sinks)
        tol = {"atol": 2e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}  # bf16 output
        torch.testing.assert_close(out[0, i].double(), want, **tol)
        if not softcap and sinks is None and dtype == torch.float32:  # the PyTorch path it replaces agrees
            view = meta.views(window)[i]
            torch_rows = _attend(q[:, :, i:i + 1], pool.keys[0], pool.values[0], view, d ** -0.5, False, None, None)
            torch.testing.assert_close(out[0, i], torch_rows[0, :, 0].float(), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize(("d", "bs"), [(16, 4), (64, 16), (128, 32), (40, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "window", "softcap", "with_sinks"), [
    (9, 3, 0, None, False), (8, 1, 0, None, False), (4, 2, 6, None, False), (6, 3, 0, 2.0, True),
])
def test_rows_with_guesses_equal_one_row_at_a_time(dtype: torch.dtype, heads: int, kv_heads: int, window: int,
                                                   softcap: float | None, with_sinks: bool, d: int, bs: int) -> None:
    """A decode row and its guesses (rows reading 1, 2, .. keys more) are one work item in the kernel, which reads
    each key once for all of them: every row's output is still exactly what it gets alone, and the reference's.
    Ten rows with eight query heads a KV head exceed one item's 64 queries (split into two items)."""
    k_impl, pool = filled_pool(kv_heads, d, bs, dtype, seed=1)
    tables = [(7, 8, 9, 10, 19, 21, 22, 23, 24, 25), (3, 9 + 30, 1, 20, 44, 45, 46, 47), (40, 2, 33, 5, 6, 11, 12, 60)]
    starts, rows = [5, 13, 1], [4, 10, 1]  # cached tokens before the rows, rows (a decode and its guesses)
    spans, q_start = [], 0
    for start, n, table in zip(starts, rows, tables, strict=True):
        spans.append(SeqSpan(q_start, start, n, table))
        q_start += n
    meta = StepMetadata(pool, torch.zeros(q_start, dtype=torch.long), tuple(spans), bs, k_impl)
    q = torch.randn(1, q_start, heads, d).to(dtype).transpose(1, 2)
    sinks = torch.randn(heads) if with_sinks else None
    plan = meta.decode_plan(window)
    assert plan is not None and plan.rest == () and plan.meta.shape[0] == q_start
    together = torch.empty(1, q_start, heads, d, dtype=dtype)
    assert k_impl.decode(q, pool.keys[0], pool.values[0], together, plan.meta, plan.tables, bs, d ** -0.5, softcap,
                         sinks)
    tol = {"atol": 2e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    for r in range(q_start):
        alone = torch.zeros(1, q_start, heads, d, dtype=dtype)
        assert k_impl.decode(q, pool.keys[0], pool.values[0], alone, plan.meta[r:r + 1].contiguous(), plan.tables, bs,
                             d ** -0.5, softcap, sinks)
        assert torch.equal(together[0, r], alone[0, r]), f"row {r}"
        row, lo, end, offset = plan.meta[r].tolist()
        table = plan.tables[offset:].tolist()
        slots = [table[p // bs] * bs + p % bs for p in range(lo, end)]
        want = reference(q[0, :, row].float(), pool.keys[0][:, slots].float(), pool.values[0][:, slots].float(),
                         softcap, sinks)
        torch.testing.assert_close(together[0, r].double(), want, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [3, 300])  # below and above the kernel's threshold for threads
def test_kv_write_kernel_equals_index_copy(dtype: torch.dtype, tokens: int) -> None:
    """The step's new keys and values land in the same slots, bit for bit, as with ``index_copy_``; the
    sources are strided views as transformers passes them ([1, Hkv, T, D] transposed from [1, T, Hkv, D])."""
    torch.manual_seed(0)
    k_impl = load_kernels()
    assert k_impl is not None
    kv_heads, d, slots_total = 3, 16, 1024
    pool, want = KVPool(1, slots_total, kv_heads, d, dtype), KVPool(1, slots_total, kv_heads, d, dtype)
    for x in (pool.keys[0], pool.values[0]):
        x.normal_()
    want.keys[0].copy_(pool.keys[0])
    want.values[0].copy_(pool.values[0])
    qkv = torch.randn(1, tokens, 3 * kv_heads * d).to(dtype)  # a fused projection's output, split as views
    key = qkv[..., kv_heads * d:2 * kv_heads * d].view(1, tokens, kv_heads, d).transpose(1, 2)
    value = qkv[..., 2 * kv_heads * d:].view(1, tokens, kv_heads, d).transpose(1, 2)
    assert not key[0].is_contiguous()
    slots = torch.randperm(slots_total)[:tokens]
    assert k_impl.write_kv(key[0], value[0], pool.keys[0], pool.values[0], slots)
    want.keys[0].index_copy_(1, slots, key[0])
    want.values[0].index_copy_(1, slots, value[0])
    assert torch.equal(pool.keys[0], want.keys[0]) and torch.equal(pool.values[0], want.values[0])
    # what it does not take, it leaves to index_copy_ (returns False, writes nothing)
    before = pool.keys[0].clone()
    bad = slots.clone()
    bad[-1] = slots_total  # outside the pool
    assert not k_impl.write_kv(key[0], value[0], pool.keys[0], pool.values[0], bad)
    assert not k_impl.write_kv(key[0].float() if dtype == torch.bfloat16 else key[0].bfloat16(), value[0],
                               pool.keys[0], pool.values[0], slots)  # a dtype other than the pool's
    assert not k_impl.write_kv(key[0], value[0], pool.keys[0], pool.values[0], slots.int())
    assert torch.equal(pool.keys[0], before)


@pytest.mark.parametrize("threads", [1, 2])
def test_argmax_kernel_chooses_what_torch_argmax_chooses(threads: int) -> None:
    """First index of the largest value, ties to the first, a NaN the largest (its first), all -inf -> 0, on
    contiguous and row-strided logits; other layouts are left to torch."""
    kernel = kernels.load_argmax()
    assert kernel is not None
    torch.manual_seed(0)
    wide = torch.randn(9, 49_160)
    logits = wide[:, :49_152]  # rows strided past their length, as a slice of a wider buffer
    logits[1, 7] = logits[1, 40_000] = logits[1].max() + 1  # a tie: the first wins
    logits[2, 30_000] = float("nan")
    logits[2, 31_000] = float("nan")
    logits[2, 5] = float("inf")
    logits[3] = float("-inf")
    logits[4, -1] = 100.0  # the last column
    logits[5, 255:257] = 50.0  # a tie across the kernel's chunk boundary
    logits[6] = 0.0
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = kernel.rows(logits)
    finally:
        torch.set_num_threads(previous)
    assert got == logits.argmax(-1).tolist()
    assert got[1] == 7 and got[2] == 30_000 and got[3] == 0 and got[4] == 49_151 and got[5] == 255 and got[6] == 0
    assert kernel.rows(torch.randn(2, 5, dtype=torch.bfloat16)) is None
    assert kernel.rows(torch.randn(5, 2).t()) is None  # columns not contiguous
    assert kernel.rows(torch.randn(2, 0)) is None


def test_rotary_kernel_is_bitwise_the_torch_operations_it_replaces() -> None:
    """One pass in C gives every bit of torch's five operations (it is built without fused multiply-adds), on
    contiguous and strided projections (a slice of a fused QKV output); layouts it does not take are declined."""
    from handlers.engine.execution.forward.lean import _rotate

    kernel = kernels.load_rotary()
    assert kernel is not None
    torch.manual_seed(0)
    for tokens, heads, d in ((1, 9, 64), (37, 3, 64), (300, 4, 128), (3, 2, 10)):
        wide = torch.randn(tokens, heads * d + 24) * 30
        for x in (wide[:, :heads * d].view(tokens, heads, d), wide[:, :heads * d].contiguous().view(tokens, heads, d)):
            angles = torch.randn(1, tokens, d) * 100
            cos, sin = angles.cos()[0, :, None], angles.sin()[0, :, None]
            got = kernel.apply(x, cos, sin)
            assert got is not None and torch.equal(got, _rotate(x, cos, sin)), (tokens, heads, d)
    x, cos, sin = torch.randn(4, 2, 8), torch.randn(4, 1, 8), torch.randn(4, 1, 8)
    assert kernel.apply(x.bfloat16(), cos, sin) is None
    assert kernel.apply(x, torch.randn(8, 1, 4).transpose(0, 2), sin) is None  # a table not [T, D] contiguous
    assert kernel.apply(torch.randn(4, 8, 2).transpose(1, 2), cos, sin) is None  # D not contiguous


def test_engine_without_a_compiler_uses_the_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels.shutil, "which", lambda name: None)
    load_kernels.cache_clear()
    try:
        assert load_kernels() is None
    finally:
        monkeypatch.undo()
        load_kernels.cache_clear()
    assert load_kernels() is not None


_FAULTS_OF_STEPS = """
import ctypes, json, resource, sys
import torch
from handlers.engine.planning.cpu import keep_freed_memory

def faults_of_one_step():
    # page faults of a step-like pattern: large temporaries of a few sizes, allocated and freed
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x = torch.ones(1 << 20)
    for _ in range(6):
        y = torch.ones(4 << 20)
        z = x * 2
        x = torch.ones(2 << 20) + 1
        del y, z
    del x
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]

mallinfo2 = ctypes.CDLL(None).mallinfo2
mallinfo2.restype = MallInfo2
if sys.argv[1] == "keep":
    assert keep_freed_memory()
before = mallinfo2().hblkhd
big = torch.ones(4 << 20)  # 16 MiB: mmapped by default (and unmapped at free), from the heap when kept
mapped = mallinfo2().hblkhd - before
del big
print(json.dumps({"mapped": mapped, "faults": [faults_of_one_step() for _ in range(10)]}))
"""


def _faults_of_steps(mode: str) -> dict[str, Any]:
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _FAULTS_OF_STEPS, mode], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_freed_activation_memory_is_reused_without_page_faults() -> None:
    """After ``keep_freed_memory`` a large temporary allocated again comes back without faulting its pages in; by
    default every step faults its temporaries in again (14,304 faults a step in 4 of 5 fresh processes; in the
    fifth glibc's own threshold rose after an early free and later steps faulted little). In a fresh process, as a
    worker is (the allocator's state is process-wide), and the typical step is compared: now and then one step
    faults a temporary's pages in even so (seen in 4 of 11 fresh processes, at a varying step), which a worker pays
    once, not every step."""
    import statistics

    kept = _faults_of_steps("keep")
    assert kept["mapped"] < 4 << 20, kept  # the first large temporary came from the heap, not a mapping of its own
    assert statistics.median(kept["faults"][2:]) < 100, kept


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("populate", ["lazy", "eager"])
def test_kv_pool_memory_is_zero_and_paid_for_when_used(populate: str) -> None:
    """The pool starts zeroed; ``lazy`` touches none of its pages at allocation (an eager start spends 36 s
    zeroing a 4.5 GiB pool on this project's VM), ``eager`` (the default) all of them; layers' tensors never
    overlap."""
    layers, slots, heads, dim = 4, 16384, 4, 64  # 128 MiB: a few MiB of the process's own growth stay well below
    nbytes = 2 * layers * heads * slots * dim * 4
    before = _rss_bytes()
    pool = KVPool(layers, slots, heads, dim, torch.float32, populate)
    grown = _rss_bytes() - before
    if populate == "lazy":
        assert grown < nbytes // 16, (grown, nbytes)
    else:
        assert grown >= nbytes * 9 // 10, (grown, nbytes)
    tensors = pool.keys + pool.values
    assert all(t.shape == (heads, slots, dim) and t.is_contiguous() and t.dtype == torch.float32 for t in tensors)
    assert len({t.data_ptr() for t in tensors}) == 2 * layers
    assert all(not t.any() for t in tensors)
    pool.keys[2][1, 7] = 1.5
    pool.values[1][0, 0] = -2.0
    assert pool.keys[2].sum() == 1.5 * dim and pool.values[1].sum() == -2.0 * dim
    assert sum(int(t.count_nonzero()) for t in tensors) == 2 * dim


def test_a_lazy_pool_pays_for_the_pages_written_not_huge_pages() -> None:
    """One token's keys and values in every head of every layer: a lazy pool grows by about that many 4 KiB
    pages (huge pages, asked for an eager pool, would fault in 2 MiB for each)."""
    layers, slots, heads, dim = 4, 16384, 8, 64  # 4 MiB a head: room for two huge pages each
    pool = KVPool(layers, slots, heads, dim, torch.float32, "lazy")
    before = _rss_bytes()
    for t in pool.keys + pool.values:
        t[:, 100] = 1.0
    grown = _rss_bytes() - before
    assert grown < 2 * layers * heads * 64 * 1024, grown


def test_kv_cache_populate_option_is_checked() -> None:
    """``option.kv_cache_populate`` is parsed and checked (auto by default)."""
    from handlers.engine.planning.engine_config import EngineConfig
    from rollcore.errors import ConfigError

    assert EngineConfig.from_options({}).kv_cache_populate == "auto"  # eager, but lazy for a GGUF file
    assert EngineConfig.from_options({"kv_cache_populate": "lazy"}).kv_cache_populate == "lazy"
    with pytest.raises(ConfigError, match="kv_cache_populate"):
        EngineConfig.from_options({"kv_cache_populate": "sometimes"})
