"""Which transformers architectures the rolling engine serves exactly, and why it refuses the others.

Design note: torch-free and driven by ``config.json`` alone, so the frontend can decide
``option.rolling_batch=auto`` (engine or dynamic batching) before any worker starts, and ``serving config``
can say it without loading weights. The engine repeats the check at load time and, on top, probes one
forward pass for attention arguments it does not implement (``handlers.engine.paged_attention``): a
feature the engine cannot honour refuses the model by name, it is never dropped silently.

Families run either through transformers' attention interface (the model is unchanged, its attention
calls ``paged_attention_forward``) or through an adapter of ours that replaces the attention module's
forward (``handlers.engine.adapters``: Falcon).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# model_type -> how the engine runs it. Every entry is covered by the family matrix test
# (tests/engine/test_families.py), which compares the engine with transformers' generate().
ATTENTION_INTERFACE = frozenset({
    "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2", "gemma3_text",
    "phi3", "starcoder2", "olmo", "olmo2", "gpt_oss", "gpt2", "gpt_neox", "cohere", "granite", "stablelm", "phi",
})
ADAPTED = frozenset({"falcon"})
SUPPORTED = ATTENTION_INTERFACE | ADAPTED

# Known families the engine refuses, with the feature it lacks.
_REFUSED = {
    "bloom": "ALiBi position bias (the engine implements rotary and learned positions only)",
    "mpt": "ALiBi position bias (the engine implements rotary and learned positions only)",
}
# RoPE variants whose frequencies depend on the sequence's current length: exact only while no sequence
# can pass the original context, where they equal plain RoPE.
_LENGTH_DEPENDENT_ROPE = frozenset({"dynamic", "longrope"})


class UnsupportedModel(ValueError):
    """The rolling engine cannot serve this model exactly; the message names the architecture and feature."""


def load_config_dict(model_dir: str | Path) -> dict[str, Any]:
    """``config.json`` of a model folder as a dict (``{}`` when absent or unreadable as JSON)."""
    path = Path(model_dir) / "config.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def unsupported_reason(config: Mapping[str, Any], max_model_len: int | None = None) -> str | None:
    """Why the rolling engine cannot serve a model with this ``config.json``, or None when it can.

    ``max_model_len``: the context the engine will allow (0/None = the model's ``max_position_embeddings``).
    """
    model_type = str(config.get("model_type") or "")
    arch = _arch_name(config)
    if not model_type:
        return f"{arch}: config.json has no model_type; the rolling engine cannot tell the architecture"
    if model_type in _REFUSED:
        return f"{arch} (model_type={model_type}): {_REFUSED[model_type]}"
    if model_type not in SUPPORTED:
        return (f"{arch} (model_type={model_type}) is not an architecture the rolling engine has been verified "
                f"on; supported: {', '.join(sorted(SUPPORTED))}")
    if model_type == "falcon" and config.get("alibi"):
        return f"{arch} (model_type=falcon, alibi=true): ALiBi position bias is not implemented by the engine"
    if config.get("use_bidirectional_attention"):
        return f"{arch} (model_type={model_type}): bidirectional attention (use_bidirectional_attention=true)"
    rope = _rope_type(config)
    if rope in _LENGTH_DEPENDENT_ROPE:
        original = int(_rope_params(config).get("original_max_position_embeddings")
                       or config.get("original_max_position_embeddings") or 0)
        limit = int(max_model_len or config.get("max_position_embeddings") or 0)
        if not original or limit > original:
            return (f"{arch} (model_type={model_type}): RoPE scaling {rope!r} changes with a sequence's length, "
                    f"which the engine does not compute per sequence; set option.max_model_len <= "
                    f"{original or 'original_max_position_embeddings'} to serve it without scaling")
    return None


def check_config(config: Mapping[str, Any], max_model_len: int | None = None) -> None:
    """Raise ``UnsupportedModel`` when ``unsupported_reason`` gives one."""
    reason = unsupported_reason(config, max_model_len)
    if reason is not None:
        raise UnsupportedModel(reason)


def _arch_name(config: Mapping[str, Any]) -> str:
    archs = config.get("architectures")
    if isinstance(archs, list) and archs:
        return str(archs[0])
    return str(config.get("model_type") or "unknown architecture")


def _rope_params(config: Mapping[str, Any]) -> Mapping[str, Any]:
    for key in ("rope_parameters", "rope_scaling"):
        value = config.get(key)
        if isinstance(value, Mapping):
            return value
    return {}


def _rope_type(config: Mapping[str, Any]) -> str:
    params = _rope_params(config)
    return str(params.get("rope_type") or params.get("type") or "default")
