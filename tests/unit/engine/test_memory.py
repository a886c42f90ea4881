"""The memory preflight (handlers.engine.planning.memory): headers, arithmetic, budget files, refusals, TP, dtype.

Figures are hand-computed for the tiny synthetic Llama (hidden 64, 2 layers, 4 heads, 2 KV heads of 16,
MLP 128, vocab 512), all fp32:
  embed 512x64 = 32768, per layer q 4096 + k 2048 + v 2048 + o 4096 + gate/up/down 3 x 8192 = 36864
  and 2 norms of 64, final norm 64, lm_head 32768 -> 139584 values = 558336 bytes;
  linear weights (layers + lm_head) 2 x 36864 + 32768 = 106496 values = 425984 bytes;
  decoder-layer matrices (sharded by tensor parallelism) 73728 values = 294912 bytes;
  KV per token 2 x 2 layers x 2 heads x 16 x 4 B = 512 B (8192 B per block of 16).
"""

from __future__ import annotations

import json
import logging
import struct
from functools import partial
from pathlib import Path

import pytest

from handlers.engine.planning import checkpoint
from handlers.engine.planning.checkpoint import (
    TensorInfo,
    WeightFigures,
    checkpoint_tensors,
    kv_bytes_per_token,
    model_geometry,
    read_safetensors_header,
    resolve_dtype,
    resolve_max_model_len,
    weight_figures,
)
from handlers.engine.planning.cpu import has_fast_bf16
from handlers.engine.planning.engine_config import EngineConfig
from handlers.engine.planning.host_memory import MemoryBudget, memory_budget
from handlers.engine.planning.memory import InsufficientMemory, MemoryPlan, plan_memory, preflight
from handlers.synthetic_model import build_model
from rollcore.errors import ConfigError

WEIGHTS = 558336
LINEAR = 425984
SHARDED = 294912
MIB = 1 << 20


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("llama"), "llama", "tiny")


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("gpt2"), "gpt2", "tiny", max_position_embeddings=64)


def write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int]]], data: bool = True) -> None:
    """A safetensors file declaring ``tensors`` (zeros; ``data=False`` writes the header only)."""
    sizes = {"F32": 4, "BF16": 2, "F16": 2, "I64": 8}
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        n = sizes[dtype]
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + (bytes(offset) if data else b""))


def no_cgroup(tmp_path: Path) -> dict[str, Path]:
    return {"cgroup_root": tmp_path / "no-cgroup", "self_cgroup": tmp_path / "no-self-cgroup"}


def fake_preflight(tmp_path: Path, kib: int) -> partial[MemoryPlan]:
    """``preflight`` on a fake /proc/meminfo with ``kib`` KiB available and no cgroup limit."""
    return partial(preflight, meminfo=meminfo(tmp_path, kib), cgroup_root=tmp_path / "no-cgroup",
                   self_cgroup=tmp_path / "no-self-cgroup")


def meminfo(tmp_path: Path, kib: int) -> Path:
    path = tmp_path / "meminfo"
    path.write_text(f"MemTotal:       99999999 kB\nMemFree:          123456 kB\nMemAvailable:   {kib} kB\n")
    return path


# ------------------------------------------------------------------------------------------ headers
def test_header_of_a_real_safetensors_file(llama: Path) -> None:
    path = llama / "model.safetensors"
    tensors = {t.name: t for t in read_safetensors_header(path)}
    assert len(tensors) == 21
    assert tensors["model.embed_tokens.weight"] == TensorInfo("model.embed_tokens.weight", "F32", (512, 64))
    assert tensors["model.layers.1.self_attn.k_proj.weight"].shape == (32, 64)
    assert tensors["model.layers.0.mlp.down_proj.weight"].shape == (64, 128)
    assert tensors["model.norm.weight"].shape == (64,)
    # The header's tensors are exactly the file's data section.
    (length,) = struct.unpack("<Q", path.read_bytes()[:8])
    assert sum(t.nbytes for t in tensors.values()) == WEIGHTS == path.stat().st_size - 8 - length


def test_sharded_checkpoint_reads_the_files_of_its_index(tmp_path: Path) -> None:
    write_safetensors(tmp_path / "model-00001-of-00002.safetensors", {"a.weight": ("F32", [4, 8])})
    write_safetensors(tmp_path / "model-00002-of-00002.safetensors", {"b.weight": ("BF16", [3, 5]),
                                                                       "c": ("I64", [7])})
    write_safetensors(tmp_path / "stray.safetensors", {"stray": ("F32", [1000])})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a.weight": "model-00001-of-00002.safetensors", "b.weight": "model-00002-of-00002.safetensors",
        "c": "model-00002-of-00002.safetensors"}}))
    tensors = checkpoint_tensors(tmp_path)
    assert [(t.name, t.dtype, t.shape, t.nbytes) for t in tensors] == [
        ("a.weight", "F32", (4, 8), 128), ("b.weight", "BF16", (3, 5), 30), ("c", "I64", (7,), 56)]


def test_a_header_only_file_is_enough_and_garbage_is_a_config_error(tmp_path: Path) -> None:
    write_safetensors(tmp_path / "big.safetensors", {"w": ("F32", [1 << 20, 1 << 20])}, data=False)
    assert read_safetensors_header(tmp_path / "big.safetensors")[0].nbytes == 4 << 40
    (tmp_path / "bad.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{nope")
    with pytest.raises(ConfigError, match="bad.safetensors: not a readable safetensors file"):
        read_safetensors_header(tmp_path / "bad.safetensors")


# ---------------------------------------------------------------------------------------- weights
def test_weight_figures_of_the_tiny_llama(llama: Path) -> None:
    config = json.loads((llama / "config.json").read_text())
    tensors = checkpoint_tensors(llama)
    assert weight_figures(tensors, config, "fp32") == WeightFigures(WEIGHTS, LINEAR, SHARDED, SHARDED)
    # Served in bf16: every floating tensor at 2 bytes.
    assert weight_figures(tensors, config, "bf16") == WeightFigures(WEIGHTS // 2, LINEAR // 2, SHARDED // 2,
                                                                    SHARDED // 2)
    assert WeightFigures(WEIGHTS, LINEAR, SHARDED, SHARDED).per_rank(2) == (WEIGHTS - SHARDED // 2,
                                                                           LINEAR - SHARDED // 2)


def test_gpt2_prepacks_only_its_tied_output_projection(gpt2: Path) -> None:
    # Conv1D projections are not nn.Linear; lm_head is tied to wte (512 x 64) and gets a packed copy.
    config = json.loads((gpt2 / "config.json").read_text())
    figures = weight_figures(checkpoint_tensors(gpt2), config, "fp32")
    assert figures.linear_bytes == 512 * 64 * 4
    # wte 512x64 + wpe 64x64 + 2 layers x (c_attn 64x192+192, c_proj 64x64+64, c_fc 64x256+256,
    # mlp c_proj 256x64+64, 4 norm vectors of 64) + final norm 2 x 64
    per_layer = 64 * 192 + 192 + 64 * 64 + 64 + 64 * 256 + 256 + 256 * 64 + 64 + 4 * 64
    assert figures.total_bytes == 4 * (512 * 64 + 64 * 64 + 2 * per_layer + 2 * 64)


@pytest.mark.parametrize(("mode", "dtype", "expected"), [
    ("hybrid", "fp32", LINEAR), ("true", "fp32", 0), ("false", "fp32", 0), ("hybrid", "bf16", 0)])
def test_prepacked_copies(mode: str, dtype: str, expected: int) -> None:
    assert checkpoint.prepacked_copy_bytes(LINEAR, mode, dtype) == expected


# ------------------------------------------------------------------------------------------ geometry
@pytest.mark.parametrize(("config", "expected"), [
    ({"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
      "hidden_size": 64}, (2, 4, 2, 16, 64)),
    ({"model_type": "qwen3", "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 4,
      "hidden_size": 64, "head_dim": 32}, (3, 8, 4, 32, 64)),
    ({"model_type": "gpt2", "n_layer": 12, "n_head": 12, "n_embd": 768}, (12, 12, 12, 64, 768)),
    ({"model_type": "falcon", "num_hidden_layers": 2, "num_attention_heads": 8, "hidden_size": 128,
      "multi_query": True, "new_decoder_architecture": False, "num_kv_heads": 8}, (2, 8, 1, 16, 128)),
    ({"model_type": "falcon", "num_hidden_layers": 2, "num_attention_heads": 8, "hidden_size": 128,
      "new_decoder_architecture": True, "num_kv_heads": 2}, (2, 8, 2, 16, 128)),
    ({"model_type": "falcon", "num_hidden_layers": 2, "num_attention_heads": 8, "hidden_size": 128,
      "multi_query": False, "new_decoder_architecture": False}, (2, 8, 8, 16, 128)),
])
def test_geometry(config: dict[str, object], expected: tuple[int, ...]) -> None:
    g = model_geometry(config)
    assert (g.num_layers, g.num_heads, g.num_kv_heads, g.head_dim, g.hidden_size) == expected


def test_kv_bytes_per_token_per_rank() -> None:
    g = model_geometry({"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                        "hidden_size": 64})
    assert kv_bytes_per_token(g, "fp32") == 512
    assert kv_bytes_per_token(g, "bf16") == 256
    assert kv_bytes_per_token(g, "fp32", 2) == 256  # one KV head per rank
    assert kv_bytes_per_token(g, "fp32", 4) == 256  # 2 heads over 4 ranks: each rank keeps a replicated head


# -------------------------------------------------------------------------------------------- budget
def test_fake_meminfo(tmp_path: Path) -> None:
    budget = memory_budget(meminfo(tmp_path, 1048576), **no_cgroup(tmp_path))
    assert budget == MemoryBudget(1 << 30) and budget.bytes == 1 << 30
    assert memory_budget(tmp_path / "absent", **no_cgroup(tmp_path)).bytes == 4 << 30


def test_cgroup_v2_limit_smaller_than_mem_available_wins(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    (root / "kubepods" / "pod1").mkdir(parents=True)
    (root / "memory.max").write_text("max\n")  # the root: unlimited
    (root / "memory.current").write_text("999999999\n")
    (root / "kubepods" / "memory.max").write_text(f"{2 << 30}\n")
    (root / "kubepods" / "memory.current").write_text(f"{1 << 30}\n")  # headroom 1 GiB
    (root / "kubepods" / "pod1" / "memory.max").write_text(f"{512 * MIB}\n")
    (root / "kubepods" / "pod1" / "memory.current").write_text(f"{100 * MIB}\n")  # headroom 412 MiB: tightest
    self_cgroup = tmp_path / "self"
    self_cgroup.write_text("0::/kubepods/pod1\n")
    budget = memory_budget(meminfo(tmp_path, 8 << 20), root, self_cgroup)
    assert budget.bytes == 412 * MIB
    assert (budget.cgroup_limit, budget.cgroup_usage) == (512 * MIB, 100 * MIB)
    assert budget.cgroup_file == str(root / "kubepods" / "pod1" / "memory.max")
    # MemAvailable below the cgroup's headroom wins in turn.
    assert memory_budget(meminfo(tmp_path, 204800), root, self_cgroup).bytes == 200 * MIB
    # An ancestor with less headroom than the process's own cgroup binds.
    (root / "kubepods" / "memory.current").write_text(f"{1948 * MIB}\n")
    budget = memory_budget(meminfo(tmp_path, 8 << 20), root, self_cgroup)
    assert budget.bytes == 100 * MIB and budget.cgroup_file == str(root / "kubepods" / "memory.max")


def test_cgroup_v1_fallback(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    (root / "memory" / "docker" / "abc").mkdir(parents=True)
    (root / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "unlimited"
    (root / "memory" / "memory.usage_in_bytes").write_text("5\n")
    (root / "memory" / "docker" / "abc" / "memory.limit_in_bytes").write_text(f"{300 * MIB}\n")
    (root / "memory" / "docker" / "abc" / "memory.usage_in_bytes").write_text(f"{44 * MIB}\n")
    self_cgroup = tmp_path / "self"
    self_cgroup.write_text("12:pids:/docker/abc\n4:memory:/docker/abc\n0::/\n")
    assert memory_budget(meminfo(tmp_path, 8 << 20), root, self_cgroup).bytes == 256 * MIB
    (root / "memory" / "docker" / "abc" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert memory_budget(meminfo(tmp_path, 8 << 20), root, self_cgroup).bytes == 8 << 30


# ---------------------------------------------------------------------------------------------- plan
def tiny_plan(llama: Path, budget: int, **options: object) -> MemoryPlan:
    config = json.loads((llama / "config.json").read_text())
    figures = weight_figures(checkpoint_tensors(llama), config, "fp32")
    cfg = EngineConfig(**{"max_num_batched_tokens": 64, **options})  # type: ignore[arg-type]
    return plan_memory(model_geometry(config), figures, cfg, MemoryBudget(budget), dtype="fp32",
                       max_model_len=resolve_max_model_len(cfg.max_model_len, config))


def test_plan_arithmetic(llama: Path) -> None:
    plan = tiny_plan(llama, 8 * MIB)
    assert (plan.weight_bytes, plan.prepack_bytes, plan.activation_bytes) == (WEIGHTS, LINEAR, 64 * 64 * 64)
    # free = 8388608 - 558336 - 425984 - 262144 = 7142144; 0.9 of it = 6427929 -> 784 blocks of 8192 B
    assert plan.free_bytes == 7142144
    assert plan.kv_budget_bytes == 6427929
    assert plan.kv_bytes_per_token == 512
    assert plan.num_kv_blocks == 784 and plan.kv_bytes_per_rank == 784 * 8192
    assert plan.max_model_len == 2048 and plan.blocks_per_sequence == 128 and plan.sequences_fit == 6
    text = plan.describe()
    assert "  budget             8.0 MiB  = MemAvailable 8.0 MiB; no cgroup memory limit\n" in text
    assert "  weights          545.2 KiB  (safetensors headers, at fp32)\n" in text
    assert "  prepacked        416.0 KiB  (prepack_weights=hybrid: a packed copy of every linear weight)\n" in text
    assert "  activations      256.0 KiB  = 64 batched tokens x 64 hidden x 64 B\n" in text
    assert "  KV per token         512 B  = 2 x 2 layers x 2 KV heads x 16 head_dim x 4 B\n" in text
    assert "    share            6.1 MiB  = 0.9 x (budget - weights - prepacked - activations)\n" in text
    assert "    need            32.0 MiB  = 32 sequences x 2048 tokens x 512 B\n" in text
    assert "  KV blocks              784  hold 6 sequences of 2048 tokens at once\n" in text


def test_plan_is_capped_at_what_max_num_seqs_need(llama: Path) -> None:
    plan = tiny_plan(llama, 1 << 30, max_num_seqs=4, max_model_len=100)
    assert plan.num_kv_blocks == 4 * 7  # ceil(100 / 16) = 7 blocks per sequence
    assert plan.sequences_fit == 4


def test_plan_fraction_and_explicit_sizes(llama: Path) -> None:
    assert tiny_plan(llama, 8 * MIB, kv_cache_memory_fraction=0.5).num_kv_blocks == 7142144 // 2 // 8192  # 435
    assert tiny_plan(llama, 8 * MIB, kv_cache_memory_mb=3).num_kv_blocks == 3 * MIB // 8192  # 384, uncapped
    explicit = tiny_plan(llama, 8 * MIB, num_kv_blocks=20, block_size=4)
    assert explicit.num_kv_blocks == 20 and explicit.kv_source == "num_kv_blocks"


def test_weights_that_do_not_fit_are_refused_with_the_figures(llama: Path) -> None:
    with pytest.raises(InsufficientMemory) as info:
        tiny_plan(llama, 1 * MIB)
    message = str(info.value)
    assert isinstance(info.value, ConfigError)
    for part in ("weights 545.2 KiB", "prepacked copies 416.0 KiB", "activations 256.0 KiB",
                 "exceed the budget of 1.0 MiB", "option.prepack_weights=false", "option.dtype=bf16",
                 "a bigger memory limit"):
        assert part in message, message
    # Without the prepacked copies the same budget holds weights, activations and 0.9 x 228096 B of KV:
    # 25 blocks, too few for one sequence of 2048 tokens (128 blocks).
    with pytest.raises(InsufficientMemory, match="cannot hold one sequence of max_model_len 2048 tokens: it gets "
                                                 r"200.0 KiB per rank \(25 blocks of 16 tokens\)"):
        tiny_plan(llama, 1 * MIB, prepack_weights="false")


def test_kv_below_one_sequence_is_refused_and_a_shorter_context_fits(llama: Path) -> None:
    budget = WEIGHTS + LINEAR + 64 * 64 * 64 + MIB  # 0.9 MiB of KV: 115 blocks, one sequence needs 128
    with pytest.raises(InsufficientMemory, match="smaller option.max_model_len") as info:
        tiny_plan(llama, budget)
    assert "one sequence needs 1.0 MiB (128 blocks)" in str(info.value)
    assert tiny_plan(llama, budget, max_model_len=1024).num_kv_blocks == 115


def test_two_tensor_parallel_ranks_share_one_budget(llama: Path) -> None:
    one = tiny_plan(llama, 64 * MIB, max_num_seqs=256)
    two = tiny_plan(llama, 64 * MIB, max_num_seqs=256, tensor_parallel_degree=2)
    # 1 rank: free 67108864 - 558336 - 425984 - 262144 = 65862400 -> 0.9 = 59276160 -> 7235 blocks of 8192 B
    assert (one.kv_budget_bytes, one.num_kv_blocks, one.kv_bytes_per_rank) == (59276160, 7235, 59269120)
    # 2 ranks: replicated weights twice (821760), prepacked 557056, activations 2 x 262144:
    # free 65205760 -> 0.9 = 58685184 shared by both ranks -> 29342592 per rank -> 7163 blocks of 4096 B
    assert (two.weight_bytes, two.prepack_bytes, two.activation_bytes) == (821760, 557056, 524288)
    assert (two.kv_bytes_per_token, two.kv_budget_bytes, two.num_kv_blocks) == (256, 29342592, 7163)
    # The same explicit KV size: half the bytes per rank, the same number of tokens.
    one_mb = tiny_plan(llama, 64 * MIB, kv_cache_memory_mb=16)
    two_mb = tiny_plan(llama, 64 * MIB, kv_cache_memory_mb=16, tensor_parallel_degree=2)
    assert (one_mb.kv_bytes_per_rank, two_mb.kv_bytes_per_rank) == (16 * MIB, 8 * MIB)
    assert one_mb.num_kv_blocks == two_mb.num_kv_blocks == 2048


# ---------------------------------------------------------------------------------- max_model_len, dtype
def test_max_model_len(caplog: pytest.LogCaptureFixture) -> None:
    gpt2 = {"model_type": "gpt2", "n_positions": 64}
    llama = {"model_type": "llama", "max_position_embeddings": 64}
    assert resolve_max_model_len(0, gpt2) == 64
    assert resolve_max_model_len(32, gpt2) == 32
    assert resolve_max_model_len(0, {}) == 2048
    with caplog.at_level(logging.WARNING, logger="handlers.engine.planning.memory"):
        assert resolve_max_model_len(100, gpt2) == 64
        assert resolve_max_model_len(100, llama) == 100
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [
        "option.max_model_len=100 capped at 64", "option.max_model_len=100 exceeds max_position_embeddings=64 of llama"]


@pytest.mark.parametrize(("option", "config", "fast_bf16", "expected"), [
    ("auto", {"dtype": "bfloat16"}, True, "bf16"),
    ("auto", {"dtype": "bfloat16"}, False, "fp32"),  # emulated bf16 is far slower than fp32
    ("auto", {"torch_dtype": "float32"}, True, "bf16"),
    ("auto", {"torch_dtype": "float32"}, False, "fp32"),
    ("auto", {"dtype": "float16"}, False, "fp32"),  # CPU: fp16 matmuls are slow
    ("auto", {}, False, "fp32"),
    ("float16", {"dtype": "bfloat16"}, True, "fp16"),
    ("BF16", {}, False, "bf16"),
])
def test_resolve_dtype(option: str, config: dict[str, str], fast_bf16: bool, expected: str) -> None:
    assert resolve_dtype(option, config, fast_bf16) == expected


def test_preflight_in_bf16_halves_weights_and_kv(llama: Path, tmp_path: Path) -> None:
    for f in llama.iterdir():
        (tmp_path / f.name).symlink_to(f)
    config = json.loads((llama / "config.json").read_text())
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    plan = fake_preflight(tmp_path, 1 << 20)(tmp_path, EngineConfig(dtype="bf16"))
    assert (plan.dtype, plan.weight_bytes, plan.prepack_bytes, plan.kv_bytes_per_token) == ("bf16", WEIGHTS // 2,
                                                                                          0, 256)


def test_preflight_refuses_under_a_simulated_cgroup_limit(llama: Path, tmp_path: Path) -> None:
    root = tmp_path / "cg"
    root.mkdir()
    (root / "memory.max").write_text(f"{2 * MIB}\n")
    (root / "memory.current").write_text(f"{1 * MIB}\n")
    (tmp_path / "self").write_text("0::/\n")
    with pytest.raises(InsufficientMemory, match=r"weights 545.2 KiB \+ prepacked copies 416.0 KiB \+ "
                                                 r"activations 8.0 MiB exceed the budget of 1.0 MiB"):
        preflight(llama, EngineConfig(), meminfo=meminfo(tmp_path, 8 << 20), cgroup_root=root,
                  self_cgroup=tmp_path / "self")


# ------------------------------------------------------------------------------------------- engine
def test_engine_refuses_before_loading(llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers

    from handlers.engine import build, engine

    def no_load(*args: object, **kwargs: object) -> None:
        raise AssertionError("from_pretrained must not run")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_load)
    monkeypatch.setattr(build, "preflight", fake_preflight(tmp_path, 1024))
    with pytest.raises(InsufficientMemory, match="exceed the budget of 1.0 MiB"):
        engine.LLMEngine.from_options(llama, {})


def test_engine_sizes_its_pool_from_the_plan(llama: Path, gpt2: Path) -> None:
    import torch

    from handlers.engine.engine import LLMEngine
    from handlers.engine.execution.weights.loading import load_model_and_tokenizer

    e = LLMEngine.from_options(llama, {"max_rolling_batch_size": "4", "dtype": "auto"})
    try:
        auto = "bf16" if has_fast_bf16() else "fp32"  # dtype=auto follows the CPU (test_resolve_dtype)
        assert e.config.dtype == auto and e.memory_plan.num_kv_blocks == 4 * 128
        assert e.runner.pool.num_slots == 4 * 128 * 16 and e.max_model_len == 2048
    finally:
        e.close()
    e = LLMEngine.from_options(gpt2, {"max_model_len": "100", "block_size": "4"})
    assert e.max_model_len == 64 and e.memory_plan.num_kv_blocks == 32 * 16  # capped: learned positions
    # Built around an already-loaded model: only what comes on top of the weights is planned.
    model, tokenizer, config = load_model_and_tokenizer(llama, {"max_rolling_batch_prefill_tokens": "64",
                                                                "prepack_weights": "hybrid"})
    assert next(model.parameters()).dtype == torch.float32
    loaded = LLMEngine(model, tokenizer, config, available_bytes=LINEAR + 64 * 64 * 64 + 2 * MIB)
    # The weights are not subtracted again: free = 2 MiB -> 0.9 x 2097152 = 1887436 B -> 230 blocks
    assert loaded.memory_plan.weights_resident and loaded.memory_plan.num_kv_blocks == 230


def test_auto_prepacking_falls_back_to_one_packed_copy_where_two_do_not_fit(llama: Path, tmp_path: Path,
                                                                            caplog: pytest.LogCaptureFixture) -> None:
    """``prepack_weights=auto`` plans hybrid's second copy of the linear weights; with memory for the weights, the
    activations and a KV cache but not the second copy, the plan is one packed copy (``true``), said in the log;
    an explicit ``hybrid`` is refused as before."""
    activations = 256 * 64 * 64  # 256 batched tokens x 64 hidden x 64 B
    kib = (WEIGHTS + activations + LINEAR // 2) // 1024  # half the second copy's bytes: room for a KV cache
    options = {"max_model_len": "64", "max_rolling_batch_prefill_tokens": "256"}
    with pytest.raises(InsufficientMemory, match="prepacked copies 416.0 KiB"):
        fake_preflight(tmp_path, kib)(llama, EngineConfig.from_options({**options, "prepack_weights": "hybrid"}))
    with caplog.at_level(logging.WARNING, logger="handlers.engine.planning.memory"):
        plan = fake_preflight(tmp_path, kib)(llama, EngineConfig.from_options(options))
    assert (plan.prepack_weights, plan.prepack_bytes) == ("true", 0) and plan.num_kv_blocks > 0
    assert "two copies of the linear weights do not fit; one packed copy" in caplog.text
    roomy = fake_preflight(tmp_path, 1 << 20)(llama, EngineConfig.from_options(options))
    assert (roomy.prepack_weights, roomy.prepack_bytes) == ("hybrid", LINEAR)
