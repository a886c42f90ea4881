"""The measured GEMM choice (handlers.engine.execution.kernels.linear_choice): routing from timings, the layers a pass
runs through, the timings cache, and a real measurement on small layers."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from handlers.engine.execution.kernels import linear_choice as lc
from handlers.engine.execution.kernels.prepack import PackedLinear


def timing(packed_at: set[int], buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32)) -> lc.Timing:
    """Timings where the packed pass is faster exactly at ``packed_at``."""
    return lc.Timing({b: 1.0 for b in buckets}, {b: 0.5 if b in packed_at else 2.0 for b in buckets})


TimingOf = Callable[[tuple[int, ...]], lc.Timing]


def tiny_model(tmp_path: Path, body_timing: TimingOf, head_timing: TimingOf
               ) -> tuple[nn.Module, list[nn.Linear], lc.TimingCache]:
    """Two decoder layers (32 -> 64 -> 32, with biases) and a 100-word head, and a timings cache holding
    ``body_timing`` and ``head_timing`` of their passes' buckets (a step of 64 tokens, 8 sequences)."""
    torch.manual_seed(0)
    model = nn.Module()
    model.layers = nn.ModuleList(nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 32)) for _ in range(2))
    model.lm_head = nn.Linear(32, 100, bias=False)
    model.config = type("Config", (), {"num_hidden_layers": 2})()
    body = [m for layer in model.layers for m in layer]
    cache = lc.TimingCache(tmp_path, threads=torch.get_num_threads())
    body_passes = lc.body_passes(body, 2, 64)
    head_passes = {rows: [model.lm_head] for rows in lc.buckets_for([lc.shape_of(model.lm_head)], 8)}
    cache.save({lc.pass_key(body_passes): body_timing(tuple(body_passes)),
                lc.pass_key(head_passes): head_timing(tuple(head_passes))})
    return model, body, cache


def test_each_bucket_goes_to_the_faster_kernel() -> None:
    assert timing({4, 8}).packed_buckets() == {4, 8}
    tie = lc.Timing({1: 1.0, 2: 1.0}, {1: 1.0, 2: 0.999})
    assert tie.packed_buckets() == {2}  # a tie keeps the plain weight (no second copy for nothing)


def test_rows_are_routed_by_the_smallest_bucket_that_holds_them() -> None:
    route = lc.router(timing({4, 8, 32}))
    # 3 and 4 -> bucket 4; 5..8 -> 8; 9..16 -> 16 (plain); 17..32 -> 32; beyond the largest bucket -> its choice
    assert [rows for rows in range(1, 41) if route(rows)] == [3, 4, 5, 6, 7, 8, *range(17, 41)]
    assert lc.router(timing({1}))(1) and not lc.router(timing({1}))(2)
    assert not lc.router(timing({1, 2}))(100)


def test_buckets_stop_at_the_rows_a_step_gives_and_at_the_flop_cap() -> None:
    small = [(64, 64, False, "torch.float32")]
    assert lc.buckets_for(small, 32) == (1, 2, 4, 8, 16, 32)
    assert lc.buckets_for(small, 3000) == lc.BUCKETS
    wide = [(4096, 14336, False, "torch.float32")]  # 117 MFLOP a row: 32 rows is the last under the cap
    assert lc.buckets_for(wide, 2048) == (1, 2, 4, 8, 16, 32)
    huge = [(1 << 16, 1 << 16, False, "torch.float32")]
    assert lc.buckets_for(huge, 2048) == (1,)  # at least one bucket


def test_each_bucket_passes_through_whole_layers_past_the_caches_within_its_flop() -> None:
    layer = [nn.Linear(256, 256, bias=False), nn.Linear(256, 1024, bias=False)]  # 256 KiB + 1 MiB
    body = [nn.Linear(m.in_features, m.out_features, bias=False) for _ in range(30) for m in layer]
    per_layer = (256 * 256 + 256 * 1024) * 4
    least = -(-lc.STREAM_BYTES // per_layer)  # the layers that fill STREAM_BYTES: 13
    # a cache no larger than STREAM_BYTES: every bucket's pass is the shortest
    small = lc.body_passes(body, 30, 2048, stream=lc.STREAM_BYTES)
    assert small and all(p == body[: 2 * least] for p in small.values())
    assert lc.body_passes(body, 30, 2048, stream=1 << 30)[1] == body  # a large last-level cache: all layers
    # wide layers (20 MiB each, on the meta device): the whole body while PASS_FLOP allows, fewer layers at more
    # rows, never fewer than the shortest pass
    wide = [nn.Linear(i, o, bias=False, device="meta") for _ in range(30) for i, o in ((1024, 1024), (1024, 4096))]
    large = lc.body_passes(wide, 30, 2048, stream=1 << 30)
    flop_per_row = 2 * (1024 * 1024 + 1024 * 4096)
    for rows, p in large.items():
        assert len(p) % 2 == 0 and p == wide[: len(p)]  # whole layers, in order
        assert len(p) // 2 == min(30, max(1, int(lc.PASS_FLOP // (rows * flop_per_row)))), rows
    assert len(large[1]) == 60 and len(large[64]) == 2 * 11 and len(large[256]) == 2 * 2
    assert lc.body_passes(body, 7, 8, stream=1 << 30)[8] == body  # layers that do not divide the body: one
    big = [nn.Linear(4096, 4096, bias=False), nn.Linear(4096, 4096, bias=False)]
    assert lc.body_passes(big, 2, 1, stream=lc.STREAM_BYTES)[1] == big[:1]  # one layer over the stream size


def test_the_last_level_cache_is_read_from_sysfs(tmp_path: Path) -> None:
    from handlers.engine.planning.cpu import last_level_cache_bytes

    for name, level, size in (("index0", 1, "48K"), ("index2", 2, "2048K"), ("index3", 3, "491520K")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "level").write_text(f"{level}\n")
        (tmp_path / name / "size").write_text(f"{size}\n")
    assert last_level_cache_bytes.__wrapped__(tmp_path) == 480 << 20
    assert last_level_cache_bytes.__wrapped__(tmp_path / "absent") == 0


def test_the_cache_round_trips_and_merges(tmp_path: Path) -> None:
    cache = lc.TimingCache(tmp_path, threads=1)
    cache.save({"a": timing({8})})
    lc.TimingCache(tmp_path, threads=1).save({"b": timing({1, 2})})
    loaded = cache.load()
    assert set(loaded) == {"a", "b"}
    assert loaded["a"].packed_buckets() == {8} and loaded["b"].packed_buckets() == {1, 2}
    # a worker that measured the same group later routes by the timings saved first
    merged = cache.save({"a": timing({1}), "c": timing(set())})
    assert merged["a"].packed_buckets() == {8} and cache.load()["a"].packed_buckets() == {8}
    assert set(cache.load()) == {"a", "b", "c"}
    assert lc.TimingCache(tmp_path, threads=2).path != cache.path  # per thread count
    for damaged in ("{not json", '{"a": {"plain": 3}}', '{"a": {"packed": {}}}', "[1, 2]"):
        cache.path.write_text(damaged)
        assert cache.load() == {}  # measured again, not a failed load


def test_apply_choice_routes_the_body_and_the_head_from_the_cache(tmp_path: Path) -> None:
    """Timings in the cache decide: the body packed at 4 and 8 rows (both copies kept), the head plain everywhere
    (left an ``nn.Linear``); outputs match ``F.linear`` on every path."""
    model, body, cache = tiny_model(tmp_path, lambda b: timing({4, 8}, b), lambda b: timing(set(), b))
    reference = {id(m): (m.weight.detach().clone(), m.bias.detach().clone()) for m in body}
    assert lc.apply_choice(model, step_tokens=64, max_seqs=8, cache=cache) == {"plain": 5, "packed": 4, "panel": 0}
    assert type(model.lm_head) is nn.Linear
    for layer, originals in zip(model.layers, [body[0:2], body[2:4]], strict=True):
        for module, original in zip(layer, originals, strict=True):
            assert isinstance(module, PackedLinear) and module.weight is not None  # hybrid: both copies
            assert [r for r in range(1, 65) if module.runs_packed(r)] == [3, 4, 5, 6, 7, 8]
            w, b = reference[id(original)]
            for rows in (1, 4, 8, 20):
                x = torch.randn(rows, module.in_features)
                torch.testing.assert_close(module(x), torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_a_real_measurement_times_every_kernel_at_every_bucket_and_is_cached(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Module()
    model.layers = nn.ModuleList(nn.Sequential(nn.Linear(48, 96, bias=False), nn.Linear(96, 48, bias=False))
                                 for _ in range(3))
    model.config = type("Config", (), {"num_hidden_layers": 3})()
    body = [m for layer in model.layers for m in layer]  # before they are replaced
    cache = lc.TimingCache(tmp_path, threads=torch.get_num_threads())
    counts = lc.apply_choice(model, step_tokens=16, max_seqs=4, cache=cache)
    assert 6 <= sum(counts.values()) <= 12  # every layer runs one or two kernels
    (key, entry), = json.loads(cache.path.read_text()).items()
    assert key == lc.pass_key(lc.body_passes(body, 3, 16))
    assert key.endswith(":torch.float32:1/6,2/6,4/6,8/6,16/6")  # every bucket through the whole (small) body
    for kernel in ("plain", "packed", "panel"):
        assert sorted(map(int, entry[kernel])) == [1, 2, 4, 8, 16] and all(t > 0 for t in entry[kernel].values())
    # a second model of the same shapes routes from the cache, measuring nothing
    again = nn.Module()
    again.layers = nn.ModuleList(nn.Sequential(nn.Linear(48, 96, bias=False), nn.Linear(96, 48, bias=False))
                                 for _ in range(3))
    again.config = model.config
    before = cache.path.stat().st_mtime_ns
    assert lc.apply_choice(again, step_tokens=16, max_seqs=4, cache=cache) == counts
    assert cache.path.stat().st_mtime_ns == before


def three(panel_at: set[int], packed_at: set[int], buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32)) -> lc.Timing:
    """Timings where the panel pass is the fastest at ``panel_at`` and packed beats plain at ``packed_at``."""
    return lc.Timing({b: 1.0 for b in buckets}, {b: 0.5 if b in packed_at else 2.0 for b in buckets},
                     {b: 0.25 if b in panel_at else 3.0 for b in buckets})


def test_the_panel_kernel_takes_the_buckets_it_wins_and_leaves_two_copies_at_most() -> None:
    # 4 would run plain, 8-32 packed: all packed, whose passes over them sum less (3.5 against 4)
    assert three({1, 2}, {8, 16, 32}).kernels() == {1: "panel", 2: "panel", 4: "packed", 8: "packed",
                                                    16: "packed", 32: "packed"}
    # packed would win 8 and 16, plain 32: the others all go to the one whose passes sum less (plain: 3 < 5)
    split = lc.Timing({b: 1.0 for b in (1, 2, 8, 16, 32)}, {1: 2.0, 2: 2.0, 8: 0.5, 16: 0.5, 32: 4.0},
                      {1: 0.1, 2: 0.1, 8: 3.0, 16: 3.0, 32: 3.0})
    assert split.kernels() == {1: "panel", 2: "panel", 8: "plain", 16: "plain", 32: "plain"}
    # without the panel kernel winning anywhere, each bucket keeps the faster of the other two
    assert three(set(), {8}).kernels() == {1: "plain", 2: "plain", 4: "plain", 8: "packed", 16: "plain", 32: "plain"}
    assert lc.Timing({1: 1.0}, {1: 2.0}, {1: 1.0}).kernels() == {1: "plain"}  # a tie keeps the plain weight
    route = lc.router(three({1, 2, 4}, set()), "panel")
    assert [rows for rows in range(1, 40) if route(rows)] == [1, 2, 3, 4]


def test_apply_choice_wraps_the_layers_the_panel_kernel_wins(tmp_path: Path) -> None:
    """Body: panel at 1-4 rows, packed beyond (packed copy only, which builds no kernel for the panel's rows);
    head: panel everywhere (one copy, the panel's). Outputs match ``F.linear`` on every path."""
    from handlers.engine.execution.kernels.panel_linear import PanelLinear
    from handlers.engine.execution.kernels.prepack import warm_packed_kernels

    model, body, cache = tiny_model(tmp_path, lambda b: three({1, 2, 4}, set(b), b), lambda b: three(set(b), set(), b))
    reference = {id(m): (m.weight.detach().clone(), None if m.bias is None else m.bias.detach().clone())
                 for m in [*body, model.lm_head]}
    originals = [*body, model.lm_head]
    assert lc.apply_choice(model, step_tokens=64, max_seqs=8, cache=cache) == {"plain": 0, "packed": 4, "panel": 5}
    modules = [m for layer in model.layers for m in layer] + [model.lm_head]
    for module, original in zip(modules, originals, strict=True):
        assert isinstance(module, PanelLinear)
        if module is model.lm_head:
            assert module.rest is None  # the panel copy only
        else:
            assert isinstance(module.rest, PackedLinear) and module.rest.weight is None  # no plain copy
            assert [r for r in range(1, 65) if module.runs_panel(r)] == [1, 2, 3, 4]
        w, b = reference[id(original)]
        for rows in (1, 3, 4, 5, 20):
            x = torch.randn(rows, module.in_features)
            torch.testing.assert_close(module(x), torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)
    # oneDNN kernels for the row counts above 4 only: those below never reach the packed copy
    built = warm_packed_kernels(model)
    assert built == 2 * len([r for r in (*range(5, 33), 48, 64, 80, 96, 112, 128)])


def test_cached_panel_timings_without_the_kernel_route_between_the_other_two(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Timings that put buckets on the panel kernel, read where it cannot be built: plain and packed only."""
    monkeypatch.setattr(lc, "load_panel_kernel", lambda: None)
    model, _, cache = tiny_model(tmp_path, lambda b: three({1, 2, 4}, {8, 16, 32}, b),
                                 lambda b: three(set(b), set(), b))
    assert lc.apply_choice(model, step_tokens=64, max_seqs=8, cache=cache) == {"plain": 5, "packed": 4, "panel": 0}
    assert type(model.lm_head) is nn.Linear
    assert all(isinstance(m, PackedLinear) for layer in model.layers for m in layer)
