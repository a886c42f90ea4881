"""Memory preflight of the rolling engine: will the model fit, and how large a KV cache can it have?

Design note: torch-free and driven by files alone -- the model folder's ``config.json`` and the JSON headers
of its ``*.safetensors`` files (8-byte little-endian length, then the header; the weights are never read) --
so the engine can refuse a model before ``from_pretrained`` and ``serving config`` can print the same plan
without a worker. Every figure of the plan is a plain number in a frozen ``MemoryPlan``; ``describe()``
prints the arithmetic line by line.

The budget is what this worker may still use when it starts loading: the smaller of ``MemAvailable``
(``/proc/meminfo``) and the headroom (limit minus usage) of every memory-limited cgroup the process is in,
cgroup v2 (``memory.max``, ``memory.current``) or v1 (``memory.limit_in_bytes``, ``memory.usage_in_bytes``).
From it the plan subtracts the weights at the serving dtype, the prepacked copies (hybrid prepacking, the
default, keeps a second, oneDNN-packed copy of every ``nn.Linear`` weight of an fp32 model) and an
activation allowance; ``option.kv_cache_memory_fraction`` (0.9) of the rest is the KV cache of the whole
worker, capped at what ``max_num_seqs`` sequences of ``max_model_len`` tokens need. With tensor parallelism
all ranks run on this host and share that one budget: the plan counts every rank's weights and
activations, and each rank's KV pool holds its share of the KV heads in ``1/N`` of the KV bytes.

Limits: the budget is measured once, at load; workers that load at the same time each see the same free
memory. With tensor parallelism every rank loads the whole checkpoint before keeping its shard; that
transient peak is not planned, only the sharded weights that stay. Page cache counted in a cgroup's usage
makes its headroom conservative. All paths of ``/proc`` and ``/sys`` files are parameters, so tests use fake
files.
"""

from __future__ import annotations

import json
import logging
import math
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from handlers.engine.config import EngineConfig
from handlers.engine.cpu import has_fast_bf16
from serving.errors import ConfigError

logger = logging.getLogger(__name__)

MEMINFO = Path("/proc/meminfo")
CGROUP_ROOT = Path("/sys/fs/cgroup")
SELF_CGROUP = Path("/proc/self/cgroup")
FALLBACK_AVAILABLE = 4 << 30  # when /proc/meminfo cannot be read
# Activation allowance per token of one step and unit of hidden size (16 fp32 values: hidden states, residual,
# q/k/v, attention output, MLP intermediates, with headroom), per rank.
ACTIVATION_BYTES = 64
_V1_UNLIMITED = 1 << 60  # cgroup v1 reports "no limit" as a page-rounded 2**63 - 1

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


class InsufficientMemory(ConfigError):
    """The model does not fit this worker's memory; the message carries the figures and the knobs to turn."""


# ---------------------------------------------------------------------------------------------- inputs
def read_model_config(model_dir: str | Path) -> dict[str, Any]:
    """``config.json`` of a model folder as a dict (``{}`` when absent or unreadable)."""
    try:
        data = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def weights_dir(model_dir: str | Path, model_id: str | None) -> Path:
    """The folder holding the weights: ``option.model_id`` relative to ``model_dir`` if that exists, else
    as given (absolute), else ``model_dir`` itself."""
    source = Path(model_dir)
    if model_id:
        return source / model_id if (source / model_id).exists() else Path(model_id)
    return source


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
    """Layers, heads, KV heads and head size, as ``handlers.engine.runner.kv_geometry`` sees them, from a
    ``config.json`` dict: GPT-2's ``n_layer``/``n_head``/``n_embd``; Falcon's ``multi_query`` (one KV head
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


# --------------------------------------------------------------------------------------------- weights
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
    """``weights`` (fp32) once ``option.quantize`` replaced every linear layer (``handlers.engine.quantize``):
    int8 keeps a byte per weight (its per-channel scales are negligible), int4 half a byte plus a fp32 scale and
    minimum per group. A tied output projection gets an int8 copy; the embedding stays. Nothing is left for
    prepacking (it packs float linears only)."""
    per_weight = 1.0 if mode == "int8" else 0.5 + 8.0 / group_size
    # a tied output projection is int8 in either mode (handlers.engine.quantize keeps int4's head at int8)
    quantized = int((weights.linear_bytes - weights.tied_bytes) / 4 * per_weight + weights.tied_bytes / 4)
    total = weights.total_bytes - (weights.linear_bytes - weights.tied_bytes) + quantized
    return WeightFigures(total, 0, source=f"{weights.source}; option.quantize={mode}")


def prepacked_copy_bytes(linear_bytes: int, prepack_weights: str, dtype: str) -> int:
    """Memory prepacking adds on top of the weights (``handlers.engine.prepack``): ``hybrid`` keeps the plain
    and the packed copy of every linear weight, ``true`` replaces the plain one, ``false`` packs nothing;
    only fp32 models are prepacked."""
    return linear_bytes if prepack_weights == "hybrid" and dtype == "fp32" else 0


# ---------------------------------------------------------------------------------------------- budget
@dataclass(frozen=True, slots=True)
class MemoryBudget:
    """What this worker may use: min(``MemAvailable``, the tightest cgroup's limit minus usage)."""

    mem_available: int
    cgroup_limit: int | None = None
    cgroup_usage: int | None = None
    cgroup_file: str | None = None  # the limit file of the tightest cgroup
    note: str | None = None  # how a device's budget was measured (``handlers.engine.device``), for describe()

    @property
    def cgroup_headroom(self) -> int | None:
        if self.cgroup_limit is None or self.cgroup_usage is None:
            return None
        return max(0, self.cgroup_limit - self.cgroup_usage)

    @property
    def bytes(self) -> int:
        headroom = self.cgroup_headroom
        return self.mem_available if headroom is None else min(self.mem_available, headroom)

    def describe(self) -> str:
        if self.note is not None:
            return self.note
        headroom = self.cgroup_headroom
        if headroom is None or self.cgroup_limit is None or self.cgroup_usage is None:
            return f"MemAvailable {_size(self.mem_available)}; no cgroup memory limit"
        return (f"min(MemAvailable {_size(self.mem_available)}, cgroup {self.cgroup_file} "
                f"{_size(self.cgroup_limit)} - usage {_size(self.cgroup_usage)} = {_size(headroom)})")


def read_mem_available(meminfo: Path = MEMINFO) -> int:
    """``MemAvailable`` of ``meminfo`` in bytes; ``FALLBACK_AVAILABLE`` (4 GiB) when it cannot be read."""
    try:
        for line in meminfo.read_text(encoding="ascii").splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return FALLBACK_AVAILABLE


def _read_int(path: Path) -> int | None:
    """The integer in a cgroup file; None when absent, unreadable or unlimited (``max``, v1's 2**63)."""
    try:
        text = path.read_text(encoding="ascii").strip()
    except OSError:
        return None
    if not text.isdigit():
        return None
    value = int(text)
    return None if value >= _V1_UNLIMITED else value


def _cgroup_paths(self_cgroup: Path) -> tuple[str, str]:
    """(v2 path, v1 memory-controller path) of this process, ``/`` when unknown."""
    v2 = v1 = "/"
    try:
        lines = self_cgroup.read_text(encoding="ascii").splitlines()
    except OSError:
        return v2, v1
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            v2 = parts[2] or "/"
        elif "memory" in parts[1].split(","):
            v1 = parts[2] or "/"
    return v2, v1


def _ancestors(root: Path, cgroup_path: str) -> list[Path]:
    """``root`` joined with ``cgroup_path`` and each of its parents up to ``root`` itself."""
    parts = [p for p in cgroup_path.split("/") if p and p != ".."]
    return [root.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]


def read_cgroup_limit(cgroup_root: Path = CGROUP_ROOT,
                      self_cgroup: Path = SELF_CGROUP) -> tuple[int, int, str] | None:
    """(limit, usage, limit file) of the memory-limited cgroup with the least headroom among this process's
    cgroup and its ancestors -- v2 ``memory.max``/``memory.current`` under ``cgroup_root``, v1
    ``memory.limit_in_bytes``/``memory.usage_in_bytes`` under ``cgroup_root/memory`` -- or None when no
    cgroup limits memory."""
    v2, v1 = _cgroup_paths(self_cgroup)
    candidates = [(d / "memory.max", d / "memory.current") for d in _ancestors(cgroup_root, v2)]
    candidates += [(d / "memory.limit_in_bytes", d / "memory.usage_in_bytes")
                   for d in _ancestors(cgroup_root / "memory", v1)]
    best: tuple[int, int, str] | None = None
    for limit_file, usage_file in candidates:
        limit, usage = _read_int(limit_file), _read_int(usage_file)
        if limit is None or usage is None:
            continue
        if best is None or limit - usage < best[0] - best[1]:
            best = (limit, usage, str(limit_file))
    return best


def memory_budget(meminfo: Path = MEMINFO, cgroup_root: Path = CGROUP_ROOT,
                  self_cgroup: Path = SELF_CGROUP) -> MemoryBudget:
    """Measure the budget now (see ``MemoryBudget``)."""
    cgroup = read_cgroup_limit(cgroup_root, self_cgroup)
    if cgroup is None:
        return MemoryBudget(read_mem_available(meminfo))
    limit, usage, path = cgroup
    return MemoryBudget(read_mem_available(meminfo), limit, usage, path)


# ------------------------------------------------------------------------------------------------ plan
@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """Every figure of one worker's memory plan; byte figures cover all tensor-parallel ranks unless named
    per rank. ``weights_resident``: the budget was measured with the weights already loaded, so they are
    not subtracted from it again."""

    dtype: str
    tensor_parallel_degree: int
    budget: MemoryBudget
    weights: WeightFigures
    weights_resident: bool
    weight_bytes: int
    prepack_weights: str
    prepack_bytes: int
    max_num_batched_tokens: int
    hidden_size: int
    activation_bytes: int
    num_layers: int
    kv_heads: int  # per rank
    head_dim: int
    kv_bytes_per_token: int  # per rank
    kv_source: str  # auto | kv_cache_memory_mb | num_kv_blocks
    kv_fraction: float
    kv_cache_memory_mb: int
    kv_budget_bytes: int  # per rank: what the pool may take before rounding to blocks and capping
    block_size: int
    max_num_seqs: int
    max_model_len: int
    requested_max_model_len: int
    position_limit: int | None
    num_kv_blocks: int

    @property
    def free_bytes(self) -> int:
        """Budget minus weights (unless resident), prepacked copies and activations."""
        spent = self.prepack_bytes + self.activation_bytes + (0 if self.weights_resident else self.weight_bytes)
        return self.budget.bytes - spent

    @property
    def blocks_per_sequence(self) -> int:
        return -(-self.max_model_len // self.block_size)

    @property
    def needed_blocks(self) -> int:
        """Blocks ``max_num_seqs`` sequences of ``max_model_len`` tokens need."""
        return self.max_num_seqs * self.blocks_per_sequence

    @property
    def kv_bytes_per_rank(self) -> int:
        return self.num_kv_blocks * self.block_size * self.kv_bytes_per_token

    @property
    def sequences_fit(self) -> int:
        """Whole sequences of ``max_model_len`` tokens the pool holds at once."""
        return self.num_kv_blocks // self.blocks_per_sequence

    def for_bytes_per_token(self, kv_bytes_per_token: int) -> MemoryPlan:
        """The same plan for a pool whose tokens take ``kv_bytes_per_token`` bytes per rank (what the loaded
        model's KV pool really holds); raises ``InsufficientMemory`` as ``plan_memory`` does."""
        if kv_bytes_per_token == self.kv_bytes_per_token:
            return self
        return _size_pool(replace(self, kv_bytes_per_token=kv_bytes_per_token))

    def describe(self) -> str:
        """The plan's arithmetic, one line per figure (byte figures of all ranks unless marked per rank)."""
        tp = self.tensor_parallel_degree
        ranks = f" x {tp} ranks" if tp > 1 else ""
        rank = " per rank" if tp > 1 else ""
        lines = [f"memory plan (rolling engine, dtype {self.dtype}, tensor_parallel_degree {tp})",
                 f"  budget          {_size(self.budget.bytes):>10}  = {self.budget.describe()}"]
        if self.weights_resident:
            lines.append(f"  weights         {_size(self.weight_bytes):>10}  already loaded (not in the budget)")
        else:
            per_rank = f"; {_size(self.weights.per_rank(tp)[0])} per rank" if tp > 1 else ""
            lines.append(f"  weights         {_size(self.weight_bytes):>10}  ({self.weights.source}, "
                         f"at {self.dtype}{per_rank})")
        why = {"hybrid": "a packed copy of every linear weight" if self.dtype == "fp32" else "fp32 models only",
               "true": "packed weights replace the plain ones", "false": "off"}[self.prepack_weights]
        lines.append(f"  prepacked       {_size(self.prepack_bytes):>10}  (prepack_weights={self.prepack_weights}: "
                     f"{why})")
        lines.append(f"  activations     {_size(self.activation_bytes):>10}  = {self.max_num_batched_tokens} "
                     f"batched tokens x {self.hidden_size} hidden x {ACTIVATION_BYTES} B{ranks}")
        if self.requested_max_model_len <= 0:
            length = "max_position_embeddings" if self.position_limit else "default"
        elif self.max_model_len < self.requested_max_model_len:
            length = f"option.max_model_len={self.requested_max_model_len} capped at the learned positions"
        else:
            length = "option.max_model_len"
        lines.append(f"  max_model_len   {self.max_model_len:>10}  tokens ({length})")
        lines.append(f"  KV per token    {_size(self.kv_bytes_per_token):>10}  = 2 x {self.num_layers} layers x "
                     f"{self.kv_heads} KV heads x {self.head_dim} head_dim x {DTYPE_BYTES[self.dtype]} B{rank}")
        if self.kv_source == "auto":
            needed = self.needed_blocks * self.block_size * self.kv_bytes_per_token
            lines.append(f"  KV cache        {_size(self.kv_bytes_per_rank):>10}  = min(share, need){rank}, "
                         f"in blocks of {self.block_size} tokens")
            lines.append(f"    share         {_size(self.kv_budget_bytes):>10}  = {self.kv_fraction:g} x (budget - "
                         f"weights - prepacked - activations){f' / {tp} ranks' if tp > 1 else ''}")
            lines.append(f"    need          {_size(needed):>10}  = {self.max_num_seqs} sequences x "
                         f"{self.blocks_per_sequence * self.block_size} tokens x {_size(self.kv_bytes_per_token)}")
        elif self.kv_source == "kv_cache_memory_mb":
            lines.append(f"  KV cache        {_size(self.kv_bytes_per_rank):>10}  = option.kv_cache_memory_mb="
                         f"{self.kv_cache_memory_mb}{f' / {tp} ranks' if tp > 1 else ''}, in blocks of "
                         f"{self.block_size} tokens")
            if self.kv_cache_memory_mb << 20 > self.free_bytes:
                lines.append(f"  warning: option.kv_cache_memory_mb={self.kv_cache_memory_mb} exceeds the "
                             f"{_size(max(0, self.free_bytes))} left after weights, prepacked copies and activations")
        else:
            lines.append(f"  KV cache        {_size(self.kv_bytes_per_rank):>10}  = option.num_kv_blocks="
                         f"{self.num_kv_blocks} x {self.block_size} tokens x {_size(self.kv_bytes_per_token)}")
        lines.append(f"  KV blocks       {self.num_kv_blocks:>10}  hold {self.sequences_fit} sequences of "
                     f"{self.max_model_len} tokens at once")
        return "\n".join(lines) + "\n"


def plan_memory(geometry: ModelGeometry, weights: WeightFigures, config: EngineConfig, budget: MemoryBudget, *,
                dtype: str, max_model_len: int, requested_max_model_len: int | None = None,
                position_limit: int | None = None, weights_resident: bool = False,
                kv_bytes_per_token_override: int | None = None) -> MemoryPlan:
    """Plan one worker's memory; raises ``InsufficientMemory`` when the weights, prepacked copies and
    activations exceed the budget, or when the KV cache cannot hold one sequence of ``max_model_len``."""
    tp = config.tensor_parallel_degree
    rank_weights, rank_linear = weights.per_rank(tp)
    per_token = kv_bytes_per_token_override or kv_bytes_per_token(geometry, dtype, tp)
    if config.num_kv_blocks > 0:
        source = "num_kv_blocks"
    elif config.kv_cache_memory_mb > 0:
        source = "kv_cache_memory_mb"
    else:
        source = "auto"
    plan = MemoryPlan(
        dtype=dtype, tensor_parallel_degree=tp, budget=budget, weights=weights, weights_resident=weights_resident,
        weight_bytes=tp * rank_weights, prepack_weights=config.prepack_weights,
        prepack_bytes=tp * prepacked_copy_bytes(rank_linear, config.prepack_weights, dtype),
        max_num_batched_tokens=config.max_num_batched_tokens, hidden_size=geometry.hidden_size,
        activation_bytes=tp * config.max_num_batched_tokens * geometry.hidden_size * ACTIVATION_BYTES,
        num_layers=geometry.num_layers, kv_heads=kv_heads_per_rank(geometry.num_kv_heads, tp),
        head_dim=geometry.head_dim, kv_bytes_per_token=per_token, kv_source=source,
        kv_fraction=config.kv_cache_memory_fraction, kv_cache_memory_mb=config.kv_cache_memory_mb,
        kv_budget_bytes=0, block_size=config.block_size, max_num_seqs=config.max_num_seqs,
        max_model_len=max_model_len,
        requested_max_model_len=config.max_model_len if requested_max_model_len is None else requested_max_model_len,
        position_limit=position_limit, num_kv_blocks=config.num_kv_blocks)
    if plan.free_bytes <= 0:
        loaded = "" if weights_resident else f"weights {_size(plan.weight_bytes)} + "
        raise InsufficientMemory(
            f"the model does not fit this worker's memory: {loaded}prepacked copies {_size(plan.prepack_bytes)} "
            f"+ activations {_size(plan.activation_bytes)} exceed the budget of {_size(budget.bytes)} "
            f"({budget.describe()}); try option.prepack_weights=false, option.dtype=bf16, a smaller "
            "option.max_rolling_batch_prefill_tokens, or a bigger memory limit")
    return _size_pool(plan)


def _size_pool(plan: MemoryPlan) -> MemoryPlan:
    """Fill in the KV budget and number of blocks of ``plan``; refuse a pool below one sequence."""
    tp = plan.tensor_parallel_degree
    block_bytes = plan.kv_bytes_per_token * plan.block_size
    if plan.kv_source == "num_kv_blocks":
        return replace(plan, kv_budget_bytes=plan.num_kv_blocks * block_bytes)
    if plan.kv_source == "kv_cache_memory_mb":
        kv_budget = (plan.kv_cache_memory_mb << 20) // tp
        blocks = kv_budget // block_bytes
        if plan.kv_cache_memory_mb << 20 > plan.free_bytes:
            logger.warning("option.kv_cache_memory_mb=%d exceeds the %s left after weights, prepacked copies and "
                           "activations", plan.kv_cache_memory_mb, _size(max(0, plan.free_bytes)))
    else:
        kv_budget = int(max(0, plan.free_bytes) * plan.kv_fraction) // tp
        blocks = min(plan.needed_blocks, kv_budget // block_bytes)
    plan = replace(plan, kv_budget_bytes=kv_budget, num_kv_blocks=blocks)
    if blocks < plan.blocks_per_sequence:
        need = plan.blocks_per_sequence * block_bytes
        raise InsufficientMemory(
            f"the KV cache cannot hold one sequence of max_model_len {plan.max_model_len} tokens: it gets "
            f"{_size(blocks * block_bytes)} per rank ({blocks} blocks of {plan.block_size} tokens), one sequence "
            f"needs {_size(need)} ({plan.blocks_per_sequence} blocks); budget {_size(plan.budget.bytes)}, "
            f"weights {_size(plan.weight_bytes)}, prepacked copies {_size(plan.prepack_bytes)}, activations "
            f"{_size(plan.activation_bytes)}; try a smaller option.max_model_len, option.prepack_weights=false, "
            "option.dtype=bf16, a bigger option.kv_cache_memory_mb or memory limit")
    return plan


def preflight(model_dir: str | Path, config: EngineConfig, *, meminfo: Path = MEMINFO,
              cgroup_root: Path = CGROUP_ROOT, self_cgroup: Path = SELF_CGROUP) -> MemoryPlan:
    """Plan the memory of serving the model in ``model_dir`` (the weights folder) before loading it: weights
    from the safetensors headers, the budget measured now. Raises ``InsufficientMemory`` (see
    ``plan_memory``) or ``ConfigError`` for an unreadable config or checkpoint."""
    model_config = read_model_config(model_dir)
    if not model_config:
        raise ConfigError(f"{Path(model_dir).name}: no readable config.json")
    dtype = resolve_dtype(config.dtype, model_config)
    tensors = checkpoint_tensors(model_dir)
    if tensors:
        weights = weight_figures(tensors, model_config, dtype)
    else:  # no safetensors (allow_unsafe_weights): the files' sizes, all counted as linear weights
        total = sum(p.stat().st_size for pattern in ("*.bin", "*.pt", "*.pth") for p in Path(model_dir).glob(pattern))
        weights = WeightFigures(total, total, source="file sizes: no safetensors headers")
    budget = memory_budget(meminfo, cgroup_root, self_cgroup)
    if config.quantize != "none":  # the fp32 model loads whole, then its linear layers are quantized
        if weights.total_bytes > budget.bytes:
            raise InsufficientMemory(f"option.quantize={config.quantize} quantizes after loading: the fp32 weights "
                                     f"({_size(weights.total_bytes)}) do not fit this worker's memory "
                                     f"({budget.describe()})")
        weights = quantized_weights(weights, config.quantize, config.quantize_group_size)
    return plan_memory(model_geometry(model_config), weights, config, budget, dtype=dtype,
                       max_model_len=resolve_max_model_len(config.max_model_len, model_config),
                       position_limit=position_limit(model_config))


def plan_loaded_model(model_config: Mapping[str, Any], config: EngineConfig, *, dtype: str, param_bytes: int,
                      linear_bytes: int, kv_bytes_per_token: int, budget: MemoryBudget) -> MemoryPlan:
    """Plan for a model a caller already loaded (and sharded, with tensor parallelism): its weights are in
    memory and outside ``budget``; ``param_bytes``/``linear_bytes`` are one rank's real figures."""
    dtype = resolve_dtype(dtype, model_config)
    return plan_memory(model_geometry(model_config), WeightFigures(param_bytes, linear_bytes, source="loaded model"),
                       config, budget, dtype=dtype,
                       max_model_len=resolve_max_model_len(config.max_model_len, model_config),
                       position_limit=position_limit(model_config), weights_resident=True,
                       kv_bytes_per_token_override=kv_bytes_per_token)


def _size(n: int) -> str:
    """Bytes as GiB / MiB / KiB with two, one or no decimals."""
    if abs(n) >= 1 << 30:
        return f"{n / (1 << 30):.2f} GiB"
    if abs(n) >= 1 << 20:
        return f"{n / (1 << 20):.1f} MiB"
    if abs(n) >= 1 << 10:
        return f"{n / (1 << 10):.1f} KiB"
    return f"{n} B"
