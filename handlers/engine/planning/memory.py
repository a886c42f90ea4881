"""Memory preflight of the rolling engine: will the model fit, and how large a KV cache can it have?

Design note: torch-free and driven by files alone -- the model folder's ``config.json`` and the JSON headers
of its ``*.safetensors`` files (8-byte little-endian length, then the header; the weights are never read) --
so the engine can refuse a model before ``from_pretrained`` and ``serving config`` can print the same plan
without a worker. Every figure of the plan is a plain number in a frozen ``MemoryPlan``; ``describe()``
prints the arithmetic line by line.

The budget is what this worker may still use when it starts loading (``host_memory``); the model's
figures come from its files (``checkpoint``). From the budget the plan subtracts the weights at the serving
dtype, the prepacked copies (hybrid prepacking, the default, keeps a second, oneDNN-packed copy of every
``nn.Linear`` weight of an fp32 model) and an activation allowance; ``option.kv_cache_memory_fraction``
(0.9) of the rest is the KV cache of the whole worker, capped at what ``max_num_seqs`` sequences of
``max_model_len`` tokens need. With tensor parallelism all ranks run on this host and share that one budget:
the plan counts every rank's weights and activations, and each rank's KV pool holds its share of the KV
heads in ``1/N`` of the KV bytes.

Limits: with tensor parallelism every rank loads the whole checkpoint before keeping its shard; that
transient peak is not planned, only the sharded weights that stay.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from handlers.engine.planning.checkpoint import (
    DTYPE_BYTES,
    ModelGeometry,
    WeightFigures,
    checkpoint_tensors,
    kv_bytes_per_token,
    kv_heads_per_rank,
    model_geometry,
    position_limit,
    prepacked_copy_bytes,
    quantized_weights,
    resolve_dtype,
    resolve_max_model_len,
    weight_figures,
)
from handlers.engine.planning.engine_config import EngineConfig
from handlers.engine.planning.gguf_plan import gguf_file_in, read_header
from handlers.engine.planning.host_memory import CGROUP_ROOT, MEMINFO, SELF_CGROUP, MemoryBudget, memory_budget
from handlers.engine.planning.host_memory import format_bytes as _size
from handlers.engine.planning.quant_config import checkpoint_served_bytes, parse_checkpoint_quant
from rollcore.errors import ConfigError
from rollcore.model_folder import read_config

logger = logging.getLogger(__name__)

# Activation allowance per token of one step and unit of hidden size (16 fp32 values: hidden states, residual,
# q/k/v, attention output, MLP intermediates, with headroom), per rank.
ACTIVATION_BYTES = 64


class InsufficientMemory(ConfigError):
    """The model does not fit this worker's memory; the message carries the figures and the knobs to turn."""


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
    gguf = gguf_file_in(Path(model_dir))
    header = read_header(gguf) if gguf is not None else None
    # a GGUF file not yet given its folder (serving config on option.model_id=FILE.gguf): its header's shapes
    model_config = read_config(model_dir) or (header.model_config() if header is not None else {})
    if not model_config:
        raise ConfigError(f"{Path(model_dir).name}: no readable config.json")
    dtype = resolve_dtype(config.dtype, model_config)
    tensors = checkpoint_tensors(model_dir) if Path(model_dir).is_dir() else ()
    quant = parse_checkpoint_quant(model_config) if header is None and tensors else None
    if quant is not None:  # served as integers and fp32 tables (quant_ckpt_load), fp32 activations
        tied = bool(model_config.get("tie_word_embeddings", True)) and not any(
            t.name.startswith("lm_head.") for t in tensors)
        served, source = checkpoint_served_bytes(tensors, quant, tied)
        weights = WeightFigures(served, 0, source=source)
        dtype = "fp32"
    elif header is not None and config.quantize != "none":
        # served as the file holds it (gguf_load): integers and scales, fp32 activations, nothing prepacked
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(header.types().items()))
        weights = WeightFigures(header.served_bytes(), 0, source=f"GGUF header of {gguf.name if gguf else '?'}: "
                                f"{_size(header.file_bytes)} file, {kinds}")
        dtype = "fp32"
    elif tensors:
        weights = weight_figures(tensors, model_config, dtype)
    else:  # no safetensors (allow_unsafe_weights): the files' sizes, all counted as linear weights
        total = sum(p.stat().st_size for pattern in ("*.bin", "*.pt", "*.pth") for p in Path(model_dir).glob(pattern))
        weights = WeightFigures(total, total, source="file sizes: no safetensors headers")
    budget = memory_budget(meminfo, cgroup_root, self_cgroup)
    if config.quantize in ("int8", "int4") and gguf is None and quant is None:
        # safetensors are quantized layer by layer while loading (quant_ckpt_load); other files load whole first
        if not tensors and weights.total_bytes > budget.bytes:
            raise InsufficientMemory(f"option.quantize={config.quantize} quantizes after loading: the fp32 weights "
                                     f"({_size(weights.total_bytes)}) do not fit this worker's memory "
                                     f"({budget.describe()})")
        weights = quantized_weights(weights, config.quantize, config.quantize_group_size)
    def plan(config: EngineConfig) -> MemoryPlan:
        return plan_memory(model_geometry(model_config), weights, config, budget, dtype=dtype,
                           max_model_len=resolve_max_model_len(config.max_model_len, model_config),
                           position_limit=position_limit(model_config))

    try:
        return plan(config)
    except InsufficientMemory:
        if not (config.measure_linears and config.prepack_weights == "hybrid"):
            raise
        # prepack_weights=auto plans two copies of the linear weights; where they do not fit, one packed copy
        logger.warning("prepack_weights=auto: two copies of the linear weights do not fit; one packed copy")
        return plan(replace(config, prepack_weights="true", measure_linears=False))


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
