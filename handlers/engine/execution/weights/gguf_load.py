"""A model built straight from a GGUF file: its quantized tensors become the kernel's integer layers, one at a time.

Design note (why: dequantizing a file first costs 8x its size in memory; a 7B Q4_K_M file of 4 GB becomes 27 GB):
the model is built with its parameters on the meta device (no memory), the file is memory-mapped, and each
tensor is read once into its final form: a quantized linear weight is read as integers and scales
(``gguf_blocks``) and packed for ``csrc/quant_linear.c``; the token embedding stays quantized too
(``QuantizedEmbedding`` reads the rows a step asks for), shared with the output projection when the model ties
them; norms and biases are small and become fp32. So the peak while loading is the final model plus one tensor.
What each ``option.quantize`` means for a GGUF file:
  auto       quantized tensors as the file has them; F16/BF16/F32 linear weights as int8 per channel;
  int8/int4  the same, with F16/BF16/F32 linear weights quantized to that (a file's blocks are never requantized);
  none       every tensor dequantized to fp32 (the fp32 detour, when the user asks for it).
Llama-architecture files store q/k rows permuted for llama.cpp's rotary layout (transformers reverses it on
load): rows are whole blocks, so the same reversal applies to the integers. Architectures whose tensors
transformers transforms in other ways are loaded by transformers dequantized (logged).
"""

from __future__ import annotations

import logging
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from torch import nn

from handlers.engine.execution.kernels.int_weights import IntWeight, quantize_int4, quantize_int8
from handlers.engine.execution.kernels.prepack import replace_module
from handlers.engine.execution.kernels.quantize import QuantizedEmbedding, QuantizedLinear, auto_activations
from handlers.engine.execution.weights.gguf_blocks import READERS, read_blocks
from handlers.engine.planning.cpu import return_freed_memory
from handlers.engine.planning.gguf_plan import GGUFFileError, GGUFHeader, GGUFTensor, read_header

logger = logging.getLogger(__name__)

# transformers' processors other than these change tensors beyond a row permutation (norm offsets, reshapes)
_DIRECT_PROCESSORS = ("TensorProcessor", "LlamaTensorProcessor")


class _Tensors:
    """The file's tensors by name, each mapped from the file and read on demand into its final form."""

    def __init__(self, header: GGUFHeader, path: Path) -> None:
        self.by_name = {t.name: t for t in header.tensors}
        self.path = path
        self.name = path.name

    @staticmethod
    def _rows_cols(t: GGUFTensor) -> tuple[int, int]:
        return t.numel // t.shape[0], t.shape[0]

    def _bytes(self, t: GGUFTensor) -> np.ndarray:
        rows, _ = self._rows_cols(t)
        return np.memmap(self.path, dtype=np.uint8, mode="r", offset=t.offset, shape=(rows, t.file_bytes() // rows))

    def is_quantized(self, key: str) -> bool:
        return self.by_name[key].type_id in READERS

    def ints(self, key: str, permute: tuple[int, int] | None) -> IntWeight:
        t = self.by_name[key]
        rows, cols = self._rows_cols(t)
        try:
            b = read_blocks(t.type_id, self._bytes(t), rows, cols)
        except ValueError as exc:
            raise GGUFFileError(f"GGUF file {self.name}: tensor {key}: {exc}") from None
        q, scale = torch.from_numpy(b.q), torch.from_numpy(np.ascontiguousarray(b.scale))
        minimum = None if b.minimum is None else torch.from_numpy(np.ascontiguousarray(b.minimum))
        if permute is not None:
            order = _unpermuted_rows(rows, *permute)
            q, scale = q[order], scale[order]
            minimum = None if minimum is None else minimum[order]
        if b.bits == 8:
            q = q.view(torch.int8) if q.dtype == torch.uint8 else q
        return IntWeight(q.contiguous(), b.bits, scale.contiguous(), None if minimum is None else minimum.contiguous(),
                         b.group)

    def floats(self, key: str, permute: tuple[int, int] | None = None) -> torch.Tensor:
        """The tensor as fp32 in transformers' shape ([rows, cols], or 1-D)."""
        from gguf import GGMLQuantizationType, dequantize

        t = self.by_name[key]
        rows, cols = self._rows_cols(t)
        try:
            raw = self._bytes(t)
            if t.type_id == 0:  # F32 and F16: the values themselves (gguf's dequantize takes them typed)
                raw = raw.view(np.float32)
            elif t.type_id == 1:
                raw = raw.view(np.float16)
            values = np.asarray(dequantize(raw, GGMLQuantizationType(t.type_id)), dtype=np.float32).reshape(rows, cols)
        except (ValueError, NotImplementedError) as exc:
            raise GGUFFileError(f"GGUF file {self.name}: tensor {key}: {exc}") from None
        out = torch.from_numpy(values.copy())
        out = out.reshape(-1) if len(t.shape) == 1 else out
        return out if permute is None else out[_unpermuted_rows(out.shape[0], *permute)]


def _unpermuted_rows(rows: int, n_head: int, n_kv: int) -> torch.Tensor:
    """The row order transformers' ``LlamaTensorProcessor`` restores: w.reshape(h, dim, 2, ...).swapaxes(1, 2)."""
    dim = rows // n_kv // 2
    return torch.arange(rows).reshape(n_kv, dim, 2).transpose(1, 2).reshape(-1)


def _empty_model(folder: Path) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):  # no memory until each tensor is read
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    for name, module in list(model.named_modules()):
        # buffers computed from the config (rotary tables): the module built again, for real
        if any(b.device.type == "meta" for b in module.buffers(recurse=False)):
            replace_module(model, name, type(module)(config=config))
    if (folder / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(folder)
    return model


def _name_map(model: nn.Module, arch: str) -> dict[str, str]:
    """HF parameter name -> GGUF tensor name, by gguf's own table for the file's architecture (built once: it is
    most of a load's time when built per module, as transformers' mapper does)."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch_id = next((k for k, v in MODEL_ARCH_NAMES.items() if v == arch), None)
    if arch_id is None:
        raise GGUFFileError(f"GGUF architecture {arch!r} is unknown to the gguf library")
    table = get_tensor_name_map(arch_id, int(model.config.num_hidden_layers))
    out = {}
    for name, _ in model.named_parameters():
        base, _, suffix = name.rpartition(".")
        mapped = table.get_name(base)
        if mapped is not None:
            out[name] = f"{mapped}.{suffix}"
    return out


def load_gguf_model(folder: Path, gguf: Path, quantize: str, group_size: int, activations: str = "auto") -> nn.Module:
    """The model of ``folder`` (config and tokenizer extracted from ``gguf``) with the weights of ``gguf``.
    ``quantize``: ``auto``, ``none``, ``int8`` or ``int4`` (see the module note); ``activations``: what the layers
    multiply (``QuantizedLinear.use_activations``; ``auto``: ``auto_activations`` of the model's size). Raises
    ``GGUFFileError``."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS

    header = read_header(gguf)  # a truncated file or a type not loaded here: refused before anything is built
    arch = header.architecture
    processor = TENSOR_PROCESSORS.get(arch)
    if processor is not None and processor.__name__ not in _DIRECT_PROCESSORS:
        logger.warning("GGUF architecture %s: its tensors are transformed on load; loaded dequantized to fp32 by "
                       "transformers", arch)
        return _transformers_load(gguf)
    model = _empty_model(folder)
    cfg = model.config
    permute_q = (cfg.num_attention_heads, cfg.num_attention_heads) if arch == "llama" else None
    permute_k = (cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads) \
        if arch == "llama" else None
    tensors = _Tensors(header, gguf)
    names = _name_map(model, arch)
    _place(model, tensors, names, quantize, group_size, permute_q, permute_k)
    left = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if left:
        raise GGUFFileError(f"GGUF file {gguf.name} has no tensor for {', '.join(left[:3])}"
                        f"{' and more' if len(left) > 3 else ''} (architecture {arch or 'unknown'})")
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    if activations == "auto":
        weights = sum(m.in_features * m.out_features for m in layers)
        activations = auto_activations(weights)
        logger.info("GGUF file %s: %d quantized linear layers, %.2e weights: %s inputs (quantized_activations=auto)",
                    gguf.name, len(layers), weights, activations)
    for module in layers:  # integer products where the CPU has them (else fp32 inputs)
        module.use_activations(activations)
    model.eval()
    return_freed_memory()  # the tensors' temporaries (a worker keeps freed memory for its steps otherwise)
    return model


def _place(model: nn.Module, tensors: _Tensors, names: dict[str, str], quantize: str, group_size: int,
           permute_q: tuple[int, int] | None, permute_k: tuple[int, int] | None) -> None:
    embedding = model.get_input_embeddings()
    head = model.get_output_embeddings()
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    embed_key = names.get(_param_name(model, embedding) + ".weight")
    table: QuantizedLinear | None = None
    if embed_key in tensors.by_name:
        if quantize == "none":
            weight = tensors.floats(embed_key)
            embedding.weight = nn.Parameter(weight, requires_grad=False)
        else:
            table = _linear(tensors, embed_key, None, None, quantize, group_size, for_embedding=True)
            replace_module(model, _param_name(model, embedding), QuantizedEmbedding(table))
    # two tensors read side by side: reading is mostly numpy's single-threaded byte work (nibbles, scales), which
    # releases the GIL; two in flight at most, so the peak stays the model plus two tensors
    in_flight: deque[tuple[str, Future[nn.Module]]] = deque()
    with ThreadPoolExecutor(2) as reader:
        for module_name, module in list(model.named_modules()):
            if type(module) is not nn.Linear:
                continue
            key = names.get(module_name + ".weight")
            if module is head and (key not in tensors.by_name) and tied:
                if table is not None:
                    replace_module(model, module_name, table)  # one copy: the embedding's rows are the head's
                else:
                    module.weight = model.get_input_embeddings().weight
                continue
            if key not in tensors.by_name:
                raise GGUFFileError(f"GGUF file {tensors.name} has no tensor for {module_name}")
            in_flight.append((module_name, reader.submit(_layer, tensors, module, key, names.get(module_name + ".bias"),
                                                         quantize, group_size, permute_q, permute_k)))
            if len(in_flight) > 1:
                _place_next(model, in_flight)
        while in_flight:
            _place_next(model, in_flight)
    for name, param in list(model.named_parameters()):
        if param.device.type != "meta":
            continue
        key = names.get(name)
        if key in tensors.by_name:
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, nn.Parameter(tensors.floats(key), requires_grad=False))


def _place_next(model: nn.Module, in_flight: deque[tuple[str, Future[nn.Module]]]) -> None:
    module_name, layer = in_flight.popleft()
    replace_module(model, module_name, layer.result())
    return_freed_memory()  # each tensor's temporaries given back


def _layer(tensors: _Tensors, module: nn.Linear, key: str, bias_key: str | None, quantize: str, group_size: int,
           permute_q: tuple[int, int] | None, permute_k: tuple[int, int] | None) -> nn.Module:
    """The layer that replaces ``module``: the file's tensor ``key`` (and its bias) in its final form."""
    permute = permute_q if key.endswith("attn_q.weight") else permute_k if key.endswith("attn_k.weight") else None
    bias = tensors.floats(bias_key, permute) if module.bias is not None and bias_key in tensors.by_name else None
    if quantize != "none":
        return _linear(tensors, key, permute, bias, quantize, group_size)
    linear = nn.Linear(module.in_features, module.out_features, bias=bias is not None, device="cpu")
    with torch.no_grad():
        linear.weight.copy_(tensors.floats(key, permute))
        if bias is not None:
            linear.bias.copy_(bias)
    return linear.requires_grad_(False)


def _param_name(model: nn.Module, module: nn.Module) -> str:
    return next(n for n, m in model.named_modules() if m is module)


def _linear(tensors: _Tensors, key: str, permute: tuple[int, int] | None, bias: torch.Tensor | None,
            quantize: str, group_size: int, for_embedding: bool = False) -> QuantizedLinear:
    """A file tensor as a quantized layer: its own blocks where it has them, else the float weight quantized
    (int4 only where asked, and never for an embedding table: per-row int8 keeps its rows as they were)."""
    if tensors.is_quantized(key):
        # K-quants' scales are products (d x a 6- or 8-bit sub-scale), inexact in fp16: rounded to it (2^-11 of a
        # scale, ~1/4000 of a quantization step), which makes a Q4_K_M model 20% smaller and its decode as fast
        return QuantizedLinear(tensors.ints(key, permute), bias, half_scales=True)
    weight = tensors.floats(key, permute)
    if quantize == "int4" and not for_embedding and weight.shape[1] % group_size == 0:
        return QuantizedLinear(quantize_int4(weight, group_size), bias)
    return QuantizedLinear(quantize_int8(weight), bias)


def _transformers_load(gguf: Path) -> nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
