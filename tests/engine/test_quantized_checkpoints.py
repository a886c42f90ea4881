"""Quantized checkpoints of the vLLM/LMI world loaded straight into the integer kernels (``quant_ckpt_load``), made
FROM THE REAL SmolLM2 fp32 weights: compressed-tensors ``pack-quantized`` by compressed-tensors itself (min-max
scales from its own ``calculate_qparams``, compressed by its ``ModelCompressor``), the reference its own
``PackedQuantizationCompressor.decompress``; GPTQ and AWQ GEMM packed by auto-round's exporters' own layers (GPTQ:
``auto_round_extension``'s ``QuantLinear``, AutoGPTQ's packing, zeros stored minus one; AWQ: ``WQLinear_GEMM``,
AutoAWQ's) from min-max scales and zero points (GPTQModel 7.7 needs a newer torch than CI's; AutoGPTQ 0.7.1 does not
import under transformers 5), the reference GPTQ's dequantization by that same ``QuantLinear``'s forward and AWQ's
by compressed-tensors' ``AutoAWQConverter``. Then: greedy tokens equal transformers' on the reference weights (the
rolling engine and the dynamic handler), refusals by name, the plan, and option.quantize on a float checkpoint
quantized while loading (same layers as before, a bounded peak)."""

from __future__ import annotations

import copy
import functools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from handlers.base import Context, Input
from handlers.engine.engine import LLMEngine
from handlers.engine.execution.kernels.quantize import QuantizedLinear, quantize_linears
from handlers.engine.execution.weights.quant_ckpt_load import load_quantized_checkpoint, load_quantizing
from handlers.engine.planning.engine_config import EngineConfig
from handlers.engine.planning.memory import preflight
from handlers.engine.planning.quant_config import parse_checkpoint_quant
from handlers.huggingface import HuggingFaceHandler
from handlers.preflight import checkpoint_parameters
from rollcore.errors import ConfigError
from rollcore.types import SamplingParams
from tests.engine.conftest import greedy_together
from tests.real_model import smollm2_folder

# compressed-tensors' schemes: (bits, group size (0: per channel), symmetric)
CT = {"ct-w4-g32": (4, 32, True), "ct-w4-g64-asym": (4, 64, False), "ct-w8-channel": (8, 0, True),
      "ct-w8-channel-asym": (8, 0, False)}
GROUP = 64  # GPTQ and AWQ: 576 and 1536 inputs (128 divides neither 576 nor 192 output channels of k/v)
TEXTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
         "The three primary colors are", "Water boils at"]
NEW_TOKENS = 8
GREEDY = ("ct-w4-g32", "ct-w8-channel", "gptq", "awq")  # served through the handler and the engine


@functools.cache
def _fp32_base() -> nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_folder(), dtype=torch.float32).eval()


def fp32_model() -> nn.Module:
    """A fresh fp32 SmolLM2 (a copy: reading the GGUF into fp32 takes ~2 s, copying it a tenth of that)."""
    return copy.deepcopy(_fp32_base())


def _linears(model: nn.Module) -> dict[str, nn.Linear]:
    return {n: m for n, m in model.named_modules() if type(m) is nn.Linear and n != "lm_head"}


def copy_folder_files(base: Path, out: Path) -> None:
    for path in base.iterdir():
        if path.suffix != ".safetensors" and path.name != "config.json" and not (out / path.name).exists():
            shutil.copy(path, out / path.name)


def build_compressed_tensors(base: nn.Module, out: Path, bits: int, group: int, symmetric: bool) -> None:
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        QuantizationStatus,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    model = copy.deepcopy(base)
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric, strategy="group" if group else "channel",
                            group_size=group or None)
    config = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)},
                                ignore=["lm_head"], quantization_status=QuantizationStatus.INITIALIZED)
    apply_quantization_config(model, config, show_progress=False)
    for module in _linears(model).values():  # calibration-free min-max observers
        w = module.weight.data
        grouped = w.view(w.shape[0], -1, group) if group else w.unsqueeze(1)
        scale, zero = calculate_qparams(grouped.amin(2), grouped.amax(2), args)
        module.weight_scale.data.copy_(scale)
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data.copy_(zero)
    compressor = ModelCompressor.from_pretrained_model(model, "pack-quantized")
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(out)


def _minmax_4bit(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit per group: q, zero (uint 0..15) [out, in] / [out, groups], fp16 scales [out, groups]."""
    grouped = w.view(w.shape[0], -1, group)
    lo, hi = grouped.amin(2).clamp(max=0), grouped.amax(2).clamp(min=0)
    scale = ((hi - lo) / 15).clamp(min=1e-6).half()
    zero = torch.round(-lo / scale.float()).clamp(0, 15)
    q = torch.round(grouped / scale.float()[..., None] + zero[..., None]).clamp(0, 15).view_as(w)
    return q.to(torch.int64), zero.to(torch.int64), scale


def _words(values: torch.Tensor) -> torch.Tensor:
    """[..., 8] values 0..15 -> int32 words, value i at bits 4i."""
    words = (values << torch.arange(0, 32, 4, dtype=torch.int64)).sum(-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32).contiguous()


def _on_grid(q: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor, group: int) -> nn.Linear:
    """The layer as GPTQ and AWQ hand it to their packers: its weight ``(q - zero) * scale`` already on the grid, so
    the packer's own rounding gives ``q`` back."""
    layer = nn.Linear(q.shape[1], q.shape[0], bias=False)
    weight = (q - zero.repeat_interleave(group, 1)).float() * scale.float().repeat_interleave(group, 1)
    layer.weight = nn.Parameter(weight, requires_grad=False)
    return layer


def _gptq_packed(q: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor, group: int) -> nn.Module:
    """auto-round's GPTQ layer (AutoGPTQ's packing: ``qweight`` [in / 8, out], ``qzeros`` [groups, out / 8] stored
    minus one, fp16 ``scales`` [groups, out], ``g_idx``) packed by its own ``pack``."""
    from auto_round_extension.torch.qlinear_torch_zp import QuantLinear

    out_f, in_f = q.shape
    packed = QuantLinear(4, group, in_f, out_f, False, g_idx=True)
    packed.pack(_on_grid(q, zero, scale, group), scale.float(), zero.clone(), None, "cpu")
    return packed


def build_gptq_or_awq(base: nn.Module, out: Path, method: str, group: int = GROUP) -> None:
    """A GPTQ (original format: zeros stored minus one) or AWQ GEMM checkpoint of ``base``'s min-max 4-bit layers,
    every layer's words, zeros and scales packed by the library's own layer (auto-round's exporters)."""
    from auto_round.export.export_to_awq.utils import WQLinear_GEMM

    tensors = {k: v.contiguous() for k, v in base.state_dict().items() if k != "lm_head.weight"}
    for name, module in _linears(base).items():
        q, zero, scale = _minmax_4bit(module.weight.detach(), group)
        del tensors[f"{name}.weight"]
        if method == "gptq":
            packed = _gptq_packed(q, zero, scale, group)
            tensors[f"{name}.g_idx"] = packed.g_idx.contiguous()
        else:
            packed = WQLinear_GEMM.from_linear(_on_grid(q, zero, scale, group), 4, group, scales=scale.float().T,
                                               zeros=zero.T.to(torch.int32), device="cpu")
        for key in ("qweight", "qzeros", "scales"):
            tensors[f"{name}.{key}"] = getattr(packed, key).contiguous()
    out.mkdir()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((smollm2_folder() / "config.json").read_text())
    config["quantization_config"] = (
        {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False, "sym": False,
         "checkpoint_format": "gptq"} if method == "gptq" else
        {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"})
    (out / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("quantized")
    base = fp32_model()
    out = {}
    for name, (bits, group, symmetric) in CT.items():
        build_compressed_tensors(base, root / name, bits, group, symmetric)
        out[name] = root / name
    for method in ("gptq", "awq"):
        build_gptq_or_awq(base, root / method, method)
        out[method] = root / method
    for folder in out.values():
        copy_folder_files(smollm2_folder(), folder)
    return out


def _gptq_dequantized(tensors: dict[str, torch.Tensor], layer: str, group: int) -> torch.Tensor:
    """A GPTQ layer's weight as auto-round's ``QuantLinear`` unpacks it in its forward (fp32 scales: the stored
    fp16 values, so its products are exact), its output for the identity."""
    from auto_round_extension.torch.qlinear_torch_zp import QuantLinear

    words = tensors[f"{layer}.qweight"]
    in_f, out_f = words.shape[0] * 8, words.shape[1]
    # its groups in order (the g_idx the packer wrote): its forward's g_idx path slices the scales by the inputs
    assert torch.equal(tensors[f"{layer}.g_idx"].long(), torch.arange(in_f) // group)
    unpacker = QuantLinear(4, group, in_f, out_f, False, g_idx=False)
    for key in ("qweight", "qzeros"):
        setattr(unpacker, key, tensors[f"{layer}.{key}"])
    unpacker.scales = tensors[f"{layer}.scales"].float()
    with torch.no_grad():
        return unpacker(torch.eye(in_f)).T.contiguous()


def _reference_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Each quantized layer's float weight as the format's library unpacks it."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    tensors = load_file(folder / "model.safetensors")
    layers = sorted({k.rpartition(".")[0] for k in tensors if k.endswith((".weight_packed", ".qweight"))})
    if config["quant_method"] == "gptq":
        return {layer: _gptq_dequantized(tensors, layer, config["group_size"]) for layer in layers}
    if config["quant_method"] == "awq":
        from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter

        converter = AutoAWQConverter.from_autoawq_config(config)
        for k in [k for k in tensors if k.endswith(".scales")]:
            tensors[k] = tensors[k].float()  # the library's unpacking under test; its products exact in fp32
        tensors = converter.process(tensors)
        group = converter._build_quant_config().config_groups["config_group_0"]
        scheme = QuantizationScheme(targets=["Linear"], weights=group.weights)
    else:
        group = config["config_groups"]["group_0"]
        scheme = QuantizationScheme(targets=group["targets"], weights=QuantizationArgs(**group["weights"]))
    out = {}
    for layer in layers:
        state = {k.rpartition(".")[2]: v for k, v in tensors.items() if k.rpartition(".")[0] == layer}
        out[layer] = PackedQuantizationCompressor.decompress(state, scheme)["weight"].float()
    return out


def _reference_model(folder: Path) -> nn.Module:
    model = fp32_model()
    for name, weight in _reference_weights(folder).items():
        model.get_submodule(name).weight = nn.Parameter(weight, requires_grad=False)
    return model


def _served_bytes(model: nn.Module) -> int:
    held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in [*model.parameters(), *model.buffers()] if t is not None}
    return sum(held.values()) - sum(b.nbytes for n, b in model.named_buffers() if "rotary" in n)


@pytest.mark.parametrize("name", [*CT, "gptq", "awq"])
def test_a_checkpoint_serves_the_formats_own_dequantization(checkpoints: dict[str, Path], name: str) -> None:
    """Every layer equal to the format library's dequantization, the logits close, the memory plan what the load
    holds, and greedy tokens of 5 prompts equal ``generate`` on the reference through the dynamic handler and the
    rolling engine."""
    folder = checkpoints[name]
    reference = _reference_model(folder)
    handler = HuggingFaceHandler()
    if name in GREEDY:
        handler.initialize(Context("m", folder, {"quantized_activations": "fp32"}))
        model = handler.model
    else:  # the zero-point variants of formats served greedy here: their layers and logits
        quant = parse_checkpoint_quant(json.loads((folder / "config.json").read_text()))
        assert quant is not None and quant.method == "compressed-tensors"
        model = load_quantized_checkpoint(folder, quant, "fp32")
    quantized = {n: m for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    assert len(quantized) == 30 * 7, len(quantized)  # every projection; the tied output projection stays float
    for layer, module in quantized.items():
        want = reference.get_submodule(layer).weight
        torch.testing.assert_close(module.dequantized(), want, rtol=0, atol=1e-6 * want.abs().max().item())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ids = torch.tensor([list(range(300, 340))])
    with torch.no_grad():
        got_logits, want_logits = model(ids).logits, reference(ids).logits
    torch.testing.assert_close(got_logits, want_logits, rtol=0, atol=2e-4 * want_logits.abs().max().item())
    plan = preflight(folder, EngineConfig.from_options({}))
    assert plan.weight_bytes == _served_bytes(model) and plan.dtype == "fp32", plan.weights.source
    assert "as integers" in plan.weights.source, plan.weights.source
    # the server's layout counts parameters from the headers: packed words as the weights they hold
    # type: ignore[operator]
    assert abs(checkpoint_parameters(folder) / checkpoint_parameters(smollm2_folder()) - 1) < 0.05
    if name not in GREEDY:
        return
    prompts = [handler.tokenizer(text).input_ids for text in TEXTS]
    want = []
    for prompt in prompts:
        with torch.no_grad():
            out = reference.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW_TOKENS,
                                     attention_mask=torch.ones(1, len(prompt), dtype=torch.long), eos_token_id=None)
        want.append(out[0, len(prompt):].tolist())
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    answers = handler.handle([Input(str(i), text, params) for i, text in enumerate(TEXTS)])
    assert [[t.id for t in a.tokens] for a in answers] == want
    del handler, model, reference
    engine = LLMEngine.from_options(folder, {"num_kv_blocks": "64", "block_size": "16", "max_model_len": "256",
                                             "quantized_activations": "fp32"})
    assert engine.runner.lean is not None  # the engine's own forward over the integer layers
    assert greedy_together(engine, prompts, NEW_TOKENS) == want


def test_the_plan_is_the_quantized_size() -> None:
    fp32 = preflight(smollm2_folder(), EngineConfig.from_options({"dtype": "fp32"}))
    int8 = preflight(smollm2_folder(), EngineConfig.from_options({"dtype": "fp32", "quantize": "int8"}))
    assert int8.weight_bytes < fp32.weight_bytes / 2 and "option.quantize=int8" in int8.weights.source


def _broken_copy(source: Path, out: Path, edit: dict[str, torch.Tensor | None]) -> Path:
    out.mkdir()
    tensors = load_file(source / "model.safetensors")
    for key, value in edit.items():
        if value is None:
            del tensors[key]
        else:
            tensors[key] = value
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    for path in source.iterdir():
        if path.suffix != ".safetensors":
            shutil.copy(path, out / path.name)
    return out


def _refused(folder: Path, pattern: str) -> None:
    for load in (lambda: LLMEngine.from_options(folder, {}),
                 lambda: HuggingFaceHandler().initialize(Context("m", folder, {}))):
        with pytest.raises(ConfigError, match=pattern) as caught:
            load()
        assert str(folder.parent) not in str(caught.value)


def test_bad_tensors_are_refused_naming_the_file_and_tensor(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    source = checkpoints["ct-w4-g32"]
    scale = "model.layers.0.self_attn.q_proj.weight_scale"
    wrong = _broken_copy(source, tmp_path / "wrong", {scale: torch.ones(576, 17)})
    _refused(wrong, rf"^model\.safetensors: tensor {scale} is float32 \[576, 17\], where 18 group\(s\) per output "
                    r"channel needs \[576, 18\]$")
    missing = "model.layers.1.mlp.down_proj.weight_scale"
    gone = _broken_copy(source, tmp_path / "gone", {missing: None})
    _refused(gone, rf"^model\.safetensors: tensor {missing} is missing \(a quantized layer needs it\)$")
    qzeros = "model.layers.2.self_attn.k_proj.qzeros"
    bad_gptq = _broken_copy(checkpoints["gptq"], tmp_path / "gptq", {qzeros: torch.zeros(9, 8, dtype=torch.int32)})
    _refused(bad_gptq, rf"^model\.safetensors: tensor {qzeros} is int32 \[9, 8\], where 9 group\(s\) of 64 inputs "
                       r"needs int32 \[9, 24\]$")


@pytest.mark.parametrize("quantization, message", [
    ({"quant_method": "bitsandbytes", "bits": 4, "load_in_4bit": True},
     r"quantization_config \(quant_method 'bitsandbytes', 4 bits\) is not loaded by this server"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"},
     r"quantization_config \(quant_method 'fp8'\) is not loaded by this server"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": True},
     r"quantization_config \(quant_method 'gptq', desc_act=true\): act-order checkpoints \(g_idx\) are not loaded"),
    ({"quant_method": "gptq", "bits": 8, "group_size": 64},
     r"quantization_config \(quant_method 'gptq', 8 bits\): only 4-bit GPTQ checkpoints are loaded"),
    ({"quant_method": "awq", "bits": 4, "group_size": 64, "version": "gemv"},
     r"quantization_config \(quant_method 'awq', version 'gemv'\): only the GEMM layout is loaded"),
])
def test_other_formats_are_refused_by_name(checkpoints: dict[str, Path], tmp_path: Path,
                                           quantization: dict[str, object], message: str) -> None:
    folder = tmp_path / "other"
    folder.mkdir()
    for path in checkpoints["gptq"].iterdir():
        (folder / path.name).symlink_to(path)
    (folder / "config.json").unlink()
    config = json.loads((checkpoints["gptq"] / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))
    _refused(folder, rf"^other/config\.json: {message}")


def test_a_float_checkpoint_quantized_while_loading_has_the_same_layers_as_before() -> None:
    """option.quantize on fp32 safetensors: the layers ``quantize_linears`` made from the whole loaded model, bit
    for bit (so the served answers do not change)."""
    for mode in ("int4",):  # int4 layers and the int8 output projection: both of quantize_linears' forms
        new = load_quantizing(smollm2_folder(), mode, 32, "fp32")
        assert new is not None
        old = fp32_model()
        quantize_linears(old, mode, 32)
        layers = {n: m for n, m in old.named_modules() if isinstance(m, QuantizedLinear)}
        assert len(layers) == 30 * 7 + 1
        for name, module in layers.items():
            ours = new.get_submodule(name)
            assert isinstance(ours, QuantizedLinear) and ours.bits == module.bits, name
            for buffer in ("qweight", "scale", "minimum"):
                a, b = getattr(ours, buffer), getattr(module, buffer)
                assert (a is None and b is None) or torch.equal(a, b), (name, buffer)
        assert torch.equal(new.model.embed_tokens.weight, old.model.embed_tokens.weight)


_PEAK = """
import json, sys
from pathlib import Path
import transformers.models.llama.modeling_llama  # the code's own memory, not the weights'
from handlers.engine.execution.kernels import quantize
from handlers.engine.execution.weights import quant_ckpt_load
quantize._kernel()
def status(key):
    return int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1]) * 1024
before = status("VmRSS:")
open("/proc/self/clear_refs", "w").write("5")  # resets VmHWM: the peak from here on
model = quant_ckpt_load.load_quantizing(Path(sys.argv[1]), sys.argv[2], 32, "fp32")
held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in [*model.parameters(), *model.buffers()]}
print(json.dumps({"before": before, "peak": status("VmHWM:"), "held": sum(held.values())}))
"""


def _large_checkpoint(out: Path) -> tuple[int, int]:
    """A llama of ~450 MB of fp32 weights (fixed seed), nearly all in its linear layers; returns (fp32 bytes, one
    decoder layer's fp32 bytes)."""
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=10, num_attention_heads=16,
                         num_key_value_heads=4, vocab_size=2048, tie_word_embeddings=True)
    out.mkdir()
    config.save_pretrained(out)
    generator = torch.Generator().manual_seed(0)
    shapes = {"model.embed_tokens.weight": (2048, 1024), "model.norm.weight": (1024,)}
    for i in range(10):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (1024, 1024), p + "self_attn.k_proj.weight": (256, 1024),
                   p + "self_attn.v_proj.weight": (256, 1024), p + "self_attn.o_proj.weight": (1024, 1024),
                   p + "mlp.gate_proj.weight": (2816, 1024), p + "mlp.up_proj.weight": (2816, 1024),
                   p + "mlp.down_proj.weight": (1024, 2816), p + "input_layernorm.weight": (1024,),
                   p + "post_attention_layernorm.weight": (1024,)}
    tensors = {k: torch.randn(s, generator=generator) * 0.02 for k, s in shapes.items()}
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return sum(t.nbytes for t in tensors.values()), sum(t.nbytes for k, t in tensors.items()
                                                        if k.startswith("model.layers.0."))


@pytest.fixture(scope="module")
def large(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int, int]:
    folder = tmp_path_factory.mktemp("large") / "model"
    return (folder, *_large_checkpoint(folder))


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantizing_while_loading_never_holds_the_fp32_model(large: tuple[Path, int, int], mode: str) -> None:
    folder, fp32, layer = large
    done = subprocess.run([sys.executable, "-c", _PEAK, str(folder), mode], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr[-2000:]
    rss = json.loads(done.stdout.strip().splitlines()[-1])
    peak = rss["peak"] - rss["before"]
    # the served model (int8 or int4 layers, the fp32 embedding) plus one layer's work, never the fp32 weights
    assert rss["held"] < fp32 / 2.5, (rss, fp32)
    # about one layer in its checkpoint dtype beyond what is served: the layer's pages read from the file and the
    # float copy being quantized (a tenth of the fp32 model here), never the model itself
    assert peak <= rss["held"] + 2 * layer, (rss, layer)
    assert peak < fp32 / 2, (rss, fp32)
    assert peak < 0.45 * fp32, (rss, fp32)


def test_gptq_zeros_in_both_formats_and_an_out_of_order_g_idx() -> None:
    """``checkpoint_format: gptq`` (the original format, packed by auto-round's GPTQ layer) stores the zeros minus
    one, a zero of 0 as a borrow; ``gptq_v2`` stores them as they are; a ``g_idx`` that puts inputs out of their
    groups (act-order) is refused naming the tensor."""
    from handlers.engine.execution.weights.checkpoint_quant import CheckpointTensorError, LayerTensors, read_layer

    weight = torch.randn(32, 128, generator=torch.Generator().manual_seed(5))  # AutoGPTQ packs 32 outputs
    weight[:3, :32] = weight[:3, :32].abs()  # groups whose zero is 0
    q, zero, scale = _minmax_4bit(weight, 32)
    assert (zero == 0).sum() >= 3
    want = (q - zero.repeat_interleave(32, 1)).float() * scale.float().repeat_interleave(32, 1)
    packed = _gptq_packed(q, zero, scale, 32)
    for fmt, stored in (("gptq_v2", _words(zero.T.reshape(-1, 4, 8))), ("gptq", packed.qzeros)):
        tensors = {"l.qweight": packed.qweight, "l.qzeros": stored, "l.scales": packed.scales}
        quant = parse_checkpoint_quant({"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 32,
                                                                "checkpoint_format": fmt}})
        assert quant is not None and quant.zeros_offset == (fmt == "gptq")
        scheme = quant.scheme_for("l")
        assert scheme is not None
        layer = LayerTensors("l", tensors.get, lambda name: "model.safetensors")
        torch.testing.assert_close(read_layer(quant, scheme, layer, 32, 128).dequantize(), want, rtol=0, atol=1e-6)
    tensors["l.g_idx"] = (torch.arange(128) % 4).to(torch.int32)
    with pytest.raises(CheckpointTensorError, match=r"^model\.safetensors: tensor l\.g_idx orders the inputs out of "
                                                    r"their groups \(act-order\), which is not loaded$"):
        read_layer(quant, scheme, layer, 32, 128)
