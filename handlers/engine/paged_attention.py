"""The paged-attention function plugged into transformers models through ``AttentionInterface``.

Design note: the model runs one flat batch ``[1, T]`` of tokens from many sequences with no cache
object (``use_cache=False``); each layer's attention call receives this step's ``StepMetadata`` through
the forward kwargs. The function writes the step's new K/V into the layer's slots of the preallocated
pool (in place), then attends per sequence against that sequence's cached KV. A sequence whose blocks are
contiguous is read as a view of the pool (no copy); otherwise its slots are gathered.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

ATTN_IMPLEMENTATION = "rollserve_paged"
STEP_KWARG = "rollserve_step"


class KVPool:
    """Preallocated KV memory: per layer one key and one value tensor of shape [Hkv, num_slots, D].

    Head-major so that a contiguous slot range is, per head, one contiguous run of rows: the CPU flash
    attention kernel reads such a view as fast as a contiguous tensor."""

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32) -> None:
        self.num_slots = num_slots
        self.keys = [torch.zeros(num_kv_heads, num_slots, head_dim, dtype=dtype) for _ in range(num_layers)]
        self.values = [torch.zeros(num_kv_heads, num_slots, head_dim, dtype=dtype) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()


@dataclass(frozen=True, slots=True)
class SeqAttention:
    """One sequence's slice of the step: query rows [q_start, q_end) and its KV of ``kv_len`` tokens.

    KV is ``pool[kv_slot_start : kv_slot_start + kv_len]`` when ``kv_index`` is None, else
    ``pool[kv_index]``. ``mask`` (bool [q, kv_len]) is set for a chunk after cached tokens; ``causal``
    for a chunk that starts at position 0.
    """

    q_start: int
    q_end: int
    kv_len: int
    kv_slot_start: int
    kv_index: torch.Tensor | None
    mask: torch.Tensor | None
    causal: bool


@dataclass(frozen=True, slots=True)
class StepMetadata:
    """What every attention layer needs for one step; built once per step by the runner."""

    pool: KVPool
    slot_mapping: torch.Tensor  # [T] int64: pool slot of each new token
    seqs: tuple[SeqAttention, ...]


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, attention_mask: torch.Tensor | None,
                            scaling: float | None = None, dropout: float = 0.0,
                            **kwargs: object) -> tuple[torch.Tensor, None]:
    """AttentionInterface function: query [1, H, T, D], key/value [1, Hkv, T, D] -> ([1, T, H, D], None)."""
    meta = kwargs.get(STEP_KWARG)
    if not isinstance(meta, StepMetadata):
        raise RuntimeError(f"{ATTN_IMPLEMENTATION} attention needs the {STEP_KWARG!r} forward kwarg")
    layer = int(module.layer_idx)  # type: ignore[arg-type]
    k_cache = meta.pool.keys[layer]
    v_cache = meta.pool.values[layer]
    k_cache.index_copy_(1, meta.slot_mapping, key[0])  # key[0]: [Hkv, T, D]
    v_cache.index_copy_(1, meta.slot_mapping, value[0])
    gqa = query.shape[1] != k_cache.shape[0]
    if len(meta.seqs) == 1:
        return _attend(query, k_cache, v_cache, meta.seqs[0], scaling, gqa).transpose(1, 2), None
    out = torch.empty(query.shape[0], query.shape[2], query.shape[1], query.shape[3], dtype=query.dtype)  # [1, T, H, D]
    for s in meta.seqs:
        rows = _attend(query[:, :, s.q_start:s.q_end], k_cache, v_cache, s, scaling, gqa)
        out[:, s.q_start:s.q_end] = rows.transpose(1, 2)
    return out, None


def _attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, s: SeqAttention,
            scaling: float | None, gqa: bool) -> torch.Tensor:
    """Causal attention of one sequence's queries [1, H, q, D] against its KV; returns [1, H, q, D].
    (4-D inputs, so SDPA takes the CPU flash kernel.)"""
    if s.kv_index is None:
        k = k_cache[:, s.kv_slot_start:s.kv_slot_start + s.kv_len].unsqueeze(0)  # [1, Hkv, L, D], a view
        v = v_cache[:, s.kv_slot_start:s.kv_slot_start + s.kv_len].unsqueeze(0)
    else:
        k = k_cache.index_select(1, s.kv_index).unsqueeze(0)
        v = v_cache.index_select(1, s.kv_index).unsqueeze(0)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=s.mask, is_causal=s.causal, scale=scaling,
                                          enable_gqa=gqa)
