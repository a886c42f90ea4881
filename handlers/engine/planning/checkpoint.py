"""What a model folder says about memory, read from files alone (torch-free): ``config.json`` (the dtype, the
position limit, the attention geometry that sizes a KV token) and the JSON headers of its ``*.safetensors``
files (8-byte little-endian length, then the header; the weights are never read): every tensor's shape and
dtype, summed into the weights at the serving dtype, their linear part (prepacked copies, quantization) and
their embedding part."""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from handlers.engine.planning.cpu import has_fast_bf16
from handlers.engine.planning.quant_config import UnsupportedQuantization, parse_checkpoint_quant
from rollcore.errors import ConfigError

logger = logging.getLogger(__name__)

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
_DTYPE_NAMES = {"fp32": "fp32", "float32": "fp32", "torch.float32": "fp32", "float": "fp32",
                "bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16",
                "fp16": "fp16", "float16": "fp16", "torch.float16": "fp16", "half": "fp16"}
# safetensors dtype codes -> (bytes per element, floating point: cast to the serving dtype at load)
_ST_DTYPES = {"F64": (8, True), "F32": (4, True), "F16": (2, True), "BF16": (2, True), "F8_E4M3": (1, True),
              "F8_E5M2": (1, True), "I64": (8, False), "I32": (4, False), "I16": (2, False), "I8": (1, False),
              "U64": (8, False), "U32": (4, False), "U16": (2, False), "U8": (1, False), "BOOL": (1, False)}
# Models whose absolute positions are a learned table: no position past it exists.
LEARNED_POSITIONS = frozenset({"gpt2", "gpt_bigcode", "opt", "gpt_neo", "biogpt"})
# Models whose projections are transformers' Conv1D, not nn.Linear: prepacking leaves them alone.
_CONV1D_MODELS = frozenset({"gpt2"})
_EMBEDDING = re.compile(r"(^|\.)(embed_tokens|embed_in|wte|wpe|word_embeddings|embed_positions|embeddings)\.")
_TOKEN_EMBEDDING = re.compile(r"(^|\.)(embed_tokens|embed_in|wte|word_embeddings)\.")
_LAYER = re.compile(r"\.\d+\.")


def resolve_dtype(option: str, config: Mapping[str, Any], fast_bf16: bool | None = None) -> str:
    """The serving dtype's canonical name (``fp32``, ``bf16``, ``fp16``) for ``option.dtype``.

    ``auto`` is bf16 on CPUs with AVX512-BF16 or AMX (``fast_bf16``; detected from /proc/cpuinfo when None),
    where bf16 matmuls run at twice fp32's speed or more and the weights and KV cache take half the memory,
    and fp32 elsewhere (bf16 is emulated and far slower there; fp16 matmuls are slow on every CPU) -- whatever
    the checkpoint stores. Raises ``ConfigError`` for an unknown name."""
    value = option.strip().lower()
    if value == "auto":
        bf16 = has_fast_bf16() if fast_bf16 is None else fast_bf16
        stored = _DTYPE_NAMES.get(str(config.get("dtype") or config.get("torch_dtype") or "").lower(), "fp32")
        chosen = "bf16" if bf16 else "fp32"
        logger.info("option.dtype=auto: %s (checkpoint %s; %s)", chosen, stored,
                    "the CPU runs bf16 natively" if bf16 else "no native bf16 on this CPU")
        return chosen
    if value not in _DTYPE_NAMES:
        raise ConfigError(f"option.dtype={option!r} must be one of fp32, bf16, fp16, auto")
    return _DTYPE_NAMES[value]


def position_limit(config: Mapping[str, Any]) -> int | None:
    """The model's ``max_position_embeddings`` (GPT-2: ``n_positions``), or None when it names none."""
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = config.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return None


def resolve_max_model_len(requested: int, config: Mapping[str, Any]) -> int:
    """The engine's ``max_model_len``: ``requested``, or the model's position limit when 0 (2048 when the
    config names none). A larger value is capped at the limit for models with learned absolute positions
    (``LEARNED_POSITIONS``: a position past the table does not exist) and allowed for the others (rotary:
    quality past the trained context is not guaranteed); both are logged as warnings."""
    limit = position_limit(config)
    if requested <= 0:
        return limit or 2048
    if limit is None or requested <= limit:
        return requested
    model_type = str(config.get("model_type") or "")
    if model_type in LEARNED_POSITIONS:
        logger.warning("option.max_model_len=%d capped at %d: %s has learned absolute positions and no position "
                       "past max_position_embeddings", requested, limit, model_type)
        return limit
    logger.warning("option.max_model_len=%d exceeds max_position_embeddings=%d of %s: allowed (no learned "
                   "position table), but the model was not trained on such lengths", requested, limit,
                   model_type or "this model")
    return requested


@dataclass(frozen=True, slots=True)
class ModelGeometry:
    """The shapes the plan needs from ``config.json`` (``num_kv_heads`` before tensor parallelism)."""

    model_type: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int


def _first_int(config: Mapping[str, Any], *keys: str) -> int | None:
    for key in keys:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def model_geometry(config: Mapping[str, Any]) -> ModelGeometry:
    """Layers, heads, KV heads and head size, as ``handlers.engine.execution.forward.runner.kv_geometry`` sees them,
    from a ``config.json`` dict: GPT-2's ``n_layer``/``n_head``/``n_embd``; Falcon's ``multi_query`` (one KV head
    unless ``new_decoder_architecture``) and ``num_kv_heads``. Raises ``ConfigError`` when a shape is missing."""
    model_type = str(config.get("model_type") or "")
    num_layers = _first_int(config, "num_hidden_layers", "n_layer", "num_layers")
    num_heads = _first_int(config, "num_attention_heads", "n_head", "num_heads")
    hidden = _first_int(config, "hidden_size", "n_embd", "d_model")
    if num_layers is None or num_heads is None or hidden is None:
        raise ConfigError("config.json lacks the number of layers, attention heads or the hidden size")
    if model_type == "falcon":
        if config.get("new_decoder_architecture", False):
            num_kv_heads = _first_int(config, "num_kv_heads") or num_heads
        elif config.get("multi_query", True):
            num_kv_heads = 1
        else:
            num_kv_heads = num_heads
    else:
        num_kv_heads = _first_int(config, "num_key_value_heads", "num_kv_heads") or num_heads
    head_dim = _first_int(config, "head_dim") or hidden // num_heads
    return ModelGeometry(model_type, num_layers, num_heads, num_kv_heads, head_dim, hidden)


def kv_heads_per_rank(num_kv_heads: int, tensor_parallel_degree: int) -> int:
    """KV heads one rank holds: its share, or one replicated head when there are fewer heads than ranks."""
    return max(1, num_kv_heads // tensor_parallel_degree)


def kv_bytes_per_token(geometry: ModelGeometry, dtype: str, tensor_parallel_degree: int = 1) -> int:
    """KV bytes one token takes in one rank's pool: 2 (K and V) x layers x KV heads x head_dim x element size."""
    heads = kv_heads_per_rank(geometry.num_kv_heads, tensor_parallel_degree)
    return 2 * geometry.num_layers * heads * geometry.head_dim * DTYPE_BYTES[dtype]


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor of a safetensors header: name, dtype code (``F32``, ``BF16``, ...) and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * _ST_DTYPES.get(self.dtype, (4, True))[0]

    @property
    def floating(self) -> bool:
        return _ST_DTYPES.get(self.dtype, (4, True))[1]


def read_safetensors_header(path: str | Path) -> tuple[TensorInfo, ...]:
    """The tensors a ``.safetensors`` file declares, from its header alone (8-byte little-endian header
    length, then that many bytes of JSON). Raises ``ConfigError`` for a file that is not safetensors."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise ValueError("shorter than 8 bytes")
            (length,) = struct.unpack("<Q", head)
            if length > 100 << 20:
                raise ValueError(f"header length {length} is implausible")
            raw = f.read(length)
        if len(raw) != length:
            raise ValueError("header truncated")
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
        return tuple(TensorInfo(name, str(entry["dtype"]), tuple(int(d) for d in entry["shape"]))
                     for name, entry in header.items() if name != "__metadata__")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{path.name}: not a readable safetensors file ({exc})") from None


def checkpoint_tensors(model_dir: str | Path) -> tuple[TensorInfo, ...]:
    """Every tensor of a folder's safetensors checkpoint: the files named by ``model.safetensors.index.json``
    (sharded checkpoints), else every ``*.safetensors`` file. Empty when there is none."""
    folder = Path(model_dir)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            files = sorted({str(name) for name in weight_map.values()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ConfigError(f"{index.name}: not a readable safetensors index ({exc})") from None
        paths = [folder / name for name in files]
    else:
        paths = sorted(folder.glob("*.safetensors"))
    return tuple(t for path in paths for t in read_safetensors_header(path))


@dataclass(frozen=True, slots=True)
class WeightFigures:
    """One full copy of a model's weights at the serving dtype, in bytes.

    ``linear_bytes``: the ``nn.Linear`` weights prepacking copies -- approximated as the 2-D tensors other
    than embeddings (none for GPT-2, whose projections are Conv1D), plus the output projection when it is
    tied to the input embedding (``lm_head`` is still an ``nn.Linear`` and gets its own packed copy).
    ``sharded_bytes``: the part tensor parallelism splits across ranks, approximated as the 2-D tensors of
    the numbered decoder layers; everything else is replicated on every rank.
    """

    total_bytes: int
    linear_bytes: int = 0
    sharded_bytes: int = 0
    sharded_linear_bytes: int = 0  # the linear weights among ``sharded_bytes``
    source: str = "safetensors headers"
    tied_bytes: int = 0  # the output projection's share of ``linear_bytes`` when it is the input embedding

    def per_rank(self, tensor_parallel_degree: int) -> tuple[int, int]:
        """(weights, linear weights) one rank holds after sharding."""
        tp = tensor_parallel_degree
        return (self.total_bytes - self.sharded_bytes + self.sharded_bytes // tp,
                self.linear_bytes - self.sharded_linear_bytes + self.sharded_linear_bytes // tp)


def weight_figures(tensors: tuple[TensorInfo, ...], config: Mapping[str, Any], dtype: str) -> WeightFigures:
    """Weights of a checkpoint served in ``dtype``: floating tensors take its element size, others keep theirs."""
    size = DTYPE_BYTES[dtype]
    conv1d = str(config.get("model_type") or "") in _CONV1D_MODELS
    total = linear = sharded = sharded_linear = embedding = 0
    for t in tensors:
        nbytes = t.numel * size if t.floating else t.nbytes
        total += nbytes
        if len(t.shape) != 2:
            continue
        if _EMBEDDING.search(t.name):
            if _TOKEN_EMBEDDING.search(t.name):
                embedding = max(embedding, nbytes)
            continue
        is_linear = not conv1d or t.name.startswith("lm_head.")
        linear += nbytes if is_linear else 0
        if _LAYER.search(t.name):
            sharded += nbytes
            sharded_linear += nbytes if is_linear else 0
    tied = 0
    if config.get("tie_word_embeddings", True) and not any(t.name.endswith("lm_head.weight") for t in tensors):
        linear += embedding
        tied = embedding
    return WeightFigures(total, linear, sharded, sharded_linear, tied_bytes=tied)


def quantized_weights(weights: WeightFigures, mode: str, group_size: int) -> WeightFigures:
    """``weights`` (fp32) once ``option.quantize`` replaced every linear layer
    (``handlers.engine.execution.kernels.quantize``):
    int8 keeps a byte per weight (its per-channel scales are negligible), int4 half a byte plus a fp32 scale and
    minimum per group. A tied output projection gets an int8 copy; the embedding stays. Nothing is left for
    prepacking (it packs float linears only)."""
    per_weight = 1.0 if mode == "int8" else 0.5 + 8.0 / group_size
    # a tied output projection is int8 in either mode (handlers.engine.execution.kernels.quantize keeps int4's head at
    # int8)
    quantized = int((weights.linear_bytes - weights.tied_bytes) / 4 * per_weight + weights.tied_bytes / 4)
    total = weights.total_bytes - (weights.linear_bytes - weights.tied_bytes) + quantized
    return WeightFigures(total, 0, source=f"{weights.source}; option.quantize={mode}")


def prepacked_copy_bytes(linear_bytes: int, prepack_weights: str, dtype: str) -> int:
    """Memory prepacking adds on top of the weights (``handlers.engine.execution.kernels.prepack``): ``hybrid`` keeps
    the plain and the packed copy of every linear weight, ``true`` replaces the plain one, ``false`` packs nothing;
    only fp32 models are prepacked."""
    return linear_bytes if prepack_weights == "hybrid" and dtype == "fp32" else 0




def check_quantization(config: Mapping[str, Any], folder_name: str) -> None:
    """Refuse, naming it, a checkpoint whose ``config.json`` says its weights are quantized in a form this server
    does not load (bitsandbytes, fp8, act-order GPTQ, GEMV AWQ, compressed-tensors forms other than pack-quantized
    without its package...): it loads GGUF files and the checkpoints ``quant_config`` reads straight into its
    integer kernels, and transformers' loaders for the others need packages built for GPUs. Raises
    ``ConfigError``."""
    quantization = config.get("quantization_config")
    if not isinstance(quantization, Mapping):
        return
    try:
        if parse_checkpoint_quant(config) is not None:
            return  # loaded by handlers.engine.execution.weights.quant_ckpt_load
    except UnsupportedQuantization as exc:
        raise ConfigError(f"{folder_name}/config.json: {exc}; serve the model's GGUF file (option.model_id=FILE.gguf), "
                          "or its 16/32-bit checkpoint with option.quantize=int8 or int4") from None
    method = str(quantization.get("quant_method") or quantization.get("format") or "unknown")
    if method == "compressed-tensors" and importlib.util.find_spec("compressed_tensors") is not None:
        return  # transformers decompresses it to a float model with that package (the fp32 detour)
    bits = quantization.get("bits") or quantization.get("num_bits")
    raise ConfigError(f"{folder_name}/config.json: quantization_config (quant_method {method!r}"
                      f"{f', {bits} bits' if bits else ''}) is not loaded by this server; serve the model's GGUF file "
                      "(option.model_id=FILE.gguf), or its 16/32-bit checkpoint with option.quantize=int8 or int4")
