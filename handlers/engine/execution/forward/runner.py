"""Runs one flat batch of tokens per step through a transformers decoder-only model with a paged KV cache.

Design note: the model is unchanged except for its attention implementation, switched to
``paged_attention.ATTN_IMPLEMENTATION`` through transformers' public ``AttentionInterface``. Each step the
runner builds input ids [1, T], position ids [1, T] and a ``StepMetadata`` (slot mapping, per-sequence
query ranges and KV locations) once, and passes the metadata as a forward kwarg that transformers hands
to every attention call. Logits are computed only for the rows that are sampled (``logits_to_keep``).
Runs on the engine thread.

Devices: the runner works on the model's device. The step's integers go to it in one copy (pinned, asynchronous
on a GPU); the KV pool, the step metadata and the logits live there. CPU-only pieces (oneDNN prepacking, the C
decode kernel) apply on CPU; on a GPU decode attention is ``gpu_attention``'s Triton kernel and decode-only steps
replay CUDA graphs (``cuda_graphs``) unless ``enforce_eager``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

import torch

from handlers.engine.core.schedule_plan import ScheduledChunk
from handlers.engine.execution.forward.cuda_graphs import DecodeGraphs, capture_sizes
from handlers.engine.execution.forward.falcon_attention import adapt_model
from handlers.engine.execution.forward.lean import LeanDecoder, unsupported
from handlers.engine.execution.forward.paged_attention import (
    ATTN_IMPLEMENTATION,
    CONTEXT_ATTR,
    KVPool,
    SeqSpan,
    StepContext,
    StepMetadata,
    on_device,
    paged_attention_forward,
)
from handlers.engine.execution.forward.pooling import HeadTap
from handlers.engine.execution.kernels.fusion import fuse_projections
from handlers.engine.execution.kernels.linear_choice import apply_choice, timing_cache
from handlers.engine.execution.kernels.native import load_argmax, load_elementwise, load_kernels
from handlers.engine.execution.kernels.prepack import can_prepack, prepack_linear_layers, warm_packed_kernels
from handlers.engine.planning.families import UnsupportedModel

if TYPE_CHECKING:
    from handlers.engine.execution.forward.lora import LoraLayers

logger = logging.getLogger(__name__)
# The fused element-wise kernels round differently from torch (their own exp and order of summing): the probe's
# logits may move by this much relative to the largest of them (a wrong kernel moves them by orders more).
FUSED_TOLERANCE = 1e-3


def use_paged_attention(model: torch.nn.Module) -> None:
    """Route every attention layer of ``model`` to ``paged_attention_forward``: through transformers'
    attention interface, or through our adapter for families that bypass it (Falcon)."""
    from transformers import AttentionInterface

    if adapt_model(model) is not None:
        return
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    try:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)  # type: ignore[operator]
    except (ValueError, NotImplementedError) as exc:
        raise UnsupportedModel(f"{type(model).__name__}: its attention does not go through transformers' "
                               f"attention interface ({exc})") from None
    if model.config._attn_implementation != ATTN_IMPLEMENTATION:  # type: ignore[union-attr]
        raise UnsupportedModel(f"{type(model).__name__}: its attention does not go through transformers' "
                               "attention interface")


def kv_geometry(config: Any) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) of a transformers config."""
    num_layers = int(config.num_hidden_layers)
    num_heads = int(config.num_attention_heads)
    if getattr(config, "model_type", "") == "falcon":
        num_kv_heads = int(config.num_kv_heads) if config.new_decoder_architecture else \
            1 if config.multi_query else num_heads
        return num_layers, num_kv_heads, int(config.hidden_size) // num_heads
    num_kv_heads = int(getattr(config, "num_key_value_heads", None) or num_heads)
    head_dim = getattr(config, "head_dim", None) or int(config.hidden_size) // num_heads
    return num_layers, num_kv_heads, int(head_dim)


@dataclass(frozen=True, slots=True)
class StepInputs:
    """One step's flat batch as plain integers (what a tensor-parallel rank receives from rank 0).

    ``seqs`` holds, per sequence, ``(q_start, start, num_new, block_table)`` where the table lists the
    blocks covering its first ``start + num_new`` tokens; ``keep`` holds the rows whose logits are sampled;
    ``adapters`` each sequence's LoRA slot (-1: the base model), empty when no sequence has one; ``pooled`` the
    indices into ``keep`` of embedding requests' rows, whose hidden states are taken instead of logits (``pooling``).
    """

    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    seqs: list[tuple[int, int, int, list[int]]]
    keep: list[int]
    adapters: list[int] = field(default_factory=list)
    pooled: list[int] = field(default_factory=list)
    fills: list[tuple[int, str, str]] = field(default_factory=list)  # LoRA slots rank 0 filled since the last step


class StepBroadcaster(Protocol):
    """Sends each step to the other tensor-parallel ranks before rank 0 runs it."""

    def broadcast_step(self, inputs: StepInputs | None) -> StepInputs | None: ...

    def mark_broken(self) -> None:
        """A step failed on this rank: the ranks no longer run the same steps."""


class ModelRunner:
    """Owns the model and the KV pool; ``execute`` runs one scheduled step and returns sampled-row logits.

    ``num_kv_heads`` overrides the config's count for a tensor-parallel shard; ``group`` (rank 0 only)
    broadcasts every step to the other ranks.
    """

    def __init__(self, model: torch.nn.Module, num_blocks: int, block_size: int, prepack_weights: str = "false",
                 num_kv_heads: int | None = None, group: StepBroadcaster | None = None,
                 fuse_weights: bool = False, use_kernels: bool = True, populate_kv: str = "eager",
                 lean: bool = True, step_tokens: int = 0, cuda_graphs: int = 0, max_model_len: int = 0,
                 measure_linears: bool = False, max_seqs: int = 1) -> None:
        """``cuda_graphs`` > 0 (a GPU model): capture decode steps of up to that many sequences, each as long as
        ``max_model_len`` at most. ``measure_linears``: prepack the layers whose shapes run faster packed on this
        CPU, routed by the measurement (``linear_choice``; ``max_seqs``: the rows the LM head can see)."""
        model.eval()
        use_paged_attention(model)
        self.device = next(model.parameters()).device
        self.lora: LoraLayers | None = None  # the model's LoRA projections, when the engine wrapped them
        if fuse_weights:
            logger.info("fused %d projection groups (QKV, gate/up)", fuse_projections(model))
        if self.device.type != "cpu":
            prepack_weights = "false"  # oneDNN packing is a CPU layout
        if prepack_weights in ("true", "hybrid"):
            started = time.perf_counter()
            if measure_linears and prepack_weights == "hybrid" and can_prepack(model):
                counts = apply_choice(model, step_tokens, max_seqs, timing_cache())
                n = counts["packed"]
                logger.info("linear kernels by measurement (timed on this CPU, or its cached timings) and laid out in "
                            "%.1f s: layers running some rows %s", time.perf_counter() - started,
                            ", ".join(f"{kernel} {count}" for kernel, count in counts.items()))
            else:
                n = prepack_linear_layers(model, hybrid=prepack_weights == "hybrid")
            started = time.perf_counter()
            # prefill-sized steps (up to the token budget) run packed too; the lm_head only sees sampled rows (it
            # may be wrapped by the routing of apply_choice: its inner modules are skipped with it)
            head = getattr(model, "lm_head", None)
            kernels = warm_packed_kernels(model, large_rows=step_tokens if prepack_weights == "hybrid" else 0,
                                          large_skip=tuple(head.modules()) if isinstance(head, torch.nn.Module)
                                          else ())
            logger.info("prepacked %d linear layers for oneDNN; built %d kernels in %.1f s", n, kernels,
                        time.perf_counter() - started)
        self.context = StepContext()
        for module in model.modules():
            if hasattr(module, "layer_idx"):
                setattr(module, CONTEXT_ATTR, self.context)
        self.model = model
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.group = group
        num_layers, config_kv_heads, head_dim = kv_geometry(model.config)
        dtype = next(model.parameters()).dtype
        graphs = cuda_graphs > 0 and self.device.type == "cuda"
        # CUDA graphs pad a step with rows that write their KV into one more block, which the scheduler never sees
        self.pool = KVPool(num_layers, (num_blocks + graphs) * block_size, num_kv_heads or config_kv_heads, head_dim,
                           dtype, "eager" if populate_kv == "auto" else populate_kv, self.device)
        self.kernels = _kernels(self.device) if use_kernels else None
        self.lean: LeanDecoder | None = None
        self.graphs: DecodeGraphs | None = None
        # embedding requests' rows are taken aside before the LM head (both forwards call this module)
        self.head_tap = HeadTap(getattr(model, "lm_head", None) or model.get_output_embeddings())
        self._probe(num_layers)
        if lean:
            self.lean = self._lean_decoder()
        if graphs and self.lean is not None and self.kernels is not None and group is None:
            self.graphs = DecodeGraphs(self.lean.forward, self.context, self.pool, self.kernels, block_size,
                                       -(-max(max_model_len, 1) // block_size), num_blocks, capture_sizes(cuda_graphs))
        elif graphs:
            logger.info("CUDA graphs: off (they capture the lean forward with the device kernel, single rank)")

    def _lean_decoder(self) -> LeanDecoder | None:
        """``LeanDecoder`` when it reproduces the model: its structure is one the lean forward knows, and a
        probe step of both forwards (a 5-token prompt, then one decode token) gives bitwise the same logits. Its
        fused element-wise kernels (on the CPU) are then kept when the same probe stays within FUSED_TOLERANCE."""
        why = unsupported(self.model)
        if why is None and self.num_blocks * self.block_size < 6:
            why = "the KV pool is smaller than the probe"
        if why is None:
            lean = LeanDecoder(self.model, paged_attention_forward)
            pairs = self._lean_probe(lean)
            if all(torch.equal(want, got) for want, got in pairs):
                lean.fused = load_elementwise() if self.kernels is not None and lean.fuses else None
                if lean.fused is not None:
                    pairs = self._lean_probe(lean)
                    err = max(float((want - got).abs().max() / want.abs().max().clamp(min=1.0)) for want, got in pairs)
                    if not err <= FUSED_TOLERANCE:  # NaN included
                        lean.fused = None
                    logger.info("fused element-wise kernels: %s (probe logits within %.3g of the exact forward's)",
                                "on" if lean.fused is not None else "off", err)
                logger.info("decoder: lean forward (%s)", type(self.model).__name__)
                return lean
            worst = max((want - got).abs().max().item() for want, got in pairs)
            why = f"its logits differ from transformers' forward by up to {worst:.3g}"
        logger.info("decoder: transformers' forward (the lean one does not apply: %s)", why)
        return None

    def _lean_probe(self, lean: LeanDecoder) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(transformers' logits, the lean forward's) of each probe step."""
        table = list(range(-(-6 // self.block_size)))  # blocks 0.. in order: slot = position
        probe = [StepInputs([1, 2, 3, 4, 5], [0, 1, 2, 3, 4], [0, 1, 2, 3, 4], [(0, 0, 5, table)], [4]),
                 StepInputs([6], [5], [5], [(0, 5, 1, table)], [0])]
        pairs = []
        for step in probe:
            want = self.forward(step)
            self.lean = lean
            try:
                pairs.append((want, self.forward(step)))
            finally:
                self.lean = None
        return pairs

    def _probe(self, num_layers: int) -> None:
        """Run one token through the model at load: an attention argument the engine does not implement
        raises here (the model is refused by name), as does a model whose layers bypass the paged attention.
        Every tensor-parallel rank probes once, so their collectives pair up."""
        self.context.calls = 0
        self.context.windows.clear()
        try:
            self.forward(StepInputs([0], [0], [0], [(0, 0, 1, [0])], [0]))
        except UnsupportedModel as exc:
            raise UnsupportedModel(f"{type(self.model).__name__}: {exc}") from None
        if self.context.calls != num_layers:
            raise UnsupportedModel(
                f"{type(self.model).__name__}: {self.context.calls} of {num_layers} layers ran the engine's paged "
                "attention; the others use an attention path the rolling engine does not control")
        windows = set(self.context.windows.values())
        # One window shared by every layer: KV blocks that fell out of it can be freed (the scheduler does).
        self.sliding_window = windows.pop() if len(windows) == 1 else 0

    def execute(self, chunks: Seq[ScheduledChunk], adapters: Seq[int] = ()) -> torch.Tensor:
        """Run the chunks as one flat batch; returns logits [kept rows, vocab] in chunk order: a chunk's prompt
        rows first (``ScheduledChunk.num_prompt_rows``), then one row if it samples, 1 + len(draft) with guesses.
        ``adapters``: each chunk's LoRA slot (-1: the base model), or empty."""
        inputs = self.prepare(chunks, adapters)
        if self.group is None:
            return self.forward(inputs)
        if self.lora is not None:  # the other ranks fill the slots this rank filled, before they run the step
            inputs = replace(inputs, fills=self.lora.take_fills())
        try:
            self.group.broadcast_step(inputs)
            return self.forward(inputs)
        except BaseException:
            # a collective failed (a rank died) or this rank stopped between them: either way the other ranks are
            # no longer in step, so the group cannot go on, whatever the exception says
            self.group.mark_broken()
            raise

    def prepare(self, chunks: Seq[ScheduledChunk], adapters: Seq[int] = ()) -> StepInputs:
        """The step's flat batch: token ids, positions, KV slots and per-sequence attention inputs."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seqs: list[tuple[int, int, int, list[int]]] = []
        keep: list[int] = []
        pooled: list[int] = []
        bs = self.block_size
        for c in chunks:
            seq = c.seq
            end = c.start + c.num_tokens + len(c.draft)
            q0 = len(input_ids)
            input_ids.extend(seq.token_ids[c.start:c.start + c.num_tokens])
            input_ids.extend(c.draft)
            positions.extend(range(c.start, end))
            table = seq.block_ids
            slots.extend(table[p // bs] * bs + p % bs for p in range(c.start, end))
            seqs.append((q0, c.start, end - c.start, table[:-(-end // bs)]))
            keep.extend(range(q0, q0 + c.num_prompt_rows))
            pooled.extend(range(len(keep), len(keep) + len(c.pooled_rows)))
            keep.extend(q0 + r for r in c.pooled_rows)
            if c.samples:  # a decode with guesses samples after its token and after each guess
                keep.extend(range(len(input_ids) - 1 - len(c.draft), len(input_ids)))
        return StepInputs(input_ids, positions, slots, seqs, keep, list(adapters), pooled)

    @torch.inference_mode()
    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """Run one prepared step through the model; returns the kept rows' logits [len(keep), vocab]."""
        if self.graphs is not None and not inputs.adapters and not inputs.pooled and \
                self.graphs.fits(inputs.seqs, inputs.keep):
            return self.graphs.run(inputs.input_ids, inputs.positions, inputs.slots, inputs.seqs)
        spans = tuple(SeqSpan(q0, start, num_new, tuple(table)) for q0, start, num_new, table in inputs.seqs)
        n = len(inputs.input_ids)
        # one copy of the step's integers to the device: ids, positions, slots, kept rows
        flat = on_device(torch.tensor(inputs.input_ids + inputs.positions + inputs.slots + inputs.keep,
                                      dtype=torch.long, device="cpu"), self.device)
        ids, positions, slots, keep = flat[:n], flat[n:2 * n], flat[2 * n:3 * n], flat[3 * n:]
        self.context.meta = StepMetadata(self.pool, slots, spans, self.block_size, self.kernels)
        if self.lora is not None and inputs.adapters:
            self.lora.set_step(inputs.seqs, inputs.adapters, self.device)
        if inputs.pooled:
            self.head_tap.arm(inputs.pooled)
        try:
            if self.lean is not None:
                return self.lean.forward(ids, positions, keep)
            out = self.model(input_ids=ids[None], position_ids=positions[None], use_cache=False, logits_to_keep=keep)
        finally:
            self.context.meta = None
            self.head_tap.disarm()
            if self.lora is not None:
                self.lora.clear_step()
        return out.logits[0]


def _kernels(device: torch.device) -> Any:
    """The decode kernels for ``device`` (``PagedKernels``' interface): C on CPU, Triton on CUDA, else none."""
    if device.type == "cuda":
        from handlers.engine.execution.gpu.gpu_attention import TritonPagedKernels

        return TritonPagedKernels()
    if device.type != "cpu":
        return None
    load_argmax()  # built at load, not in the first request's step
    return load_kernels()
