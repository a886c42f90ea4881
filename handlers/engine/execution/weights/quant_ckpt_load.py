"""A model built from a safetensors checkpoint one tensor at a time, its linear layers made integer as they are read:
a quantized checkpoint's (compressed-tensors, GPTQ, AWQ) as it holds them, or a 16/32-bit checkpoint's quantized
on the way in (``option.quantize=int8|int4``).

Design note (why not transformers' loader then ``quantize_model``: that holds the whole fp32 model first, 4x the
served int8 size; its GPTQ/AWQ loaders need GPU packages, and its compressed-tensors path decompresses to float):
as ``gguf_load`` does for a GGUF file, the model is built on the meta device, and each tensor is read from its
file (``safetensors.safe_open``) into its final form, then dropped: a quantized layer's packed integers through
``checkpoint_quant``, a float layer's weight through ``quantize_int8``/``quantize_int4`` exactly as
``quantize_linears`` does after a float load (so answers do not change), norms, biases and the embedding as fp32.
The peak while loading is the served model plus one layer in its checkpoint dtype. Layers a quantized checkpoint
leaves in float (its ``ignore``, a tied output projection) stay float, as the format's own dequantization has them.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from handlers.engine.execution.kernels.int_weights import quantize_int4, quantize_int8
from handlers.engine.execution.kernels.prepack import replace_module
from handlers.engine.execution.kernels.quantize import QUANTIZE_MODES, QuantizedLinear, float_checkpoint_activations
from handlers.engine.execution.weights.checkpoint_quant import CheckpointTensorError, LayerTensors, read_layer
from handlers.engine.execution.weights.gguf_load import _empty_model
from handlers.engine.planning.cpu import return_freed_memory
from handlers.engine.planning.quant_config import QUANT_SUFFIXES, CheckpointQuant, parse_checkpoint_quant
from rollcore.errors import ConfigError
from rollcore.model_folder import read_config

logger = logging.getLogger(__name__)


class SafetensorsFolder:
    """A folder's safetensors tensors by name (``model.safetensors.index.json`` for a sharded checkpoint), each read
    from its file when asked; errors name the file, never its path. A file is opened for each tensor and the tensor
    copied out: safetensors' tensors are views of a mapping of the whole file, whose pages, once read, would count
    in the process's memory for as long as any view of it lives (the whole checkpoint, by the end of a load)."""

    def __init__(self, folder: Path) -> None:
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
                self.file_of = {str(k): folder / str(v) for k, v in weight_map.items()}
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
                raise ConfigError(f"{index.name}: not a readable safetensors index ({exc})") from None
        else:
            self.file_of = {}
            for path in sorted(folder.glob("*.safetensors")):
                with self._open(path) as handle:
                    for name in handle.keys():
                        self.file_of[name] = path

    def __enter__(self) -> SafetensorsFolder:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    @staticmethod
    def _open(path: Path) -> Any:
        from safetensors import safe_open

        try:
            return safe_open(str(path), framework="pt")
        except Exception as exc:  # safetensors' own error types: a missing, truncated or corrupt file
            raise ConfigError(f"{path.name}: not a readable safetensors file ({type(exc).__name__})") from None

    def __contains__(self, name: str) -> bool:
        return name in self.file_of

    def has_module(self, module: str) -> bool:
        """Whether any tensor of ``module`` is in the checkpoint (a tied head has none; a quantized one has its own)."""
        return any(name.rpartition(".")[0] == module for name in self.file_of)

    def where(self, name: str) -> str:
        path = self.file_of.get(name)
        if path is None:  # a missing tensor: the file its layer's other tensors are in, else the checkpoint's files
            prefix = name.rpartition(".")[0]
            path = next((p for n, p in self.file_of.items() if n.rpartition(".")[0] == prefix), None)
        return path.name if path is not None else ", ".join(sorted({p.name for p in self.file_of.values()}))

    def get(self, name: str) -> torch.Tensor | None:
        path = self.file_of.get(name)
        if path is None:
            return None
        try:
            with self._open(path) as handle:
                return handle.get_tensor(name).clone()
        except ConfigError:
            raise
        except Exception as exc:  # a truncated or corrupt file: safetensors raises its own error types
            raise CheckpointTensorError(f"{path.name}: tensor {name} cannot be read ({type(exc).__name__}; the "
                                        "file is truncated or corrupt)") from None

    def floats(self, name: str) -> torch.Tensor:
        tensor = self.get(name)
        if tensor is None:
            raise CheckpointTensorError(f"{self.where(name)}: tensor {name} is missing")
        return tensor.float().contiguous()


def load_quantized_checkpoint(folder: Path, quant: CheckpointQuant, activations: str = "auto") -> nn.Module:
    """The model of ``folder``, whose ``config.json`` says ``quant``: its quantized layers as ``QuantizedLinear``
    (``activations``: ``QuantizedLinear.use_activations``; ``auto`` = ``int8x2``, as for a GGUF file). Raises
    ``CheckpointTensorError`` naming the file and tensor that is missing or of the wrong shape."""
    marker = QUANT_SUFFIXES[quant.method][0]
    mode = "int8x2" if activations == "auto" else activations

    def linear(tensors: SafetensorsFolder, name: str, module: nn.Linear) -> nn.Module | None:
        if f"{name}.{marker}" not in tensors:
            return None  # kept in float by the checkpoint
        scheme = quant.scheme_for(name)
        if scheme is None:
            raise CheckpointTensorError(f"{tensors.where(f'{name}.{marker}')}: {name} is quantized, but no "
                                        f"quantization_config group targets it")
        layer = LayerTensors(name, tensors.get, tensors.where)
        weight = read_layer(quant, scheme, layer, module.out_features, module.in_features)
        bias = tensors.floats(f"{name}.bias") if module.bias is not None else None
        out = QuantizedLinear(weight, bias)
        out.use_activations(mode)
        return out

    with SafetensorsFolder(folder) as tensors:
        if not any(name.endswith(f".{marker}") for name in tensors.file_of):
            raise CheckpointTensorError(f"{folder.name}/config.json says quant_method {quant.method!r}, but its "
                                        f"checkpoint has no quantized layer (no *.{marker} tensor)")
    model = _load(folder, linear, quantize_tied_head=None)
    logger.info("quantized checkpoint %s: %s loaded into the integer kernels", folder.name, quant.describe)
    return model


def load_quantizing(folder: Path, mode: str, group_size: int, activations: str) -> nn.Module | None:
    """The 16/32-bit checkpoint of ``folder`` with every linear layer quantized as it is read, as
    ``quantize_linears`` quantizes a loaded fp32 model (int4 keeps the output projection int8). None where the
    checkpoint's tensor names are not the model's own (transformers renames them on load): the caller loads it
    whole instead, as it does for a model with linear layers of its own class. Raises ``ConfigError`` for a group
    size that does not divide a layer's inputs."""
    bits = 8 if mode == "int8" else 4

    def linear(tensors: SafetensorsFolder, name: str, module: nn.Linear) -> nn.Module | None:
        weight = tensors.floats(f"{name}.weight")
        bias = tensors.floats(f"{name}.bias") if module.bias is not None else None
        out_bits = 8 if name == head_name else bits
        out = QuantizedLinear(quantize_int8(weight) if out_bits == 8 else quantize_int4(weight, group_size), bias)
        out.use_activations(activations)
        return out

    model_probe = _empty_model(folder)
    head = model_probe.get_output_embeddings() if hasattr(model_probe, "get_output_embeddings") else None
    head_name = next((n for n, m in model_probe.named_modules() if m is head), None) if head is not None else None
    if any(isinstance(m, nn.Linear) and type(m) is not nn.Linear for m in model_probe.modules()):
        return None  # a family's own linear class (Falcon's), made plain by the engine's adapter before quantizing
    with SafetensorsFolder(folder) as tensors:
        wanted = [n for n, _ in model_probe.named_parameters(remove_duplicate=False)
                  if not (n.startswith(f"{head_name}.") and _tied(model_probe))]
        if any(n not in tensors for n in wanted):
            return None
    for name, m in model_probe.named_modules():
        if type(m) is nn.Linear and bits == 4 and name != head_name and m.in_features % group_size:
            raise ConfigError(f"option.quantize_group_size={group_size} does not divide {name}'s {m.in_features} "
                              "inputs")
    return _load(folder, linear, quantize_tied_head=activations, model=model_probe)


def _tied(model: nn.Module) -> bool:
    return bool(getattr(model.config, "tie_word_embeddings", False))


def _load(folder: Path, linear: Any, quantize_tied_head: str | None, model: nn.Module | None = None) -> nn.Module:
    """Build ``folder``'s model on the meta device and fill it: ``linear(tensors, name, module)`` makes each
    ``nn.Linear`` (None: keep it float); a tied output projection shares the embedding, or is its int8 copy
    when ``quantize_tied_head`` (the activations mode) is given, as ``quantize_linears`` makes it."""
    model = _empty_model(folder) if model is None else model
    embedding = model.get_input_embeddings()
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    names = {m: n for n, m in model.named_modules()}
    with SafetensorsFolder(folder) as tensors:
        embed_name = names[embedding]
        embedding.weight = nn.Parameter(tensors.floats(f"{embed_name}.weight"), requires_grad=False)
        for name, module in list(model.named_modules()):
            if type(module) is not nn.Linear:
                continue
            if module is head and _tied(model) and not tensors.has_module(name):
                if quantize_tied_head is None:
                    module.weight = embedding.weight  # one copy, float, as the checkpoint ties them
                else:
                    tied = QuantizedLinear(quantize_int8(embedding.weight.detach()), None)
                    tied.use_activations(quantize_tied_head)
                    replace_module(model, name, tied)
                continue
            made = linear(tensors, name, module)
            if made is None:
                made = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
                made.weight = nn.Parameter(tensors.floats(f"{name}.weight"), requires_grad=False)
                if module.bias is not None:
                    made.bias = nn.Parameter(tensors.floats(f"{name}.bias"), requires_grad=False)
            replace_module(model, name, made)
            return_freed_memory()  # the layer's temporaries given back: the peak stays the model plus one layer
        for name, param in list(model.named_parameters()):
            if param.device.type == "meta":
                owner, _, attr = name.rpartition(".")
                setattr(model.get_submodule(owner), attr, nn.Parameter(tensors.floats(name), requires_grad=False))
        for name, buffer in list(model.named_buffers()):
            if buffer is not None and buffer.device.type == "meta":
                owner, _, attr = name.rpartition(".")
                model.get_submodule(owner).register_buffer(attr, tensors.floats(name))
    model.eval()
    return_freed_memory()
    return model


def check_checkpoint_layout(quant: CheckpointQuant | None, tensor_parallel_degree: int, device: torch.device) -> None:
    """Refuse, before anything loads, a quantized checkpoint where its integer kernels do not run (they are CPU
    kernels over whole layers)."""
    if quant is None:
        return
    if tensor_parallel_degree > 1:
        raise ConfigError(f"a {quant.method} checkpoint is not combined with tensor parallelism "
                          f"(option.tensor_parallel_degree={tensor_parallel_degree})")
    if device.type != "cpu":
        raise ConfigError(f"a {quant.method} checkpoint runs on CPU workers only (this worker has {device})")


def load_integer_model(folder: Path, quantize: str, group_size: int, activations: str,
                       quantize_here: bool) -> nn.Module | None:
    """What the dynamic handler loads through this module: a quantized checkpoint (``folder``'s ``config.json``
    says so), or, with ``option.quantize`` int8/int4 where ``quantize_here`` (fp32 on the CPU), the float checkpoint
    quantized on the way in. None: transformers loads it whole (and ``quantize_linears`` quantizes it after)."""
    quant = parse_checkpoint_quant(read_config(folder))
    if quant is not None:
        return load_quantized_checkpoint(folder, quant, activations)
    if quantize in QUANTIZE_MODES and quantize_here and any(folder.glob("*.safetensors")):
        return load_quantizing(folder, quantize, group_size, float_checkpoint_activations(activations))
    return None
