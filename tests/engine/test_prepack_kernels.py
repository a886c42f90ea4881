"""Packed linear layers: padded row counts give the unpadded result, and a worker's memory does not grow with
the row counts traffic brings (oneDNN caches one JIT kernel of ~0.55 MiB per input shape; the soak benchmark)."""

from __future__ import annotations

import ctypes
import ctypes.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from handlers.engine.engine import LLMEngine
from handlers.engine.execution.kernels.prepack import (
    HYBRID_MAX_PACKED_ROWS,
    HYBRID_MIN_PACKED_ROWS,
    KERNEL_BYTES,
    PackedLinear,
    can_prepack,
    large_row_counts,
    packed_row_counts,
    packed_rows,
)
from rollcore.types import SamplingParams
from tests.engine.conftest import reference_greedy


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


def test_prefill_sized_inputs_run_packed_only_when_built_and_barely_padded() -> None:
    """Beyond HYBRID_MAX_PACKED_ROWS the packed weight runs only for inputs whose bucket's kernel was built at
    load (``large_rows``) and which pad at most a sixteenth; the rest run on the plain weight. The packed copy
    is zeroed, so each route shows in the output."""
    torch.manual_seed(0)
    linear = nn.Linear(48, 40)
    packed = PackedLinear(linear, max_packed_rows=HYBRID_MAX_PACKED_ROWS)
    zero = torch.ops.mkldnn._reorder_linear_weight(torch.zeros_like(linear.weight), 8)
    packed.register_buffer("packed_weight", zero, persistent=False)
    assert large_row_counts(2048) == [192, 256, 320, 384, 448, 512, 768, 1024, 1280, 1536, 1792, 2048]
    routes = {}
    with torch.no_grad():
        for large_rows in (0, 512):
            packed.large_rows = large_rows
            for rows in (129, 160, 192, 250, 256, 300, 310, 500, 513):
                x = torch.randn(rows, 48)
                out = packed(x)
                on_packed = torch.equal(out, linear.bias.expand(rows, 40))
                if not on_packed:
                    torch.testing.assert_close(out, F.linear(x, linear.weight, linear.bias), rtol=1e-5, atol=1e-5)
                routes[large_rows, rows] = on_packed
    assert not any(routes[0, rows] for rows in (129, 160, 192, 250, 256, 300, 310, 500, 513)), routes
    # 129 -> 192, 160 -> 192 and 300 -> 320 pad more than a sixteenth, 513 -> 768 is beyond the built kernels
    assert [rows for rows in (129, 160, 192, 250, 256, 300, 310, 500, 513) if routes[512, rows]] == \
        [192, 250, 256, 310, 500], routes


def test_prefill_steps_on_the_packed_weight_equal_generate(model_dirs: dict[str, Path]) -> None:
    """The engine builds the prefill-sized kernels up to its token budget for every layer but the lm_head, and
    a 500-row prefill step (two long prompts at once) runs on them: greedy output equals ``generate``."""
    engine = LLMEngine.from_options(model_dirs["llama"], {"num_kv_blocks": "256", "prepack_weights": "hybrid",
                                                          "max_rolling_batch_prefill_tokens": "512"})
    layers = [m for m in engine.model.modules() if isinstance(m, PackedLinear)]
    head = engine.model.get_submodule("lm_head")
    assert isinstance(head, PackedLinear) and head.large_rows == 0
    body = [m for m in layers if m is not head]
    assert body and all(m.large_rows == 512 and m.runs_packed(500) for m in body)
    calls: list[int] = []
    for m in body:
        m.register_forward_pre_hook(lambda _m, args: calls.append(args[0].numel() // _m.in_features))
    rng = torch.Generator().manual_seed(3)
    prompts = [torch.randint(5, 500, (n,), generator=rng).tolist() for n in (260, 240)]
    params = SamplingParams(max_new_tokens=12)  # stops at EOS, as generate does
    for i, p in enumerate(prompts):
        engine.add(f"r{i}", p, params)
    got: dict[str, list[int]] = {"r0": [], "r1": []}
    while engine.has_work():
        for d in engine.step():
            got[d.request_id].extend(t.id for t in d.tokens)
    assert max(calls) == 500  # both prompts in one step, on the packed weight
    for i, p in enumerate(prompts):
        assert got[f"r{i}"] == reference_greedy(model_dirs["llama"], p, 12), f"prompt {i} differs from generate"


def test_engine_memory_does_not_grow_with_new_row_counts(model_dirs: dict[str, Path]) -> None:
    """After the engine is built, every row count 1..128 through every packed layer builds no new kernel, nor do
    prefill-sized row counts up to the token budget."""
    engine = LLMEngine.from_options(model_dirs["llama"], {"num_kv_blocks": "64", "prepack_weights": "hybrid"})
    layers = [m for m in engine.model.modules() if isinstance(m, PackedLinear)]
    assert layers, "the engine prepacked nothing: the test would prove nothing"
    assert any(m.large_rows == 2048 for m in layers)
    _assert_no_kernel_built_after_load(layers)


def _assert_no_kernel_built_after_load(layers: list[PackedLinear], head: nn.Module | None = None) -> None:
    """``head`` (the LM head, which sees one row per sequence) gets the decode row counts only."""
    before = heap_bytes_in_use()
    with torch.no_grad():
        # every row count a decode step brings, and prefill-sized ones up to the budget (some run packed)
        for rows in [*range(1, HYBRID_MAX_PACKED_ROWS + 1), *range(129, 2049, 61), 2048]:
            for layer in {(m.shape_key(), m.large_rows): m for m in layers}.values():
                if layer is not head or rows <= HYBRID_MAX_PACKED_ROWS:
                    layer(torch.zeros(rows, layer.in_features))
    grown = heap_bytes_in_use() - before
    # Unwarmed, this loop builds ~5 shapes x 128 kernels x 0.55 MiB = ~350 MiB; allow a few stray allocations.
    assert grown < 4 * KERNEL_BYTES, f"heap grew {grown / 2**20:.1f} MiB: kernels were built after load"


def _cached_timings(model_dir: Path, body_packed: set[int], head_packed: set[int], step_tokens: int,
                    max_seqs: int, body_panel: frozenset[int] = frozenset(),
                    head_panel: frozenset[int] = frozenset()) -> None:
    """Write the linear-kernel timings ``prepack_weights=auto`` would measure for ``model_dir`` into the cache
    under ``$HOME``, with the packed pass faster than the plain one exactly at the given buckets and the panel
    kernel's the fastest at its own (a real measurement's outcome depends on the CPU; the routing it implies
    does not)."""
    from transformers import AutoModelForCausalLM

    from handlers.engine.execution.kernels import linear_choice as lc
    from handlers.engine.execution.kernels.native import cache_dir

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    body = [m for m in linears if m is not model.lm_head]
    entries = {}
    for passes, packed_at, panel_at in (
            (lc.body_passes(body, model.config.num_hidden_layers, max(step_tokens, max_seqs)), body_packed,
             body_panel),
            ({r: [model.lm_head] for r in lc.buckets_for([lc.shape_of(model.lm_head)], max_seqs)}, head_packed,
             head_panel)):
        entries[lc.pass_key(passes)] = lc.Timing({b: 1.0 for b in passes},
                                                 {b: 0.5 if b in packed_at else 2.0 for b in passes},
                                                 {b: 0.25 if b in panel_at else 3.0 for b in passes})
    lc.TimingCache(cache_dir(), threads=1).save(entries)  # the engines below run one thread


def test_auto_routes_rows_by_the_measured_timings_and_equals_generate(model_dirs: dict[str, Path],
                                                                     monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path: Path) -> None:
    """``prepack_weights=auto`` (the default) routes each row count of the body and of the LM head to the kernel
    its bucket measured faster (here: the cache's timings), keeps both copies where both are used, and the
    engine's greedy output over those routes (decode steps of 8 rows packed, of fewer plain) equals generate."""
    monkeypatch.setenv("HOME", str(tmp_path))
    _cached_timings(model_dirs["llama"], {8, 16, 256, 512}, {1}, step_tokens=512, max_seqs=8)
    options = {"num_kv_blocks": "256", "max_rolling_batch_size": "8", "max_rolling_batch_prefill_tokens": "512",
               "num_threads": "1"}
    engine = LLMEngine.from_options(model_dirs["llama"], options)
    head = engine.model.get_submodule("lm_head")
    body = [m for m in engine.model.modules() if isinstance(m, PackedLinear) and m is not head]
    assert len(body) == 14 and all(m.weight is not None for m in body)  # 2 layers x 7, both copies
    for m in body:
        assert [r for r in range(1, 33) if m.runs_packed(r)] == [5, 6, 7, 8, *range(9, 17)]
        assert m.runs_packed(250) and m.runs_packed(500) and not m.runs_packed(100)
    assert isinstance(head, PackedLinear) and [r for r in range(1, 9) if head.runs_packed(r)] == [1]
    calls: list[tuple[int, bool]] = []
    for m in body:
        m.register_forward_pre_hook(lambda _m, args: calls.append(
            (args[0].numel() // _m.in_features, _m.runs_packed(args[0].numel() // _m.in_features))))
    prompts = [torch.randint(5, 500, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (9, 17, 30, 41, 12, 25, 33, 20)]
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    for i, p in enumerate(prompts):  # ending one after another: decode steps of 8 rows down to 1
        engine.add(f"r{i}", p, SamplingParams(max_new_tokens=4 + i))
    while engine.has_work():
        for d in engine.step():
            got[d.request_id].extend(t.id for t in d.tokens)
    assert (8, True) in calls and (3, False) in calls  # both kernels ran
    for i, p in enumerate(prompts):
        assert got[f"r{i}"] == reference_greedy(model_dirs["llama"], p, 4 + i), f"prompt {i} differs from generate"


def test_auto_packed_everywhere_keeps_one_copy_and_builds_every_kernel_at_load(model_dirs: dict[str, Path],
                                                                             monkeypatch: pytest.MonkeyPatch,
                                                                             tmp_path: Path) -> None:
    """Where the packed pass won every bucket, a layer keeps the packed copy only, and the prefill-sized kernels
    are built at load for it too: no row count up to the token budget builds a kernel afterwards."""
    from handlers.engine.execution.kernels.linear_choice import BUCKETS

    monkeypatch.setenv("HOME", str(tmp_path))
    _cached_timings(model_dirs["llama"], set(BUCKETS), set(BUCKETS), step_tokens=2048, max_seqs=32)
    engine = LLMEngine.from_options(model_dirs["llama"], {"num_kv_blocks": "64", "num_threads": "1"})
    layers = [m for m in engine.model.modules() if isinstance(m, PackedLinear)]
    assert len(layers) == 15 and all(m.weight is None for m in layers)
    head = engine.model.get_submodule("lm_head")
    assert head in layers and head.large_rows == 0 and all(m.large_rows == 2048 for m in layers if m is not head)
    _assert_no_kernel_built_after_load(layers, head)


def test_auto_runs_decode_rows_on_the_panel_kernel_and_equals_generate(model_dirs: dict[str, Path],
                                                                      monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path: Path) -> None:
    """Where the panel kernel's passes were the fastest (here: 1-8 rows of the body, every row count of the
    head), decode steps run on it, prefill chunks on the packed copy, and the greedy output equals generate."""
    from handlers.engine.execution.kernels.panel_linear import PanelLinear

    monkeypatch.setenv("HOME", str(tmp_path))
    _cached_timings(model_dirs["llama"], {16, 32, 64, 128, 256, 512}, set(), step_tokens=512, max_seqs=8,
                    body_panel=frozenset({1, 2, 4, 8}), head_panel=frozenset({1, 2, 4, 8}))
    options = {"num_kv_blocks": "256", "max_rolling_batch_size": "8", "max_rolling_batch_prefill_tokens": "512",
               "num_threads": "1"}
    engine = LLMEngine.from_options(model_dirs["llama"], options)
    head = engine.model.get_submodule("lm_head")
    assert isinstance(head, PanelLinear) and head.rest is None  # the panel copy only
    body = [m for m in engine.model.modules() if isinstance(m, PanelLinear) and m is not head]
    assert len(body) == 14 and all(isinstance(m.rest, PackedLinear) and m.rest.weight is None for m in body)
    calls: list[tuple[int, bool]] = []
    for m in body:
        m.register_forward_pre_hook(lambda _m, args: calls.append(
            (args[0].numel() // _m.in_features, _m.runs_panel(args[0].numel() // _m.in_features))))
    prompts = [torch.randint(5, 500, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (9, 17, 30, 41, 12, 25, 33, 20)]
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        engine.add(f"r{i}", p, SamplingParams(max_new_tokens=4 + i))
    while engine.has_work():
        for d in engine.step():
            got[d.request_id].extend(t.id for t in d.tokens)
    assert (8, True) in calls and (1, True) in calls and any(not panel for _, panel in calls)  # both kernels ran
    for i, p in enumerate(prompts):
        assert got[f"r{i}"] == reference_greedy(model_dirs["llama"], p, 4 + i), f"prompt {i} differs from generate"


def test_a_head_wrapped_by_the_panel_kernel_builds_no_prefill_sized_kernels(model_dirs: dict[str, Path],
                                                                           monkeypatch: pytest.MonkeyPatch,
                                                                           tmp_path: Path) -> None:
    """The LM head sees one row per sequence: where the panel kernel takes some of its buckets and the packed
    weight the rest, the packed copy inside it is warmed for those rows only, never for prefill-sized ones (on
    the real model they were most of a load: 49,152 outputs times up to 2,048 rows)."""
    from handlers.engine.execution.kernels.panel_linear import PanelLinear

    monkeypatch.setenv("HOME", str(tmp_path))
    _cached_timings(model_dirs["llama"], {16, 32, 64, 128, 256, 512}, {4, 8}, step_tokens=512, max_seqs=8,
                    body_panel=frozenset({1, 2}), head_panel=frozenset({1, 2}))
    options = {"num_kv_blocks": "256", "max_rolling_batch_size": "8", "max_rolling_batch_prefill_tokens": "512",
               "num_threads": "1"}
    engine = LLMEngine.from_options(model_dirs["llama"], options)
    head = engine.model.get_submodule("lm_head")
    assert isinstance(head, PanelLinear) and isinstance(head.rest, PackedLinear)
    assert head.rest.large_rows == 0
    body = [m for m in engine.model.modules() if isinstance(m, PackedLinear) and m is not head.rest]
    assert body and all(m.large_rows == 512 for m in body)
