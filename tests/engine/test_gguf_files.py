"""GGUF files loaded as they are (``handlers.engine.execution.weights.gguf_load``), against the format's own reference:
transformers' GGUF loader, which dequantizes every tensor with the ``gguf`` package's ``dequantize``. The files are
the small ones of ``tests/data/gguf`` (made by llama.cpp's quantizer, every type the server loads); the real
SmolLM2 Q4_1 file shows the memory: no fp32 copy while loading."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from handlers.base import Context, Input
from handlers.engine.engine import LLMEngine
from handlers.engine.execution.kernels.quantize import QuantizedEmbedding, QuantizedLinear
from handlers.engine.execution.weights.gguf_load import _name_map, load_gguf_model
from handlers.engine.planning.gguf_plan import GGUFFileError, read_header
from handlers.gguf_folder import write_folder
from handlers.huggingface import HuggingFaceHandler
from rollcore.types import SamplingParams
from tests.engine.conftest import greedy_together
from tests.real_model import smollm2_gguf

DATA = Path(__file__).parents[1] / "data" / "gguf"
FILES = sorted(DATA.glob("tiny-*.gguf"))
EVERY_TYPE = {"F16", "BF16", "F32", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"}
PROMPT = [258, 72, 101, 108, 108, 111, 32, 116, 104, 101, 114, 101, 44, 32, 119, 111, 114, 108, 100]


def test_the_files_hold_every_supported_type() -> None:
    seen = {kind for path in FILES for kind in read_header(path).types()}
    assert seen == EVERY_TYPE, seen


def _folder(gguf: Path, tmp: Path) -> Path:
    out = tmp / gguf.stem
    write_folder(gguf, out)
    return out


def _reference(folder: Path) -> nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, gguf_file="model.gguf", dtype=torch.float32).eval()


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_weights_equal_the_reference_dequantization_and_logits_follow(path: Path, tmp_path: Path) -> None:
    folder = _folder(path, tmp_path)
    model = load_gguf_model(folder, folder / "model.gguf", "auto", 32, "fp32")
    reference = _reference(folder)
    floats = path.stem in ("tiny-F16", "tiny-BF16")  # their matrices become int8 per channel: within half a step
    kinds = {t.name: t.type_name for t in read_header(path).tensors}
    names = _name_map(reference, "llama")
    quantized = 0
    for name, module in model.named_modules():
        if isinstance(module, QuantizedLinear) and not name.endswith("table"):
            want = reference.get_submodule(name).weight
            if floats:
                step = want.abs().amax(dim=1, keepdim=True) / 127
                assert ((module.dequantized() - want).abs() <= step * 0.5001).all(), name
                with torch.no_grad():  # the reference computes with the weights the kernel holds from here on
                    want.copy_(module.dequantized())
            else:
                # the file's integers and scales: the reference's values up to fp32 rounding of q*scale+min, and
                # for K-quants the scales rounded to fp16 (2^-11 of a scale)
                rounded = kinds[names[f"{name}.weight"]].endswith("_K")
                tol = (2e-3 if rounded else 1e-6) * want.abs().max().item()
                torch.testing.assert_close(module.dequantized(), want, rtol=0, atol=tol)
            quantized += 1
    assert quantized == 2 * 7 + 1  # every projection of both layers and the output projection
    assert isinstance(model.get_input_embeddings(), QuantizedEmbedding)
    table = reference.get_input_embeddings().weight
    ours = model.get_input_embeddings()(torch.arange(table.shape[0]))
    if floats:
        assert ((ours - table).abs() <= table.abs().amax(dim=1, keepdim=True) / 254 * 1.001).all()
        with torch.no_grad():
            table.copy_(ours)
    embed_rounded = kinds["token_embd.weight"].endswith("_K")
    torch.testing.assert_close(ours, table, rtol=0, atol=2e-3 * table.abs().max().item() if embed_rounded else 1e-5)
    with torch.no_grad():
        got, want = model(torch.tensor([PROMPT])).logits, reference(torch.tensor([PROMPT])).logits
    rounded = any(kind.endswith("_K") for kind in kinds.values())
    torch.testing.assert_close(got, want, rtol=0, atol=(5e-3 if rounded else 2e-4) * want.abs().max().item())


def test_quantize_none_is_the_fp32_detour(tmp_path: Path) -> None:
    folder = _folder(DATA / "tiny-Q4_K_M.gguf", tmp_path)
    model = load_gguf_model(folder, folder / "model.gguf", "none", 32)
    assert not any(isinstance(m, (QuantizedLinear, QuantizedEmbedding)) for m in model.modules())
    reference = _reference(folder)
    for name, param in reference.named_parameters():
        torch.testing.assert_close(model.get_parameter(name), param, rtol=0, atol=0)


def test_float_files_load_as_int8_or_int4_as_asked(tmp_path: Path) -> None:
    folder = _folder(DATA / "tiny-F16.gguf", tmp_path)
    default = load_gguf_model(folder, folder / "model.gguf", "auto", 32)
    int4 = load_gguf_model(folder, folder / "model.gguf", "int4", 32)
    bits = {name: m.bits for name, m in default.named_modules() if isinstance(m, QuantizedLinear)}
    assert set(bits.values()) == {8}, bits
    bits4 = {name: m.bits for name, m in int4.named_modules() if isinstance(m, QuantizedLinear)}
    assert bits4["model.layers.0.mlp.down_proj"] == 4 and bits4["model.embed_tokens.table"] == 8, bits4


@pytest.mark.parametrize("name", ["tiny-Q4_K_M", "tiny-Q4_0", "tiny-Q8_0"])
def test_the_memory_plan_is_what_loading_takes(name: str, tmp_path: Path) -> None:
    folder = _folder(DATA / f"{name}.gguf", tmp_path)
    model = load_gguf_model(folder, folder / "model.gguf", "auto", 32)
    # fp16 tables: the legacy types' own fp16 scales, the K-quants' products rounded to fp16
    halves = {m.scale.dtype for n, m in model.named_modules() if isinstance(m, QuantizedLinear) and "layers" in n}
    assert halves == {torch.float16}, halves
    tensors = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
               for t in [*model.parameters(), *model.buffers()] if t is not None}
    rotary = sum(b.nbytes for name, b in model.named_buffers() if "rotary" in name)
    assert read_header(folder / "model.gguf").served_bytes() == sum(tensors.values()) - rotary


def _iq4_nl_file(path: Path) -> Path:
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("token_embd.weight", np.zeros((4, 18), dtype=np.uint8), raw_dtype=gguf.GGMLQuantizationType.IQ4_NL)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_bad_files_are_refused_by_name(tmp_path: Path) -> None:
    iq = _iq4_nl_file(tmp_path / "odd.gguf")
    with pytest.raises(GGUFFileError, match=r"^GGUF file odd.gguf: tensor token_embd.weight is IQ4_NL, which"):
        read_header(iq)
    whole = (DATA / "tiny-Q4_K_M.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(GGUFFileError, match=r"^GGUF file cut.gguf is truncated: its tensors need \d+ bytes, the file "
                                            r"has \d+$"):
        read_header(cut)
    header_cut = tmp_path / "head.gguf"
    header_cut.write_bytes(whole[:300])
    with pytest.raises(GGUFFileError, match=r"^GGUF file head.gguf: its header is truncated or corrupt"):
        read_header(header_cut)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"\x00" * 4096)
    with pytest.raises(GGUFFileError, match=r"^junk.gguf is not a GGUF file"):
        read_header(junk)
    for bad in (iq, cut):  # the folder step refuses them too, with the file's name and no path
        done = subprocess.run([sys.executable, "-m", "handlers.gguf_folder", str(bad), str(tmp_path / "out")],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 2 and bad.name in done.stderr and str(tmp_path) not in done.stderr, done.stderr


def test_the_dynamic_handler_serves_a_file(tmp_path: Path) -> None:
    folder = _folder(DATA / "tiny-Q4_K_M.gguf", tmp_path)
    handler = HuggingFaceHandler()
    handler.initialize(Context("m", folder, {"quantized_activations": "fp32"}))
    assert isinstance(handler.model.get_input_embeddings(), QuantizedEmbedding)
    reference = _reference(folder)
    text = "Hello there, world"
    ids = handler.tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        want = reference.generate(ids, do_sample=False, max_new_tokens=8, attention_mask=torch.ones_like(ids),
                                  eos_token_id=None)
    out = handler.handle([Input("d", text, SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True))])[0]
    assert [t.id for t in out.tokens] == want[0, ids.shape[1]:].tolist()


_PEAK = """
import json, sys, torch, transformers, gguf
from pathlib import Path
import transformers.models.llama.modeling_llama  # the code's own memory, not the weights'
from handlers.engine.execution.kernels import quantize
from handlers.engine.execution.weights import gguf_load
quantize._kernel()
def status(key):
    return int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1]) * 1024
before = status("VmRSS:")
open("/proc/self/clear_refs", "w").write("5")  # resets VmHWM: the peak from here on
model = gguf_load.load_gguf_model(Path(sys.argv[1]), Path(sys.argv[1]) / "model.gguf", "auto", 32)
held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in [*model.parameters(), *model.buffers()]}
print(json.dumps({"before": before, "peak": status("VmHWM:"), "after": status("VmRSS:"), "held": sum(held.values())}))
"""


def test_loading_the_real_file_never_holds_an_fp32_copy(tmp_path: Path) -> None:
    gguf = smollm2_gguf()
    folder = _folder(gguf, tmp_path)
    header = read_header(gguf)
    fp32 = 4 * sum(t.numel for t in header.tensors)
    largest = max(t.served_bytes() for t in header.tensors)
    done = subprocess.run([sys.executable, "-c", _PEAK, str(folder)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr[-2000:]
    rss = json.loads(done.stdout.strip().splitlines()[-1])
    peak_over = rss["peak"] - rss["after"]
    # the model holds the served form, byte for byte as the header plans it (norms' fp32 and the packing's padding
    # aside); RSS grows by that plus what the allocator and lazily imported code keep, and the peak is one tensor's
    # work above it: never an fp32 copy
    assert header.served_bytes() <= rss["held"] <= 1.05 * header.served_bytes(), (rss, header.served_bytes())
    assert peak_over <= 6 * largest, (rss, largest)
    assert rss["peak"] - rss["before"] < fp32 / 3, (rss, fp32)


@pytest.mark.parametrize("name", ["tiny-Q4_K_M", "tiny-Q6_K", "tiny-Q5_0"])
def test_the_rolling_engine_serves_a_file_greedy_as_transformers(name: str, tmp_path: Path) -> None:
    folder = _folder(DATA / f"{name}.gguf", tmp_path)
    engine = LLMEngine.from_options(folder, {"num_kv_blocks": "64", "block_size": "4", "max_model_len": "256",
                                             "quantized_activations": "fp32"})
    assert engine.runner.lean is not None  # the engine's own forward, not transformers'
    assert isinstance(engine.model.get_input_embeddings(), QuantizedEmbedding)
    reference = _reference(folder)
    prompts = [PROMPT, PROMPT[:7], [258, *range(65, 90)]]
    got = greedy_together(engine, prompts, 10)
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            out = reference.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=10, eos_token_id=None,
                                     attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        assert got[i] == out[0, len(prompt):].tolist(), i


def _int8_kernel() -> bool:
    from handlers.engine.execution.kernels.quantize import _kernel

    fn = _kernel()
    return fn is not None and bool(fn.int8_dot(256, 32))


def test_integer_activations_where_the_cpu_has_them(tmp_path: Path) -> None:
    """int8 inputs (llama.cpp's precision) and int8x2 (the default for a file): close to the fp32-input result,
    and a row's logits the same alone or in a batch. On a CPU without AVX-512 VNNI/VBMI the layers keep fp32."""
    folder = _folder(DATA / "tiny-Q4_K_M.gguf", tmp_path)
    exact = load_gguf_model(folder, folder / "model.gguf", "auto", 32, "fp32")
    assert {m.activations for m in exact.modules() if isinstance(m, QuantizedLinear)} == {"fp32"}
    rows = torch.tensor([PROMPT, PROMPT[::-1]])
    with torch.no_grad():
        want = exact(rows).logits
    for mode, bound in (("int8", 2e-2), ("auto", 2e-4)):
        model = load_gguf_model(folder, folder / "model.gguf", "auto", 32, mode)
        modes = {m.activations for m in model.modules() if isinstance(m, QuantizedLinear)}
        expected = ("int8" if mode == "int8" else "int8x2") if _int8_kernel() else "fp32"
        assert modes == {expected}, modes
        with torch.no_grad():
            got, alone = model(rows).logits, model(rows[1:]).logits
        assert torch.equal(alone[0], got[1])
        err = ((got - want).norm() / want.norm()).item()
        assert err < (bound if _int8_kernel() else 1e-6), (mode, err)


def test_auto_inputs_are_llama_cpps_int8_from_a_billion_weights(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """``auto`` follows the model's size: int8x2 below the threshold, int8 at it (the tiny file stands in for a
    large model by moving the threshold to its own weight count)."""
    from handlers.engine.execution.kernels import quantize

    assert quantize.auto_activations(quantize.LARGE_MODEL_WEIGHTS - 1) == "int8x2"
    assert quantize.auto_activations(quantize.LARGE_MODEL_WEIGHTS) == "int8"
    folder = _folder(DATA / "tiny-Q4_0.gguf", tmp_path)
    small = load_gguf_model(folder, folder / "model.gguf", "auto", 32)
    layers = [m for m in small.modules() if isinstance(m, QuantizedLinear)]
    weights = sum(m.in_features * m.out_features for m in layers)
    integer = _int8_kernel()
    assert {m.activations for m in layers} == {"int8x2" if integer else "fp32"}
    monkeypatch.setattr(quantize, "LARGE_MODEL_WEIGHTS", weights)
    large = load_gguf_model(folder, folder / "model.gguf", "auto", 32)
    assert {m.activations for m in large.modules() if isinstance(m, QuantizedLinear)} == \
        {"int8" if integer else "fp32"}


def test_the_default_activations_keep_the_real_models_answers_and_perplexity() -> None:
    import math

    from transformers import AutoTokenizer

    from tests.real_model import smollm2_gguf_folder

    folder = smollm2_gguf_folder()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = torch.tensor([tokenizer(Path("/usr/share/common-licenses/Apache-2.0").read_text())["input_ids"][:512]])
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                         add_generation_prompt=True, return_tensors="pt")
    chat = chat["input_ids"] if hasattr(chat, "keys") else chat
    ppl, answers = {}, {}
    for mode in ("fp32", "auto"):
        model = load_gguf_model(folder, folder / "model.gguf", "auto", 32, mode)
        with torch.no_grad():
            logits = model(ids).logits[0, :-1]
            answers[mode] = model.generate(chat, max_new_tokens=8, do_sample=False)[0, chat.shape[1]:].tolist()
        ppl[mode] = math.exp(torch.nn.functional.cross_entropy(logits, ids[0, 1:]).item())
    assert 1.5 < ppl["fp32"] < 30, ppl  # a trained model on English text
    assert abs(ppl["auto"] / ppl["fp32"] - 1) < 1e-3, ppl
    # this question's first token is a knife edge (llama.cpp's own int8 inputs answer "L'Étoile, ..."): the
    # default keeps the fp32-input answer
    assert answers["auto"] == answers["fp32"], answers
    assert "Paris" in tokenizer.decode(answers["auto"]), tokenizer.decode(answers["auto"])


def test_a_file_is_planned_from_its_header_before_anything_loads(tmp_path: Path) -> None:
    """``serving config`` and the preflight on ``option.model_id=FILE.gguf``: the weights as served, from the
    header; a machine too small refuses the model before loading, naming both figures."""
    from handlers.engine.planning.engine_config import EngineConfig
    from handlers.engine.planning.memory import InsufficientMemory, preflight
    from handlers.preflight import memory_plan_text

    path = DATA / "tiny-Q4_K_M.gguf"
    header = read_header(path)
    assert header.model_config()["num_hidden_layers"] == 2 and header.model_config()["num_key_value_heads"] == 2
    text = memory_plan_text(tmp_path, str(path), {"rolling_batch": "scheduler"})
    assert "GGUF header of tiny-Q4_K_M.gguf" in text and "Q4_K" in text, text
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemAvailable: 512 kB\n")
    with pytest.raises(InsufficientMemory, match=r"weights .*(KiB|MiB)"):
        preflight(path, EngineConfig.from_options({}), meminfo=meminfo, cgroup_root=tmp_path / "none",
                  self_cgroup=tmp_path / "none")
