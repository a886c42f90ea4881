"""option.quantize: the int8 / int4 kernel against its definition, rows independent of their batch-mates, the
engine's greedy tokens equal to transformers' on the very weights the kernel computes with, refusals by name,
and quality on the real model (perplexity on real English text)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from handlers.base import Context, Input
from handlers.engine.engine import LLMEngine
from handlers.engine.execution.kernels.int_weights import IntWeight, quantize_int4, quantize_int8
from handlers.engine.execution.kernels.quantize import QuantizedLinear, quantize_linears
from handlers.engine.planning.checkpoint import WeightFigures, quantized_weights
from handlers.engine.planning.engine_config import EngineConfig
from handlers.huggingface import HuggingFaceHandler
from rollcore.errors import ConfigError
from rollcore.types import SamplingParams
from tests.engine.conftest import greedy_together, make_prompts
from tests.real_model import smollm2_folder

ROW_COUNTS = (1, 2, 3, 4, 5, 6, 7, 8, 13, 24, 37, 130)


def _layer(n: int, k: int, bias: bool, seed: int) -> nn.Linear:
    torch.manual_seed(seed)
    layer = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        layer.weight.mul_(torch.linspace(0.2, 3.0, n)[:, None])  # channels of different ranges
    return layer


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("n, k, bias", [(40, 64, True), (16, 96, False), (300, 160, True)])
def test_kernel_computes_x_times_the_dequantized_weight(bits: int, n: int, k: int, bias: bool) -> None:
    layer = _layer(n, k, bias, seed=n + k)
    q = QuantizedLinear.from_linear(layer, bits, 32)
    w = q.dequantized()
    assert w.shape == (n, k)
    # the quantization itself: within half a step of the original everywhere
    if bits == 8:
        step = layer.weight.abs().amax(dim=1, keepdim=True) / 127
    else:
        grouped = layer.weight.view(n, k // 32, 32)
        step = ((grouped.amax(2) - grouped.amin(2)) / 15).repeat_interleave(32, dim=1)
    assert bool(((w - layer.weight).abs() <= step / 2 + 1e-6).all())
    for m in ROW_COUNTS:  # fresh inputs each time: a row the kernel skipped cannot match by leftover memory
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        expected = x.double() @ w.double().T + (layer.bias.double() if bias else 0)
        got = q(x)
        assert got.shape == (m, n)
        torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bits", [8, 4])
def test_a_row_does_not_depend_on_its_batch_mates_or_the_thread_count(bits: int) -> None:
    q = QuantizedLinear.from_linear(_layer(200, 128, True, seed=3), bits, 32)
    x = torch.randn(130, 128, generator=torch.Generator().manual_seed(7))
    alone = torch.cat([q(x[i:i + 1]) for i in range(x.shape[0])])
    for m in ROW_COUNTS:
        assert torch.equal(q(x[:m]), alone[:m]), m  # bit for bit: the same operations in the same order
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert torch.equal(q(x), alone)
    finally:
        torch.set_num_threads(threads)


def _grouped_int8(n: int, k: int, group: int, seed: int) -> IntWeight:
    """int8 with a scale per group of ``group`` inputs (a GGUF file's Q8_0 / Q6_K form)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    return IntWeight(q, 8, torch.rand(n, k // group, generator=gen) * 0.02 + 0.001, None, group)


@pytest.mark.parametrize("mode", ["int8", "int8x2"])
@pytest.mark.parametrize("weights", ["int4-g32", "int8-channel", "int8-g16", "int8-g32-min"])
def test_integer_inputs_keep_a_row_independent_of_its_batch_mates(mode: str, weights: str) -> None:
    """The integer-input kernels change path with the row count (tiles that convert their weights, then weights
    converted once per group for every row): a row's result is bit-identical on either path, close to the
    fp32-input one (int8: llama.cpp's precision; int8x2: inputs to about 1e-5 of their group's largest)."""
    layer = _layer(200, 128, True, seed=5)
    if weights == "int4-g32":
        weight = quantize_int4(layer.weight.detach(), 32)
    elif weights == "int8-channel":
        weight = quantize_int8(layer.weight.detach())
    else:
        grouped = _grouped_int8(200, 128, 16 if weights == "int8-g16" else 32, seed=9)
        minimum = None if weights == "int8-g16" else -grouped.scale * 3
        weight = IntWeight(grouped.q, 8, grouped.scale, minimum, grouped.group)
    q = QuantizedLinear(weight, layer.bias)
    if q.use_activations(mode) != mode:
        assert not q._fn.int8_dot(128, weight.group)  # a CPU without AVX-512 VNNI/VBMI keeps fp32 inputs
    x = torch.randn(130, 128, generator=torch.Generator().manual_seed(11))
    alone = torch.cat([q(x[i:i + 1]) for i in range(x.shape[0])])
    for m in ROW_COUNTS:
        assert torch.equal(q(x[:m]), alone[:m]), m
    exact = x.double() @ weight.dequantize().double().T + layer.bias.double()
    err = ((alone.double() - exact).norm() / exact.norm()).item()
    assert err < (2e-2 if q.activations == "int8" else 1e-4), err


def test_inputs_of_other_shapes_and_dtypes() -> None:
    q = QuantizedLinear.from_linear(_layer(24, 64, True, seed=1), 8, 32)
    x = torch.randn(3, 5, 64)
    torch.testing.assert_close(q(x), x @ q.dequantized().T + q.bias)
    torch.testing.assert_close(q(x[:, :, ::1].transpose(0, 1)), (x @ q.dequantized().T + q.bias).transpose(0, 1))
    with pytest.raises(RuntimeError, match="input of 63 features for a layer of 64"):
        q(torch.randn(2, 63))


def test_refusals_name_the_cause() -> None:
    model = nn.Sequential(nn.Linear(48, 32), nn.ReLU(), nn.Linear(32, 8))
    with pytest.raises(ValueError, match="option.quantize=awq is not supported"):
        quantize_linears(model, "awq")
    with pytest.raises(ValueError, match="quantize_group_size=32 does not divide 0's 48 inputs"):
        quantize_linears(model, "int4", 32)
    with pytest.raises(ValueError, match="set option.dtype=fp32"):
        quantize_linears(nn.Sequential(nn.Linear(8, 8).to(torch.bfloat16)), "int8")
    assert quantize_linears(model, "int4", 16) == 2
    assert [type(m).__name__ for m in model] == ["QuantizedLinear", "ReLU", "QuantizedLinear"]


def test_the_engine_refuses_tensor_parallelism_and_unknown_modes(model_dirs: dict[str, Path]) -> None:
    with pytest.raises(ConfigError, match="not combined with tensor parallelism"):
        LLMEngine.from_options(model_dirs["llama"], {"quantize": "int8", "tensor_parallel_degree": "2"})
    with pytest.raises(ConfigError, match="option.quantize = 'gptq'.*int8"):
        EngineConfig.from_options({"quantize": "gptq"})


def test_preflight_counts_quantized_weights() -> None:
    fp32 = WeightFigures(total_bytes=1000, linear_bytes=800, tied_bytes=200)
    int8 = quantized_weights(fp32, "int8", 32)
    assert (int8.total_bytes, int8.linear_bytes) == (1000 - 600 + 200, 0)  # the tied head's copy, embedding kept
    int4 = quantized_weights(fp32, "int4", 32)
    assert int4.total_bytes == 1000 - 600 + int(600 / 4 * (0.5 + 8 / 32) + 200 / 4)


def test_int4_keeps_the_output_projection_at_int8(model_dirs: dict[str, Path]) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dirs["llama"], dtype=torch.float32)
    quantize_linears(model, "int4", 32)
    assert model.lm_head.bits == 8
    assert {m.bits for name, m in model.named_modules() if isinstance(m, QuantizedLinear) and name != "lm_head"} == {4}


def _dequantized_twin(model_dir: Path, mode: str) -> nn.Module:
    """transformers' own model with every linear weight replaced by what the kernel computes with."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    quantize_linears(model, mode, 32)
    for name, module in model.named_modules():
        if isinstance(module, QuantizedLinear):
            target = reference.get_submodule(name)
            target.weight = nn.Parameter(module.dequantized(), requires_grad=False)
    return reference


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_engine_greedy_equals_transformers_on_the_quantized_weights(model_dirs: dict[str, Path], mode: str) -> None:
    model_dir = model_dirs["llama"]
    twin = _dequantized_twin(model_dir, mode)
    engine = LLMEngine.from_options(model_dir, {"quantize": mode, "num_kv_blocks": "64", "block_size": "4"})
    prompts = make_prompts(5, seed=11)
    got = greedy_together(engine, prompts, 10)
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            out = twin.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=10,
                                attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        assert got[i] == out[0, len(prompt):].tolist(), i


def _license_text_ids(tokenizer: object, tokens: int) -> list[int]:
    text = Path("/usr/share/common-licenses/Apache-2.0").read_text()
    ids = tokenizer(text)["input_ids"]  # type: ignore[operator]
    return list(ids[:tokens])


def _perplexity(model: nn.Module, ids: list[int]) -> float:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1]
    nll = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]))
    return math.exp(nll.item())


def test_real_model_perplexity_and_the_dynamic_handler() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = smollm2_folder()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = _license_text_ids(tokenizer, 512)
    fp32 = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    base = _perplexity(fp32, ids)
    assert 1.5 < base < 30  # a trained model on English text (a random one is in the tens of thousands)
    quantize_linears(fp32, "int8")
    int8 = _perplexity(fp32, ids)
    assert int8 <= base * 1.01, (base, int8)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    quantize_linears(model, "int4", 32)
    int4 = _perplexity(model, ids)
    assert int4 <= base * 1.08, (base, int4)
    # the dynamic (generate) handler quantizes the same way and still answers
    handler = HuggingFaceHandler()
    handler.initialize(Context("m", folder, {"quantize": "int8"}))
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    out = handler.handle([Input("d", "The capital of France is", params)])[0]
    assert "Paris" in tokenizer.decode([t.id for t in out.tokens])


@pytest.mark.parametrize("method, bits", [("bitsandbytes", 4), ("fp8", None), ("compressed-tensors", None)])
def test_checkpoints_quantized_in_other_formats_are_refused_by_name(model_dirs: dict[str, Path], tmp_path: Path,
                                                                     method: str, bits: int | None) -> None:
    import json
    import shutil

    folder = tmp_path / "quantized"
    shutil.copytree(model_dirs["llama"], folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": method, **({"bits": bits} if bits else {})}
    (folder / "config.json").write_text(json.dumps(config))
    want = rf"^quantized/config.json: quantization_config \(quant_method '{method}'"
    if method == "compressed-tensors" and importlib.util.find_spec("compressed_tensors") is not None:
        return  # transformers decompresses such a checkpoint with that package: not refused
    with pytest.raises(ConfigError, match=want):
        LLMEngine.from_options(folder, {})
    with pytest.raises(ConfigError, match=want):
        HuggingFaceHandler().initialize(Context("m", folder, {}))


@pytest.mark.parametrize("bits", [4, 8])
def test_the_packer_writes_the_layout_numpy_writes(bits: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """``csrc/pack_blocks.c`` (tiles of 64 columns) against the numpy path it replaces, on widths that leave a
    partial tile (the kernel against the dequantized weight: the tests above)."""
    from handlers.engine.execution.kernels import int_weights

    assert int_weights._pack_kernel() is not None  # a C compiler is part of the test environment
    gen = torch.Generator().manual_seed(bits)
    q = torch.randint(0, 16 if bits == 4 else 256, (48, 200), generator=gen, dtype=torch.uint8)
    built = int_weights._packed_bytes(q, bits)
    monkeypatch.setattr(int_weights, "_pack_kernel", lambda: None)
    assert torch.equal(built, int_weights._packed_bytes(q, bits))
