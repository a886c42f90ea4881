"""Sharding a model in place for one tensor-parallel rank (Megatron-style, on stock transformers modules).

Every rank keeps 1/N of the attention heads (rows of ``q/k/v_proj``, columns of ``o_proj``) and 1/N of the MLP
(rows of ``gate/up_proj``, columns of ``down_proj``); a forward hook all-reduces the outputs of the attention and
MLP blocks. Embeddings, norms and ``lm_head`` stay replicated, so every rank computes the same logits.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def _keep_rows(linear: torch.nn.Linear, start: int, end: int) -> None:
    # what this rank keeps of the full projection: a LoRA adapter's B is cut the same way (forward.lora)
    linear.rollserve_shard = ("rows", start, end, linear.out_features)  # type: ignore[assignment]
    linear.weight = torch.nn.Parameter(linear.weight.data[start:end].contiguous(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = torch.nn.Parameter(linear.bias.data[start:end].contiguous(), requires_grad=False)
    linear.out_features = end - start


def _keep_cols(linear: torch.nn.Linear, start: int, end: int, rank: int) -> None:
    linear.rollserve_shard = ("cols", start, end, linear.in_features)  # type: ignore[assignment]  # A's cut
    linear.weight = torch.nn.Parameter(linear.weight.data[:, start:end].contiguous(), requires_grad=False)
    if linear.bias is not None and rank != 0:  # the all-reduce would add the bias N times
        linear.bias = torch.nn.Parameter(torch.zeros_like(linear.bias.data), requires_grad=False)
    linear.in_features = end - start


def _all_reduce_hook(module: torch.nn.Module, args: object, output: object) -> None:
    """Sum the partial outputs of a row-parallel block in place (attention returns a tuple)."""
    all_reduce(output[0] if isinstance(output, tuple) else output)  # type: ignore[arg-type]


def all_reduce(partial: torch.Tensor) -> torch.Tensor:
    """Sum a row-parallel projection's partial output over the ranks, in place."""
    dist.all_reduce(partial)
    return partial


def head_ranges(heads: int, kv_heads: int, rank: int, world_size: int) -> tuple[int, int, int, int]:
    """This rank's query heads [q0, q1) and KV heads [kv0, kv1). With fewer KV heads than ranks (multi-query,
    or GQA with few groups) each KV head is replicated on the ranks whose query heads use it.
    Raises ValueError when the heads do not split evenly."""
    if heads % world_size:
        raise ValueError(f"tensor_parallel_degree={world_size} does not divide num_attention_heads={heads}")
    hq = heads // world_size
    if kv_heads >= world_size:
        if kv_heads % world_size:
            raise ValueError(f"tensor_parallel_degree={world_size} does not divide num_key_value_heads={kv_heads}")
        hkv = kv_heads // world_size
        return rank * hq, (rank + 1) * hq, rank * hkv, (rank + 1) * hkv
    if world_size % kv_heads:
        raise ValueError(f"num_key_value_heads={kv_heads} cannot be replicated evenly over "
                         f"tensor_parallel_degree={world_size} ranks (the degree must be a multiple of it)")
    kv = rank * hq // (heads // kv_heads)
    return rank * hq, (rank + 1) * hq, kv, kv + 1


def shard_model(model: torch.nn.Module, rank: int, world_size: int) -> int:
    """Shard a model in place for ``rank``; returns this rank's number of KV heads. Layouts: Llama-family
    (q/k/v/o_proj, gate/up/down_proj) and Falcon (after ``handlers.engine.execution.forward.falcon_attention``:
    canonical fused QKV).

    Raises ValueError for a model whose layout is not supported or whose heads do not divide evenly.
    """
    from handlers.engine.execution.forward.runner import kv_geometry

    cfg: Any = model.config
    heads = int(cfg.num_attention_heads)
    _, kv_heads, head_dim = kv_geometry(cfg)
    q0, q1, kv0, kv1 = head_ranges(heads, kv_heads, rank, world_size)
    if getattr(model, "rollserve_adapter", None) == "falcon":
        _shard_falcon(model, rank, world_size, (q0, q1, kv0, kv1), heads, kv_heads, head_dim)
        return kv1 - kv0
    inter = int(getattr(cfg, "intermediate_size", 0))
    if inter % world_size:
        raise ValueError(f"tensor_parallel_degree={world_size} does not divide intermediate_size={inter}")
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: tensor parallelism supports Llama-family models "
                         "(model.model.layers with q/k/v/o_proj and gate/up/down_proj) and Falcon")
    hi = inter // world_size
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        if not all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")) or \
                not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
            raise ValueError(f"{type(model).__name__}: unsupported layer layout for tensor parallelism")
        _keep_rows(attn.q_proj, q0 * head_dim, q1 * head_dim)
        _keep_rows(attn.k_proj, kv0 * head_dim, kv1 * head_dim)
        _keep_rows(attn.v_proj, kv0 * head_dim, kv1 * head_dim)
        _keep_cols(attn.o_proj, q0 * head_dim, q1 * head_dim, rank)
        _keep_rows(mlp.gate_proj, rank * hi, (rank + 1) * hi)
        _keep_rows(mlp.up_proj, rank * hi, (rank + 1) * hi)
        _keep_cols(mlp.down_proj, rank * hi, (rank + 1) * hi, rank)
        # On the blocks, not the projections: prepacking later swaps the Linear modules out.
        attn.register_forward_hook(_all_reduce_hook)
        mlp.register_forward_hook(_all_reduce_hook)
    # the lean forward calls the projections, not the blocks: it sums o_proj's and down_proj's outputs itself
    model.rollserve_tp_reduce = all_reduce
    return kv1 - kv0


def _shard_falcon(model: torch.nn.Module, rank: int, world_size: int, ranges: tuple[int, int, int, int],
                  heads: int, kv_heads: int, head_dim: int) -> None:
    """Falcon: rows of the canonical fused QKV ([queries | keys | values]) and of dense_h_to_4h; columns of
    dense and dense_4h_to_h. The attention adapter reads its per-rank head counts from the module."""
    q0, q1, kv0, kv1 = ranges
    for layer in model.transformer.h:  # type: ignore[union-attr]
        attn, mlp = layer.self_attention, layer.mlp
        qkv = attn.query_key_value
        k_base, v_base = heads * head_dim, (heads + kv_heads) * head_dim
        rows = torch.cat([torch.arange(q0 * head_dim, q1 * head_dim),
                          torch.arange(k_base + kv0 * head_dim, k_base + kv1 * head_dim),
                          torch.arange(v_base + kv0 * head_dim, v_base + kv1 * head_dim)])
        qkv.weight = torch.nn.Parameter(qkv.weight.data[rows].contiguous(), requires_grad=False)
        if qkv.bias is not None:
            qkv.bias = torch.nn.Parameter(qkv.bias.data[rows].contiguous(), requires_grad=False)
        qkv.out_features = len(rows)
        attn.rollserve_heads, attn.rollserve_kv_heads = q1 - q0, kv1 - kv0
        _keep_cols(attn.dense, q0 * head_dim, q1 * head_dim, rank)
        inter = mlp.dense_h_to_4h.out_features
        if inter % world_size:
            raise ValueError(f"tensor_parallel_degree={world_size} does not divide ffn_hidden_size={inter}")
        hi = inter // world_size
        _keep_rows(mlp.dense_h_to_4h, rank * hi, (rank + 1) * hi)
        _keep_cols(mlp.dense_4h_to_h, rank * hi, (rank + 1) * hi, rank)
        attn.register_forward_hook(_all_reduce_hook)
        mlp.register_forward_hook(_all_reduce_hook)
