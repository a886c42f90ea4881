"""Per-architecture adapters: families whose attention does not go through transformers' attention interface.

Design note: an adapter replaces one module's ``forward`` on the loaded model (our code, the weights and
every other module stay transformers') so that the family runs on the engine's paged attention. Falcon's
fused ``query_key_value`` weight comes in three layouts; the adapter rewrites it once, at load, into one
canonical layout -- all query heads (grouped by their KV head), then the KV heads' keys, then their
values -- so the forward, the KV pool and tensor parallelism (``handlers.engine.execution.parallel.ranks``) need to know
only head counts. Layouts:

- Falcon-7B (``multi_query``): [H queries | 1 key | 1 value] per token;
- Falcon-40B/180B (``new_decoder_architecture``): per KV group [g queries | key | value];
- Falcon-RW (neither): per head [query | key | value].

ALiBi Falcon variants are refused (``handlers.engine.planning.families``). Runs at load, in every rank's process.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn

from handlers.engine.execution.forward.paged_attention import UnsupportedAttentionFeature, paged_attention_forward
from handlers.engine.execution.kernels.prepack import replace_module

ADAPTED_ATTR = "rollserve_adapter"


def adapt_model(model: nn.Module) -> str | None:
    """Install the adapter ``model`` needs, in place; returns its name, or None when the model runs
    through transformers' attention interface unchanged. Idempotent."""
    done = getattr(model, ADAPTED_ATTR, None)
    if done is not None:
        return str(done)
    model_type = getattr(model.config, "model_type", "")
    if model_type != "falcon":
        return None
    if getattr(model.config, "alibi", False):
        raise UnsupportedAttentionFeature(f"{type(model).__name__}: ALiBi position bias (alibi=true) is not "
                                          "implemented by the rolling engine")
    _plain_linears(model)
    for layer in model.transformer.h:  # type: ignore[union-attr]
        _adapt_falcon_attention(layer.self_attention)
    setattr(model, ADAPTED_ATTR, "falcon")
    return "falcon"


def adapted(model: nn.Module) -> bool:
    return getattr(model, ADAPTED_ATTR, None) is not None


def _plain_linears(model: nn.Module) -> None:
    """FalconLinear (an ``nn.Linear`` subclass with its own matmul) -> ``nn.Linear`` on the same weights, so
    prepacking and tensor parallelism treat Falcon's projections like every other family's."""
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and type(module) is not nn.Linear:
            plain = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                              device="meta")
            plain.weight = module.weight
            plain.bias = module.bias
            replace_module(model, name, plain)


def _adapt_falcon_attention(attn: Any) -> None:
    heads, head_dim = int(attn.num_heads), int(attn.head_dim)
    if attn.new_decoder_architecture:
        kv_heads = int(attn.config.num_kv_heads)
        layout = "grouped"
    elif attn.multi_query:
        kv_heads, layout = 1, "multi_query"
    else:
        kv_heads, layout = heads, "per_head"
    qkv: nn.Linear = attn.query_key_value
    with torch.no_grad():
        qkv.weight = nn.Parameter(canonical_qkv(qkv.weight, layout, heads, kv_heads, head_dim), requires_grad=False)
        if qkv.bias is not None:
            bias = canonical_qkv(qkv.bias[:, None], layout, heads, kv_heads, head_dim)[:, 0].contiguous()
            qkv.bias = nn.Parameter(bias, requires_grad=False)
    attn.rollserve_heads = heads  # per-rank counts; tensor parallelism rewrites them
    attn.rollserve_kv_heads = kv_heads
    attn.forward = types.MethodType(_falcon_attention_forward, attn)


def canonical_qkv(w: torch.Tensor, layout: str, heads: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    """Rows of a Falcon fused QKV weight [(H + 2 Hkv) * D, in] reordered to [queries | keys | values],
    query heads in KV-group order (head h uses KV head h // (H / Hkv), as grouped-query attention)."""
    cols = w.shape[1]
    if layout == "grouped":
        g = heads // kv_heads
        v = w.reshape(kv_heads, g + 2, head_dim, cols)
        q, k, val = v[:, :g], v[:, g], v[:, g + 1]
    elif layout == "multi_query":
        v = w.reshape(heads + 2, head_dim, cols)
        q, k, val = v[:heads], v[heads], v[heads + 1]
    elif layout == "per_head":
        v = w.reshape(heads, 3, head_dim, cols)
        q, k, val = v[:, 0], v[:, 1], v[:, 2]
    else:
        raise ValueError(f"unknown Falcon QKV layout {layout!r}")
    return torch.cat([q.reshape(-1, cols), k.reshape(-1, cols), val.reshape(-1, cols)]).contiguous()


def _falcon_attention_forward(self: Any, hidden_states: torch.Tensor, alibi: torch.Tensor | None = None,
                              attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                              layer_past: object = None, use_cache: bool = False, output_attentions: bool = False,
                              position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                              **kwargs: object) -> tuple[torch.Tensor, None]:
    """FalconAttention.forward on the paged KV: hidden [1, T, hidden] -> ([1, T, hidden], None). ``alibi`` is
    optional: transformers up to 5.24 passes it by keyword, later releases leave it out of rotary models' calls."""
    from transformers.models.falcon.modeling_falcon import apply_rotary_pos_emb

    if alibi is not None or position_embeddings is None:
        raise UnsupportedAttentionFeature("FalconAttention: ALiBi position bias is not implemented by the engine")
    heads, kv_heads, d = self.rollserve_heads, self.rollserve_kv_heads, self.head_dim
    _, t, _ = hidden_states.shape
    fused = self.query_key_value(hidden_states)  # [1, T, (H + 2 Hkv) * D]
    q, k, v = fused.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q = q.view(1, t, heads, d).transpose(1, 2)  # [1, H, T, D]
    k = k.view(1, t, kv_heads, d).transpose(1, 2)  # [1, Hkv, T, D]
    v = v.view(1, t, kv_heads, d).transpose(1, 2)
    cos, sin = position_embeddings
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    out, _ = paged_attention_forward(self, q, k, v, None, scaling=self.inv_norm_factor)  # [1, T, H, D]
    return self.dense(out.reshape(1, t, heads * d)), None
